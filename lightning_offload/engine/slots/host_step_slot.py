"""The host step that projected weights and dense parameters share: one optimizer of the engine's host rule (a fused
``torch.optim.Adam`` for Adam/AdamW, :mod:`~lightning_offload.engine.rules`) over one host tensor (a projected
weight's ``Z``, a dense parameter's fp32 master), stepped on the gradient that landed."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.link import CopyLabel
from lightning_offload.engine.slots.slot import Clip, JobSettings, Slot, clip_, thread_minor_faults
from lightning_offload.inner_optimizers import step_unhooked


class HostStepSlot(Slot):
    """A slot whose host state is one tensor stepped by its own optimizer of the engine's host rule.

    Subclasses say what the tensor is (:meth:`_before_host_step`, :meth:`_after_host_step`) and add their own L2 term.

    Attributes:
        host_param: the host tensor the host optimizer steps (``Z`` or the fp32 master).
        host_grad: where the gradient lands, in the link dtype.
        host_optimizer: its host optimizer (the state a checkpoint keeps).
        host_update: the update or value as it crosses back, where that dtype differs from ``host_param``'s.
    """

    speculates = True
    #: Whether a speculative step holds its result back until the step confirms it (a dense value, which would
    #: overwrite the device weight; a projected update waits for its apply anyway).
    holds_value_back = False
    #: Whether the host variable restarts from zero at every step (a projected weight's ``Z``, only the step's update):
    #: then rolling a step back needs no copy of it.
    restarts_each_step = False

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool,
                 host_param: Tensor, host_optimizer: Optimizer, host_update: Tensor | None, owner: int = 0) -> None:
        super().__init__(name, param, group, lanes, decoupled, owner)
        self.host_param = host_param
        self.host_optimizer = host_optimizer
        self.host_grad = torch.zeros(host_param.shape, dtype=lanes.link_dtype, pin_memory=lanes.pin)
        self.host_update = host_update
        # The fp32 copy of a gradient that lands narrower, or of one a speculative step clamps or adds L2 to, is made
        # in the host jobs' shared buffer (engine/lanes/host_scratch.py): it lives only while the job runs. Reserved
        # where every step needs it; the speculative case grows it at its first such step, as it used to allocate.
        if lanes.link_dtype != torch.float32:
            lanes.scratch.reserve(host_param.numel())
        # A projected weight's coupled L2 term λ·A W Bᵀ, landed from the device (dense parameters: the host optimizer
        # adds it).
        self.host_l2: Tensor | None = None

    def send(self, timeline: StepTimeline) -> None:
        grad = self.gradient()
        if grad.dtype != self.lanes.link_dtype:
            grad = grad.to(self.lanes.link_dtype)  # narrow on the device: half the bytes cross the link
        # No reference is kept: the link marks the source as in use by its copy stream, so its memory is not reused
        # before the copy has read it (a projected weight's S is freed as soon as the layer releases it, in step).
        self.to_host_event = self.lanes.link.to_host(grad, self.host_grad, CopyLabel(timeline, self.name))

    def host_step(self, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  speculative: bool = False) -> None:
        """Worker thread: wait for the gradient, step the host optimizer, and hand the result on
        (:meth:`_after_host_step`).

        Args:
            speculative: leave the landing buffer as it arrived (the step may be redone), and hold a dense value back
                until the step is confirmed.
        """
        faults = thread_minor_faults()
        start = time.perf_counter()
        hparams, l2_weight = settings
        self.host_optimizer.param_groups[0].update(hparams)
        self.lanes.link.host_wait(self.to_host_event)
        self._wait_for_l2()
        landed = time.perf_counter()
        # In place: the landing buffer is rewritten by the next step's copy anyway. A gradient that landed narrower,
        # or that a speculative step changes (a redo needs it as it arrived), is worked on in the shared scratch.
        grad = self.host_grad
        narrower = grad.dtype != torch.float32
        if narrower or (speculative and (clip is not None or self.host_l2 is not None)):
            grad = self.lanes.scratch.view(grad.shape, grow=not narrower).copy_(grad)
        clip_(grad, clip)
        if self.host_l2 is not None:
            # As torch's Adam: the gradient is clipped first, then λW is added — after the sign flip under
            # maximize, so L2 always pulls towards zero. The host Adam flips the whole sum, hence the sign here.
            sign = -1.0 if hparams.get("maximize", False) else 1.0
            grad.add_(self.host_l2, alpha=sign * l2_weight)
        self._before_host_step()
        self.host_param.grad = grad
        step_unhooked(self.host_optimizer)  # the user's optimizer hooks are for their step (inner_optimizers.py)
        self.host_param.grad = None
        stepped = time.perf_counter()
        self._after_host_step(compute_done, stepped, speculative)
        # One worker thread runs the jobs one after another, so the step's figure needs no lock.
        step.host_page_faults += thread_minor_faults() - faults
        self.timeline.add("host_wait", self.name, start, landed)
        self.timeline.add("host", self.name, landed, stepped)

    def _wait_for_l2(self) -> None:
        """Worker thread: the coupled L2 term, where the kind has one, has landed."""

    def _before_host_step(self) -> None:
        """Worker thread, right before the host optimizer steps ``host_param``."""

    def _after_host_step(self, compute_done: Any, stepped: float, speculative: bool) -> None:
        """Worker thread, right after the host optimizer stepped ``host_param``: start the result's way back."""
        raise NotImplementedError

    def host_optimizer_state(self) -> dict[str, Any]:
        """The host optimizer's state of ``host_param`` (empty before its first step)."""
        return self.host_optimizer.state.get(self.host_param, {})

    def forget_host_optimizer_state(self) -> None:
        """Drop the host optimizer's state of ``host_param`` (rolling back the step that created it)."""
        self.host_optimizer.state.pop(self.host_param, None)

    def state_tensors(self) -> list[Tensor]:
        tensors = [t for t in (self.host_param, self.host_grad, self.host_update, self.host_l2) if t is not None]
        return tensors + [v for state in self.host_optimizer.state.values() for v in state.values()
                          if torch.is_tensor(v)]

    def host_state(self) -> dict[str, Any]:
        return self.host_optimizer.state_dict()

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.host_optimizer.load_state_dict(state)
