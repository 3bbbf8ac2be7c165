"""When a slot's host step runs and commits: the commit policy the orchestrator hands each slot's step to.

:class:`CommitAfterNorm` (this module) runs every host step once the step's global norm and its clipping are decided,
at the launch after backward. :class:`~lightning_offload.engine.step.speculation.SpeculativeCommit` starts them during
backward and confirms, redoes or undoes each at the launch. A policy sees a slot only through its
:class:`~lightning_offload.engine.step.slot_step.SlotStep` record and the slot's interface; a new one is a subclass of
:class:`CommitAfterNorm` in a module of its own, chosen where the engine is built
(:mod:`~lightning_offload.engine.step.commit_policies`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes.worker import HostWorker, Job
from lightning_offload.engine.slots.slot import Clip, JobSettings
from lightning_offload.engine.step.slot_step import SlotStep


class CommitAfterNorm:
    """Every host step runs after backward, once the norm and the clipping are known: nothing to roll back.

    Args:
        worker: the host worker the jobs run on.
    """

    #: Whether host steps may start during backward (the orchestrator then tells :meth:`sent` of each gradient).
    speculative = False

    def __init__(self, worker: HostWorker) -> None:
        self.worker = worker
        # The figures of host steps begun before the launch (none here; the step's figures start from them).
        self.step: StepTelemetry | None = None

    def adopt(self, records: Iterable[SlotStep]) -> None:
        """The records of the slots built at set-up (a policy that commits early gives them their backups)."""

    # ------------------------------------------------------------------------------------------------ backward
    def sent(self, record: SlotStep, round_: int, timeline: StepTimeline) -> None:
        """During backward, right after ``record``'s gradient was sent (nothing to do here)."""

    # ------------------------------------------------------------------------------------------------ the step
    def launch(self, record: SlotStep, round_: int, clip: Clip, compute_done: Any, step: StepTelemetry,
               settings: JobSettings, timeline: StepTimeline, resent: bool) -> None:
        """Main thread, at the launch: start ``record``'s host step of ``round_`` (its gradient is on its way;
        ``resent``: it crossed again at the launch, having changed since backward sent it)."""
        slot = record.slot
        slot.timeline = timeline  # first: the copies prepare_l2 issues are recorded there
        slot.prepare(step)
        slot.prepare_l2(step)
        record.job = self.submit(record, clip, compute_done, step, settings, "plain")

    def undo(self, record: SlotStep, round_: int) -> None:
        """Main thread: forget a host step of ``round_`` begun before the launch (none here)."""

    def roll_back(self, records: Iterable[SlotStep], round_: int) -> None:
        """Undo every host step of ``round_`` begun before the launch (a skipped step, or a closure that failed)."""
        for record in records:
            self.undo(record, round_)
        self.step = None

    def launched(self, clip: Clip) -> None:
        """A step was launched with ``clip`` (what a policy that commits early assumes next)."""

    def take_step(self) -> StepTelemetry:
        """The step's figures, starting from those of its host steps begun before the launch."""
        step, self.step = self.step or StepTelemetry(), None
        return step

    def state_tensors(self) -> list[Tensor]:
        """Host tensors the policy keeps (the backups of a policy that commits early)."""
        return []

    # ------------------------------------------------------------------------------------------------ worker
    def submit(self, record: SlotStep, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
               mode: str) -> Job:
        """Queue ``record``'s host step on the worker (``mode`` tells :meth:`_host_job` what the step is)."""
        slot = record.slot
        return self.worker.submit(partial(self._host_job, record, clip, compute_done, step, settings, mode), slot.name,
                                  key=slot)

    def _host_job(self, record: SlotStep, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  mode: str) -> None:
        """Worker thread: one host step of ``record``'s slot."""
        # The host variable (Z, a master, rows) and its staging copy are about to be rewritten: the previous copy
        # from them to the device must have read them. Waited here, not right after issuing that copy, so no job
        # waits for its own copy (long done in practice: this gradient came from a forward that used it).
        record.slot.wait_for_send_back()
        record.slot.host_step(clip, compute_done, step, settings)

