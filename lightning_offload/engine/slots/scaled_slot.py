"""A weight trained by the scaled rule (``update="scaled"``, :mod:`lightning_offload.lsp.channel_scales`): its full
gradient stays on the device, its projection ``R = G·Pᵀ`` crosses to the host, where Adam's moments of ``R`` give one
scale per channel, and the scales cross back to scale ``G`` in place of Adam's update.

The gradient is the weight's ``.grad`` until the step: a user's clipping call edits it, and the global norm reads it
(both exact). At the step it is taken out of ``.grad`` and held until this step's scales are applied (before the
module's next forward, or inside the step when not pipelined): the device holds the projected layers' full gradients
from backward to their updates, as native training does until its step. No stale scale is ever applied: the
update waits for its own step's host job.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.link import CopyLabel
from lightning_offload.engine.slots.host_step_slot import HostStepSlot
from lightning_offload.engine.slots.slot import Clip, JobSettings, clip_, pinned_zeros, thread_minor_faults
from lightning_offload.inner_optimizers import step_unhooked
from lightning_offload.lsp.channel_scales import ScaledWeight, bias_correction, channel_scales


def coupled_decay_error(name: str) -> ValueError:
    """The refusal of Adam's coupled L2 under the scaled rule."""
    return ValueError(
        f"{name}: update='scaled' takes AdamW's decoupled weight decay, not Adam's coupled L2 (torch.optim.Adam with "
        f"weight_decay > 0 adds λW to every gradient, which the scaled rule would have to project and scale as well). "
        f"Use torch.optim.AdamW, or weight_decay=0 in that group, or update='projected'.")


class ScaledSlot(HostStepSlot):
    """A weight stepped by the scaled rule: Adam on ``R`` on the host (``Z``, ``channels × r``, restarted at 0 with
    learning rate 1, so after the step ``Z = −R̃``), the channel scales back, the full-rank update on the device.

    Args:
        weight: the scaled weight (its projection and layout).
        generator: the stochastic-rounding generator of a low-precision weight (seeded per slot).
    """

    gradient_is_param_grad = True
    # Its host step starts at the launch, never during backward: the step's clip and skip decide what Adam sees, and
    # the scales are applied only from this step's moments.
    speculates = False
    steps_scaled = True

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool,
                 weight: ScaledWeight, generator: torch.Generator) -> None:
        if group.get("weight_decay") and not decoupled:
            raise coupled_decay_error(name)
        z = pinned_zeros((weight.channels, weight.rank), lanes.pin)
        direction = lanes.rule.optimizer_over(z, self._adam_hparams(lanes, group))
        super().__init__(name, param, group, lanes, decoupled, z, direction, None)
        self.weight = weight
        self.generator = generator
        # ‖G_j‖² of each channel, landed beside R (fp32 whatever the link: a norm is not narrowed).
        self.host_squares = pinned_zeros((weight.channels,), lanes.pin)
        self.squares_event: Any = None
        # The scales as they cross back, and their device buffer (on the CPU they are read where the host wrote them).
        self.host_scales = pinned_zeros((weight.channels,), lanes.pin)
        self.device_scales = torch.zeros(weight.channels, device=lanes.device, dtype=torch.float32) \
            if lanes.link.asynchronous else None
        #: The norm of the update last applied (the limiter's reference), and the steps taken (the draw of ``P``).
        self.last_norm: float | None = None
        self.steps_taken = 0
        # The gradient taken out of .grad at the step, held until its scales are applied; and what applying needs,
        # captured at the step (a scheduler may change the group before the update is applied).
        self.held: Tensor | None = None
        self.step_size = 0.0
        self.decay = 1.0

    @staticmethod
    def _adam_hparams(lanes: Lanes, group: dict[str, Any]) -> dict[str, Any]:
        # Adam gives the direction R̃ only: its step is 1 and it has no decay (AdamW's is applied to W on the device)
        # and no sign flip (maximize only changes the sign of the update applied, never a norm).
        return {**lanes.rule.hparams_of(group), "lr": 1.0, "weight_decay": 0.0, "maximize": False}

    # ------------------------------------------------------------------------------------------------ backward
    def send(self, timeline: StepTimeline) -> None:
        projected, squares = self.weight.project(self.param.grad)
        self.to_host_event = self.lanes.link.to_host(projected.to(self.lanes.link_dtype), self.host_grad,
                                                     CopyLabel(timeline, self.name))
        self.squares_event = self.lanes.link.to_host(squares, self.host_squares,
                                                     CopyLabel(timeline, f"{self.name} (squares)"))

    def clamp_on_device(self, bound: float) -> bool:
        # Exact: the full gradient the update scales is clamped, and the projection of the clamped one crosses again.
        self.param.grad.clamp_(-bound, bound)
        return True

    def abandon_gradient(self) -> None:
        super().abandon_gradient()
        self.lanes.link.host_wait(self.squares_event)
        self.squares_event = None

    # ------------------------------------------------------------------------------------------------ the step
    def settings(self) -> JobSettings:
        return self._adam_hparams(self.lanes, self.group), 0.0

    def prepare(self, step: StepTelemetry) -> None:
        step.bytes_device_to_host += (self.host_grad.numel() * self.host_grad.element_size()
                                      + self.host_squares.numel() * 4)
        step.bytes_host_to_device += self.host_scales.numel() * 4
        sign = -1.0 if self.group.get("maximize", False) else 1.0
        self.step_size = sign * self.group["lr"] * self.weight.alpha
        self.decay = self.decoupled_decay()
        # Out of .grad: the user's zero_grad must not clear (or zero in place) what the update still reads.
        self.held, self.param.grad = self.param.grad, None
        step.device_held_gradient_bytes += self.held.numel() * self.held.element_size()

    def host_step(self, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  speculative: bool = False) -> None:
        """Worker thread: Adam on the landed ``R`` (clipped as the step decided), then the channel scales and the
        limiter, and the scales' copy back."""
        faults = thread_minor_faults()
        start = time.perf_counter()
        self.host_optimizer.param_groups[0].update(settings[0])
        self.lanes.link.host_wait(self.to_host_event)
        self.lanes.link.host_wait(self.squares_event)
        landed = time.perf_counter()
        grad = self.host_grad if self.host_grad.dtype == torch.float32 else \
            self.lanes.scratch.view(self.host_grad.shape).copy_(self.host_grad)  # a job's fp32 working copy
        # ‖R_j‖ before clipping: the device's G is unclipped, so the scale ‖R̃_j‖/‖c·R_j‖ of the clipped c·G is
        # returned as ‖R̃_j‖/‖R_j‖ for G itself (the same update).
        gradient_norms = torch.linalg.vector_norm(grad, dim=1)
        if clip is not None and clip[0] == "norm":
            clip_(grad, clip)  # a clip by value was applied to G on the device (clamp_on_device)
        self.host_param.zero_()
        self.host_param.grad = grad
        step_unhooked(self.host_optimizer)  # the user's optimizer hooks are for their step (inner_optimizers.py)
        self.host_param.grad = None
        scales, self.last_norm = channel_scales(self.host_param, gradient_norms, self.host_squares, self.last_norm,
                                                self.weight.rule.norm_growth_limit, self._correction())
        self.host_scales.copy_(scales)
        stepped = time.perf_counter()
        if self.device_scales is not None:
            self.to_device_event = self.lanes.link.to_device(self.host_scales, self.device_scales, after=compute_done,
                                                             label=CopyLabel(self.timeline, self.name))
        step.host_page_faults += thread_minor_faults() - faults
        self.timeline.add("host_wait", self.name, start, landed)
        self.timeline.add("host", self.name, landed, stepped)

    def _correction(self) -> float:
        """Adam's bias correction at the step its moments took last (what the limiter leaves out of its norms)."""
        steps = int(self.host_optimizer.state[self.host_param]["step"])
        return bias_correction(self.host_optimizer.param_groups[0]["betas"], steps)

    def finish(self, start: float) -> None:
        lanes = self.lanes
        scales = self.host_scales if self.device_scales is None else self.device_scales
        lanes.link.device_wait(self.to_device_event)  # the compute stream waits for the scales; the host does not
        self.timeline.add("device_wait", self.name, start, time.perf_counter())
        self.weight.apply(self.held, scales, self.step_size, self.decay, self.generator)
        self.held = None
        self.steps_taken += 1
        self.weight.draw_for_step(self.steps_taken)  # a new P from the step a redraw is due (the moments stay)

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> list[Tensor]:
        return super().state_tensors() + [self.host_squares, self.host_scales]

    def device_persistent_bytes(self) -> dict[str, int]:
        return {"scaled_projections": self.weight.nbytes()}

    def host_state(self) -> dict[str, Any]:
        return {**self.host_optimizer.state_dict(), "scaled": {
            "last_norm": self.last_norm, "steps_taken": self.steps_taken,
            "seed": self.weight.seed,
            "rounding_generator": self.generator.get_state()}}

    def load_host_state(self, state: dict[str, Any]) -> None:
        scaled = state["scaled"]
        self.host_optimizer.load_state_dict({key: value for key, value in state.items() if key != "scaled"})
        self.last_norm = scaled["last_norm"]  # the limiter's norm without Adam's bias correction
        self.steps_taken = int(scaled["steps_taken"])
        self.weight.seed = int(scaled["seed"])  # the draws the checkpoint's run made, whatever this run's seed
        self.weight.draw_number = -1
        self.weight.draw_for_step(self.steps_taken)
        self.generator.set_state(scaled["rounding_generator"])
