"""The examples' data: token sequences with structure a tiny model learns in a few dozen steps (each an arithmetic
progression of tokens modulo the vocabulary). Replace it with your own dataset; nothing else in the examples
depends on it."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64


def progressions(n: int = 256, length: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """``n`` sequences of ``length`` tokens, shuffled with ``seed``, in batches of ``(input_ids,)``."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=generator)
    stride = torch.randint(1, 4, (n, 1), generator=generator)
    ids = (start + stride * torch.arange(length)) % VOCAB
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    """A causal LM's next-token loss on a batch of ``(input_ids,)``, moved to the model's device."""
    (ids,) = batch
    ids = ids.to(next(model.parameters()).device)
    return model(input_ids=ids, labels=ids).loss
