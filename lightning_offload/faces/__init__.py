"""The engine's faces beyond the Trainer strategies: a loop of one's own (:mod:`~lightning_offload.faces.loop`, which
Hugging Face's ``Trainer`` takes as its optimizer) and Lightning Fabric (:mod:`~lightning_offload.faces.fabric`)."""
