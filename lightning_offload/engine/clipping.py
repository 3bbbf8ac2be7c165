"""Norms, clipping and the non-finite decision of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`: one
global norm over every gradient of the step (compressed, dense, device-kept and external), clipping coefficients, and
skipping or refusing a step whose gradients hold inf/nan."""

from __future__ import annotations

import time
import warnings
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from lightning_offload.engine.pipeline import StepTimeline
from lightning_offload.engine.telemetry import StepTelemetry


NonFinitePolicy = Literal["skip", "raise"]


class NonFiniteGradientError(FloatingPointError):
    """Raised when ``on_nonfinite="raise"`` and a step's gradients hold inf or nan."""


class NonFiniteStepWarning(UserWarning):
    """Issued for every step skipped because its gradients hold inf or nan (``on_nonfinite="skip"``)."""


class GradientClipping:
    """The step's global norm, clipping and non-finite handling.

    A part of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`, which holds the state these methods
    use (set in its ``__init__``).
    """

    # ------------------------------------------------------------------------------------------------ gradients
    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """Global 2-norm of the full gradient, on the device: exact for dense gradients, estimated for projected ones.

        A projected weight's full gradient ``G`` never exists; its norm is estimated as ``‖S‖ / ρ``, where ``ρ`` is
        the layer's ``‖S‖/‖G‖`` measured after its last fit on batches the fit had not used
        (:attr:`~lightning_offload.lsp.linear.ProjectedWeight.norm_ratio`, :mod:`lightning_offload.lsp.norm_ratio`;
        1 for random draws, which keep norms in expectation, and exactly right for signed permutations). So ``gradient_clip_val`` means what it means for
        plain AdamW: learned projectors at ``rank=0.25`` keep only ~1/3 of the norm in ``S``.
        """
        if self.ranks is not None:
            return self._data_parallel_grad_norm()
        grads, ratios = [], []
        for slot in self.slots:
            if slot.layer is not None:
                if slot.layer.has_grad:
                    grads.append(slot.layer.grad_buffer)
                    ratios.append(slot.layer.norm_ratio)
            elif slot.param.grad is not None:
                grads.append(slot.param.grad)
                ratios.append(1.0)
        for param in self.device_adam.params if self.device_adam is not None else ():
            if param.grad is not None:
                grads.append(param.grad)
                ratios.append(1.0)
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch.stack([n.float().to(self.device) for n in torch._foreach_norm(grads)])
        if any(ratio != 1.0 for ratio in ratios):
            norms = norms / torch.tensor(ratios, device=self.device)
        return torch.linalg.vector_norm(norms)

    def _data_parallel_grad_norm(self) -> Tensor:
        """The global norm over the reduced gradients: each rank's share over the tensors it owns (a device Adam's,
        which every rank holds, counted on rank 0), summed in one all-reduce that also carries, per tensor, how many
        ranks had a gradient for it."""
        self.ranks.finish()
        grads, ratios, present = [], [], []
        for slot in self.slots:
            local = slot.layer.has_grad if slot.layer is not None else slot.param.grad is not None
            present.append(1.0 if local else 0.0)
            if slot.owned and local:
                grads.append(slot.layer.grad_buffer if slot.layer is not None else slot.param.grad)
                ratios.append(slot.layer.norm_ratio if slot.layer is not None else 1.0)
        if self.ranks.rank == 0:
            device_grads = [p.grad for p in (self.device_adam.params if self.device_adam is not None else ())
                            if p.grad is not None]
            grads, ratios = grads + device_grads, ratios + [1.0] * len(device_grads)
        total = torch.zeros(1, device=self.device)
        if grads:
            # One foreach kernel for every owned tensor's norm, as the single-process norm does.
            norms = torch.stack([n.float().to(self.device) for n in torch._foreach_norm(grads)])
            total = (norms / torch.tensor(ratios, device=self.device)).square().sum().reshape(1)
        vector = torch.cat([total, torch.tensor(present, device=self.device)])
        self.ranks.all_reduce_(vector)
        counts = vector[1:].tolist()
        partial = [slot.name for slot, count in zip(self.slots, counts) if 0 < count < self.ranks.world]
        if partial:
            raise RuntimeError(
                f"{partial[0]} (and {len(partial) - 1} more) got a gradient on some ranks but not on others. Every "
                f"rank must use the same parameters in its forward (as with DDP without find_unused_parameters), "
                f"so that the reduced gradient is a mean over all ranks."
            )
        self._present = {id(slot): count > 0 for slot, count in zip(self.slots, counts)}
        return vector[0].sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip all gradients to global norm ``max_norm`` (see :meth:`grad_norm`); returns the norm before clipping.

        Same rule as ``torch.nn.utils.clip_grad_norm_``, ``coef = min(1, max_norm / (norm + 1e-6))``; the
        coefficient is applied on the host to the gradients as they arrive (bit-identical to scaling them on the
        device, and it does not have to wait for copies already under way).
        """
        total = self.grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clip = ("norm", coef)
        self._last_norm = total
        return total

    def set_clip_coefficient(self, coef: float | Tensor, norm: Tensor) -> None:
        """Scale this step's gradients by ``coef`` on the host, and take ``norm`` as their global norm.

        For strategies whose global norm also covers gradients this optimizer does not hold (MEFT's host rows):
        they compute the norm and coefficient, and this optimizer applies the coefficient and checks the norm.
        """
        self._clip = ("norm", torch.as_tensor(coef, dtype=torch.float32))
        self._last_norm = torch.as_tensor(norm)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element (compressed and dense) to ``[-clip_value, clip_value]`` (on the host)."""
        self._clip = ("value", float(clip_value))

    def _skip_step(self, norm: Tensor) -> None:
        self._clip, self._last_norm = None, None
        self._roll_back_speculation()  # the host state must be as if this step never began
        if self.ranks is not None:
            self.ranks.reset()
        if self.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                f"Non-finite gradient (global norm {float(norm)}) at optimizer step {self.telemetry.steps}. The host "
                f"state was not touched. Pass on_nonfinite='skip' to the strategy to skip such steps instead."
            )
        for slot in self.slots:
            self.link.host_wait(slot.to_host_event)  # copies already under way must land before S is cleared
            slot.to_host_event = None
        for layer in self.projected_layers:
            layer.zero_grad()
        self._timeline = StepTimeline()
        self._round += 1
        self.telemetry.skipped_steps += 1
        self.telemetry.last = StepTelemetry(skipped=1.0)
        self.telemetry.last_timeline = None  # a skipped step has no timeline of its own
        self.telemetry.complete_step()
        # Never silent: a run whose steps are all skipped would otherwise look like one that merely stopped learning.
        warnings.warn(
            f"Skipped an optimizer step: a gradient is non-finite (global norm {float(norm)}); weights and host "
            f"state are untouched. {self.telemetry.skipped_steps} step(s) skipped so far, {self.telemetry.steps} "
            f"taken (logged as offload/skipped_steps). Lower the learning rate, clip gradients (gradient_clip_val), "
            f"or pass on_nonfinite='raise' to stop at the first one.",
            NonFiniteStepWarning,
            stacklevel=2,
        )
        self._step_start = time.perf_counter()
