"""One slot's step as one record: where its gradient and its host step stand, owned by the orchestrator and written
only by it and by the commit policy (:mod:`~lightning_offload.engine.step.commit`). The slots keep their host state
only; what happens when is decided here."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from lightning_offload.engine.lanes.worker import Job
from lightning_offload.engine.slots.slot import Clip, JobSettings, Slot


@dataclass(eq=False)
class Backup:
    """What a host step committed before the step's decision keeps to be rolled back: the host variable (a dense
    parameter's fp32 master; ``None`` for a projected weight's ``Z``, which every step recomputes from zero) and Adam's
    state before it, what it assumed, the round it belongs to, and whether its gradient is still the one the step
    uses."""

    master: Tensor | None
    round: int = -1
    valid: bool = False
    settings: JobSettings | None = None
    clip: Clip = None
    moments: dict[str, Tensor] | None = None
    had_state: bool = False


@dataclass(eq=False)
class SlotStep:
    """Where one slot's step stands.

    Attributes:
        slot: the slot (its host state; the kind's hops).
        sent_round: the step whose final gradient crossed (``-1``: none, or it must cross again).
        pending: an update was launched and not yet applied on the device.
        job: the host job of the step in flight (``None`` once applied).
        backup: what rolling back a host step begun before the decision restores (a policy that commits early only).
    """

    slot: Slot
    sent_round: int = -1
    pending: bool = False
    job: Job | None = None
    backup: Backup | None = field(default=None, repr=False)

    def is_sent(self, round_: int) -> bool:
        """Whether the final gradient of step ``round_`` crossed and has not changed since."""
        return self.sent_round == round_ and self.slot.unchanged_since_sent()

    def host_done(self) -> bool:
        """Whether its launched update is computed on the host and not yet applied."""
        return self.pending and self.job is not None and self.job.done.is_set()
