"""Gradient passes over batches a caller hands in, for a projector fit in a loop of one's own: each batch's loss from
``loss_fn(model, batch)``, its backward delivering the projected layers' full gradients layer by layer
(:func:`~lightning_offload.lsp.sampling.sample_gradients`). The Lightning callback's passes
(:class:`~lightning_offload.faces.trainer.gradient_sampling.GradientPasses`) are these with the Trainer's dataloader,
``training_step`` and precision context.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.sampling import GradientConsumer, sample_gradients

#: ``loss_fn(model, batch) -> loss``: the loss of one batch (``None`` skips the batch).
LossFn = Callable[[torch.nn.Module, Any], Tensor | None]

#: Batches drawn per usable pass wanted, at most, when the loss function skips some (returns ``None``).
MAX_DRAWS_PER_PASS = 8


class BatchGradients:
    """Batches drawn one at a time from one iterator over ``batches``, each a forward and backward pass.

    Several phases share one :class:`BatchGradients` (the fit, then the measurement on batches it never used): each
    :meth:`run` continues the same iterator where the previous one stopped.

    Args:
        model: the module whose projected layers' gradients are wanted.
        batches: where the batches come from (a DataLoader, a list); iterated from its start, lazily.
        loss_fn: ``loss_fn(model, batch) -> loss``; it moves the batch to the model's device itself.
        passes: usable passes wanted over all phases; at most ``MAX_DRAWS_PER_PASS`` times as many batches are drawn.
    """

    def __init__(self, model: torch.nn.Module, batches: Iterable[Any], loss_fn: LossFn | None, passes: int) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.drawn = 0
        self.used = 0
        self._batches = self._draw(batches, passes * MAX_DRAWS_PER_PASS)

    def _draw(self, batches: Iterable[Any], limit: int) -> Iterator[Any]:
        """Up to ``limit`` batches; iterated only when the first pass runs (inside the caller's sampling context)."""
        yield from itertools.islice(iter(batches), limit)

    def _context(self) -> AbstractContextManager[Any]:
        """What the passes run inside (nothing here; Lightning mutes the module's logging)."""
        return nullcontext()

    def _before_pass(self) -> None:
        """Called before each pass (Lightning stops a preempted run here)."""

    def run(self, passes: int, layers: Callable[[], Sequence[ProjectedWeight]], consume: GradientConsumer) -> int:
        """Run up to ``passes`` usable passes, each delivering every layer of ``layers()`` (asked before each pass;
        an empty answer ends the phase) to ``consume``.

        Returns:
            The usable passes run: fewer than ``passes`` when the batches ran out or the loss skipped (returned
            ``None`` for) every batch drawn.
        """
        used = 0
        with self._context(), torch.enable_grad():
            while used < passes:
                self._before_pass()
                active = layers()
                batch = next(self._batches, None) if active else None
                if batch is None:
                    break
                self.drawn += 1
                with sample_gradients(self.model, active, consume):
                    loss = self._loss(batch, self.drawn - 1)
                    if loss is None:
                        continue  # the loss skipped this batch: draw another
                    loss.backward()
                used += 1
                self.used += 1
        return used

    def _loss(self, batch: Any, index: int) -> Tensor | None:
        """The batch's loss, or ``None`` where the loss function skipped it."""
        assert self.loss_fn is not None
        return loss_tensor(self.loss_fn(self.model, batch), "loss_fn")

    def no_gradients_error(self) -> str:
        """What to say when no pass delivered a gradient."""
        return (f"The projector fit drew {self.drawn} batch(es) and loss_fn returned None (skip) for every one, or "
                f"there were none: there are no gradients to fit to. Hand fit_projectors batches whose loss it can "
                f"compute, or use projectors='random'.")


def loss_tensor(output: Any, source: str) -> Tensor | None:
    """The loss in ``output`` (a tensor, or a mapping with ``"loss"``), or ``None`` for a skipped batch.

    Raises:
        ValueError: when ``output`` holds no loss tensor (``source`` names what returned it).
    """
    if output is None:
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise ValueError(f"The projector fit needs a loss tensor from {source}; got {type(output).__name__}. Return "
                         f"the loss (or a mapping with 'loss'), or pass loss_fn=lambda model, batch: ...")
    return loss
