"""A projected weight's slot: host Adam on the compressed gradient ``S = A G Bᵀ`` (variable ``Z``, moments
``d_o × d_i``), the update ``U`` crossing back through the update ring and expanded on the device. The update starts
crossing as soon as its host step ends, where a ring buffer is free; otherwise the step starts its copy ahead of its
layer's forward (engine/step/update_prefetch.py), or the forward does."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.link import CopyLabel
from lightning_offload.engine.slots.host_step_slot import HostStepSlot
from lightning_offload.engine.slots.slot import JobSettings, pinned_zeros
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.lsp.rotation import coordinate_map, rotate_moments


@torch.no_grad()
def install_projectors(layer: ProjectedWeight, lanes: Lanes, state: dict[str, Any], proj_out: SparseProjector,
                       proj_in: SparseProjector, norm_ratio: float, second_moment_scale: float) -> None:
    """Give ``layer`` new projectors and map its host optimizer's state (empty where another rank keeps it) into the
    new subspace, by the moments the engine's host rule names: on the host, so only ``d × d`` maps cross the link.

    Raises:
        ValueError: if the compressed shape would change.
    """
    if (proj_out.dim_out, proj_in.dim_out) != layer.compressed_shape:
        raise ValueError(
            f"A refit must keep {layer.name}'s compressed shape {layer.compressed_shape}; got "
            f"({proj_out.dim_out}, {proj_in.dim_out})."
        )
    if state:
        rotate_moments(state, coordinate_map(layer.proj_out, proj_out), coordinate_map(layer.proj_in, proj_in),
                       lanes.rule.first_moments, lanes.rule.second_moments, second_moment_scale)
    layer.set_projectors(proj_out.to(lanes.device), proj_in.to(lanes.device))
    # A degenerate measurement (zero, nan) must not turn every later norm into inf and skip every step.
    layer.norm_ratio = float(norm_ratio) if math.isfinite(norm_ratio) and norm_ratio > 0 else 1.0


#: What a user's in-place edit of ``param.grad`` cannot see of a projected weight's gradient.
PROJECTED_UNSEEN = "the projected weights' compressed gradients"


def count_projected_buffers(layer: ProjectedWeight, step: StepTelemetry) -> None:
    """Add the device buffers a projected weight's gradient took this step to ``step``: its compressed gradient
    ``S`` and the projected inputs its forwards kept for backward."""
    if layer.grad_buffer is not None:
        step.device_compressed_grad_bytes += layer.grad_buffer.numel() * layer.grad_buffer.element_size()
    step.device_saved_projection_bytes += layer.saved_projection_bytes


def projector_bytes(layer: ProjectedWeight) -> dict[str, int]:
    """The device bytes a projected weight's two sparse projectors take (the telemetry's ``projectors``)."""
    return {"projectors": layer.proj_out.nbytes() + layer.proj_in.nbytes()}


def projector_checkpoint(layer: ProjectedWeight, generator: torch.Generator) -> dict[str, Any]:
    """A projected weight's part of a checkpoint: its projectors, the clipping norm's ``ρ`` and its probes' averages
    (plain numbers), and its stochastic-rounding generator."""
    return {"projectors": {"out": layer.proj_out.state_dict(), "in": layer.proj_in.state_dict(),
                           "norm_ratio": layer.norm_ratio, "norm_probe": layer.norm_probe.state_dict()},
            "rounding_generators": generator.get_state()}


def load_projector_checkpoint(name: str, layer: ProjectedWeight, generator: torch.Generator, state: dict[str, Any],
                              device: torch.device) -> None:
    """Restore ``name``'s :func:`projector_checkpoint` from the whole checkpoint ``state`` (projectors go to
    ``device``)."""
    saved = state["projectors"][name]
    layer.set_projectors(SparseProjector.from_state_dict(saved["out"], device),
                         SparseProjector.from_state_dict(saved["in"], device))
    layer.norm_ratio = float(saved["norm_ratio"])
    layer.norm_probe.load_state_dict(saved["norm_probe"], device)  # the probes' averages and draw count
    generator.set_state(state["rounding_generators"][name])


class ProjectedSlot(HostStepSlot):
    """A projected weight stepped in the compressed space.

    Args:
        layer: the projected weight (its module's forward and backward produce ``S``).
        generator: the stochastic-rounding generator of low-precision weights (seeded per slot).
    """

    fetches_update = True
    restarts_each_step = True  # Z = U: _before_host_step zeroes it

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool,
                 layer: ProjectedWeight, generator: torch.Generator, owner: int = 0) -> None:
        shape = layer.compressed_shape
        narrower = lanes.link_dtype != torch.float32
        # Z restarts from zero at every step. Where U crosses narrower, it is narrowed into its staging buffer right
        # after the step, so Z lives only while the job runs: the host jobs' shared buffer holds it (rebound to it
        # before every step, _before_host_step). Otherwise Z is what crosses back and is kept until then.
        if narrower:
            lanes.scratch.reserve(math.prod(shape), "variable")
        z = lanes.scratch.view(shape, "variable") if narrower else pinned_zeros(shape, lanes.pin)
        # Weight decay of projected weights is applied to W on the device (decoupled) or added to S as
        # λ·A W Bᵀ (coupled L2), never to Z, whose value is only the step's update.
        host_optimizer = lanes.rule.optimizer_over(z, {**lanes.rule.hparams_of(group), "weight_decay": 0.0})
        host_update = pinned_zeros(shape, lanes.pin, lanes.link_dtype) if narrower else None
        super().__init__(name, param, group, lanes, decoupled, z, host_optimizer, host_update, owner)
        self.layer = layer
        self.generator = generator
        self.host_l2 = pinned_zeros(shape, lanes.pin) if group.get("weight_decay") and not decoupled else None
        self.l2_event: Any = None
        self.sent_version = -1
        # Captured at the step: a scheduler may change lr before the update is applied.
        self.decay = 1.0
        # The device buffer the update lands in, and its number in the update ring (None for a one-off allocation).
        self.update_on_device: Tensor | None = None
        self.ring_index: int | None = None

    # ------------------------------------------------------------------------------------------------ backward
    def gradient(self) -> Tensor | None:
        return self.layer.grad_buffer if self.layer.has_grad else None

    def has_grad(self) -> bool:
        return self.layer.has_grad

    @property
    def norm_ratio(self) -> float:
        return self.layer.norm_ratio

    def gradient_numel(self) -> int:
        return math.prod(self.layer.compressed_shape)

    def send(self, timeline: StepTimeline) -> None:
        super().send(timeline)
        self.sent_version = self.layer.grad_version  # a later accumulation into S makes this copy stale

    def unchanged_since_sent(self) -> bool:
        return self.sent_version == self.layer.grad_version

    def release_gradient(self) -> None:
        # S is released, not cleared: its copy may still be reading it, and the link keeps its memory from being
        # reused until then (no wait on the compute stream).
        self.layer.zero_grad()

    def begin_collect(self) -> None:
        self.layer.reset_forward_count()  # a forward whose backward never ran must not hold back this step's send

    def gradient_unseen_by_edits(self) -> str | None:
        return PROJECTED_UNSEEN if self.layer.has_grad else None

    def abandon_gradient(self) -> None:
        super().abandon_gradient()
        self.layer.zero_grad()

    def count_device_buffers(self, step: StepTelemetry) -> None:
        count_projected_buffers(self.layer, step)

    # ------------------------------------------------------------------------------------------------ the step
    def settings(self) -> JobSettings:
        # A projected weight's decay is not Adam's: it is applied to W or added as L2.
        hparams, l2_weight = super().settings()
        hparams.pop("weight_decay", None)
        return hparams, l2_weight

    def prepare(self, step: StepTelemetry) -> None:
        step.bytes_device_to_host += self.host_grad.numel() * self.host_grad.element_size()
        self.decay = self.decoupled_decay()
        step.bytes_host_to_device += self.host_param.numel() * self.lanes.link_dtype.itemsize

    def prepare_l2(self, step: StepTelemetry) -> None:
        """Adam's coupled L2 term in the compressed space, ``A (G + λW) Bᵀ = S + λ·A W Bᵀ``, from ``W`` before the
        update (main thread: it reads the device weight)."""
        if self.host_l2 is None or self.decoupled:
            return
        # On the copy stream, like the gradient: the host job waits for it, the main thread does not.
        self.l2_event = self.lanes.link.to_host(self.layer.compress_weight(), self.host_l2,
                                                CopyLabel(self.timeline, f"{self.name} (L2)"))
        step.bytes_device_to_host += self.host_l2.numel() * self.host_l2.element_size()

    def _wait_for_l2(self) -> None:
        self.lanes.link.host_wait(self.l2_event)

    def _before_host_step(self) -> None:
        if self.host_update is not None:  # Z in the shared buffer (which set-up may have grown since this slot's)
            self.host_param.set_(self.lanes.scratch.view(self.host_param.shape, "variable"))
        self.host_param.zero_()  # Z restarts at 0 every step, so after the step Z = U

    def _after_host_step(self, compute_done: Any, stepped: float, speculative: bool) -> None:
        if self.host_update is not None:
            self.host_update.copy_(self.host_param)  # narrowed to the link dtype on the host
        # The update starts crossing now, where a ring buffer is free, so that its copy overlaps the rest of backward
        # (a speculative step) or the next host steps, not its layer's next forward. A speculative step's copy is
        # dropped if the step is redone or undone (drop_fetch); without a free buffer the main thread fetches it.
        self.drop_fetch()  # a redone step's earlier copy: landed, the job waited for it before rewriting Z
        if self.lanes.ring is not None:
            self.start_fetch(allocate=False)

    def finish(self, start: float) -> None:
        lanes = self.lanes
        update = self._fetch_update()
        self.timeline.add("device_wait", self.name, start, time.perf_counter())
        if lanes.ranks is not None:
            lanes.ranks.broadcast_(update, src=self.owner)  # the other ranks apply the same U
        self.layer.apply_update(update, self.decay, self.generator, lanes.rule.one_step_size)
        if self.ring_index is not None:
            # Queued, not run: the event tells the next copy into this buffer when the apply has read it.
            lanes.ring.release(self.ring_index, lanes.link.compute_event())
        self.update_on_device, self.ring_index = None, None

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> list[Tensor]:
        tensors = super().state_tensors()
        # Z in the shared buffer is counted once, with it (engine/step/sizes.py).
        return [t for t in tensors if t is not self.host_param] if self.host_update is not None else tensors

    def checkpoint_part(self) -> dict[str, Any]:
        return projector_checkpoint(self.layer, self.generator)

    def load_checkpoint_part(self, state: dict[str, Any]) -> None:
        load_projector_checkpoint(self.name, self.layer, self.generator, state, self.lanes.device)

    def device_persistent_bytes(self) -> dict[str, int]:
        return projector_bytes(self.layer)

    # ------------------------------------------------------------------------------------------------ refit
    def replace_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float,
                           second_moment_scale: float) -> None:
        """Install new projectors and carry the host Adam moments into the new subspace (no update pending)."""
        install_projectors(self.layer, self.lanes, self.host_optimizer_state(), proj_out, proj_in, norm_ratio,
                           second_moment_scale)

    # ------------------------------------------------------------------------------------------------ update ring
    def _update_source(self) -> Tensor:
        """The host tensor the update crosses from: ``Z`` in the link dtype."""
        return self.host_update if self.host_update is not None else self.host_param

    def _fetch_update(self) -> Tensor:
        """The device tensor holding the finished update, ordered before the compute that reads it."""
        if self.lanes.ring is None:
            return self._update_source()  # the device is the host: read where the host step wrote it
        if self.update_on_device is None:
            self.start_fetch()  # not prefetched
        self.lanes.link.device_wait(self.to_device_event)  # the compute stream waits; the host does not
        return self.update_on_device

    def start_fetch(self, allocate: bool = True) -> bool:
        """Issue the host→device copy of the finished update into a ring buffer; returns whether it was issued.

        Args:
            allocate: with no free buffer, copy into a one-off device allocation (the main thread); ``False`` (the
                host worker, which allocates nothing): leave the copy to the main thread.
        """
        lanes = self.lanes
        shape = self.layer.compressed_shape
        index = lanes.ring.claim()
        if index is None:
            if not allocate:
                return False
            lanes.ring.fallbacks += 1
            destination, after = torch.empty(shape, dtype=lanes.link_dtype, device=lanes.device), None
        else:
            destination, after = lanes.ring.view(index, shape), lanes.ring.last_read[index]
        self.to_device_event = lanes.link.to_device(self._update_source(), destination, after=after,
                                                    label=CopyLabel(self.timeline, self.name))
        self.update_on_device, self.ring_index = destination, index
        return True

    def drop_fetch(self) -> None:
        # The copy has landed (waited for by whoever rewrites Z next); copies into the buffer stay in issue order.
        if self.update_on_device is not None and self.ring_index is not None:
            self.lanes.ring.release(self.ring_index, None)
        self.update_on_device, self.ring_index = None, None

    def fetch_started(self) -> bool:
        return self.update_on_device is not None

