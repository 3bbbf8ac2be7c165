"""The slot kinds: what each offloaded tensor is to the engine's step (the :class:`~.slot.Slot` interface and the lanes
slots share), one module per kind, and which kind each tensor gets (:mod:`.slot_building`)."""
