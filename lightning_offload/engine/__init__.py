"""The offload engine: the optimizer that keeps Adam on the host, its layer-wise pipeline, and the host and device
Adams it runs (no Lightning here: the faces in :mod:`lightning_offload.faces` put it in a training loop)."""
