"""Which gradients cross after backward instead of as soon as they are final: the deepest layers', when a step's
copies to the host would otherwise outlast its backward.

A gradient is sent as soon as backward has made it final, so the link to the host works only from the first gradient
(the forward's end) on. Where its copies take longer than backward, the last gradients (the shallowest layers', whose
updates the next forward needs first) wait behind the deep layers' in the copy stream's order, and the next forward
waits for them: at a link taking a whole device step each way, 1.55× ``max(device, link, host)``
(docs/benchmarks/2026-12-07.md). The deep layers' updates are needed last in the next forward, so their gradients can
cross during it instead: the engine sends them at the step's launch, after the shallow ones, and the link works
through the forward as well.

How many: from the step just completed, the time the copies to the host took beyond backward (the excess), taken from
the deepest tensors (last in forward order: first made in backward) until their copies cover it, within half the
next forward's time (estimated as half of backward, the matmuls' share; their updates must cross back before their
layers run). The timeline's link lanes hold the copies' busy time where the link records it (the simulated link);
where they hold only issue times (a GPU's copy streams, not timed yet) the excess is none and nothing is deferred.
Results are the same either way: a deferred gradient is the one backward made, sent and stepped after the decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.slots.slot import Slot

#: The share of the next forward the deferred copies may take (their updates cross back before their layers run).
FORWARD_SHARE = 0.75
#: A forward's time relative to its backward's (the backward's matmuls are twice the forward's).
FORWARD_PER_BACKWARD = 0.5


class SendDeferral:
    """The set of tensors whose gradients the next step sends at its launch rather than during backward.

    Args:
        slots: every slot in forward order.
    """

    def __init__(self, slots: Sequence[Slot]) -> None:
        self.slots = slots
        self._deferred: frozenset[int] = frozenset()

    def defers(self, slot: Slot) -> bool:
        """Whether ``slot``'s gradient waits for the launch this step."""
        return id(slot) in self._deferred

    def plan(self, timeline: StepTimeline) -> None:
        """Choose the next step's deferred tensors from the completed step's ``timeline`` (see the module docstring)."""
        if timeline.backward_start is None or timeline.backward_end is None:
            return
        backward = timeline.backward_end - timeline.backward_start
        copies = {name: 0.0 for name in (slot.name for slot in self.slots)}
        for span in timeline.spans:
            if span.lane == "link_to_host":
                owner = span.name.split(" (", 1)[0]  # a tensor's extra copies ("(rows)", "(L2)") are its own
                if owner in copies:
                    copies[owner] += span.end - span.start
        excess = sum(copies.values()) - backward
        budget = FORWARD_SHARE * FORWARD_PER_BACKWARD * backward
        deferred: list[int] = []
        covered = 0.0
        for slot in reversed(self.slots):  # deepest first: made first in backward, needed last in the next forward
            took = copies[slot.name]
            if covered >= excess or covered + took > budget or not slot.routed or slot.crosses_by_itself:
                break
            deferred.append(id(slot))
            covered += took
        self._deferred = frozenset(deferred)
