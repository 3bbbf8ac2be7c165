"""lightning_offload under Lightning Fabric: ``Fabric(strategy=...)``, then Fabric's own ``setup``, ``backward``,
``clip_gradients``, ``save`` and ``load``.

    python examples/fabric_loop.py           # a tiny LLaMA on synthetic sequences; put your model and data in
"""

from __future__ import annotations

from pathlib import Path
import tempfile

import lightning as L
import torch

from lightning_offload import FabricOffload
from lightning_offload.models.tiny import tiny_llama
from progressions import VOCAB, lm_loss, progressions


def main(steps: int = 40, accumulation: int = 2, accelerator: str = "auto") -> list[float]:
    """Trains ``steps`` optimizer steps, saving a checkpoint halfway; returns each step's loss."""
    fabric = L.Fabric(accelerator=accelerator, devices=1,
                      strategy=FabricOffload(rank=0.5, min_dim=32, projectors="learned",
                                             accumulation_steps=accumulation))
    model = tiny_llama(vocab_size=VOCAB, hidden=64, intermediate=128)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    loader = fabric.setup_dataloaders(progressions())
    optimizer.fit_projectors(loader, lm_loss)  # learned projectors: fitted to sampled gradients first
    losses: list[float] = []
    batches = iter(loader)
    checkpoint = Path(tempfile.mkdtemp()) / "halfway.ckpt"
    for step in range(steps):
        total = 0.0
        for _ in range(accumulation):
            batch = next(batches, None) or next(batches := iter(loader))
            loss = lm_loss(model, batch) / accumulation
            fabric.backward(loss)
            total += float(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the engine's global norm, projected part included
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        if step + 1 == steps // 2:
            fabric.save(checkpoint, {"model": model, "optimizer": optimizer})  # fabric.load(checkpoint, ...) resumes
    optimizer.close()  # applies what is pending, gives the model back as it was
    return losses


if __name__ == "__main__":
    trained = main()
    print(f"loss {trained[0]:.3f} -> {trained[-1]:.3f} over {len(trained)} steps")
