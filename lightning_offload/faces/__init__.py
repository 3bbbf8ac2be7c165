"""The engine's faces, one per kind of training loop and peers over :mod:`lightning_offload.setup` (none imports
another): Lightning's Trainer (:mod:`~lightning_offload.faces.trainer`), Lightning Fabric
(:mod:`~lightning_offload.faces.fabric`), a loop of one's own (:mod:`~lightning_offload.faces.loop`) and Hugging Face's
``Trainer`` (:mod:`~lightning_offload.faces.hf`)."""
