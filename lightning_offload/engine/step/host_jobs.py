"""Every host job of the engine, and speculation: a tensor's host Adam stepped during backward, as soon as its
gradient has landed, before the step's global norm is known.

A speculative step assumes the step will be neither clipped by norm nor skipped, with the previous step's value
clipping (not after a step whose norm clipping fired: the next one would most likely be redone). At the step, one
whose assumption held (same clipping, same hyper-parameters, same gradient) is confirmed; any other is rolled back
from a copy of its state and redone, or undone when the step is skipped. Results equal the non-speculative path bit
for bit. :class:`HostJobs` keeps that copy per slot, so the slots themselves know nothing of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes.worker import HostWorker, Job
from lightning_offload.engine.slots.host_step_slot import HostStepSlot
from lightning_offload.engine.slots.slot import Clip, JobSettings, Slot

_Mode = Literal["plain", "speculative", "redo"]


@dataclass
class _Backup:
    """One slot's speculation: the round it was launched in, whether its gradient is still the one the step uses,
    what it assumed, and what rolling it back restores (Adam's state before the step and the host variable: a dense
    parameter's fp32 master, or a projected weight's ``Z``)."""

    master: Tensor
    round: int = -1
    valid: bool = False
    settings: JobSettings | None = None
    clip: Clip = None
    moments: dict[str, Tensor] | None = None
    had_state: bool = False


class HostJobs:
    """Submits each slot's host job, and speculates where it is on.

    Args:
        speculative: speculate at all (accelerators; on the CPU host and "device" share the cores).
        slots: the engine's slots; those that can speculate (owned host-Adam slots) get a backup each.
        worker: the host worker the jobs run on.
    """

    def __init__(self, speculative: bool, slots: Iterable[Slot], worker: HostWorker) -> None:
        self.speculative = speculative
        self.worker = worker
        # Z and a dense master are small next to the moments and preallocated now; the moments' copies are
        # allocated at a slot's first step, when Adam creates its state, so no later step allocates.
        self._backups = {id(slot): _Backup(torch.empty_like(slot.host_param)) for slot in slots
                         if speculative and slot.speculates and slot.owned}
        # What speculative steps assume about clipping: the previous step's value clipping (an elementwise clamp,
        # known before the norm), else none. Norm clipping is assumed not to fire.
        self.assumed_clip: Clip = None
        # Whether norm clipping fired at the last step taken: then the next step is not speculated, since its
        # speculative work would most likely be redone (clipping tends to fire for stretches of training).
        self.norm_clip_fired = False
        # The figures of speculative jobs started during this backward (the step's figures start from them).
        self.step: StepTelemetry | None = None

    # ------------------------------------------------------------------------------------------------ backward
    def start(self, slot: Slot, round_: int, timeline: StepTimeline) -> None:
        """During backward, right after ``slot``'s gradient was sent: start its host step now, if it may."""
        backup = self._backups.get(id(slot))
        if backup is None:
            return
        if backup.round == round_:
            backup.valid = False  # sent again (its gradient changed): the step redoes it with the final gradient
            return
        if slot.pending or self.norm_clip_fired:
            return  # its previous update is not applied yet, or clipping will likely fire: the ordinary path
        if self.step is None:
            self.step = StepTelemetry()
        backup.settings = slot.settings()
        slot.prepare_l2(self.step)
        backup.round, backup.valid, backup.clip = round_, True, self.assumed_clip
        slot.timeline = timeline
        slot.job = self.worker.submit(
            partial(self._host_job, slot, backup.clip, None, self.step, backup.settings, "speculative"), slot.name)

    # ------------------------------------------------------------------------------------------------ the step
    def speculated(self, slot: Slot, round_: int) -> bool:
        """Whether ``slot``'s host step of ``round_`` already ran (or is queued) speculatively."""
        backup = self._backups.get(id(slot))
        return backup is not None and backup.round == round_

    def holds(self, slot: Slot, round_: int, clip: Clip, settings: JobSettings) -> bool:
        """Whether ``slot``'s speculative step stands: same gradient, same clipping, same hyper-parameters."""
        backup = self._backups.get(id(slot))
        return (backup is not None and backup.round == round_ and backup.valid and slot.is_sent(round_)
                and backup.clip == clip and backup.settings == settings)

    def confirm(self, slot: Slot, compute_done: Any) -> None:
        """The speculative step stands: a dense value, held back until now, may cross to the device."""
        if slot.holds_value_back:
            slot.job = self.worker.submit(partial(self._publish_job, slot, compute_done), slot.name)

    def submit(self, slot: Slot, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
               redo: bool) -> Job:
        """Queue ``slot``'s host step of this step (``redo``: first roll back its speculative one)."""
        mode: _Mode = "redo" if redo else "plain"
        return self.worker.submit(partial(self._host_job, slot, clip, compute_done, step, settings, mode), slot.name)

    def launched(self, clip: Clip) -> None:
        """A step was launched with ``clip``: what the next step's speculation assumes."""
        self.assumed_clip = clip if clip is not None and clip[0] == "value" else None
        self.norm_clip_fired = clip is not None and clip[0] == "norm"

    def take_step(self) -> StepTelemetry:
        """The step's figures, starting from those of its speculative jobs."""
        step, self.step = self.step or StepTelemetry(), None
        return step

    def undo(self, slot: Slot, round_: int) -> None:
        """Main thread: roll back a speculative step that will not be confirmed (waits for it first)."""
        backup = self._backups.get(id(slot))
        if backup is None or backup.round != round_:
            return
        if slot.job is not None:
            self.worker.wait(slot.job)
        self._restore(slot, backup)
        slot.job, backup.round, backup.valid = None, -1, False

    def roll_back(self, slots: Iterable[Slot], round_: int) -> None:
        """Undo every speculative step of ``round_`` (a skipped step, or a closure that failed)."""
        for slot in slots:
            self.undo(slot, round_)
        self.step = None

    def state_tensors(self) -> list[Tensor]:
        """The backups' host tensors (host memory speculation costs)."""
        tensors = [backup.master for backup in self._backups.values()]
        return tensors + [t for backup in self._backups.values() for t in (backup.moments or {}).values()]

    # ------------------------------------------------------------------------------------------------ worker
    def _host_job(self, slot: Slot, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  mode: _Mode) -> None:
        """Worker thread: one host step of ``slot`` (``speculative``: keep what rolling it back needs; ``redo``: first
        roll back the speculative step that ran earlier in this worker's queue)."""
        # The host variable (Z, a master, rows) and its staging copy are about to be rewritten: the previous copy
        # from them to the device must have read them. Waited here, not right after issuing that copy, so no job
        # waits for its own copy (long done in practice: this gradient came from a forward that used it).
        slot.wait_for_send_back()
        backup = self._backups.get(id(slot))
        if mode == "redo":
            self._restore(slot, backup)
        elif mode == "speculative":
            self._keep(slot, backup)
        slot.host_step(clip, compute_done, step, settings, speculative=mode == "speculative")
        if backup is not None and backup.moments is None:
            self._allocate(slot, backup)  # at the first step, when Adam creates its state: no later step allocates

    def _publish_job(self, slot: Slot, compute_done: Any) -> None:
        """Worker thread: send a confirmed speculative step's new dense value to the device."""
        slot.send_value(compute_done, time.perf_counter())

    @staticmethod
    def _allocate(slot: HostStepSlot, backup: _Backup) -> None:
        state = slot.host_optimizer_state()
        if state:
            backup.moments = {key: torch.empty_like(value) for key, value in state.items() if torch.is_tensor(value)}

    def _keep(self, slot: HostStepSlot, backup: _Backup) -> None:
        """Worker thread, before a speculative step: copy what :meth:`_restore` needs (into preallocated buffers)."""
        state = slot.host_optimizer_state()
        backup.had_state = bool(state)
        if state:
            if backup.moments is None:  # state restored from a checkpoint: this process has not stepped it yet
                self._allocate(slot, backup)
            for key, saved in backup.moments.items():
                saved.copy_(state[key])
        backup.master.copy_(slot.host_param)

    @staticmethod
    def _restore(slot: HostStepSlot, backup: _Backup) -> None:
        """Put ``slot``'s host state back as it was before its speculative step (exactly: copies, no arithmetic)."""
        if not backup.had_state:
            slot.forget_host_optimizer_state()  # the step created the state: it did not exist before
        else:
            state = slot.host_optimizer_state()
            for key, saved in backup.moments.items():
                state[key].copy_(saved)
        slot.host_param.copy_(backup.master)
