"""Starts the copies of the next finished updates in forward order, as far as the update ring has free buffers, so
the next layers' updates are on the device before their forwards ask for them."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.engine.step.slot_step import SlotStep


class UpdatePrefetch:
    """After each applied update, the next ones whose host step is done start crossing.

    Args:
        records: every slot's step, in forward order (only slots that fetch their update are prefetched).
        lanes: the engine's lanes (the ring and the worker).
    """

    def __init__(self, records: Sequence[SlotStep], lanes: Lanes) -> None:
        self.lanes = lanes
        self.fetching = [record for record in records if record.slot.fetches_update]
        self.position = {id(record.slot): i for i, record in enumerate(self.fetching)}

    def after(self, slot: Slot) -> None:
        """``slot``'s update was just applied: start fetching the ones after it."""
        ring = self.lanes.ring
        position = self.position.get(id(slot))
        if ring is None or position is None:
            return
        for later in self.fetching[position + 1: position + 1 + len(ring.buffers)]:
            if not ring.free:
                return
            if later.host_done() and not later.slot.fetch_started():
                self.lanes.worker.check()
                later.slot.start_fetch()
                ring.prefetched += 1
