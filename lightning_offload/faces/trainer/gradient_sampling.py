"""Extra forward/backward passes over training batches that hand the projected layers' full gradients to a consumer.

Both the projector fit (:class:`~lightning_offload.faces.trainer.refit.ProjectorRefit`) and the measurement of
``ρ = ‖S‖/‖G‖`` for the clipping norm (:mod:`lightning_offload.lsp.norm_ratio`) need full gradients of real
training batches outside the training loop. :class:`GradientPasses` draws the batches from the training dataloader,
prepares each as the loop would, runs ``training_step`` (or a ``loss_fn``) with logging muted and backward inside
:func:`~lightning_offload.lsp.sampling.sample_gradients`; the caller decides what a gradient is for.

The passes run under a forked, seeded RNG: the run's own data order and random state are untouched, and a resumed run
draws the same batches as an uninterrupted one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_offload.engine.fitting.batch_gradients import MAX_DRAWS_PER_PASS, BatchGradients, LossFn, loss_tensor

__all__ = ["MAX_DRAWS_PER_PASS", "GradientPasses", "LossFn", "sampling_rng", "stop_if_terminated"]


class GradientPasses(BatchGradients):
    """Training batches for gradient passes, drawn one at a time from one iterator over the Trainer's training
    dataloader, each prepared as the training loop prepares a batch; the loss from ``training_step`` (with logging
    muted) or ``loss_fn``.

    Several phases can share one :class:`GradientPasses` (the fit, then the measurement on batches it never used):
    each :meth:`run` continues the same iterator where the previous one stopped.

    Args:
        trainer: the running Trainer; its training dataloader is sampled.
        module: the LightningModule whose ``training_step`` gives the loss.
        passes: usable passes wanted over all phases; at most ``MAX_DRAWS_PER_PASS`` times as many batches are drawn.
        loss_fn: ``loss_fn(module, batch) -> loss`` instead of ``training_step``.
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, passes: int,
                 loss_fn: LossFn | None = None) -> None:
        self.trainer = trainer
        super().__init__(module, (), loss_fn, passes)

    def _draw(self, batches: Iterable[Any], limit: int) -> Iterator[Any]:
        return _draw_batches(self.trainer, limit)

    def _context(self) -> AbstractContextManager[Any]:
        return _muted_logging(self.model)

    def _before_pass(self) -> None:
        stop_if_terminated(self.trainer)

    def _loss(self, batch: Any, index: int) -> Tensor | None:
        """The batch's loss, or ``None`` where ``training_step`` returned ``None`` (Lightning's way to skip it)."""
        with self.trainer.strategy.precision_plugin.train_step_context():
            if self.loss_fn is not None:
                return loss_tensor(self.loss_fn(self.model, batch), "training_step (or loss_fn)")
            return loss_tensor(self.model.training_step(batch, index), "training_step (or loss_fn)")

    def no_gradients_error(self) -> str:
        return (f"ProjectorRefit drew {self.drawn} training batch(es) and training_step returned None (skip) for "
                f"every one: there are no gradients to fit to. Return a loss for some batches, pass loss_fn, or use "
                f"LSPOffloadStrategy(projectors='random').")


def _draw_batches(trainer: pl.Trainer, limit: int) -> Iterator[Any]:
    """Up to ``limit`` training batches, each prepared as the training loop prepares a batch."""
    loader = trainer.train_dataloader
    if loader is None or isinstance(loader, (Mapping, list, tuple)):
        raise ValueError(
            f"ProjectorRefit samples batches from a single training DataLoader, got {type(loader).__name__}. "
            f"Use one train dataloader, or LSPOffloadStrategy(projectors='random')."
        )
    module = trainer.lightning_module
    empty = True
    for batch in itertools.islice(iter(loader), limit):
        empty = False
        # The same preparation the training loop gives a batch: precision conversion, the module's hook, transfer.
        batch = trainer.precision_plugin.convert_input(batch)
        batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
        yield trainer.strategy.batch_to_device(batch, dataloader_idx=0)
    if empty:
        raise ValueError("ProjectorRefit found an empty training dataloader: there are no gradients to fit to.")


@contextmanager
def sampling_rng(trainer: pl.Trainer, seed: int) -> Iterator[None]:
    """Run the block under a forked RNG seeded with ``seed``.

    Drawing batches (sampler seeds) and dropout in the passes must neither disturb the run's own random stream nor
    differ between an uninterrupted and a resumed run.
    """
    device = trainer.strategy.root_device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def stop_if_terminated(trainer: pl.Trainer) -> None:
    """Raises Lightning's SIGTERM exception once the trainer has received SIGTERM, as its loops do between batches
    (passes over a large model take minutes on a CPU: a preempted job stops between them)."""
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()


@contextmanager
def _muted_logging(module: pl.LightningModule) -> Iterator[None]:
    # The passes call training_step outside the loop's bookkeeping: whatever it logs must not be recorded.
    module.log = _ignore  # type: ignore[method-assign]
    module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
