"""Planning a run before it starts: whether it fits the device and the host, and how long a step will take
(:func:`~lightning_offload.planning.plan.plan`), and the settings that fit with the best predicted throughput
(:func:`~lightning_offload.planning.choose.choose`). No Lightning here: it sits on the set-up layer."""
