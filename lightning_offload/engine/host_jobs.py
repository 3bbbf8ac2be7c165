"""The host worker's jobs for :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`: each tensor's Adam
step on the host (compressed, dense or row-sparse), sending its update back, and the backups and roll-backs of
speculative steps."""

from __future__ import annotations

import resource
import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.slots import _Slot, is_decoupled, _synced_hparams
from lightning_offload.engine.telemetry import StepTelemetry


def _clip_(grad: Tensor, clip: tuple[str, Tensor | float] | None) -> None:
    """Clip a gradient in place as the step decided: ``("norm", coefficient)`` scales it (a 0-dim CPU tensor, which
    also scales a device tensor), ``("value", bound)`` clamps it."""
    if clip is None:
        return
    if clip[0] == "norm":
        grad.mul_(clip[1])
    else:
        grad.clamp_(-clip[1], clip[1])


def _thread_minor_faults() -> int:
    """Minor page faults of the calling thread so far (Linux's per-thread count; 0 where there is none)."""
    if _RUSAGE_THREAD is None:
        return 0
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


class HostJobs:
    """What the host worker runs for each offloaded tensor at a step.

    A part of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`, which holds the state these methods
    use (set in its ``__init__``).
    """

    def _decay_factor(self, slot: _Slot) -> float:
        """A projected weight's decoupled decay ``1 − lr·λ`` for the step being launched (1 for coupled L2)."""
        if not is_decoupled(self.wrapped, slot.group):
            return 1.0
        return 1.0 - slot.group["lr"] * slot.group.get("weight_decay", 0.0)

    def _job_settings(self, slot: _Slot) -> tuple[dict[str, Any], float]:
        """What ``slot``'s next host job takes from the user's group, read now on the main thread (a scheduler may
        change the group once the step returns, before the job runs): the host Adam's hyper-parameters (a projected
        weight's decay is not Adam's: it is applied to ``W`` or added as L2), and the weight of the coupled L2 term.
        A speculative step is confirmed only if these are unchanged at the step."""
        host = _synced_hparams(slot.group)
        if slot.layer is not None:
            host.pop("weight_decay", None)
        return host, float(slot.group.get("weight_decay", 0.0))

    def _prepare_l2(self, slot: _Slot, step: StepTelemetry) -> None:
        """Adam's coupled L2 term of a projected weight in the compressed space, ``A (G + λW) Bᵀ = S + λ·A W Bᵀ``,
        from ``W`` before the update (main thread: it reads the device weight)."""
        if slot.layer is None or slot.host_l2 is None or is_decoupled(self.wrapped, slot.group):
            return
        # On the copy stream, like the gradient: the host job waits for it, the main thread does not.
        slot.l2_event = self.link.to_host(slot.layer.compress_weight(), slot.host_l2)
        step.bytes_device_to_host += slot.host_l2.numel() * slot.host_l2.element_size()

    def _prepare_update(self, slot: _Slot, step: StepTelemetry) -> None:
        """Main thread, at the step: the bytes that cross each way, and what applying the update will need: the
        decoupled decay factor of a projected weight, the device buffer a row-sparse embedding's rows land in."""
        if slot.row_adam is not None:
            width = slot.param.shape[1]
            step.bytes_device_to_host += slot.row_count * (width * self.link_dtype.itemsize + 8)
            step.bytes_host_to_device += slot.row_count * width * slot.param.element_size()
            step.sparse_rows += slot.row_count
            if self.update_ring is not None or self.device.type != "cpu":
                # The rows' new values land here; the apply scatters them into the weight.
                slot.update_on_device = torch.empty((slot.row_count, width), dtype=slot.param.dtype,
                                                    device=self.device)
            return
        step.bytes_device_to_host += slot.host_grad.numel() * slot.host_grad.element_size()
        if slot.layer is None:
            step.bytes_host_to_device += slot.param.numel() * slot.param.element_size()
            return
        slot.decay = self._decay_factor(slot)  # captured now: a scheduler may change lr before the update is applied
        step.bytes_host_to_device += slot.host_param.numel() * self.link_dtype.itemsize

    def _host_job(self, slot: _Slot, clip: tuple[str, Tensor | float] | None, compute_done: Any,
                  step: StepTelemetry, settings: tuple[dict[str, Any], float], speculative: bool = False,
                  redo: bool = False) -> None:
        """Worker thread: wait for the gradient, step Adam, and (dense parameters, unless speculative) send the new
        value back.

        Args:
            settings: the host Adam's hyper-parameters and the L2 weight for this step (:meth:`_job_settings`).
            speculative: keep what rolling the step back needs, and leave the gradient's landing buffer as it
                arrived; a dense parameter's value is sent by :meth:`_publish_job` once the step is confirmed.
            redo: first roll back this tensor's speculative step (it ran earlier in this worker's queue).
        """
        if slot.row_adam is not None:
            self._row_job(slot, clip, compute_done, step, settings)
            return
        faults = _thread_minor_faults()
        start = time.perf_counter()
        # The host variable (Z or the fp32 master) and its staging copy are about to be rewritten: the previous
        # copy from them to the device must have read them. Waited here, not right after issuing that copy, so no
        # job waits for its own copy (long done in practice: this gradient came from a forward that used it).
        self.link.host_wait(slot.to_device_event)
        if redo:
            self._restore(slot)
        hparams, l2_weight = settings
        slot.adam.param_groups[0].update(hparams)
        self.link.host_wait(slot.to_host_event)
        self.link.host_wait(slot.l2_event)
        landed = time.perf_counter()
        if speculative:
            self._backup(slot)
        # In place: the landing buffer (or its fp32 working copy) is rewritten by the next step's copy anyway; a
        # speculative step that changes the gradient works on a copy, which a redo then does not need.
        grad = slot.host_grad if slot.host_grad_fp32 is None else slot.host_grad_fp32.copy_(slot.host_grad)
        if speculative and grad is slot.host_grad and (clip is not None or slot.host_l2 is not None):
            if slot.host_grad_work is None:
                slot.host_grad_work = torch.empty_like(slot.host_grad)
            grad = slot.host_grad_work.copy_(slot.host_grad)
        _clip_(grad, clip)
        if slot.host_l2 is not None:
            # As torch's Adam: the gradient is clipped first, then λW is added — after the sign flip under
            # maximize, so L2 always pulls towards zero. The host Adam flips the whole sum, hence the sign here.
            sign = -1.0 if hparams.get("maximize", False) else 1.0
            grad.add_(slot.host_l2, alpha=sign * l2_weight)
        if slot.layer is not None:
            slot.host_param.zero_()  # Z restarts at 0 every step, so after the step Z = U
        slot.host_param.grad = grad
        slot.adam.step()
        slot.host_param.grad = None
        if self.speculative and slot.backup is None:
            self._allocate_backup(slot)  # at the first step, when Adam creates its state: no later step allocates
        stepped = time.perf_counter()
        timeline = slot.timeline
        if slot.layer is not None:
            if slot.host_update is not None:
                slot.host_update.copy_(slot.host_param)  # narrowed to the link dtype on the host
            # The main thread copies it to the device when the layer is about to need it (_fetch_update): device
            # buffers for updates are a small ring shared by all layers, not one per layer.
        elif not speculative:
            self._send_value(slot, compute_done, stepped)
        # One worker thread runs the jobs one after another, so the step's figure needs no lock.
        step.host_page_faults += _thread_minor_faults() - faults
        timeline.add("link_to_host", f"{slot.name} (landing)", start, landed)
        timeline.add("host", slot.name, landed, stepped)

    def _row_job(self, slot: _Slot, clip: tuple[str, Tensor | float] | None, compute_done: Any,
                 step: StepTelemetry, settings: tuple[dict[str, Any], float]) -> None:
        """Worker thread: step a row-sparse embedding's touched rows and send their new values back."""
        faults = _thread_minor_faults()
        start = time.perf_counter()
        self.link.host_wait(slot.to_device_event)  # the previous values copy must have read the staging buffer
        self.link.host_wait(slot.to_host_event)
        landed = time.perf_counter()
        count = slot.row_count
        grad = slot.host_grad[:count]
        if slot.host_grad_fp32 is not None:
            grad = slot.host_grad_fp32[:count].copy_(grad)
        _clip_(grad, clip)
        hparams, l2_weight = settings
        values = slot.row_adam.step(
            slot.host_rows[:count], grad, lr=hparams["lr"], betas=hparams["betas"], eps=hparams["eps"],
            weight_decay=l2_weight, decoupled=is_decoupled(self.wrapped, slot.group),
            maximize=hparams.get("maximize", False))
        # Rounded to the parameter's dtype here: only its bytes cross.
        staged = slot.host_update[:count].copy_(values) if slot.host_update is not None else values
        slot.row_values = staged
        stepped = time.perf_counter()
        if slot.update_on_device is not None:
            slot.to_device_event = self.link.to_device(staged, slot.update_on_device, after=compute_done)
        step.host_page_faults += _thread_minor_faults() - faults
        slot.timeline.add("link_to_host", f"{slot.name} (landing)", start, landed)
        slot.timeline.add("host", slot.name, landed, stepped)

    def _send_value(self, slot: _Slot, compute_done: Any, start: float) -> None:
        """Worker thread: start copying a dense parameter's new value to the device (the next job on this tensor,
        or anything else that writes its host buffers, waits for the copy first)."""
        source = slot.host_param
        if slot.host_update is not None:
            # Rounded to the parameter's dtype on the host (the same round-to-nearest the device would do), so
            # only the parameter's bytes cross.
            source = slot.host_update.copy_(source)
        slot.to_device_event = self.link.to_device(source, slot.param.data, after=compute_done)
        slot.timeline.add("link_to_device", slot.name, start, time.perf_counter())

    def _publish_job(self, slot: _Slot, compute_done: Any) -> None:
        """Worker thread: send a confirmed speculative step's new dense value to the device."""
        self._send_value(slot, compute_done, time.perf_counter())

    def _backup(self, slot: _Slot) -> None:
        """Worker thread, before a speculative step: keep what :meth:`_restore` needs (into preallocated buffers)."""
        state = slot.adam.state.get(slot.host_param)
        slot.backup_had_state = bool(state)
        if state:
            if slot.backup is None:  # state restored from a checkpoint: this process has not stepped it yet
                self._allocate_backup(slot)
            for key, saved in slot.backup.items():
                saved.copy_(state[key])
        if slot.backup_master is not None:
            slot.backup_master.copy_(slot.host_param)

    @staticmethod
    def _allocate_backup(slot: _Slot) -> None:
        """Buffers shaped like ``slot``'s Adam state, for :meth:`_backup`."""
        state = slot.adam.state[slot.host_param]
        slot.backup = {key: torch.empty_like(value) for key, value in state.items() if torch.is_tensor(value)}

    def _restore(self, slot: _Slot) -> None:
        """Put ``slot``'s host state back as it was before its speculative step (exactly: copies, no arithmetic)."""
        if not slot.backup_had_state:
            slot.adam.state.pop(slot.host_param, None)  # the step created the state: it did not exist before
        else:
            state = slot.adam.state[slot.host_param]
            for key, saved in slot.backup.items():
                state[key].copy_(saved)
        if slot.backup_master is not None:
            slot.host_param.copy_(slot.backup_master)

    def _undo(self, slot: _Slot) -> None:
        """Main thread: roll back a speculative step that will not be confirmed (waits for it first)."""
        if slot.spec_round != self._round:
            return
        if slot.job is not None:
            self.worker.wait(slot.job)
        self._restore(slot)
        slot.job, slot.spec_round, slot.spec_valid = None, -1, False

    def _roll_back_speculation(self) -> None:
        """Undo every speculative step of the current round (a skipped step, or a closure that failed)."""
        for slot in self.slots:
            self._undo(slot)
        self._spec_step = None
