"""The backward side of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`: gradient hooks, sending each
tensor's final gradient to the host (or to its owner rank) as soon as backward has produced it, and starting
speculative host steps."""

from __future__ import annotations

import math
import time
import warnings
from functools import partial
from typing import Any

import torch

from lightning_offload.engine.data_parallel import ReducedTensor
from lightning_offload.engine.slots import _Slot
from lightning_offload.engine.telemetry import StepTelemetry


class GradientSending:
    """Hooks on the offloaded tensors, and what happens when each one's gradient is final.

    A part of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`, which holds the state these methods
    use (set in its ``__init__``).
    """

    def _build_reductions(self, tied: set[int]) -> None:
        """Hand the ranks every gradient to reduce, in forward order. Gradients that are final only at the step
        (a device Adam's, a projected weight with a tied use elsewhere) come first, so their buckets are the last
        ones of backward and never hold back the launch of the others."""
        tensors: list[ReducedTensor] = []
        for param in self.device_adam.params if self.device_adam is not None else ():
            tensors.append(ReducedTensor(param, lambda param=param: param.grad, param.numel(), None))
        late = [slot for slot in self.slots if id(slot.param) in tied]
        for slot in late + [slot for slot in self.slots if id(slot.param) not in tied]:
            if slot.layer is not None:
                getter = (lambda layer=slot.layer: layer.grad_buffer if layer.has_grad else None)
                numel = math.prod(slot.layer.compressed_shape)
            else:
                getter, numel = (lambda param=slot.param: param.grad), slot.param.numel()
            tensors.append(ReducedTensor(slot, getter, numel, slot.owner))
        self._late_reduced = {id(slot) for slot in late}
        self.ranks.reduce_dtype = self.link_dtype
        self.ranks.on_reduced = self._reduced
        self.ranks.build(tensors)

    def _reduced(self, key: Any) -> None:
        """An owned tensor's gradient, reduced over the ranks, is in place: send it to the host."""
        if isinstance(key, _Slot):
            self._send_gradient(key)

    def _attach_hooks(self, model: torch.nn.Module) -> list[_Slot]:
        """Forward pre-hooks on every module holding an offloaded tensor; returns the slots no hook can serve."""
        by_param = {id(slot.param): slot for slot in self.slots}
        served: set[int] = set()
        for module in model.modules():
            if module is model:
                continue  # the root's forward need not run in training_step (Lightning calls training_step)
            slots = [by_param[id(p)] for p in module._parameters.values() if p is not None and id(p) in by_param]
            if slots:
                self._slots_by_module[id(module)] = slots
                self._hooks.append(module.register_forward_pre_hook(self._before_forward))
                served.update(id(slot) for slot in slots)
        return [slot for slot in self.slots if id(slot) not in served]

    def _dense_gradient_of_projected(self, slot: _Slot) -> None:
        layer = slot.layer
        if layer.sampling or slot.param.grad is None:
            return  # a projector fit is sampling full gradients: they are its to consume
        if self.ranks is not None and id(slot) not in self._late_reduced and self._collecting:
            raise ValueError(
                f"The projected weight {slot.name}.weight is used outside its module's forward, which data "
                f"parallelism cannot reduce: its compressed gradient may already be on its way to another rank. Call "
                f"the module instead of using its weight directly, or exclude it with exclude_modules=[...]."
            )
        if all(eager is not slot for eager in self._eager_slots):
            # Its pending update cannot wait for the module's next forward (a forward pre-hook): the outside use may
            # come first and would read the old weight. It is applied inside the step instead.
            self._eager_slots.append(slot)
            warnings.warn(
                f"The projected weight {slot.name}.weight is used outside its module's forward, so autograd gives it "
                f"a full gradient there. It is compressed into the layer's S (exact: projection is linear), which "
                f"costs one full-size gradient on the device per such backward, and its update is applied inside "
                f"each step rather than overlapped with the next forward. Call the module instead of using its "
                f"weight directly, or exclude it with exclude_modules=[...], to avoid this.",
                stacklevel=2,
            )
        grad, slot.param.grad = slot.param.grad, None
        layer.accumulate_dense(grad)

    def _gradient_ready(self, slot: _Slot) -> None:
        # Called from autograd during backward: on the last micro-batch, start this gradient's trip at once (with
        # data parallelism, first its reduction to the owner rank, which sends it on once that completes).
        if not self._collecting:
            return
        if self.ranks is None:
            self._send_gradient(slot)
        elif id(slot) not in self._late_reduced:
            self.ranks.ready(slot)

    def _send_gradient(self, slot: _Slot) -> None:
        start = time.perf_counter()
        if slot.row_adam is not None:
            self._send_rows(slot)
            self._timeline.add("link_to_host", slot.name, start, time.perf_counter())
            return
        grad = slot.layer.grad_buffer if slot.layer is not None else slot.param.grad
        if grad.dtype != self.link_dtype:
            grad = grad.to(self.link_dtype)  # narrow on the device: half the bytes cross the link
        # No reference is kept: the link marks the source as in use by its copy stream, so its memory is not reused
        # before the copy has read it, and S is freed as soon as the layer releases it (zero_grad, in step).
        slot.to_host_event = self.link.to_host(grad, slot.host_grad)
        slot.sent_round = self._round
        slot.sent_version = slot.layer.grad_version if slot.layer is not None else 0
        self._timeline.add("link_to_host", slot.name, start, time.perf_counter())
        if self._collecting and self.speculative:
            self._speculate(slot)

    def _send_rows(self, slot: _Slot) -> None:
        """Send the rows of a row-sparse embedding's gradient that are nonzero (the rows of the batch's tokens)."""
        grad = slot.param.grad
        # Which rows: the one host↔device synchronisation of this path (their count sizes the copies). An embedding
        # is the first layer, so its gradient comes last in backward and the wait costs little device time.
        rows = torch.nonzero(grad.ne(0).any(dim=1)).squeeze(1)
        count = rows.numel()
        values = grad.index_select(0, rows)
        if values.dtype != self.link_dtype:
            values = values.to(self.link_dtype)
        # Same copy stream, in order: the event of the second copy covers both.
        self.link.to_host(rows, slot.host_rows[:count])
        slot.to_host_event = self.link.to_host(values, slot.host_grad[:count])
        slot.row_count, slot.rows_on_device = count, rows
        slot.sent_round, slot.sent_version = self._round, 0

    def _speculate(self, slot: _Slot) -> None:
        """During backward: start this tensor's host step now, on the assumptions of :attr:`speculative`."""
        if slot.spec_round == self._round:
            slot.spec_valid = False  # sent again (its gradient changed): the step redoes it with the final gradient
            return
        if slot.pending or self._norm_clip_fired or slot.row_adam is not None:
            # Its previous update is not applied yet, or clipping will likely fire: the ordinary path. A row-sparse
            # embedding's gradient comes last in backward: nothing would be gained by speculating on it.
            return
        if self._spec_step is None:
            self._spec_step = StepTelemetry()
        slot.spec_settings = self._job_settings(slot)
        self._prepare_l2(slot, self._spec_step)
        slot.spec_round, slot.spec_valid, slot.spec_clip = self._round, True, self._spec_clip
        slot.timeline = self._timeline
        slot.job = self.worker.submit(
            partial(self._host_job, slot, slot.spec_clip, None, self._spec_step, slot.spec_settings, True), slot.name)

    def _is_sent(self, slot: _Slot) -> bool:
        """Whether this step's final gradient is already on its way (sent during backward, not changed since)."""
        if slot.sent_round != self._round:
            return False
        return slot.layer is None or slot.sent_version == slot.layer.grad_version
