"""Where the engine's state lives and what it takes: host bytes, device bytes the offload keeps between steps by
category, and optimizer state found on the device (the placement check). Counted from the tensors' sizes, so it
works on any device, ``meta`` included."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_offload.engine.lanes.link import UpdateRing
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.engine.step.device_optimizer import DeviceOptimizer
from lightning_offload.engine.step.commit import CommitAfterNorm

#: The categories of :attr:`~lightning_offload.engine.figures.telemetry.OffloadTelemetry.device_persistent_bytes`,
#: each logged (as 0 where a run has none), so runs with different settings log the same keys.
PERSISTENT_CATEGORIES = ("projectors", "update_ring", "scaled_projections", "device_optimizer")


def state_tensors(slots: Sequence[Slot], commit: CommitAfterNorm) -> list[Tensor]:
    """Every tensor of optimizer state the engine keeps: each slot's, the commit policy's (speculation's backups), and
    the host jobs' shared working buffers (once)."""
    scratch = slots[0].lanes.scratch.buffers() if slots else []
    return [t for slot in slots for t in slot.state_tensors()] + commit.state_tensors() + scratch


def host_state_bytes(slots: Sequence[Slot], commit: CommitAfterNorm) -> int:
    """Bytes of optimizer state on the host: moments, fp32 masters, ``Z``, landing and staging buffers, the
    speculative steps' backups, and the host jobs' working buffers."""
    # Counted at every step (telemetry): nbytes and is_cpu are the cheap reads of the same figures.
    return sum(t.nbytes for t in state_tensors(slots, commit) if t.is_cpu)


def device_state_bytes(slots: Sequence[Slot], commit: CommitAfterNorm) -> int:
    """Bytes of the slots' optimizer state found on a non-CPU device (expected 0 on a GPU)."""
    return sum(t.nbytes for t in state_tensors(slots, commit) if not t.is_cpu)


def device_persistent_bytes(slots: Sequence[Slot], ring: UpdateRing | None,
                            device_optimizer: DeviceOptimizer | None) -> dict[str, int]:
    """Device bytes the offload machinery keeps between steps, by category: each slot's own (projectors, the
    scaled rule's projections), the update ring and the device Adam's state."""
    sizes = dict.fromkeys(PERSISTENT_CATEGORIES, 0)
    for slot in slots:
        for category, size in slot.device_persistent_bytes().items():
            sizes[category] += size
    sizes["update_ring"] = ring.nbytes() if ring is not None else 0
    sizes["device_optimizer"] = device_optimizer.state_bytes() if device_optimizer is not None else 0
    return sizes
