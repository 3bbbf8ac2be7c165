"""Gradients changed in place after backward produced them: a user's own ``torch.nn.utils.clip_grad_norm_`` (or
``clip_grad_value_``, or any other in-place edit of ``param.grad``) between ``backward()`` and ``step()``.

The engine sends each gradient to the host as soon as backward has finished it (the last micro-batch of a loop, the
Trainer's closure), so an edit made afterwards would change a tensor nobody reads again: the step would silently train
on the unedited gradient. :class:`GradientEdits` notices such edits at the step, from each ``param.grad``'s identity
and version counter (every in-place op bumps it). Any in-place op counts, whatever it did to the values or the norm:
torch's ``clip_grad_norm_`` multiplies by exactly 1 whenever the norm *it* measured is under the limit, and where that
norm could not see every gradient (projected weights) the true one may be over it, so a call that changed nothing is
as wrong as one that did. The same goes for a norm read through ``clip_grad_norm_(..., inf)``: it reports a norm
without the gradients it cannot see (``optimizer.grad_norm()`` reads the true one).

What an edit leads to is the orchestrator's call: where every gradient of the step is a ``param.grad``
(``zero_offload``, nothing projected), torch's clipping saw the true global norm, so the edited gradients simply cross
again and the edit takes effect exactly; where some are not (projected weights' compressed gradients, MEFT's host rows),
the edit saw a partial norm and left those unclipped, and the step is refused with the offload's own clipping named.

The norm recorded when a gradient crossed is also the one the step's global norm uses while the gradient is unchanged,
so the check costs no pass over the gradients beyond the norm the step computes anyway.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_offload.engine.slots.slot import Slot

#: How to clip through the offload, in each loop (the error and the warning name them all).
CLIP_THROUGH_THE_OFFLOAD = (
    "Clip through the offload instead: offload(..., max_grad_norm=c) or optimizer.clip_grad_norm_(c) in a loop of "
    "your own (also Fabric's strategies' max_grad_norm=c, or fabric.clip_gradients(model, optimizer, max_norm=c)); "
    "Trainer(gradient_clip_val=c) under Lightning's Trainer; under Hugging Face's Trainer, OffloadCallback(optimizer) "
    "in its callbacks makes TrainingArguments.max_grad_norm the offload's clipping. optimizer.grad_norm() reads the "
    "global norm without clipping.")


@dataclass
class _Seen:
    """A gradient as the engine last saw it: the tensor, its version then, and its norm then (where measured)."""

    grad: weakref.ref
    version: int
    norm: Tensor | None = None

    def holds(self, grad: Tensor) -> bool:
        """Whether ``grad`` is that tensor, unchanged since."""
        return self.grad() is grad and grad._version == self.version


class GradientEdits:
    """Notices the in-place edits of ``param.grad`` made after backward, for the slots whose gradient it is.

    Args:
        slots: the engine's slots; those whose gradient is their parameter's ``.grad`` (dense parameters and
            row-sparse embeddings) are watched.
    """

    def __init__(self, slots: Sequence[Slot]) -> None:
        self._watched = [slot for slot in slots if slot.gradient_is_param_grad]
        self._seen: dict[int, _Seen] = {}

    def backward_wrote(self, slot: Slot, measure: bool) -> None:
        """Autograd has just accumulated into ``slot``'s ``param.grad`` (its post-accumulate hook): what it left is the
        unedited gradient, measured (``measure``) where it may be the step's final one (it crosses now, or the loop
        sends gradients only at the step)."""
        grad = slot.param.grad
        if grad is None:
            return
        norm = torch._foreach_norm([grad])[0] if measure else None
        self._seen[id(slot)] = _Seen(weakref.ref(grad), grad._version, norm)

    def watch(self, slot: Slot) -> None:
        """Watch a slot that joined after set-up, its gradient as it is now taken as the one backward left."""
        if slot.gradient_is_param_grad:
            self._watched.append(slot)
            self.backward_wrote(slot, measure=True)

    def norm(self, slot: Slot) -> Tensor | None:
        """``slot``'s gradient norm as measured when backward left it, while the gradient is unchanged since
        (``None`` otherwise: the caller measures it now)."""
        seen = self._seen.get(id(slot))
        grad = slot.param.grad
        if seen is None or seen.norm is None or grad is None or not seen.holds(grad):
            return None
        return seen.norm

    def find(self) -> list[Slot]:
        """At the step: the watched slots whose ``param.grad`` was changed in place (or replaced) after backward left
        it. Reads no gradient: identities and version counters only."""
        edited = []
        for slot in self._watched:
            grad = slot.param.grad
            if grad is None:
                continue
            seen = self._seen.get(id(slot))
            if seen is None or not seen.holds(grad):
                edited.append(slot)
        return edited


def edited_gradients_error(edited: Sequence[Slot], unseen: str) -> RuntimeError:
    """The refusal of a step whose gradients were edited in place where the edit could not have been exact:
    ``unseen`` names the gradients it could not see (projected weights' compressed ones, MEFT's host rows)."""
    more = f" (and {len(edited) - 1} more)" if len(edited) > 1 else ""
    return RuntimeError(
        f"The gradient of {edited[0].name}{more} was changed in place after backward, e.g. by "
        f"torch.nn.utils.clip_grad_norm_(model.parameters(), ...) between backward() and step(). Such a call cannot "
        f"clip this offload: {unseen} never fill param.grad, so it measured a norm without them and left them "
        f"unclipped (also when it changed nothing: torch multiplies by exactly 1 when the norm it measured is under "
        f"the limit, which the true norm may not be). The step was not taken. {CLIP_THROUGH_THE_OFFLOAD}")


def resent_warning(edited: Sequence[Slot]) -> str:
    """What the engine says once when edited gradients that had crossed already cross again."""
    more = f" (and {len(edited) - 1} more)" if len(edited) > 1 else ""
    return (f"The gradient of {edited[0].name}{more} was changed in place after it had crossed to the host (e.g. by "
            f"torch.nn.utils.clip_grad_norm_ between backward() and step()): the changed gradients crossed again, so "
            f"the change takes effect exactly, at the cost of a second copy of each such gradient every step. "
            f"{CLIP_THROUGH_THE_OFFLOAD}")
