"""What an offloaded tensor is to the engine's step: the :class:`Slot` interface every kind implements, and the small
helpers their host steps share (clipping a gradient, pinned host buffers, a thread's page faults). What all slots of
one engine share (the worker, the link, the ranks) is :class:`~lightning_offload.engine.lanes.Lanes`, a floor below.

The kinds (one module each): a projected weight (:mod:`~lightning_offload.engine.slots.projected_slot`), a weight under
``update="scaled"`` (:mod:`~lightning_offload.engine.slots.scaled_slot`), a dense parameter
(:mod:`~lightning_offload.engine.slots.dense_slot`; projected and dense share their host step,
:mod:`~lightning_offload.engine.slots.host_step_slot`), an embedding stepped row by row
(:mod:`~lightning_offload.engine.slots.row_slot`), host matrices stepped by blocks of rows, MEFT's adapters
(:mod:`~lightning_offload.engine.slots.row_blocks_slot`), and a tensor another rank steps
(:mod:`~lightning_offload.engine.slots.remote_slot`); which tensor gets which is
:mod:`~lightning_offload.engine.slots.slot_building`'s. The step knows them only through :class:`Slot`.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_offload.engine.checkpoint_kinds import refuse_other_kind
from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.slots.weight_fingerprint import fingerprint

#: How a step clips its gradients: ``("norm", coefficient)`` (a 0-dim CPU tensor) or ``("value", bound)``, or None.
Clip = Optional[tuple[str, Union[Tensor, float]]]

#: What a host job takes from the user's group, read on the main thread at launch (:meth:`Slot.settings`).
JobSettings = tuple[dict[str, Any], float]


def pinned_zeros(shape: Sequence[int], pin: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """A preallocated host buffer, page-locked when ``pin``."""
    # Pinned pages let device↔host copies run by DMA, asynchronously (worth it with a CUDA device across the link);
    # preallocated once, as a fresh host allocation costs several times a copy into an existing buffer.
    return torch.zeros(tuple(shape), dtype=dtype, pin_memory=pin)


def clip_(grad: Tensor, clip: Clip) -> None:
    """Clip a gradient in place as the step decided: ``("norm", coefficient)`` scales it (a 0-dim CPU tensor, which
    also scales a device tensor), ``("value", bound)`` clamps it."""
    if clip is None:
        return
    if clip[0] == "norm":
        grad.mul_(clip[1])
    else:
        grad.clamp_(-clip[1], clip[1])


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def thread_minor_faults() -> int:
    """Minor page faults of the calling thread so far (Linux's per-thread count; 0 where there is none)."""
    if _RUSAGE_THREAD is None:
        return 0
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt


class Slot:
    """One offloaded tensor as the engine's step sees it; each kind owns its host state and implements the hops.

    The step's order, for every kind: during backward the gradient is :meth:`send` (device→host, on the link's
    copy stream); at the step, :meth:`prepare` (main thread: what the host job needs from the device), then the host
    worker runs :meth:`host_step`; before the owning module's next forward (or at a synchronize), :meth:`finish`
    applies the update on the device.

    Attributes:
        name: the tensor's name in the model.
        param: the model's parameter.
        group: the user's param group (shared dict: LR schedulers write it).
        owner: the rank that steps it (0 for one process); ``owned`` says whether that is this rank.
        timeline: the step whose spans this slot's work records into.

    Where its step stands (sent, pending, the job, a speculation's backup) is the orchestrator's record of it
    (:class:`~lightning_offload.engine.step.slot_step.SlotStep`), not the slot's.
    """

    #: A projected weight's layer (kinds without one: ``None``).
    layer = None
    #: Whether a host step may start during backward (:mod:`~lightning_offload.engine.step.speculation`).
    speculates = False
    #: Whether its gradient crosses during backward by its owner's own means, never through :meth:`send`.
    crosses_by_itself = False
    #: Whether its update crosses back when its module's forward nears (a projected weight's): the step may start that
    #: copy earlier (:mod:`~lightning_offload.engine.step.update_prefetch`).
    fetches_update = False
    #: Whether ``host_param`` is an fp32 master of the parameter (dense and row kinds).
    keeps_master = False
    #: Whether the engine's hooks route its gradient and apply its update (else its owner's own hooks do).
    routed = True
    #: Whether its gradient is its parameter's ``.grad`` (which a user's own clipping call can edit in place).
    gradient_is_param_grad = False
    #: Whether ``param.grad`` crosses whole and nothing on the device reads it after launch (``free_sent_gradients``).
    crosses_param_grad = False
    #: Whether its host state is the scaled rule's, and whether it is a row Adam's (what a checkpoint must match).
    steps_scaled = False
    steps_rows = False

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool,
                 owner: int = 0, owned: bool = True) -> None:
        self.name = name
        self.param = param
        self.group = group
        self.lanes = lanes
        self.decoupled = decoupled
        self.owner = owner
        self.owned = owned
        self.timeline: StepTimeline | None = None
        # Events of the copies in flight: the gradient landing on the host, the update (or value) leaving it.
        self.to_host_event: Any = None
        self.to_device_event: Any = None

    # ------------------------------------------------------------------------------------------------ backward
    def gradient(self) -> Tensor | None:
        """The gradient this step uses (``None`` when there is none), on the device."""
        return self.param.grad

    @property
    def norm_ratio(self) -> float:
        """``‖gradient‖ / ‖full gradient‖``: the global norm divides each gradient's norm by it."""
        return 1.0

    def gradient_numel(self) -> int:
        """Elements of the gradient that crosses (and is reduced between ranks)."""
        return self.param.numel()

    def has_grad(self) -> bool:
        """Whether backward produced a gradient for it this step."""
        return self.gradient() is not None

    def send(self, timeline: StepTimeline) -> None:
        """Start copying the final gradient to the host (main thread, usually during backward)."""
        raise NotImplementedError

    def unchanged_since_sent(self) -> bool:
        """Whether the gradient last sent is still the one the step uses (most kinds: a sent gradient is final)."""
        return True

    def clamp_on_device(self, bound: float) -> bool:
        """Clip by value on the device where the host cannot clamp what crosses (the scaled rule: its projection
        crosses, its full gradient is applied); returns whether what crossed changed and must cross again."""
        return False

    def fetch_started(self) -> bool:
        """Whether its computed update is on its way to the device (kinds that fetch their update)."""
        return True

    def start_fetch(self, allocate: bool = True) -> bool:
        """Issue the host→device copy of its computed update (kinds that fetch their update); returns whether it was
        issued (``allocate=False``: not where no device buffer is free)."""
        raise NotImplementedError

    def drop_fetch(self) -> None:
        """Forget an update copied ahead for a host step that is redone or undone (kinds that fetch their update; the
        copy must have landed: the caller waited for it, :meth:`wait_for_send_back`)."""

    def release_gradient(self) -> None:
        """Drop what the device holds of a gradient once it is on its way (a projected weight's ``S``)."""

    def begin_collect(self) -> None:
        """Before the step's forward and backward run (most kinds: nothing to reset)."""

    def gradient_unseen_by_edits(self) -> str | None:
        """What of this step's gradient an in-place edit of ``param.grad`` (a user's own clipping call) cannot see,
        in words; ``None`` when there is nothing (most kinds)."""
        return None

    # ------------------------------------------------------------------------------------------------ the step
    def settings(self) -> JobSettings:
        """What the next host job takes from the user's group, read now (a scheduler may change the group before
        the job runs): the host optimizer's hyper-parameters and the coupled L2 weight."""
        return self.lanes.rule.hparams_of(self.group), float(self.group.get("weight_decay", 0.0))

    def decoupled_decay(self) -> float:
        """The decoupled decay factor ``1 − lr·λ`` a projected weight's apply multiplies ``W`` by (1 for coupled L2)."""
        if not self.decoupled:
            return 1.0
        return 1.0 - self.group["lr"] * self.group.get("weight_decay", 0.0)

    def count_device_buffers(self, step: StepTelemetry) -> None:
        """Main thread, at the step: add to ``step`` the transient device buffers its gradient took (most: none)."""

    def prepare(self, step: StepTelemetry) -> None:
        """Main thread, at the step: count the bytes that cross and capture what applying the update needs."""

    def prepare_l2(self, step: StepTelemetry) -> None:
        """Main thread, before the host job: what a coupled L2 term needs from the device (most kinds: nothing)."""

    def host_step(self, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  keep_landing: bool = False) -> None:
        """Worker thread: step the host optimizer on the landed gradient and start sending the result back.

        Args:
            clip: the step's clipping. compute_done: a device event after backward (copies to the device wait for it).
            keep_landing: leave the gradient's landing buffer as it arrived (a speculative step may be redone).
        """
        raise NotImplementedError

    def expect_update(self, timeline: StepTimeline) -> None:
        """Main thread, at the step, on a rank that does not own it: the update comes by broadcast at apply time."""
        raise NotImplementedError

    def finish(self, start: float) -> None:
        """Main thread: wait for the update (its host job has run) and apply it on the device."""
        raise NotImplementedError

    def abandon_gradient(self) -> None:
        """A skipped step: let copies under way land, then forget the gradient."""
        self.lanes.link.host_wait(self.to_host_event)
        self.to_host_event = None

    def settle(self) -> None:
        """Bring the parameter up to date with what its host state owes it before anything reads it (most: none)."""

    def owes_settle(self) -> bool:
        """Whether :meth:`settle` may have something to apply (most kinds: never)."""
        return False

    def unsettle(self) -> None:
        """Before a training forward: undo what :meth:`settle` showed that training must not see (most kinds: none)."""

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> list[Tensor]:
        """Every tensor of optimizer state this slot keeps (host moments, masters, staging buffers)."""
        return []

    def host_state(self) -> dict[str, Any] | None:
        """Its host optimizer's state for a checkpoint (``None`` where another rank keeps it)."""
        return None

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`host_state` output."""

    def check_saved_state(self, saved: dict[str, Any]) -> None:
        """Refuse a checkpoint's host state written by another kind of slot for this tensor.

        Raises:
            ValueError: naming the setting that wrote it and the one to resume with.
        """
        refuse_other_kind(self.name, saved, scaled=self.steps_scaled, rows=self.steps_rows)

    def checkpoint_part(self) -> dict[str, Any]:
        """What a checkpoint keeps of this slot besides its host state and fp32 master, by section of the
        checkpoint (a projected weight's projectors and rounding generator; most kinds: nothing)."""
        return {}

    def load_checkpoint_part(self, state: dict[str, Any]) -> None:
        """Restore this slot's :meth:`checkpoint_part` from the whole checkpoint ``state``."""

    def device_persistent_bytes(self) -> dict[str, int]:
        """Device bytes this slot keeps between steps (most kinds: none), by category of
        :attr:`~lightning_offload.engine.figures.telemetry.OffloadTelemetry.device_persistent_bytes`."""
        return {}

    def master_in_checkpoint(self) -> bool:
        """Whether a checkpoint keeps the fp32 master: where the parameter is narrower (an fp32 one equals it)."""
        return self.keeps_master and self.param.dtype != torch.float32

    def master_state(self) -> Tensor:
        """A copy of the fp32 master, for a checkpoint."""
        return self.host_param.clone()

    def load_master(self, master: Tensor | None) -> None:
        """Restore the master from a checkpoint, or from the restored parameter where none was kept."""
        self.host_param.copy_(master if master is not None else self.param.detach())
        self.watch_weights()

    def watch_weights(self) -> None:
        """Remember the parameter as the engine left it: its version counter (moved by others' in-place writes, not by
        the engine's through ``.data``) and its fingerprint, which a write through ``.data`` moves too
        (:mod:`~lightning_offload.engine.slots.weight_fingerprint`)."""
        self.weights_version = self.param._version
        self.weights_fingerprint = fingerprint(self.param) if self.keeps_master else None

    @torch.no_grad()
    def adopt_written_weights(self) -> None:
        """Before a step, where the parameter was written since the engine last did (weights loaded after the
        optimizer's state or ``offload()``, a user's write, through ``.data`` too): the master takes the written value,
        as ``torch.optim`` would step from it, unless it is the master's own (a checkpoint restoring both)."""
        self.watch_weights()
        if not self.weights_match_master():
            self.host_param.copy_(self.param.detach())
            self.adopted_weights()

    def weights_written(self) -> bool:
        """Whether the parameter of a master-keeping slot was written in place by anyone but the engine since the
        master was set (its version counter moved; a write through ``.data`` is the fingerprint's to see)."""
        return self.keeps_master and self.param._version != self.weights_version

    def weights_match_master(self) -> bool:
        """Whether the parameter holds the master's value (in its own dtype)."""
        return torch.equal(self.param.detach(), self.host_param.to(self.param.device, self.param.dtype))

    def adopted_weights(self) -> None:
        """The master took the parameter's written value (most kinds: nothing else to do)."""

    def wait_for_send_back(self) -> None:
        """Block until the last copy from this slot's host buffers to the device has read them."""
        self.lanes.link.host_wait(self.to_device_event)

    def _record(self, lane: str, label: str, start: float) -> None:
        self.timeline.add(lane, label, start, time.perf_counter())
