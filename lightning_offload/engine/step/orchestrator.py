"""The engine's step over its slots, which it knows only through :class:`~lightning_offload.engine.slots.slot.Slot`: the
backward that sends each gradient as it is final, one global norm and one clip or skip decision, each slot's host job,
and each update applied before the module that owns it runs again (``docs/design.md``, "The engine"). Where each
slot's step stands is one record (:class:`~lightning_offload.engine.step.slot_step.SlotStep`) it owns; when a host step
runs and commits is its commit policy's (:mod:`~lightning_offload.engine.step.commit`).

:class:`~lightning_offload.engine.optimizer.OffloadOptimizer` builds the slots and hands every step to it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.step_figures import StepFigures
from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.slots.slot import Clip, Slot
from lightning_offload.engine.slots.weight_fingerprint import changed_since
from lightning_offload.engine.step.clipping import (
    GradientNorms, NonFinitePolicy, NonFiniteStepWarning, launch_clip, nonfinite_error, skipped_step_warning)
from lightning_offload.engine.step.device_optimizer import DeviceOptimizer
from lightning_offload.engine.step.gradient_edits import edited_gradients_error, resent_warning
from lightning_offload.engine.step.gradients import GradientRouting, final_twice_error
from lightning_offload.engine.step.commit import CommitAfterNorm
from lightning_offload.engine.step.norm_probes import measure_norm_ratios
from lightning_offload.engine.step.send_deferral import SendDeferral
from lightning_offload.engine.step.sizes import device_persistent_bytes, host_state_bytes
from lightning_offload.engine.step.slot_step import SlotStep
from lightning_offload.engine.step.update_prefetch import UpdatePrefetch
from lightning_offload.lsp.linear_ops import without_autocast


class StepOrchestrator:
    """Runs the engine's steps over its slots.

    Args:
        lanes: what the slots share (link, worker, update ring, ranks).
        slots: every offloaded tensor's slot, in the order their host jobs run (forward order).
        device_optimizer: the parameters stepped on the device, clipped and checked with the rest (or ``None``).
        commit: when each slot's host step runs and commits (after the norm, or speculated during backward).
        norms: the step's global norm and the clipping asked for.
        figures: the steps' timelines and figures.
        on_nonfinite: ``"skip"`` or ``"raise"`` for a step whose gradients hold inf/nan.
        pipelined: apply updates before the owning modules' next forwards (else before the step returns).
        model: the module whose forwards apply pending updates (``None``: updates land at the step).
        tied: ids of projected weights tied to another parameter (their gradient arrives in two parts).
    """

    def __init__(self, lanes: Lanes, slots: list[Slot], device_optimizer: DeviceOptimizer | None,
                 commit: CommitAfterNorm,
                 norms: GradientNorms, figures: StepFigures, on_nonfinite: NonFinitePolicy, pipelined: bool,
                 model: torch.nn.Module | None = None, tied: AbstractSet[int] = frozenset(),
                 free_sent_gradients: bool = False) -> None:
        self.lanes = lanes
        self.slots = slots
        self.device_optimizer = device_optimizer
        self.commit = commit
        self.records = {id(slot): SlotStep(slot) for slot in slots}  # where each slot's step stands
        commit.adopt(self.records.values())
        self.update_prefetch = UpdatePrefetch([self.records[id(slot)] for slot in slots], lanes)
        # The deepest layers' gradients cross at the launch while the link lags behind backward (send_deferral.py).
        self.deferral = SendDeferral(self.slots)
        self.norms = norms
        self.figures = figures
        self.on_nonfinite = on_nonfinite
        self.pipelined = pipelined
        # Dropping a host-stepped .grad at its launch keeps it off the device through the next forward.
        self.free_sent_gradients = free_sent_gradients
        self.round = 0  # counts launched steps: tells gradients sent for this step from stale ones
        self.last_step_skipped = False
        self.warned_resent = False  # said once: gradients edited after they crossed cross again
        self._finishing: set[int] = set()  # slots whose update is being applied right now
        # The model's hooks route each final gradient to send_gradient and finish updates at their module's forward.
        self.routing = GradientRouting(slots, model, lanes.ranks, self.device_params, tied, self.send_gradient,
                                       self.finish, self.pending, norms.edits, lanes.phases)

    @property
    def device_params(self) -> list[Tensor]:
        """The parameters the device Adam steps."""
        return self.device_optimizer.params if self.device_optimizer is not None else []

    def pending(self, slot: Slot) -> bool:
        """Whether ``slot``'s launched update is not applied yet."""
        return self.records[id(slot)].pending

    def is_sent(self, slot: Slot) -> bool:
        """Whether this step's final gradient of ``slot`` is on its way (sent in this round, not changed since)."""
        return slot.crosses_by_itself or self.records[id(slot)].is_sent(self.round)

    def grad_norm(self) -> Tensor:
        """The step's global 2-norm over every slot and the device-stepped parameters
        (:meth:`~lightning_offload.engine.step.clipping.GradientNorms.global_norm`)."""
        return self.norms.global_norm(self.slots, self.device_params)

    def sizes(self) -> tuple[int, dict[str, int], int]:
        """Host state bytes, device persistent bytes by category and update-ring fallbacks, as a step's figures
        take them when they complete."""
        ring = self.lanes.ring
        return (host_state_bytes(self.slots, self.commit),
                device_persistent_bytes(self.slots, ring, self.device_optimizer),
                ring.fallbacks if ring is not None else 0)

    # ------------------------------------------------------------------------------------------------ backward
    def collect(self, closure: Callable[[], Any]) -> Any:
        """Run the step's forward and backward (``closure``); each gradient is sent as soon as it is final."""
        # No synchronize here: the forward applies the previous step's updates module by module, hiding their host work.
        for slot in self.slots:
            slot.begin_collect()
        self.routing.collecting = True
        try:
            with torch.enable_grad():
                return closure()
        except BaseException:
            self.abandon()  # nothing of a step that never happened may stay in the host state
            raise
        finally:
            self.routing.collecting = False

    def send_gradient(self, slot: Slot) -> None:
        """``slot``'s gradient is final: it crosses now, and during backward its host step may start at once.

        Raises:
            RuntimeError: when it was sent as final already in this step (it changed after it crossed: a loop of one's
                own told the engine a micro-batch was the last when more followed).
        """
        if self.is_sent(slot):
            raise final_twice_error(slot.name)
        timeline = self.figures.timeline
        if self.routing.collecting and timeline.backward_start is None:
            timeline.backward_start = time.perf_counter()  # the first gradient: the forward's end, as the link sees it
        if self.routing.collecting and self.deferral.defers(slot):
            return  # it crosses at the launch, after the shallower layers' (send_deferral.py)
        record = self.records[id(slot)]
        with self.lanes.phases.phase("send"):
            slot.send(timeline)
            record.sent_round = self.round
            if self.routing.collecting and self.commit.speculative:
                self.commit.sent(record, self.round, timeline)

    def take_on(self, slots: list[Slot]) -> None:
        """Step ``slots`` too from the next step on, after every other slot (their host steps run after the norm:
        no backup was made for them)."""
        for slot in slots:
            self.slots.append(slot)
            self.records[id(slot)] = SlotStep(slot)

    def adopt(self, slots: list[Slot]) -> None:
        """Step slots that joined after set-up (late_params.py) from this step on, their gradients as they are now."""
        self.take_on(slots)
        for slot in slots:
            self.routing.add_late(slot)
            if self.norms.edits is not None:
                self.norms.edits.watch(slot)

    # ------------------------------------------------------------------------------------------------ the step
    def decide_and_launch(self) -> None:
        """After backward: one norm (the clipping call's, else :meth:`grad_norm`), one decision; then every slot's
        host step is launched (or the step skipped: :attr:`last_step_skipped`)."""
        with self.lanes.phases.phase("step_launch"):
            self._decide_and_launch()

    def _decide_and_launch(self) -> None:
        # Updates of modules this forward did not run, and last step's figures, are settled before the next launch.
        self.synchronize()
        if self.routing.compiled_forward:
            self.routing.check_user_hooks()  # the compiled forwards did not say them
        self.figures.backward_ended()
        clip, norm = self.norms.take()
        edited = self.norms.edits.find() if self.norms.edits is not None else []
        if norm is None:
            norm = self.grad_norm()
        self.last_step_skipped = not bool(torch.isfinite(norm))
        if self.last_step_skipped:
            self._skip(norm)  # nothing steps: whatever edited the gradients changes nothing
            return
        if edited:
            self._take_edits(edited)
        measure_norm_ratios(self.slots, self.lanes.ranks, clip)  # ρ kept true for the norm's readers
        step = self.commit.take_step()
        for slot in self.slots:
            slot.count_device_buffers(step)
        clip = launch_clip(clip)
        compute_done = self.lanes.link.compute_event()
        written = self._written_through_data()
        for slot in self.slots:
            self._launch(slot, clip, compute_done, step, id(slot) in written)
        if self.device_optimizer is not None:
            # Queued on the device after backward, like a native optimizer step: nothing waits for it.
            self.device_optimizer.step(clip, written)
            if self.free_sent_gradients:
                # As the host-stepped ones: no gradient is held past its step (the step's kernels were queued first).
                for param in self.device_optimizer.params:
                    param.grad = None
        self.commit.launched(clip)
        if self.lanes.ranks is not None:
            # This step's reductions and norm, and the broadcasts of the previous step's updates.
            step.bytes_between_ranks = float(self.lanes.ranks.bytes_this_step)
            self.lanes.ranks.reset()
        self.figures.launched(step)
        self.round += 1
        for slot in self.routing.eager:
            self.finish(slot)
        if not self.pipelined or self.routing.compiled_forward:
            # A compiled forward cannot wait for each module's update (lsp/linear.py): they are all applied now.
            self.synchronize()
        self.routing.expose()  # reads through the modules until their next forwards settle first
        self.figures.restart_clock()

    def _take_edits(self, edited: list[Slot]) -> None:
        """A user's in-place edit of gradients after backward (their own ``clip_grad_norm_``) takes effect exactly, or
        the step is refused (:mod:`~lightning_offload.engine.step.gradient_edits`).

        Raises:
            RuntimeError: when some of the step's gradients are no ``param.grad`` the edit could see.
        """
        unseen = list(dict.fromkeys(what for what in (slot.gradient_unseen_by_edits() for slot in self.slots) if what))
        if unseen:
            self.abandon()  # nothing of this step may stay in the host state
            raise edited_gradients_error(edited, " and ".join(unseen))
        # Every gradient is a param.grad, so the edit saw the true norm; those that crossed already cross again.
        resent = [slot for slot in edited if self.is_sent(slot)]
        for slot in resent:
            self.records[id(slot)].sent_round = -1
        if resent and not self.warned_resent:
            self.warned_resent = True
            warnings.warn(resent_warning(resent), stacklevel=4)

    def _written_through_data(self) -> set[int]:
        """The master-keeping slots, and the device Adam's master-keeping parameters, whose parameter was written
        through ``.data`` since the engine's last write (its fingerprint moved:
        :mod:`~lightning_offload.engine.slots.weight_fingerprint`), by identity, read with one synchronisation."""
        watched = [slot for slot in self.slots if slot.owned and slot.keeps_master]
        kept = self.device_optimizer.watched if self.device_optimizer is not None else []
        kept_fingerprints = self.device_optimizer.watched_fingerprints() if self.device_optimizer is not None else []
        changed = changed_since([slot.param for slot in watched] + kept,
                                [slot.weights_fingerprint for slot in watched] + kept_fingerprints)
        return {id(what) for what, moved in zip([*watched, *kept], changed) if moved}

    def _launch(self, slot: Slot, clip: Clip, compute_done: Any, step: StepTelemetry, written: bool) -> None:
        """Main thread, at the step: start (or confirm) ``slot``'s host step, or expect its update from its owner
        (``written``: its parameter was written through ``.data`` since the engine's last write)."""
        ranks = self.lanes.ranks
        record = self.records[id(slot)]
        has_grad = slot.has_grad() if ranks is None else self.norms.present.get(id(slot), False)
        if not slot.owned:
            if has_grad:
                slot.expect_update(self.figures.timeline)
                record.pending = True
            return
        if not has_grad:
            self.commit.undo(record, self.round)  # its gradient was dropped after it was sent (never in Lightning)
            return
        if written or slot.weights_written():  # loaded weights, a clamp: the master steps from them, as torch would
            self.commit.undo(record, self.round)  # a step begun during backward stepped the master it held
            slot.adopt_written_weights()
        if clip is not None and clip[0] == "value" and slot.clamp_on_device(clip[1]):
            record.sent_round = -1  # clamped on the device (the scaled rule): what crossed must cross again
        resent = not self.is_sent(slot)
        if resent:
            # Deferred to this launch, manual optimization, or a gradient that changed after it was sent.
            step.deferred_sends += self.deferral.defers(slot)
            self.send_gradient(slot)
        self.commit.launch(record, self.round, clip, compute_done, step, slot.settings(), self.figures.timeline, resent)
        record.pending = True
        slot.release_gradient()
        if self.free_sent_gradients and slot.crosses_param_grad:
            # The link recorded the host copy's stream on this tensor: its memory waits for the copy to read it.
            slot.param.grad = None

    def finish(self, slot: Slot) -> None:
        """Main thread: wait for a slot's update and apply it on the device."""
        record = self.records[id(slot)]
        if not record.pending or id(slot) in self._finishing:
            return  # nothing pending, or being applied (applying it read the weights through the module: no twice)
        self._finishing.add(id(slot))
        phases = self.lanes.phases
        try:
            start = time.perf_counter()
            if slot.owned:
                with phases.phase("waits"):
                    self.lanes.worker.wait(record.job)
            # Under the user's autocast too (a module's forward pre-hook applies it): the update's products are the
            # engine's own, in their own dtypes, whenever they run (a bf16 autocast would round a dense kernel's).
            with phases.phase("apply_update"), without_autocast(slot.param.device.type):
                slot.finish(start)
                self.update_prefetch.after(slot)  # the next layers' updates start crossing while this layer computes
            record.pending, record.job = False, None
        finally:
            self._finishing.discard(id(slot))

    def synchronize(self) -> None:
        """Apply every pending update now, and complete the launched step's figures."""
        for slot in self.slots:
            self.finish(slot)
        self.lanes.worker.check()
        completing = self.figures.in_flight
        with self.lanes.phases.phase("telemetry"):
            self.figures.complete(self.sizes)
        if completing:
            self.deferral.plan(self.figures.telemetry.last_timeline)
        self.routing.expose()  # the modules settled give back their plain dicts

    def abandon(self) -> None:
        """Forget a step that will not be taken: its speculative host steps and its reductions."""
        self.commit.roll_back(self.records.values(), self.round)
        if self.lanes.ranks is not None:
            self.lanes.ranks.reset()

    def _skip(self, norm: Tensor) -> None:
        self.abandon()  # the host state must be as if this step never began
        for slot in self.slots:
            slot.abandon_gradient()  # and a projected weight's S
        telemetry = self.figures.telemetry
        if self.on_nonfinite == "raise":
            raise nonfinite_error(norm, telemetry.steps)
        self.round += 1
        self.figures.skipped()
        warnings.warn(skipped_step_warning(norm, telemetry.skipped_steps, telemetry.steps), NonFiniteStepWarning,
                      stacklevel=3)
        self.figures.restart_clock()
