"""A dense parameter's slot (ZeRO-Offload style): an fp32 master and its Adam on the host, the gradient crossing
in full and the new value crossing back in the parameter's own dtype."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.link import CopyLabel
from lightning_offload.engine.slots.host_step_slot import HostStepSlot
from lightning_offload.engine.slots.slot import pinned_zeros
from lightning_offload.engine.slots.weight_fingerprint import fingerprint, fingerprint_dtype


class DenseSlot(HostStepSlot):
    """A parameter stepped densely on the host; its new value replaces the device tensor's."""

    keeps_master = True
    gradient_is_param_grad = True
    crosses_param_grad = True
    holds_value_back = True

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool,
                 owner: int = 0) -> None:
        master = pinned_zeros(param.shape, lanes.pin)
        master.copy_(param.detach())
        host_optimizer = lanes.rule.optimizer_over(master, lanes.rule.hparams_of(group), decoupled)
        # A low-precision parameter's value crosses in its own dtype (bf16: 2 bytes per element, not the master's 4).
        host_update = pinned_zeros(param.shape, lanes.pin, param.dtype) if param.dtype != master.dtype else None
        super().__init__(name, param, group, lanes, decoupled, master, host_optimizer, host_update, owner)
        #: Where the worker writes the fingerprint of each value it sends (preallocated: host jobs allocate nothing).
        self.host_fingerprint = torch.zeros((), dtype=fingerprint_dtype(param))
        self.watch_weights()

    def prepare(self, step: StepTelemetry) -> None:
        step.bytes_device_to_host += self.host_grad.numel() * self.host_grad.element_size()
        step.bytes_host_to_device += self.param.numel() * self.param.element_size()

    def _after_host_step(self, compute_done: Any, stepped: float, speculative: bool) -> None:
        if not speculative:
            self.send_value(compute_done)

    def send_value(self, compute_done: Any) -> None:
        """Worker thread: start copying the new value to the device (the next job on this tensor, or anything else
        that writes its host buffers, waits for the copy first)."""
        source = self.host_param
        if self.host_update is not None:
            # Rounded to the parameter's dtype on the host (the same round-to-nearest the device would do), so
            # only the parameter's bytes cross.
            source = self.host_update.copy_(source)
        self.to_device_event = self.lanes.link.to_device(source, self.param.data, after=compute_done,
                                                         label=CopyLabel(self.timeline, self.name))
        # What the parameter holds once the copy lands, for the step to see writes through .data since (taken from the
        # host's bits, which the copy carries unchanged: no device work on this thread).
        self.weights_fingerprint = fingerprint(source, out=self.host_fingerprint)

    def finish(self, start: float) -> None:
        lanes = self.lanes
        lanes.link.device_wait(self.to_device_event)
        self.timeline.add("device_wait", self.name, start, time.perf_counter())
        if lanes.ranks is not None:
            lanes.ranks.broadcast_(self.param.data, src=self.owner)  # ordered after the copy by the wait above
