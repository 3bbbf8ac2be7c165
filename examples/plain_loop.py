"""lightning_offload in a plain PyTorch loop: the AdamW state and arithmetic on the host, gradients compressed by
learned projectors, an LR scheduler, gradient accumulation and clipping as usual.

    python examples/plain_loop.py            # a tiny LLaMA on synthetic sequences; put your model and data in
"""

from __future__ import annotations

import torch

import lightning_offload
from lightning_offload.models.tiny import tiny_llama
from progressions import VOCAB, lm_loss, progressions


def main(steps: int = 40, accumulation: int = 2) -> list[float]:
    """Trains ``steps`` optimizer steps; returns each step's loss."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama(vocab_size=VOCAB, hidden=64, intermediate=128).to(device)
    loader = progressions()
    optimizer = lightning_offload.offload(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), "lsp_offload",
        rank=0.5, min_dim=32,              # project every Linear with both dims ≥ 32, each side to half its size
        projectors="learned",              # fitted to sampled gradients (the default, "random", is never fitted)
        max_grad_norm=1.0,                 # clipped by the global norm, projected gradients included
        accumulation_steps=accumulation,   # the last micro-batch's backward sends gradients as they are final
        refit_every=20)                    # refit_due turns True every 20 steps
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    optimizer.fit_projectors(loader, lm_loss)  # learned projectors: fitted to sampled gradients first
    losses: list[float] = []
    batches = iter(loader)
    for _ in range(steps):
        if optimizer.refit_due:
            optimizer.fit_projectors(loader, lm_loss)
        total = 0.0
        for _ in range(accumulation):
            batch = next(batches, None) or next(batches := iter(loader))
            loss = lm_loss(model, batch) / accumulation
            loss.backward()
            total += float(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
    optimizer.settle()  # pending updates applied: the weights are this step's, ready to read or save
    # To resume later, save {"model": model.state_dict(), "optimizer": optimizer.state_dict()} now, and load both
    # (in either order, as with torch.optim) into a model and optimizer set up the same way.
    optimizer.close()  # applies what is pending, gives the model back as it was
    return losses


if __name__ == "__main__":
    trained = main()
    print(f"loss {trained[0]:.3f} -> {trained[-1]:.3f} over {len(trained)} steps")
