"""Applying updates on the device for :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`: each module's
forward pre-hook waits for its tensors' updates (and prefetches the next module's), expands compressed updates and
copies dense values back; with data parallelism, updates arrive by broadcast from their owner rank."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.slots import _Slot


class UpdateApplication:
    """Receives and applies the updates of a launched step, module by module.

    A part of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`, which holds the state these methods
    use (set in its ``__init__``).
    """

    def _expect_update(self, slot: _Slot) -> None:
        """Main thread, at the step: a tensor another rank steps will have its update broadcast when applied; what
        applying it needs is captured now, as the owner does (a scheduler may change lr before then)."""
        if slot.layer is not None:
            slot.decay = self._decay_factor(slot)
            slot.layer.zero_grad()
        slot.timeline = self._timeline
        slot.pending = True

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        for slot in self._slots_by_module.get(id(module), ()):
            if slot.pending:
                self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        """Main thread: wait for a tensor's update and apply it on the device."""
        if not slot.pending:
            return
        start = time.perf_counter()
        if not slot.owned:
            self._receive(slot, start)
            return
        self.worker.wait(slot.job)
        if slot.row_adam is not None:
            values = slot.row_values  # the device is the host: read where the host wrote them
            if slot.update_on_device is not None:
                self.link.device_wait(slot.to_device_event)
                values = slot.update_on_device
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            slot.param.data.index_copy_(0, slot.rows_on_device, values)
            slot.update_on_device, slot.rows_on_device, slot.row_values = None, None, None
        elif slot.layer is not None:
            update = self._fetch_update(slot)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            if self.ranks is not None:
                self.ranks.broadcast_(update, src=slot.owner)  # the other ranks apply the same U
            slot.layer.apply_update(update, slot.decay, slot.generator)
            if slot.ring_index is not None:
                # Queued, not run: the event tells the next copy into this buffer when the apply has read it.
                self.update_ring.release(slot.ring_index, self.link.compute_event())
            slot.update_on_device, slot.ring_index = None, None
            self._prefetch_after(slot)
        else:
            self.link.device_wait(slot.to_device_event)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            if self.ranks is not None:
                self.ranks.broadcast_(slot.param.data, src=slot.owner)  # ordered after the copy by the wait above
        slot.pending = False
        slot.job = None

    def _receive(self, slot: _Slot, start: float) -> None:
        """Main thread: take a tensor's update from the rank that stepped it, and apply it as that rank does."""
        if slot.layer is not None:
            index = self.update_ring.claim() if self.update_ring is not None else None
            if index is None:
                update = torch.empty(slot.layer.compressed_shape, dtype=self.link_dtype, device=self.device)
            else:
                # The broadcast writes it in compute-stream order, after the apply that last read it: no wait.
                update = self.update_ring.view(index, slot.layer.compressed_shape)
            self.ranks.broadcast_(update, src=slot.owner)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            slot.layer.apply_update(update, slot.decay, slot.generator)
            if index is not None:
                self.update_ring.release(index, self.link.compute_event())
        else:
            self.ranks.broadcast_(slot.param.data, src=slot.owner)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
        slot.pending = False

    def _update_source(self, slot: _Slot) -> Tensor:
        """The host tensor a projected update crosses from: ``Z`` in the link dtype."""
        return slot.host_update if slot.host_update is not None else slot.host_param

    def _fetch_update(self, slot: _Slot) -> Tensor:
        """The device tensor holding ``slot``'s finished update, ordered before the compute that reads it."""
        if self.update_ring is None:
            return self._update_source(slot)  # the device is the host: read where the host step wrote it
        if slot.update_on_device is None:
            self._start_fetch(slot)  # not prefetched
        self.link.device_wait(slot.to_device_event)  # the compute stream waits; the host does not
        return slot.update_on_device

    def _start_fetch(self, slot: _Slot) -> None:
        """Issue the host→device copy of a finished update into a ring buffer (a one-off buffer if none is free)."""
        start = time.perf_counter()
        shape = slot.layer.compressed_shape
        index = self.update_ring.claim()
        if index is None:
            self.update_ring.fallbacks += 1
            destination, after = torch.empty(shape, dtype=self.link_dtype, device=self.device), None
        else:
            destination, after = self.update_ring.view(index, shape), self.update_ring.last_read[index]
        slot.to_device_event = self.link.to_device(self._update_source(slot), destination, after=after)
        slot.update_on_device, slot.ring_index = destination, index
        slot.timeline.add("link_to_device", slot.name, start, time.perf_counter())

    def _prefetch_after(self, slot: _Slot) -> None:
        """Start the copies of the next finished updates in forward order, as far as the ring has free buffers, so
        the next layers' updates are on the device before their forwards ask for them."""
        ring = self.update_ring
        if ring is None:
            return
        position = self._projected_position[id(slot)]
        for later in self._projected_slots[position + 1: position + 1 + len(ring.buffers)]:
            if not ring.free:
                return
            if later.pending and later.update_on_device is None and later.job is not None and later.job.done.is_set():
                self.worker.check()
                self._start_fetch(later)
                ring.prefetched += 1
