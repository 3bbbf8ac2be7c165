"""Speculation: a tensor's host step run during backward, as soon as its gradient has landed, before the step's global
norm is known.

A speculative step assumes the step will be neither clipped by norm nor skipped, with the previous step's value
clipping (not after a step whose norm clipping fired: the next one would most likely be redone). At the step, one
whose assumption held (same clipping, same hyper-parameters, same gradient) is confirmed; any other is rolled back
from its record's :class:`~lightning_offload.engine.step.slot_step.Backup` and redone, or undone when the step is
skipped. Results equal :class:`~lightning_offload.engine.step.commit.CommitAfterNorm`'s bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes.worker import HostWorker
from lightning_offload.engine.slots.slot import Clip, JobSettings
from lightning_offload.engine.step.commit import CommitAfterNorm
from lightning_offload.engine.step.slot_step import Backup, SlotStep


class SpeculativeCommit(CommitAfterNorm):
    """Host steps start during backward and commit at the launch when their assumptions held.

    Args:
        worker: the host worker the jobs run on.
    """

    speculative = True

    def __init__(self, worker: HostWorker) -> None:
        super().__init__(worker)
        self._backups: list[Backup] = []
        # What speculative steps assume about clipping: the previous step's value clipping (an elementwise clamp,
        # known before the norm), else none. Norm clipping is assumed not to fire.
        self.assumed_clip: Clip = None
        # Whether norm clipping fired at the last step taken: then the next step is not speculated, since its
        # speculative work would most likely be redone (clipping tends to fire for stretches of training).
        self.norm_clip_fired = False

    def adopt(self, records: Iterable[SlotStep]) -> None:
        # A dense master is preallocated now (Z is not kept: every step recomputes it from zero); the moments' copies
        # are allocated at a slot's first step, when Adam creates its state, so no later step allocates. Owned
        # host-Adam slots only.
        for record in records:
            slot = record.slot
            if slot.speculates and slot.owned:
                record.backup = Backup(None if slot.restarts_each_step else torch.empty_like(slot.host_param))
                self._backups.append(record.backup)

    # ------------------------------------------------------------------------------------------------ backward
    def sent(self, record: SlotStep, round_: int, timeline: StepTimeline) -> None:
        """During backward, right after ``record``'s gradient was sent: start its host step now, if it may."""
        backup, slot = record.backup, record.slot
        if backup is None:
            return
        if backup.round == round_:
            backup.valid = False  # sent again (its gradient changed): the step redoes it with the final gradient
            return
        if record.pending or self.norm_clip_fired:
            return  # its previous update is not applied yet, or clipping will likely fire: the ordinary path
        if self.step is None:
            self.step = StepTelemetry()
        backup.settings = slot.settings()
        slot.timeline = timeline  # first: the copies prepare_l2 issues are recorded there
        slot.prepare_l2(self.step)
        backup.round, backup.valid, backup.clip = round_, True, self.assumed_clip
        record.job = self.submit(record, backup.clip, None, self.step, backup.settings, "speculative")

    # ------------------------------------------------------------------------------------------------ the step
    def launch(self, record: SlotStep, round_: int, clip: Clip, compute_done: Any, step: StepTelemetry,
               settings: JobSettings, timeline: StepTimeline, resent: bool) -> None:
        backup, slot = record.backup, record.slot
        if backup is None or backup.round != round_:
            super().launch(record, round_, clip, compute_done, step, settings, timeline, resent)
            return
        slot.prepare(step)
        if backup.valid and not resent and backup.clip == clip and backup.settings == settings:
            # It stands: same gradient, same clipping, same hyper-parameters.
            step.speculative_steps += 1
            if slot.holds_value_back:  # a dense value, held back until now, may cross to the device
                record.job = self.worker.submit(partial(self._publish_job, record, compute_done), slot.name,
                                                key=slot)
            return
        step.rolled_back_steps += 1  # the redo job first restores what the speculative one changed
        record.job = self.submit(record, clip, compute_done, step, settings, "redo")

    def undo(self, record: SlotStep, round_: int) -> None:
        """Main thread: roll back a speculative step that will not be confirmed (waits for it first)."""
        backup = record.backup
        if backup is None or backup.round != round_:
            return
        if record.job is not None:
            self.worker.wait(record.job)
        # The update the job copied ahead must have read Z before Z is restored, and is not this step's.
        record.slot.wait_for_send_back()
        self._restore(record)
        record.slot.drop_fetch()
        record.job, backup.round, backup.valid = None, -1, False

    def launched(self, clip: Clip) -> None:
        self.assumed_clip = clip if clip is not None and clip[0] == "value" else None
        self.norm_clip_fired = clip is not None and clip[0] == "norm"

    def state_tensors(self) -> list[Tensor]:
        tensors = [backup.master for backup in self._backups if backup.master is not None]
        return tensors + [t for backup in self._backups for t in (backup.moments or {}).values()]

    # ------------------------------------------------------------------------------------------------ worker
    def _host_job(self, record: SlotStep, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  mode: str) -> None:
        """Worker thread: one host step (``speculative``: keep what rolling it back needs; ``redo``: first roll back
        the speculative step that ran earlier in this worker's queue)."""
        slot = record.slot
        slot.wait_for_send_back()  # as CommitAfterNorm's job: the last copy from the host variable has read it
        if mode == "redo":
            self._restore(record)
        elif mode == "speculative":
            self._keep(record)
        slot.host_step(clip, compute_done, step, settings, speculative=mode == "speculative")
        backup = record.backup
        if backup is not None and backup.moments is None:
            self._allocate(record)  # at the first step, when Adam creates its state: no later step allocates

    @staticmethod
    def _publish_job(record: SlotStep, compute_done: Any) -> None:
        """Worker thread: send a confirmed speculative step's new dense value to the device."""
        record.slot.send_value(compute_done)

    @staticmethod
    def _allocate(record: SlotStep) -> None:
        state = record.slot.host_optimizer_state()
        if state:
            record.backup.moments = {key: torch.empty_like(value) for key, value in state.items()
                                     if torch.is_tensor(value)}

    def _keep(self, record: SlotStep) -> None:
        """Worker thread, before a speculative step: copy what :meth:`_restore` needs (into preallocated buffers)."""
        slot, backup = record.slot, record.backup
        state = slot.host_optimizer_state()
        backup.had_state = bool(state)
        if state:
            if backup.moments is None:  # state restored from a checkpoint: this process has not stepped it yet
                self._allocate(record)
            for key, saved in backup.moments.items():
                saved.copy_(state[key])
        if backup.master is not None:
            backup.master.copy_(slot.host_param)

    @staticmethod
    def _restore(record: SlotStep) -> None:
        """Put the slot's host state back as it was before its speculative step (exactly: copies, no arithmetic)."""
        slot, backup = record.slot, record.backup
        if not backup.had_state:
            slot.forget_host_optimizer_state()  # the step created the state: it did not exist before
        else:
            state = slot.host_optimizer_state()
            for key, saved in backup.moments.items():
                state[key].copy_(saved)
        if backup.master is not None:
            slot.host_param.copy_(backup.master)
