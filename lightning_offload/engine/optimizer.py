"""The optimizer that takes over a user's Adam/AdamW: host Adam on compressed and dense gradients.

:class:`OffloadOptimizer` is what the offload strategies put in place of the optimizer returned by
``configure_optimizers``. It shares that optimizer's ``param_groups`` dicts, so per-group hyper-parameters are
honoured and LR schedulers (which write ``param_groups[i]["lr"]``) keep working. The user's optimizer never
steps and holds no state. All optimizer state lives on the host:

* projected weights: Adam on ``S = A G Bᵀ`` with moments of shape ``d_o × d_i``; the update ``U`` is expanded
  on the device (``W ← W·(1 − lr·wd) + Aᵀ U B``);
* every other parameter in the optimizer: fp32 master copy plus Adam moments on the host (ZeRO-Offload style);
  the new value is copied back to the device.

Both host optimizers are ``torch.optim.Adam(fused=True)`` instances over host tensors, so the Adam arithmetic is
PyTorch's own, with one step counter per tensor.

The class is split by job over :mod:`~lightning_offload.engine.slots` (host state per tensor),
:mod:`~lightning_offload.engine.gradients` (backward: hooks and sends), :mod:`~lightning_offload.engine.clipping`
(norms, clipping, non-finite steps), :mod:`~lightning_offload.engine.host_jobs` (the worker's Adam jobs) and
:mod:`~lightning_offload.engine.updates` (applying updates on the device); this module holds the step's
orchestration, set-up, checkpoints and accounting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.checkpoint_kinds import WEIGHTS_ONLY, optimizer_state_kind, torch_state_under_offload
from lightning_offload.engine.clipping import GradientClipping, NonFinitePolicy
from lightning_offload.engine.data_parallel import RankShards
from lightning_offload.engine.device_adam import DeviceAdam
from lightning_offload.engine.gradients import GradientSending
from lightning_offload.engine.host_jobs import HostJobs, _clip_
from lightning_offload.engine.pipeline import HostWorker, Link, StepTimeline, TimelineRecorder, UpdateRing
from lightning_offload.engine.slots import SlotBuilding, _Slot, is_decoupled, _synced_hparams
from lightning_offload.engine.telemetry import OffloadTelemetry, StepTelemetry
from lightning_offload.engine.updates import UpdateApplication
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.lsp.rotation import coordinate_map, rotate_adam_state


SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


_STATE_FORMAT = 2


LINK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def validate_user_optimizer(optimizer: Any) -> Optimizer:
    """Check the optimizer an offload strategy can take over; return it unwrapped.

    Raises:
        TypeError: for anything but ``torch.optim.Adam``/``AdamW`` (subclasses are refused too: their ``step``
            may do something the host Adam would not reproduce).
    """
    inner = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    if type(inner) not in SUPPORTED_OPTIMIZERS:
        raise TypeError(
            f"The offload strategies take over torch.optim.Adam or torch.optim.AdamW, but configure_optimizers "
            f"returned {type(inner).__module__}.{type(inner).__qualname__}. Return torch.optim.AdamW(...) (any param "
            f"groups, lr, betas, eps, weight_decay) — its state will live on the host."
        )
    for group in inner.param_groups:
        if group.get("capturable") or group.get("differentiable"):
            raise ValueError(
                "capturable/differentiable Adam cannot be offloaded: the host Adam is neither. Create the optimizer "
                "without capturable=True and differentiable=True."
            )
    return inner


def _named(groups: list[dict[str, Any]], model: torch.nn.Module | None) -> list[tuple[str, Tensor]]:
    """Each parameter of the optimizer's groups with its name in ``model`` (``param<i>`` where unknown)."""
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    params = [p for group in groups for p in group["params"]]
    return [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]


class OffloadOptimizer(SlotBuilding, GradientSending, GradientClipping, HostJobs, UpdateApplication, Optimizer):
    """Adam/AdamW whose state and arithmetic live on the host, stepped tensor by tensor through a pipeline.

    Each offloaded tensor's gradient goes device→host as soon as backward has produced it (last micro-batch
    only), a host worker thread runs its Adam step, and its update comes back; the device applies it right before
    the owning module's next forward (a forward pre-hook). With ``pipelined=False`` every update is applied before
    :meth:`step` returns; both modes run the same arithmetic, so their results are identical. The offload
    strategies build one in place of the Adam/AdamW from ``configure_optimizers``; build one yourself for a plain
    PyTorch loop, and :meth:`close` it when done.

    Args:
        optimizer: the user's ``torch.optim.Adam``/``AdamW``; its ``param_groups`` are shared, never copied.
        projected: the projected weights; each weight that appears in ``optimizer`` takes the compressed path.
        device: the training device (where parameters and ``S`` buffers live).
        model: the module holding the parameters; needed for ``pipelined=True`` (its forward pre-hooks apply
            updates just in time). Default: ``None``.
        pipelined: defer each update to its module's next forward (``True``) or apply all in :meth:`step`.
            Default: ``False`` (the strategies pass ``True``).
        link_dtype: ``"fp32"`` or ``"bf16"`` for gradients crossing to the host and compressed updates crossing
            back (dense parameters always come back in their own dtype, exactly). Default: ``"fp32"``.
        on_nonfinite: ``"skip"`` skips a step whose gradients hold inf/nan (counted in telemetry); ``"raise"``
            raises :class:`NonFiniteGradientError`. Either way the host state is untouched. Default: ``"skip"``.
        rounding_seed: seed of the per-tensor generators used for stochastic rounding of low-precision weights.
            Default: ``0``.
        update_buffers: device buffers compressed updates land in (a ring shared by all layers). Default: ``None``
            (4 on an accelerator, none on the CPU, where the device is the host and updates are read where the host
            step wrote them).
        speculative: step each tensor's host Adam during backward, as soon as its gradient has landed, assuming the
            step will be neither clipped by norm nor skipped, with the previous step's value clipping (not after a
            step whose norm clipping fired: the next one would most likely be redone); once the
            global norm is known, a step whose assumption failed (clipping fired, a non-finite gradient, changed
            hyper-parameters or gradient) is rolled back from a copy of its state and redone or skipped. Results
            equal the non-speculative path bit for bit. Costs a host copy of each tensor's Adam state (and a dense
            parameter's master) per step, and that much host memory. Default: ``None`` (on for an accelerator, off
            on the CPU, where host and "device" share the cores; measured: it only adds contention there).
        keep_on_device: parameters stepped by a device Adam (:class:`~lightning_offload.engine.device_adam.DeviceAdam`)
            instead of the host: clipped and checked like the rest, state on the device. Default: ``()``.
        row_sparse: embedding weights stepped row-sparsely on the host: only the rows with a nonzero gradient cross
            each way and are stepped (:class:`~lightning_offload.engine.row_adam.HostRowAdam`). Default: ``()``.
        frozen: parameters of the user's groups not trained here (the strategy has turned their gradients off).
            Default: ``()``.
        tied_projected: projected weights also used outside their module (an input embedding tied to a projected
            head): their update is applied inside the step, and the outside use's gradient compressed, without a
            warning. Default: ``()``.
        data_parallel: the ranks this optimizer trains with (:mod:`lightning_offload.engine.data_parallel`):
            gradients are reduced to each tensor's owner rank, which alone keeps its host state and steps it, and
            updates are broadcast from there. Default: ``None`` (one process).

    Example::

        model = torch.nn.Linear(256, 256)
        optimizer = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), [], torch.device("cpu"))
        for batch in batches:
            model(batch).square().mean().backward()
            optimizer.step(); optimizer.zero_grad()  # the Adam state and arithmetic live on the host
        optimizer.close()
    """

    def __init__(
        self,
        optimizer: Optimizer,
        projected: Iterable[ProjectedWeight],
        device: torch.device,
        model: torch.nn.Module | None = None,
        pipelined: bool = False,
        link_dtype: str = "fp32",
        on_nonfinite: NonFinitePolicy = "skip",
        rounding_seed: int = 0,
        update_buffers: int | None = None,
        speculative: bool | None = None,
        keep_on_device: Sequence[Tensor] = (),
        row_sparse: Sequence[Tensor] = (),
        frozen: Sequence[Tensor] = (),
        tied_projected: Sequence[Tensor] = (),
        data_parallel: RankShards | None = None,
    ) -> None:
        optimizer = validate_user_optimizer(optimizer)
        if data_parallel is not None and row_sparse:
            raise ValueError("embeddings='sparse' is not available with data parallelism: each rank's batch touches "
                             "different rows. Use embeddings='host', 'device' or 'frozen' with the DDP strategies.")
        if on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}.")
        if link_dtype not in LINK_DTYPES:
            raise ValueError(f"link_dtype must be one of {sorted(LINK_DTYPES)}, got {link_dtype!r}.")
        if pipelined and model is None:
            raise ValueError("pipelined=True needs the model, whose forward pre-hooks apply the updates.")
        # Optimizer.__init__ appends the very dicts it is given, so the groups are shared with the user's optimizer
        # (and with any scheduler attached to it); the list itself is shared below as well.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.wrapped = optimizer
        self.device = torch.device(device)
        self.pipelined = pipelined
        self.link_dtype = LINK_DTYPES[link_dtype]
        self.on_nonfinite = on_nonfinite
        # On the CPU the "device" and the host share the cores: host work started during backward only competes
        # with it (and the state copies cost extra), so speculation is for accelerators.
        self.speculative = speculative if speculative is not None else self.device.type != "cpu"
        # What speculative steps assume about clipping: the previous step's value clipping (an elementwise clamp,
        # known before the norm), else none. Norm clipping is assumed not to fire.
        self._spec_clip: tuple[str, float] | None = None
        # Whether norm clipping fired at the last step taken: then the next step is not speculated, since its
        # speculative work would most likely be redone (clipping tends to fire for stretches of training).
        self._norm_clip_fired = False
        self._spec_step: StepTelemetry | None = None
        self.telemetry = OffloadTelemetry()
        self.timelines = TimelineRecorder()
        self.link = Link(self.device)
        # On an accelerator the worker keeps off one core, so the main thread's kernel launches never wait for one.
        self.worker = HostWorker(leave_main_a_core=self.device.type != "cpu")
        self._collecting = False
        self._round = 0  # counts launched steps: tells gradients sent for this step from stale ones
        self._clip: tuple[str, Tensor | float] | None = None
        self._last_norm: Tensor | None = None
        self._step_start = time.perf_counter()
        # The timeline of the step being collected (its backward's sends and speculative jobs), and that of the
        # launched step whose figures complete at the next synchronize.
        self._timeline = StepTimeline()
        self._pending_timeline: StepTimeline | None = None
        self._pending_telemetry: StepTelemetry | None = None
        # Set by a strategy whose step has gradients outside this optimizer (MEFT's host rows): their norm joins the
        # non-finite check, so one decision covers every gradient of the step.
        self.external_grad_norm: Callable[[], Tensor] | None = None
        self.last_step_skipped = False
        self.ranks = data_parallel
        # Which tensors had a gradient on some rank this step (data parallelism: decided by every rank alike).
        self._present: dict[int, bool] = {}

        self._hooks: list[Any] = []
        self._slots_by_module: dict[int, list[_Slot]] = {}
        on_device = {id(p) for p in keep_on_device}
        # Parameters that do not require gradients (the user's frozen layers left in the optimizer, and those the
        # strategy froze) get no host state and are never stepped, as torch.optim skips a parameter whose grad is
        # None. One unfrozen later would get gradients no slot takes: refused at the step (_check_still_frozen).
        self._frozen_at_setup = [(p, name) for name, p in _named(self.param_groups, model) if not p.requires_grad]
        self._left_out = on_device | {id(p) for p in frozen} | {id(p) for p, _ in self._frozen_at_setup}
        self._row_sparse = {id(p) for p in row_sparse}
        self.slots = self._build_slots(list(projected), rounding_seed, model)
        self.projected_layers = [slot.layer for slot in self.slots if slot.layer is not None]
        self._eager_slots = list(self.slots) if model is None else self._attach_hooks(model)
        tied = {id(p) for p in tied_projected}
        eager = {id(slot) for slot in self._eager_slots}
        self._eager_slots += [slot for slot in self.slots if id(slot.param) in tied and id(slot) not in eager]
        self.device_adam: DeviceAdam | None = None
        kept = [(p, group, is_decoupled(optimizer, group)) for group in self.param_groups for p in group["params"]
                if id(p) in on_device]
        if kept:
            self.device_adam = DeviceAdam(kept)
        projected_slots = [slot for slot in self.slots if slot.layer is not None]
        self._projected_position = {id(slot): i for i, slot in enumerate(projected_slots)}
        self._projected_slots = projected_slots
        if self.ranks is not None:
            self._build_reductions(tied)
        if update_buffers is None:
            update_buffers = 4 if self.device.type != "cpu" else 0
        self.update_ring: UpdateRing | None = None
        if update_buffers and projected_slots:
            largest = max(math.prod(slot.layer.compressed_shape) for slot in projected_slots)
            self.update_ring = UpdateRing(update_buffers, largest, self.link_dtype, self.device)
        self.telemetry.host_state_bytes = self.host_state_bytes()
        self.telemetry.device_persistent_bytes = self.device_persistent_bytes()

    @torch.no_grad()
    def settle_row_decay(self) -> None:
        """Applies the decoupled weight decay that row-sparse embeddings' untouched rows owe (their next step would
        apply it), on the host master and the device weight: call before the weights are read (evaluation,
        checkpoints, the end of fit, a callback), after :meth:`synchronize`."""
        for slot in self.slots:
            if slot.row_adam is None or not slot.owned or not is_decoupled(self.wrapped, slot.group):
                continue
            rows = slot.row_adam.settle_decay(slot.group["lr"], slot.group.get("weight_decay", 0.0))
            if rows.numel():
                on_device = rows.to(slot.param.device)
                slot.param.data.index_copy_(0, on_device, slot.host_param[rows].to(slot.param.device,
                                                                                   slot.param.dtype))

    def _check_still_frozen(self) -> None:
        """Refuses a step in which a parameter frozen at set-up has a gradient: it has no host state to step."""
        for param, name in self._frozen_at_setup:
            if param.grad is not None or param.requires_grad:
                raise ValueError(
                    f"{name} was frozen (requires_grad=False) when the strategy set up and now has a gradient: the "
                    f"offload strategies build each trained tensor's host state at set-up, so it would never be "
                    f"stepped. Unfreeze it before trainer.fit (e.g. in configure_model), or stop and start a new "
                    f"fit from a checkpoint after unfreezing it.")

    def close(self) -> None:
        """Apply what is pending, then remove hooks and stop the worker (idempotent)."""
        try:
            if self.worker._thread.is_alive():
                self.synchronize()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            for layer in self.projected_layers:
                layer.on_grad_ready = None
            self.worker.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense gradients (via the user's optimizer) and the ``S`` accumulators."""
        self.wrapped.zero_grad(set_to_none=set_to_none)
        for layer in self.projected_layers:
            layer.zero_grad()

    # ------------------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward, backward, clipping hooks), then launch or confirm one host Adam step per tensor."""
        loss = None
        if closure is not None:
            # No synchronize before the closure: its forward applies the previous step's updates module by module
            # (forward pre-hooks), which is where the host work of that step gets hidden.
            for layer in self.projected_layers:
                layer.reset_forward_count()  # a forward whose backward never ran must not hold back this step's send
            self._collecting = True
            try:
                with torch.enable_grad():
                    loss = closure()
            except BaseException:
                self._roll_back_speculation()  # nothing of a step that never happened may stay in the host state
                if self.ranks is not None:
                    self.ranks.reset()
                raise
            finally:
                self._collecting = False
        self._check_still_frozen()
        # Updates of modules this forward did not run, and last step's telemetry, are settled before the next launch.
        self.synchronize()
        backward_end = time.perf_counter()
        self._timeline.add("device", "forward+backward", self._step_start, backward_end)
        self._timeline.backward_end = backward_end
        norm = self._last_norm if self._last_norm is not None else self.grad_norm()
        if self._last_norm is None and self.external_grad_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack([norm.float().cpu(), self.external_grad_norm().float()]))
        self.last_step_skipped = not bool(torch.isfinite(norm))
        if self.last_step_skipped:
            self._skip_step(norm)
            return loss

        step, self._spec_step = self._spec_step or StepTelemetry(), None
        for layer in self.projected_layers:
            if layer.grad_buffer is not None:
                step.device_compressed_grad_bytes += layer.grad_buffer.numel() * layer.grad_buffer.element_size()
            step.device_saved_projection_bytes += layer.saved_projection_bytes
        # Consumed here; set again by the next clipping call (inside the next closure, or before a manual step).
        clip, self._clip, self._last_norm = self._clip, None, None
        if clip is not None and clip[0] == "norm":
            coefficient = clip[1].to("cpu", torch.float32)
            # A coefficient of exactly 1 (the clamp's ceiling: the norm is under the limit) changes no bit.
            clip = None if float(coefficient) == 1.0 else ("norm", coefficient)
        compute_done = self.link.compute_event()
        for slot in self.slots:
            has_grad = slot.layer.has_grad if slot.layer is not None else slot.param.grad is not None
            if self.ranks is not None:
                has_grad = self._present.get(id(slot), False)
                if not slot.owned:
                    if has_grad:
                        self._expect_update(slot)
                    continue
            speculated = slot.spec_round == self._round
            if not has_grad:
                if speculated:
                    self._undo(slot)  # its gradient was dropped after it was sent (never the case in Lightning's loop)
                continue
            settings = self._job_settings(slot)
            confirmed = (speculated and slot.spec_valid and self._is_sent(slot) and slot.spec_clip == clip
                         and slot.spec_settings == settings)
            if not self._is_sent(slot):
                self._send_gradient(slot)  # manual optimization, or a gradient that changed after it was sent
            self._prepare_update(slot, step)
            if confirmed:
                step.speculative_steps += 1
                if slot.layer is None:
                    # Its new master is final: now it may cross to the device.
                    slot.job = self.worker.submit(partial(self._publish_job, slot, compute_done), slot.name)
            else:
                if speculated:
                    step.rolled_back_steps += 1  # the redo job first restores what the speculative one changed
                else:
                    self._prepare_l2(slot, step)
                    slot.timeline = self._timeline
                slot.job = self.worker.submit(
                    partial(self._host_job, slot, clip, compute_done, step, settings, False, speculated), slot.name)
            slot.pending = True
            if slot.layer is not None:
                # S is released, not cleared: its copy may still be reading it, and the link keeps its memory from
                # being reused until then (no wait on the compute stream).
                slot.layer.zero_grad()
        if self.device_adam is not None:
            # Queued on the device after backward, like a native optimizer step: nothing waits for it.
            for param in self.device_adam.params:
                if param.grad is not None:
                    _clip_(param.grad, clip)
            self.device_adam.step(_synced_hparams)
        self._spec_clip = clip if clip is not None and clip[0] == "value" else None
        self._norm_clip_fired = clip is not None and clip[0] == "norm"
        if self.ranks is not None:
            # This step's reductions and norm, and the broadcasts of the previous step's updates.
            step.bytes_between_ranks = float(self.ranks.bytes_this_step)
            self.ranks.reset()
        self._pending_telemetry = step
        self._pending_timeline, self._timeline = self._timeline, StepTimeline()
        self._round += 1
        # torch's LR schedulers track the step of the optimizer they were built with; mark it as stepped so the
        # scheduler's order check does not warn (the user's optimizer never steps itself).
        self.wrapped._opt_called = True  # type: ignore[attr-defined]
        for slot in self._eager_slots:
            self._finish(slot)
        if not self.pipelined:
            self.synchronize()
        self._step_start = time.perf_counter()
        return loss

    def restart_step_clock(self) -> None:
        """Start the next step's device lane now: work done since the last step (a projector fit) is not the step's."""
        self._step_start = time.perf_counter()

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer this one drives. Lightning's ``LearningRateMonitor`` reads a wrapper's
        ``.optimizer`` (as for DeepSpeed's), so the learning rate is logged once, under the user's optimizer's name
        (``lr-AdamW``), not a second time as ``lr-OffloadOptimizer``."""
        return self.wrapped

    @property
    def step_in_flight(self) -> bool:
        """Whether the latest step's host work may still be running: its figures complete at the next
        :meth:`synchronize` (the next step's launch, when pipelined)."""
        return self._pending_telemetry is not None

    def synchronize(self) -> None:
        """Apply every pending update now (before reading weights outside training, saving, or evaluating)."""
        for slot in self.slots:
            self._finish(slot)
        self.worker.check()
        if self._pending_telemetry is not None:
            step = self._pending_telemetry
            self._pending_telemetry = None
            timeline, self._pending_timeline = self._pending_timeline, None
            step.host_optimizer_seconds = timeline.busy("host")
            step.host_share_before_backward_end = timeline.share_before("host", timeline.backward_end)
            self.telemetry.last = step
            self.telemetry.last_timeline = timeline
            self.telemetry.steps += 1
            # Adam allocates its moments lazily at the first step, so the size is re-measured after each.
            self.telemetry.host_state_bytes = self.host_state_bytes()
            self.telemetry.device_persistent_bytes = self.device_persistent_bytes()  # a refit may change them
            self.telemetry.update_ring_fallbacks = self.update_ring.fallbacks if self.update_ring is not None else 0
            self.timelines.record(self.telemetry.steps, timeline)
            self.telemetry.complete_step()

    # ------------------------------------------------------------------------------------------------------ refit
    @torch.no_grad()
    def replace_projectors(
        self, layer: ProjectedWeight, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float = 1.0,
        second_moment_scale: float = 1.0,
    ) -> None:
        """Install new projectors for ``layer`` and carry its host Adam moments into the new subspace.

        Pending updates are applied first (they belong to the old subspace). The moments are mapped on the host
        (:func:`~lightning_offload.lsp.rotation.rotate_adam_state`); only ``d × d`` maps cross the link.
        ``norm_ratio`` is the new projectors' ``‖S‖/‖G‖`` on sampled gradients (see :meth:`grad_norm`);
        ``second_moment_scale`` is ``(‖S_new‖/‖S_old‖)²`` on the same gradients, applied to the carried ``v``.

        Raises:
            ValueError: if ``layer`` is not offloaded here or the compressed sizes change.
        """
        slot = next((s for s in self.slots if s.layer is layer), None)
        if slot is None:
            raise ValueError(f"Layer {layer.name} is not one of this optimizer's projected layers.")
        if (proj_out.dim_out, proj_in.dim_out) != layer.compressed_shape:
            raise ValueError(
                f"A refit must keep {layer.name}'s compressed shape {layer.compressed_shape}; got "
                f"({proj_out.dim_out}, {proj_in.dim_out})."
            )
        self.synchronize()
        state = slot.adam.state.get(slot.host_param) if slot.adam is not None else None
        if state:
            rotate_adam_state(
                state, coordinate_map(layer.proj_out, proj_out), coordinate_map(layer.proj_in, proj_in),
                second_moment_scale,
            )
        layer.set_projectors(proj_out.to(self.device), proj_in.to(self.device))
        # A degenerate measurement (zero, nan) must not turn every later norm into inf and skip every step.
        layer.norm_ratio = float(norm_ratio) if math.isfinite(norm_ratio) and norm_ratio > 0 else 1.0

    # ----------------------------------------------------------------------------------------------- accounting
    def host_state_bytes(self) -> int:
        """Bytes of optimizer state on the host: Adam moments, fp32 masters, ``Z`` and landing/staging buffers."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors() if t.device.type == "cpu")

    def device_persistent_bytes(self) -> dict[str, int]:
        """Device bytes the offload machinery keeps between steps, by category (see
        :attr:`~lightning_offload.engine.telemetry.OffloadTelemetry.device_persistent_bytes`). Counted from the tensors'
        sizes, so it works on any device, ``meta`` included."""
        return {
            "projectors": sum(layer.proj_out.nbytes() + layer.proj_in.nbytes() for layer in self.projected_layers),
            "update_ring": self.update_ring.nbytes() if self.update_ring is not None else 0,
            "device_optimizer": self.device_adam.state_bytes() if self.device_adam is not None else 0,
        }

    def device_state_bytes(self) -> int:
        """Bytes of optimizer state found on a non-CPU device (the placement check: expected 0 on a GPU)."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors() if t.device.type != "cpu")

    def _state_tensors(self) -> list[Tensor]:
        tensors: list[Tensor] = []
        for slot in self.slots:
            tensors += [t for t in (slot.host_param, slot.host_grad, slot.host_update, slot.host_grad_fp32, slot.host_l2,
                                    slot.backup_master, slot.host_grad_work) if t is not None]
            tensors += list(slot.backup.values()) if slot.backup is not None else []
            if slot.row_adam is not None:
                tensors += [slot.host_rows, *slot.row_adam.state_tensors()]
            elif slot.adam is not None:
                tensors += [v for state in slot.adam.state.values() for v in state.values() if torch.is_tensor(v)]
        return tensors

    # ----------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Everything needed to resume exactly: group hyper-parameters, host moments and step counts, projector
        indices and values, fp32 masters of low-precision dense parameters, rounding generators, counters."""
        self.synchronize()
        host_adam = {slot.name: slot.adam.state_dict() if slot.row_adam is None else slot.row_adam.state_dict()
                     for slot in self.slots if slot.owned}
        dense_masters = {slot.name: slot.host_param.clone() for slot in self.slots
                         if slot.owned and slot.layer is None and slot.param.dtype != torch.float32}
        if self.ranks is not None:
            # The host state is sharded: rank 0 (which writes the checkpoint) gathers every rank's share, so the
            # checkpoint is the same as one process's and resumes on any number of ranks.
            shares = self.ranks.gather_to_zero((host_adam, dense_masters))
            if shares is not None:
                for adam_share, master_share in shares:
                    host_adam.update(adam_share)
                    dense_masters.update(master_share)
            else:
                host_adam, dense_masters = {}, {}  # the other ranks' checkpoints are not written
        return {
            "format": _STATE_FORMAT,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "slots": [slot.name for slot in self.slots],
            "host_adam": [host_adam.get(slot.name) for slot in self.slots],
            "device_adam": self.device_adam.state_dict() if self.device_adam is not None else None,
            "projectors": {
                slot.name: {"out": slot.layer.proj_out.state_dict(), "in": slot.layer.proj_in.state_dict(),
                            "norm_ratio": slot.layer.norm_ratio}
                for slot in self.slots
                if slot.layer is not None
            },
            # fp32 params equal their masters (restored with the model); lower-precision ones don't.
            "dense_masters": dense_masters,
            "rounding_generators": {
                slot.name: slot.generator.get_state() for slot in self.slots if slot.generator is not None
            },
            "telemetry": self.telemetry.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` output; all state stays on the host, projectors go to the device.

        Call after the model weights are restored (Lightning does), since fp32 masters are refreshed from them.

        Raises:
            ValueError: when the checkpoint was written for different layers or param groups.
        """
        if optimizer_state_kind(state_dict) == "torch":
            raise ValueError(torch_state_under_offload())
        if state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(
                "This optimizer state was not written by this version of lightning_offload's OffloadOptimizer; "
                "resume with the version and strategy that wrote the checkpoint. " + WEIGHTS_ONLY
            )
        names = [slot.name for slot in self.slots]
        if state_dict["slots"] != names:
            raise ValueError(
                f"Checkpoint has offloaded tensors {state_dict['slots'][:3]}… ({len(state_dict['slots'])}), but this "
                f"run has {names[:3]}… ({len(names)}): resume with the same model, strategy settings (rank, density, "
                f"patterns) and optimizer groups."
            )
        if None in state_dict["host_adam"]:
            raise ValueError("This optimizer state lacks the host Adam state of some tensors: it is a non-zero "
                             "rank's share of a data-parallel checkpoint. Resume from the checkpoint rank 0 wrote.")
        for slot, adam_state in zip(self.slots, state_dict["host_adam"]):
            saved_rows = "last_step" in adam_state  # a HostRowAdam's state, not a torch optimizer's
            if saved_rows != (slot.row_adam is not None):
                raise ValueError(
                    f"The checkpoint stepped {slot.name} {'row-sparsely' if saved_rows else 'densely'}, this run "
                    f"{'row-sparsely' if slot.row_adam is not None else 'densely'}: resume with "
                    f"embeddings={'sparse' if saved_rows else 'host'!r} (checkpoints written before embeddings= "
                    f"existed stepped every embedding densely: embeddings='host')."
                )
        if (state_dict.get("device_adam") is None) != (self.device_adam is None):
            raise ValueError("Checkpoint and this run disagree on which parameters a device Adam steps: resume with "
                             "the same embeddings= and head= settings.")
        self.synchronize()
        for slot in self.slots:
            # Host buffers are overwritten below: copies still reading them to the device must have finished.
            self.link.host_wait(slot.to_device_event)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        for slot, adam_state in zip(self.slots, state_dict["host_adam"]):
            if slot.row_adam is not None:
                slot.row_adam.load_state_dict(adam_state)
            elif slot.adam is not None:  # a tensor another rank steps keeps no host state here
                slot.adam.load_state_dict(adam_state)
            if slot.layer is not None:
                saved = state_dict["projectors"][slot.name]
                slot.layer.set_projectors(
                    SparseProjector.from_state_dict(saved["out"], self.device),
                    SparseProjector.from_state_dict(saved["in"], self.device),
                )
                slot.layer.norm_ratio = float(saved.get("norm_ratio", 1.0))
                slot.generator.set_state(state_dict["rounding_generators"][slot.name])
            elif slot.owned:
                master = state_dict["dense_masters"].get(slot.name)
                slot.host_param.copy_(master if master is not None else slot.param.detach())
        if self.device_adam is not None:
            self.device_adam.load_state_dict(state_dict["device_adam"])
        self.telemetry.load_state_dict(state_dict["telemetry"])
        self.telemetry.host_state_bytes = self.host_state_bytes()
