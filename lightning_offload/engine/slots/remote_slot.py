"""The slot of a tensor another rank steps (data parallelism): no host buffers or Adam state here, only what
applying its broadcast update needs."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.slots.projected_slot import (
    PROJECTED_UNSEEN, count_projected_buffers, install_projectors, load_projector_checkpoint, projector_bytes,
    projector_checkpoint)
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector


class RemoteSlot(Slot):
    """A tensor whose gradient this rank reduces to its owner and whose update it receives by broadcast.

    Args:
        layer: the projected weight, for a projected tensor (``None`` for a dense one).
        generator: a projected weight's stochastic-rounding generator, seeded as on every rank, so each rank rounds
            the broadcast update alike.
    """

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool,
                 layer: ProjectedWeight | None, generator: torch.Generator | None, owner: int) -> None:
        super().__init__(name, param, group, lanes, decoupled, owner, owned=False)
        self.layer = layer
        self.generator = generator
        # What applying the broadcast update multiplies W by, captured at the step as the owner captures it.
        self.decay = 1.0

    def gradient(self) -> Tensor | None:
        if self.layer is None:
            return self.param.grad
        return self.layer.grad_buffer if self.layer.has_grad else None

    def has_grad(self) -> bool:
        return self.layer.has_grad if self.layer is not None else self.param.grad is not None

    @property
    def norm_ratio(self) -> float:
        return self.layer.norm_ratio if self.layer is not None else 1.0

    def gradient_numel(self) -> int:
        return math.prod(self.layer.compressed_shape) if self.layer is not None else self.param.numel()

    def begin_collect(self) -> None:
        if self.layer is not None:
            self.layer.reset_forward_count()  # as the owner's slot does

    def gradient_unseen_by_edits(self) -> str | None:
        return PROJECTED_UNSEEN if self.layer is not None and self.layer.has_grad else None

    def abandon_gradient(self) -> None:
        super().abandon_gradient()
        if self.layer is not None:
            self.layer.zero_grad()

    def count_device_buffers(self, step: StepTelemetry) -> None:
        if self.layer is not None:
            count_projected_buffers(self.layer, step)

    def checkpoint_part(self) -> dict[str, Any]:
        # Every rank's projectors are the same; rank 0 writes them with the rest.
        return projector_checkpoint(self.layer, self.generator) if self.layer is not None else {}

    def load_checkpoint_part(self, state: dict[str, Any]) -> None:
        if self.layer is not None:
            load_projector_checkpoint(self.name, self.layer, self.generator, state, self.lanes.device)

    def device_persistent_bytes(self) -> dict[str, int]:
        return projector_bytes(self.layer) if self.layer is not None else {}

    def replace_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float,
                           second_moment_scale: float) -> None:
        """Install a refit's projectors (the owner carries the Adam state; this rank keeps none)."""
        install_projectors(self.layer, self.lanes, {}, proj_out, proj_in, norm_ratio, second_moment_scale)

    def expect_update(self, timeline: StepTimeline) -> None:
        # What applying the update needs is captured now, as the owner does (a scheduler may change lr before then).
        if self.layer is not None:
            self.decay = self.decoupled_decay()
            self.layer.zero_grad()
        self.timeline = timeline

    def finish(self, start: float) -> None:
        lanes = self.lanes
        if self.layer is None:
            lanes.ranks.broadcast_(self.param.data, src=self.owner)
            self.timeline.add("device_wait", self.name, start, time.perf_counter())
            return
        index = lanes.ring.claim() if lanes.ring is not None else None
        if index is None:
            update = torch.empty(self.layer.compressed_shape, dtype=lanes.link_dtype, device=lanes.device)
        else:
            # The broadcast writes it in compute-stream order, after the apply that last read it: no wait.
            update = lanes.ring.view(index, self.layer.compressed_shape)
        lanes.ranks.broadcast_(update, src=self.owner)
        self.timeline.add("device_wait", self.name, start, time.perf_counter())
        # Applied as the owner applies it: the same decay, the same rounding generator.
        self.layer.apply_update(update, self.decay, self.generator, lanes.rule.one_step_size)
        if index is not None:
            lanes.ring.release(index, lanes.link.compute_event())
