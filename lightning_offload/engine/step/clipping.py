"""Norms, clipping and the non-finite decision of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`: one
global norm over every gradient of the step (compressed, dense, device-kept and external), clipping coefficients, and
skipping or refusing a step whose gradients hold inf/nan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.engine.slots.slot import Clip, Slot
from lightning_offload.engine.step.gradient_edits import GradientEdits


NonFinitePolicy = Literal["skip", "raise"]


class NonFiniteGradientError(FloatingPointError):
    """Raised when ``on_nonfinite="raise"`` and a step's gradients hold inf or nan."""


class NonFiniteStepWarning(UserWarning):
    """Issued for every step skipped because its gradients hold inf or nan (``on_nonfinite="skip"``)."""


class GradientNorms:
    """The step's global gradient norm and its clipping decision.

    Args:
        device: the training device (the norm is computed there).
        ranks: the ranks of data parallelism, or ``None``.
    """

    def __init__(self, device: torch.device, ranks: RankShards | None) -> None:
        self.device = device
        self.ranks = ranks
        #: The clipping asked for this step (consumed by the step), and the norm it was computed from.
        self.clip: Clip = None
        self.last_norm: Tensor | None = None
        #: Data parallelism: which slots had a gradient on some rank this step (decided by every rank alike).
        self.present: dict[int, bool] = {}
        #: Row gradients summed on the host (MEFT's adapter rows): their norm joins the device gradients' norm.
        self.rows: RowGradients | None = None
        #: The in-place edits of ``param.grad`` after backward, and the norms backward left (one process only: between
        #: ranks the reduction itself writes the gradients back).
        self.edits: GradientEdits | None = None
        #: Each parameter's place in the user's groups, by identity: the per-tensor norms are combined in that order,
        #: as ``torch.nn.utils.clip_grad_norm_`` combines them, wherever each tensor is stepped (a device-kept vector
        #: between two host-stepped matrices gives the norm the bits it had on the host). A tensor not in it goes last.
        self.positions: dict[int, int] = {}

    @torch.no_grad()
    def global_norm(self, slots: Sequence[Slot], device_params: Sequence[Tensor]) -> Tensor:
        """Global 2-norm of the full gradient, on the device: exact for dense gradients, estimated for projected
        ones as ``‖S‖ / ρ`` (:attr:`~lightning_offload.engine.slots.slot.Slot.norm_ratio`)."""
        if self.ranks is not None:
            return self._data_parallel_norm(slots, device_params)
        norm = self._device_norm(slots, device_params)
        if self.rows is not None:
            # Summed on the host: combined there, as torch.nn.utils.clip_grad_norm_ would over ordinary parameters.
            norm = torch.linalg.vector_norm(torch.stack([norm.float().cpu(), self.rows.norm()]))
        return norm

    def _in_parameter_order(self, entries: list[tuple[Tensor, ...]]) -> list[tuple[Tensor, ...]]:
        """``entries`` (each led by its parameter) sorted by :attr:`positions` (stable: unknown ones keep their order,
        last)."""
        last = len(self.positions)
        return sorted(entries, key=lambda entry: self.positions.get(id(entry[0]), last))

    def _device_norm(self, slots: Sequence[Slot], device_params: Sequence[Tensor]) -> Tensor:
        entries = []
        for slot in slots:
            grad = slot.gradient()
            if grad is not None:
                # Measured when backward left it (as it crossed), if unchanged since: not measured twice.
                entries.append((slot.param, grad, slot.norm_ratio, self.edits.norm(slot) if self.edits is not None
                                else None))
        entries += [(param, param.grad, 1.0, None) for param in device_params if param.grad is not None]
        if not entries:
            return torch.zeros((), device=self.device, dtype=torch.float32)
        _, grads, ratios, known = zip(*self._in_parameter_order(entries))
        # One foreach kernel for every norm not known yet (the same kernel measured the known ones: same bits).
        unknown = [grad for grad, norm in zip(grads, known) if norm is None]
        measured = iter(torch._foreach_norm(unknown) if unknown else ())
        norms = torch.stack([(norm if norm is not None else next(measured)).float().to(self.device) for norm in known])
        if any(ratio != 1.0 for ratio in ratios):
            norms = norms / torch.tensor(ratios, device=self.device, dtype=torch.float32)
        return torch.linalg.vector_norm(norms)

    def _data_parallel_norm(self, slots: Sequence[Slot], device_params: Sequence[Tensor]) -> Tensor:
        """The global norm over the reduced gradients: each rank's share over the tensors it owns (a device Adam's,
        which every rank holds, counted on rank 0), summed in one all-reduce that also carries, per tensor, how many
        ranks had a gradient for it."""
        self.ranks.finish()
        entries, present = [], []
        for slot in slots:
            local = slot.has_grad()
            present.append(1.0 if local else 0.0)
            if slot.owned and local:
                entries.append((slot.param, slot.gradient(), slot.norm_ratio))
        if self.ranks.rank == 0:
            entries += [(p, p.grad, 1.0) for p in device_params if p.grad is not None]
        total = torch.zeros(1, device=self.device, dtype=torch.float32)
        if entries:
            _, grads, ratios = zip(*self._in_parameter_order(entries))
            # One foreach kernel for every owned tensor's norm, as the single-process norm does.
            norms = torch.stack([n.float().to(self.device) for n in torch._foreach_norm(grads)])
            total = (norms / torch.tensor(ratios, device=self.device, dtype=torch.float32)).square().sum().reshape(1)
        vector = torch.cat([total, torch.tensor(present, device=self.device, dtype=torch.float32)])
        self.ranks.all_reduce_(vector)
        counts = vector[1:].tolist()
        partial = [slot.name for slot, count in zip(slots, counts) if 0 < count < self.ranks.world]
        if partial:
            raise RuntimeError(
                f"{partial[0]} (and {len(partial) - 1} more) got a gradient on some ranks but not on others. Every "
                f"rank must use the same parameters in its forward (as with DDP without find_unused_parameters), "
                f"so that the reduced gradient is a mean over all ranks."
            )
        self.present = {id(slot): count > 0 for slot, count in zip(slots, counts)}
        return vector[0].sqrt()

    def clip_norm(self, total: Tensor, max_norm: float) -> None:
        """Clip this step to global norm ``max_norm`` given its norm ``total`` (``torch.nn.utils.clip_grad_norm_``'s
        rule, ``coef = min(1, max_norm / (norm + 1e-6))``)."""
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.clip, self.last_norm = ("norm", coef), total

    def take(self) -> tuple[Clip, Tensor | None]:
        """This step's clipping and norm, consumed: the next clipping call (inside the next closure, or before a
        manual step) sets them again."""
        clip, norm = self.clip, self.last_norm
        self.clip, self.last_norm = None, None
        return clip, norm


def launch_clip(clip: Clip) -> Clip:
    """The clipping the host jobs apply: a norm coefficient moved to the host as fp32, or none where it is exactly 1
    (the clamp's ceiling: the norm is under the limit; scaling by 1 changes no bit)."""
    if clip is None or clip[0] != "norm":
        return clip
    coefficient = clip[1].to("cpu", torch.float32)
    return None if float(coefficient) == 1.0 else ("norm", coefficient)


def skipped_step_warning(norm: Tensor, skipped: int, taken: int) -> str:
    """What a skipped step says: never silent, since a run whose steps are all skipped would otherwise look like one
    that merely stopped learning."""
    return (f"Skipped an optimizer step: a gradient is non-finite (global norm {float(norm)}); weights and host "
            f"state are untouched. {skipped} step(s) skipped so far, {taken} taken (logged as offload/skipped_steps). "
            f"Lower the learning rate, clip gradients (gradient_clip_val), or pass on_nonfinite='raise' to stop at "
            f"the first one.")


def nonfinite_error(norm: Tensor, step: int) -> NonFiniteGradientError:
    """The error of ``on_nonfinite="raise"``."""
    return NonFiniteGradientError(
        f"Non-finite gradient (global norm {float(norm)}) at optimizer step {step}. The host state was not touched. "
        f"Pass on_nonfinite='skip' to the strategy to skip such steps instead.")
