"""The order of the training data, fixed by the seed and the epoch, and resumable in the middle of an epoch.

A plain ``DataLoader(shuffle=True, generator=...)`` draws each epoch's order from a generator that a resumed run
builds anew: a run resumed from ``last.ckpt`` would see epoch 0's order again, from its start. Here each epoch's order
depends only on ``(seed, epoch)``, and the data module saves how far the current epoch got in the checkpoint
(Lightning saves a data module's ``state_dict``), so the resumed run continues with the very batch the interrupted one
would have trained on next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Sampler


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s order (epoch 0 uses ``seed`` itself, as ``DataLoader(shuffle=True,
    generator=torch.Generator().manual_seed(seed))`` did for its first epoch)."""
    return seed if epoch == 0 else seed * 1_000_003 + epoch


class EpochShuffle(Sampler[int]):
    """A random permutation of ``range(size)`` per epoch, seeded by ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` at the start of every epoch. :meth:`resume_at` makes the next pass over one
    epoch start part-way through.

    Args:
        size: the dataset's length.
        seed: the run's data seed.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples to skip) for the next pass over that epoch

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next pass yields."""
        self.epoch = epoch

    def resume_at(self, epoch: int, samples: int) -> None:
        """Starts the next pass over ``epoch`` after its first ``samples`` indices."""
        self._resume = (epoch, samples)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch)))
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip, self._resume = self._resume[1], None
        return iter(order[skip:].tolist())

    def __len__(self) -> int:
        # The whole epoch: Lightning counts a resumed epoch's batches from where it stopped.
        return self.size


class TrainOrder:
    """What a data module needs for a resumable training order: the sampler, and its part of the checkpoint.

    Args:
        seed: the data seed.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._resume: tuple[int, int] | None = None

    def sampler(self, size: int) -> EpochShuffle:
        """A sampler for a new training DataLoader, starting where a restored checkpoint left off."""
        sampler = EpochShuffle(size, self.seed)
        if self._resume is not None:
            sampler.set_epoch(self._resume[0])
            sampler.resume_at(*self._resume)
            self._resume = None
        return sampler

    @staticmethod
    def state_dict(trainer: pl.Trainer | None, batch_size: int) -> dict[str, Any]:
        """How far the current epoch got: its number, and the samples of the batches trained in it so far.

        Nothing with several ranks: Lightning's distributed sampler then shards the order, each rank's position is
        in its own shard, and a resumed run starts the epoch again (as before this existed)."""
        if trainer is None or trainer.state.fn != "fit" or trainer.world_size > 1:
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": trainer.current_epoch, "samples": done * batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next training DataLoader continue the saved epoch after its saved samples."""
        if state:
            self._resume = (int(state["epoch"]), int(state["samples"]))
