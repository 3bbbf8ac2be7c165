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
"""

from __future__ import annotations

import math
import resource
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.data_parallel import RankShards, ReducedTensor, contiguous_owners
from lightning_offload.device_adam import DeviceAdam
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.lsp.rotation import coordinate_map, rotate_adam_state
from lightning_offload.pipeline import HostWorker, Job, Link, StepTimeline, TimelineRecorder, UpdateRing
from lightning_offload.row_adam import HostRowAdam
from lightning_offload.telemetry import OffloadTelemetry, StepTelemetry

SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
# Hyper-parameters copied from each user group into the host optimizers' groups before every step.
_SYNCED_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
NonFinitePolicy = Literal["skip", "raise"]
_STATE_FORMAT = 2
LINK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class NonFiniteGradientError(FloatingPointError):
    """Raised when ``on_nonfinite="raise"`` and a step's gradients hold inf or nan."""


class NonFiniteStepWarning(UserWarning):
    """Issued for every step skipped because its gradients hold inf or nan (``on_nonfinite="skip"``)."""


@dataclass
class _Slot:
    """One offloaded tensor: a projected weight (host variable ``Z``) or a dense parameter (host fp32 master).

    The per-step fields track it through the pipeline: gradient sent (event), host job, update sent (event), applied.
    """

    name: str
    param: Tensor
    group: dict[str, Any]
    host_param: Tensor
    host_grad: Tensor
    adam: torch.optim.Adam | None
    layer: ProjectedWeight | None = None
    # An embedding stepped row-sparsely: its Adam, and the rows of the step in flight (their indices on the host,
    # how many, and on the device, where the new values are scattered).
    row_adam: HostRowAdam | None = None
    host_rows: Tensor | None = None
    row_count: int = 0
    rows_on_device: Tensor | None = None
    row_values: Tensor | None = None
    # The update as it crosses to the device, in the dtype that crosses: Z in the link dtype (projected), or the
    # parameter's own dtype for a low-precision dense parameter (bf16: 2 bytes per element cross, not the master's 4).
    host_update: Tensor | None = None
    # fp32 working copy of a gradient that lands narrower (link_dtype="bf16"): preallocated, so no host job allocates.
    host_grad_fp32: Tensor | None = None
    host_l2: Tensor | None = None
    l2_event: Any = None
    generator: torch.Generator | None = None
    # Per step:
    sent_round: int = -1
    sent_version: int = -1
    to_host_event: Any = None
    job: Job | None = None
    to_device_event: Any = None
    # A projected update on its way to the device: the buffer it lands in, and its number in the update ring (None
    # for a one-off allocation).
    update_on_device: Tensor | None = None
    ring_index: int | None = None
    decay: float = 1.0
    pending: bool = False
    # The timeline of the step whose job this slot runs now (host spans and the apply's waits are that step's).
    timeline: StepTimeline | None = None
    # Speculation (Adam stepped during backward, before the global norm is known): the round it was launched in,
    # whether its gradient is still the one the step uses, the hyper-parameters and clipping it assumed, and what
    # rolling it back restores (Adam's state before the step, and the host variable: a dense parameter's fp32 master,
    # or a projected weight's Z).
    spec_round: int = -1
    spec_valid: bool = False
    spec_settings: tuple[dict[str, Any], float] | None = None
    spec_clip: tuple[str, float] | None = None
    backup: dict[str, Tensor] | None = None
    backup_master: Tensor | None = None
    backup_had_state: bool = False
    # fp32 copy of an fp32-link gradient that a speculative step clamps or adds L2 to: the landing buffer must stay
    # as it arrived, in case the step is redone (allocated at the first such step).
    host_grad_work: Tensor | None = None
    # Data parallelism: the rank that steps this tensor on its host (its Adam state lives only there); every other
    # rank keeps no host buffers for it and receives its updates by broadcast.
    owner: int = 0
    owned: bool = True

    @property
    def projected(self) -> bool:
        return self.layer is not None


def _synced_hparams(group: dict[str, Any]) -> dict[str, Any]:
    """The Adam hyper-parameters of a user group that the host (or device) Adam copies before each step."""
    return {key: group[key] for key in _SYNCED_HPARAMS if key in group}


def _clip_(grad: Tensor, clip: tuple[str, Tensor | float] | None) -> None:
    """Clip a gradient in place as the step decided: ``("norm", coefficient)`` scales it (a 0-dim CPU tensor, which
    also scales a device tensor), ``("value", bound)`` clamps it."""
    if clip is None:
        return
    if clip[0] == "norm":
        grad.mul_(clip[1])
    else:
        grad.clamp_(-clip[1], clip[1])


def _is_decoupled(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


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


def _pinned_zeros(shape: Sequence[int], pin: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    # Pinned host memory lets device↔host copies run by DMA (and asynchronously); pinned pages are only worth it
    # when there is a CUDA device on the other end of the link. Preallocated once: a fresh host allocation costs
    # several times a copy into an existing buffer.
    return torch.zeros(tuple(shape), dtype=dtype, pin_memory=pin)


class OffloadOptimizer(Optimizer):
    """Adam/AdamW whose state and arithmetic live on the host, stepped tensor by tensor through a pipeline.

    Each offloaded tensor's gradient goes device→host as soon as backward has produced it (last micro-batch
    only), a host worker thread runs its Adam step, and its update comes back; the device applies it right before
    the owning module's next forward (a forward pre-hook). With ``pipelined=False`` every update is applied before
    :meth:`step` returns; both modes run the same arithmetic, so their results are identical.

    Args:
        optimizer: the user's ``torch.optim.Adam``/``AdamW``; its ``param_groups`` are shared, never copied.
        projected: the projected weights; each weight that appears in ``optimizer`` takes the compressed path.
        device: the training device (where parameters and ``S`` buffers live).
        model: the module holding the parameters; needed for ``pipelined=True`` (its forward pre-hooks apply
            updates just in time).
        pipelined: defer each update to its module's next forward (``True``) or apply all in :meth:`step`.
        link_dtype: ``"fp32"`` or ``"bf16"`` for gradients crossing to the host and compressed updates crossing
            back (dense parameters always come back in their own dtype, exactly).
        on_nonfinite: ``"skip"`` skips a step whose gradients hold inf/nan (counted in telemetry); ``"raise"``
            raises :class:`NonFiniteGradientError`. Either way the host state is untouched.
        rounding_seed: seed of the per-tensor generators used for stochastic rounding of low-precision weights.
        update_buffers: device buffers compressed updates land in (a ring shared by all layers). ``None``: 4 on an
            accelerator, none on the CPU, where the device is the host and updates are read where the host step
            wrote them.
        speculative: step each tensor's host Adam during backward, as soon as its gradient has landed, assuming the
            step will be neither clipped by norm nor skipped, with the previous step's value clipping (not after a
            step whose norm clipping fired: the next one would most likely be redone); once the
            global norm is known, a step whose assumption failed (clipping fired, a non-finite gradient, changed
            hyper-parameters or gradient) is rolled back from a copy of its state and redone or skipped. Results
            equal the non-speculative path bit for bit. Costs a host copy of each tensor's Adam state (and a dense
            parameter's master) per step, and that much host memory. ``None``: on for an accelerator, off on the
            CPU, where host and "device" share the cores (measured: it only adds contention there).
        keep_on_device: parameters stepped by a device Adam (:class:`~lightning_offload.device_adam.DeviceAdam`)
            instead of the host: clipped and checked like the rest, state on the device.
        row_sparse: embedding weights stepped row-sparsely on the host: only the rows with a nonzero gradient cross
            each way and are stepped (:class:`~lightning_offload.row_adam.HostRowAdam`).
        frozen: parameters of the user's groups not trained here (the strategy has turned their gradients off).
        tied_projected: projected weights also used outside their module (an input embedding tied to a projected
            head): their update is applied inside the step, and the outside use's gradient compressed, without a
            warning.
        data_parallel: the ranks this optimizer trains with (:mod:`lightning_offload.data_parallel`): gradients are
            reduced to each tensor's owner rank, which alone keeps its host state and steps it, and updates are
            broadcast from there. ``None``: one process.
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
        self._left_out = on_device | {id(p) for p in frozen}
        self._row_sparse = {id(p) for p in row_sparse}
        self.slots = self._build_slots(list(projected), rounding_seed, model)
        self.projected_layers = [slot.layer for slot in self.slots if slot.layer is not None]
        self._eager_slots = list(self.slots) if model is None else self._attach_hooks(model)
        tied = {id(p) for p in tied_projected}
        eager = {id(slot) for slot in self._eager_slots}
        self._eager_slots += [slot for slot in self.slots if id(slot.param) in tied and id(slot) not in eager]
        self.device_adam: DeviceAdam | None = None
        kept = [(p, group, _is_decoupled(optimizer, group)) for group in self.param_groups for p in group["params"]
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

    # ----------------------------------------------------------------------------------------------- set-up
    def _build_slots(
        self, projected: list[ProjectedWeight], rounding_seed: int, model: torch.nn.Module | None
    ) -> list[_Slot]:
        pin = self.device.type == "cuda"
        by_param = {id(layer.weight): layer for layer in projected}
        names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        order = {id(p): i for i, p in enumerate(model.parameters())} if model is not None else {}
        entries = [(param, group, by_param.pop(id(param), None)) for group in self.param_groups
                   for param in group["params"] if id(param) not in self._left_out]
        owners = self._owners(entries, order)
        slots: list[_Slot] = []
        for (param, group, layer), owner in zip(entries, owners):
            hparams = _synced_hparams(group)
            decoupled = _is_decoupled(self.wrapped, group)
            if owner != (self.ranks.rank if self.ranks is not None else 0):
                name = layer.name if layer is not None else names.get(id(param), f"param{len(slots)}")
                slots.append(self._remote_slot(name, param, group, layer, owner, rounding_seed * 100_003 + len(slots)))
                continue
            if layer is None and id(param) in self._row_sparse:
                slots.append(self._row_sparse_slot(names.get(id(param), f"param{len(slots)}"), param, group, pin))
                continue
            if layer is None:
                master = _pinned_zeros(param.shape, pin)
                master.copy_(param.detach())
                backup_master = torch.empty_like(master) if self.speculative else None
                adam = _host_adam(master, {**hparams, "decoupled_weight_decay": decoupled})
                grad = _pinned_zeros(param.shape, pin, self.link_dtype)
                name = names.get(id(param), f"param{len(slots)}")
                slots.append(_Slot(
                    name, param, group, master, grad, adam,
                    host_update=_pinned_zeros(param.shape, pin, param.dtype) if param.dtype != master.dtype
                    else None,
                    host_grad_fp32=torch.zeros(param.shape) if self.link_dtype != torch.float32 else None,
                    backup_master=backup_master, owner=owner,
                ))
                continue
            shape = layer.compressed_shape
            z = _pinned_zeros(shape, pin)
            # Weight decay of projected weights is applied to W on the device (decoupled) or added to S as
            # λ·A W Bᵀ (coupled L2), never to Z, whose value is only the step's update.
            adam = _host_adam(z, {**hparams, "weight_decay": 0.0})
            generator = torch.Generator(device=self.device).manual_seed(rounding_seed * 100_003 + len(slots))
            slots.append(
                _Slot(
                    layer.name, param, group, z, _pinned_zeros(shape, pin, self.link_dtype), adam, layer=layer,
                    host_update=_pinned_zeros(shape, pin, self.link_dtype) if self.link_dtype != z.dtype else None,
                    host_l2=_pinned_zeros(shape, pin) if group.get("weight_decay") and not decoupled else None,
                    host_grad_fp32=torch.zeros(shape) if self.link_dtype != torch.float32 else None,
                    generator=generator,
                    # Z holds the last update; a rolled-back step leaves it as it was (small: d_o × d_i).
                    backup_master=torch.empty_like(z) if self.speculative else None, owner=owner,
                )
            )
        if by_param:
            names = ", ".join(layer.name for layer in by_param.values())
            raise ValueError(
                f"Projected layers {names} have weights that the optimizer does not train; their compressed "
                f"gradients would never be stepped. Add their weights to the optimizer or do not project them."
            )
        if model is not None:
            # Host jobs run in slot order: registration order approximates forward order, so the update the next
            # forward needs first is computed first (param-group order would put every norm after every weight).
            slots.sort(key=lambda slot: order.get(id(slot.param), len(order)))
        for slot in slots:
            if slot.layer is not None:
                slot.layer.on_grad_ready = lambda layer, slot=slot: self._gradient_ready(slot)
                # A projected weight used outside its module's forward (``F.linear(h, layer.weight)`` elsewhere, a
                # tied use) gets a dense .grad from that use: it is compressed into S here rather than ignored.
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(
                    lambda param, slot=slot: self._dense_gradient_of_projected(slot)))
            else:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(
                    lambda param, slot=slot: self._gradient_ready(slot)))
        return slots

    def _owners(self, entries: list[tuple[Tensor, dict[str, Any], ProjectedWeight | None]],
                order: dict[int, int]) -> list[int]:
        """Owner rank of each entry: every rank's host steps about as many elements (contiguous in forward order)."""
        if self.ranks is None:
            return [0] * len(entries)
        forward = sorted(range(len(entries)), key=lambda i: order.get(id(entries[i][0]), len(order)))
        sizes = [math.prod(entries[i][2].compressed_shape) if entries[i][2] is not None else entries[i][0].numel()
                 for i in forward]
        owners = [0] * len(entries)
        for i, owner in zip(forward, contiguous_owners(sizes, self.ranks.world)):
            owners[i] = owner
        return owners

    def _remote_slot(self, name: str, param: Tensor, group: dict[str, Any], layer: ProjectedWeight | None,
                     owner: int, seed: int) -> _Slot:
        """The slot of a tensor another rank steps: no host buffers or Adam state here, only what applying its
        broadcast update needs (a projected weight's stochastic-rounding generator, seeded as on every rank)."""
        empty = torch.empty(0)
        generator = torch.Generator(device=self.device).manual_seed(seed) if layer is not None else None
        return _Slot(name, param, group, empty, empty, None, layer=layer, generator=generator, owner=owner,
                     owned=False)

    def _build_reductions(self, tied: set[int]) -> None:
        """Hand the ranks every gradient to reduce, in forward order. Gradients that are final only at the step
        (a device Adam's, a projected weight with a tied use elsewhere) come first, so their buckets are the last
        ones of backward and never hold back the launch of the others."""
        tensors: list[ReducedTensor] = []
        for param in self.device_adam.params if self.device_adam is not None else ():
            tensors.append(ReducedTensor(param, lambda param=param: param.grad, param.numel(), None))
        late = [slot for slot in self.slots if id(slot.param) in tied]
        for slot in late + [slot for slot in self.slots if id(slot.param) not in tied]:
            if slot.layer is not None:
                getter = (lambda layer=slot.layer: layer.grad_buffer if layer.has_grad else None)
                numel = math.prod(slot.layer.compressed_shape)
            else:
                getter, numel = (lambda param=slot.param: param.grad), slot.param.numel()
            tensors.append(ReducedTensor(slot, getter, numel, slot.owner))
        self._late_reduced = {id(slot) for slot in late}
        self.ranks.reduce_dtype = self.link_dtype
        self.ranks.on_reduced = self._reduced
        self.ranks.build(tensors)

    def _reduced(self, key: Any) -> None:
        """An owned tensor's gradient, reduced over the ranks, is in place: send it to the host."""
        if isinstance(key, _Slot):
            self._send_gradient(key)

    def _row_sparse_slot(self, name: str, param: Tensor, group: dict[str, Any], pin: bool) -> _Slot:
        """The slot of an embedding stepped row-sparsely: full-size host buffers (a step may touch every row), of
        which each step uses the first ``rows`` rows."""
        if param.ndim != 2:
            raise ValueError(f"embeddings='sparse' steps the rows of a matrix, but {name} has shape "
                             f"{tuple(param.shape)}. Use embeddings='host' for it.")
        if group.get("amsgrad"):
            raise ValueError(f"embeddings='sparse' does not support amsgrad=True (param group of {name}). Use "
                             f"embeddings='host' or amsgrad=False.")
        master = _pinned_zeros(param.shape, False)
        master.copy_(param.detach())
        return _Slot(
            name, param, group, master, _pinned_zeros(param.shape, pin, self.link_dtype), None,
            row_adam=HostRowAdam(master),
            host_rows=_pinned_zeros((param.shape[0],), pin, torch.int64),
            # A staging buffer for the new rows: pinned for an async copy to a GPU, or in a narrower parameter dtype.
            # On the CPU an fp32 embedding's rows are read straight from the row Adam's workspace.
            host_update=_pinned_zeros(param.shape, pin, param.dtype) if pin or param.dtype != torch.float32 else None,
            host_grad_fp32=torch.zeros(param.shape) if self.link_dtype != torch.float32 else None,
        )

    def _attach_hooks(self, model: torch.nn.Module) -> list[_Slot]:
        """Forward pre-hooks on every module holding an offloaded tensor; returns the slots no hook can serve."""
        by_param = {id(slot.param): slot for slot in self.slots}
        served: set[int] = set()
        for module in model.modules():
            if module is model:
                continue  # the root's forward need not run in training_step (Lightning calls training_step)
            slots = [by_param[id(p)] for p in module._parameters.values() if p is not None and id(p) in by_param]
            if slots:
                self._slots_by_module[id(module)] = slots
                self._hooks.append(module.register_forward_pre_hook(self._before_forward))
                served.update(id(slot) for slot in slots)
        return [slot for slot in self.slots if id(slot) not in served]

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

    # ------------------------------------------------------------------------------------------------ gradients
    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """Global 2-norm of the full gradient, on the device: exact for dense gradients, estimated for projected ones.

        A projected weight's full gradient ``G`` never exists; its norm is estimated as ``‖S‖ / ρ``, where ``ρ`` is
        the layer's ``‖S‖/‖G‖`` measured on the gradients its projectors were last fitted to
        (:attr:`~lightning_offload.lsp.linear.ProjectedWeight.norm_ratio`; 1 for random draws, which keep norms in
        expectation, and exactly right for signed permutations). So ``gradient_clip_val`` means what it means for
        plain AdamW: learned projectors at ``rank=0.25`` keep only ~1/3 of the norm in ``S``.
        """
        if self.ranks is not None:
            return self._data_parallel_grad_norm()
        grads, ratios = [], []
        for slot in self.slots:
            if slot.layer is not None:
                if slot.layer.has_grad:
                    grads.append(slot.layer.grad_buffer)
                    ratios.append(slot.layer.norm_ratio)
            elif slot.param.grad is not None:
                grads.append(slot.param.grad)
                ratios.append(1.0)
        for param in self.device_adam.params if self.device_adam is not None else ():
            if param.grad is not None:
                grads.append(param.grad)
                ratios.append(1.0)
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch.stack([n.float().to(self.device) for n in torch._foreach_norm(grads)])
        if any(ratio != 1.0 for ratio in ratios):
            norms = norms / torch.tensor(ratios, device=self.device)
        return torch.linalg.vector_norm(norms)

    def _data_parallel_grad_norm(self) -> Tensor:
        """The global norm over the reduced gradients: each rank's share over the tensors it owns (a device Adam's,
        which every rank holds, counted on rank 0), summed in one all-reduce that also carries, per tensor, how many
        ranks had a gradient for it."""
        self.ranks.finish()
        grads, ratios, present = [], [], []
        for slot in self.slots:
            local = slot.layer.has_grad if slot.layer is not None else slot.param.grad is not None
            present.append(1.0 if local else 0.0)
            if slot.owned and local:
                grads.append(slot.layer.grad_buffer if slot.layer is not None else slot.param.grad)
                ratios.append(slot.layer.norm_ratio if slot.layer is not None else 1.0)
        if self.ranks.rank == 0:
            device_grads = [p.grad for p in (self.device_adam.params if self.device_adam is not None else ())
                            if p.grad is not None]
            grads, ratios = grads + device_grads, ratios + [1.0] * len(device_grads)
        total = torch.zeros(1, device=self.device)
        if grads:
            # One foreach kernel for every owned tensor's norm, as the single-process norm does.
            norms = torch.stack([n.float().to(self.device) for n in torch._foreach_norm(grads)])
            total = (norms / torch.tensor(ratios, device=self.device)).square().sum().reshape(1)
        vector = torch.cat([total, torch.tensor(present, device=self.device)])
        self.ranks.all_reduce_(vector)
        counts = vector[1:].tolist()
        partial = [slot.name for slot, count in zip(self.slots, counts) if 0 < count < self.ranks.world]
        if partial:
            raise RuntimeError(
                f"{partial[0]} (and {len(partial) - 1} more) got a gradient on some ranks but not on others. Every "
                f"rank must use the same parameters in its forward (as with DDP without find_unused_parameters), "
                f"so that the reduced gradient is a mean over all ranks."
            )
        self._present = {id(slot): count > 0 for slot, count in zip(self.slots, counts)}
        return vector[0].sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip all gradients to global norm ``max_norm`` (see :meth:`grad_norm`); returns the norm before clipping.

        Same rule as ``torch.nn.utils.clip_grad_norm_``, ``coef = min(1, max_norm / (norm + 1e-6))``; the
        coefficient is applied on the host to the gradients as they arrive (bit-identical to scaling them on the
        device, and it does not have to wait for copies already under way).
        """
        total = self.grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clip = ("norm", coef)
        self._last_norm = total
        return total

    def set_clip_coefficient(self, coef: float | Tensor, norm: Tensor) -> None:
        """Scale this step's gradients by ``coef`` on the host, and take ``norm`` as their global norm.

        For strategies whose global norm also covers gradients this optimizer does not hold (MEFT's host rows):
        they compute the norm and coefficient, and this optimizer applies the coefficient and checks the norm.
        """
        self._clip = ("norm", torch.as_tensor(coef, dtype=torch.float32))
        self._last_norm = torch.as_tensor(norm)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element (compressed and dense) to ``[-clip_value, clip_value]`` (on the host)."""
        self._clip = ("value", float(clip_value))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense gradients (via the user's optimizer) and the ``S`` accumulators."""
        self.wrapped.zero_grad(set_to_none=set_to_none)
        for layer in self.projected_layers:
            layer.zero_grad()

    def _dense_gradient_of_projected(self, slot: _Slot) -> None:
        layer = slot.layer
        if layer.sampling or slot.param.grad is None:
            return  # a projector fit is sampling full gradients: they are its to consume
        if self.ranks is not None and id(slot) not in self._late_reduced and self._collecting:
            raise ValueError(
                f"The projected weight {slot.name}.weight is used outside its module's forward, which data "
                f"parallelism cannot reduce: its compressed gradient may already be on its way to another rank. Call "
                f"the module instead of using its weight directly, or exclude it with exclude_modules=[...]."
            )
        if all(eager is not slot for eager in self._eager_slots):
            # Its pending update cannot wait for the module's next forward (a forward pre-hook): the outside use may
            # come first and would read the old weight. It is applied inside the step instead.
            self._eager_slots.append(slot)
            warnings.warn(
                f"The projected weight {slot.name}.weight is used outside its module's forward, so autograd gives it "
                f"a full gradient there. It is compressed into the layer's S (exact: projection is linear), which "
                f"costs one full-size gradient on the device per such backward, and its update is applied inside "
                f"each step rather than overlapped with the next forward. Call the module instead of using its "
                f"weight directly, or exclude it with exclude_modules=[...], to avoid this.",
                stacklevel=2,
            )
        grad, slot.param.grad = slot.param.grad, None
        layer.accumulate_dense(grad)

    def _gradient_ready(self, slot: _Slot) -> None:
        # Called from autograd during backward: on the last micro-batch, start this gradient's trip at once (with
        # data parallelism, first its reduction to the owner rank, which sends it on once that completes).
        if not self._collecting:
            return
        if self.ranks is None:
            self._send_gradient(slot)
        elif id(slot) not in self._late_reduced:
            self.ranks.ready(slot)

    def _send_gradient(self, slot: _Slot) -> None:
        start = time.perf_counter()
        if slot.row_adam is not None:
            self._send_rows(slot)
            self._timeline.add("link_to_host", slot.name, start, time.perf_counter())
            return
        grad = slot.layer.grad_buffer if slot.layer is not None else slot.param.grad
        if grad.dtype != self.link_dtype:
            grad = grad.to(self.link_dtype)  # narrow on the device: half the bytes cross the link
        # No reference is kept: the link marks the source as in use by its copy stream, so its memory is not reused
        # before the copy has read it, and S is freed as soon as the layer releases it (zero_grad, in step).
        slot.to_host_event = self.link.to_host(grad, slot.host_grad)
        slot.sent_round = self._round
        slot.sent_version = slot.layer.grad_version if slot.layer is not None else 0
        self._timeline.add("link_to_host", slot.name, start, time.perf_counter())
        if self._collecting and self.speculative:
            self._speculate(slot)

    def _send_rows(self, slot: _Slot) -> None:
        """Send the rows of a row-sparse embedding's gradient that are nonzero (the rows of the batch's tokens)."""
        grad = slot.param.grad
        # Which rows: the one host↔device synchronisation of this path (their count sizes the copies). An embedding
        # is the first layer, so its gradient comes last in backward and the wait costs little device time.
        rows = torch.nonzero(grad.ne(0).any(dim=1)).squeeze(1)
        count = rows.numel()
        values = grad.index_select(0, rows)
        if values.dtype != self.link_dtype:
            values = values.to(self.link_dtype)
        # Same copy stream, in order: the event of the second copy covers both.
        self.link.to_host(rows, slot.host_rows[:count])
        slot.to_host_event = self.link.to_host(values, slot.host_grad[:count])
        slot.row_count, slot.rows_on_device = count, rows
        slot.sent_round, slot.sent_version = self._round, 0

    def _speculate(self, slot: _Slot) -> None:
        """During backward: start this tensor's host step now, on the assumptions of :attr:`speculative`."""
        if slot.spec_round == self._round:
            slot.spec_valid = False  # sent again (its gradient changed): the step redoes it with the final gradient
            return
        if slot.pending or self._norm_clip_fired or slot.row_adam is not None:
            # Its previous update is not applied yet, or clipping will likely fire: the ordinary path. A row-sparse
            # embedding's gradient comes last in backward: nothing would be gained by speculating on it.
            return
        if self._spec_step is None:
            self._spec_step = StepTelemetry()
        slot.spec_settings = self._job_settings(slot)
        self._prepare_l2(slot, self._spec_step)
        slot.spec_round, slot.spec_valid, slot.spec_clip = self._round, True, self._spec_clip
        slot.timeline = self._timeline
        slot.job = self.worker.submit(
            partial(self._host_job, slot, slot.spec_clip, None, self._spec_step, slot.spec_settings, True), slot.name)

    def _is_sent(self, slot: _Slot) -> bool:
        """Whether this step's final gradient is already on its way (sent during backward, not changed since)."""
        if slot.sent_round != self._round:
            return False
        return slot.layer is None or slot.sent_version == slot.layer.grad_version

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

    def _expect_update(self, slot: _Slot) -> None:
        """Main thread, at the step: a tensor another rank steps will have its update broadcast when applied; what
        applying it needs is captured now, as the owner does (a scheduler may change lr before then)."""
        if slot.layer is not None:
            slot.decay = self._decay_factor(slot)
            slot.layer.zero_grad()
        slot.timeline = self._timeline
        slot.pending = True

    def _decay_factor(self, slot: _Slot) -> float:
        """A projected weight's decoupled decay ``1 − lr·λ`` for the step being launched (1 for coupled L2)."""
        if not _is_decoupled(self.wrapped, slot.group):
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
        if slot.layer is None or slot.host_l2 is None or _is_decoupled(self.wrapped, slot.group):
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
            weight_decay=l2_weight, decoupled=_is_decoupled(self.wrapped, slot.group),
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

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        for slot in self._slots_by_module.get(id(module), ()):
            if slot.pending:
                self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        """Main thread: wait for a tensor's update and apply it on the device."""
        if not slot.pending:
            return
        start = time.perf_counter()
        if not slot.owned:
            self._receive(slot, start)
            return
        self.worker.wait(slot.job)
        if slot.row_adam is not None:
            values = slot.row_values  # the device is the host: read where the host wrote them
            if slot.update_on_device is not None:
                self.link.device_wait(slot.to_device_event)
                values = slot.update_on_device
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            slot.param.data.index_copy_(0, slot.rows_on_device, values)
            slot.update_on_device, slot.rows_on_device, slot.row_values = None, None, None
        elif slot.layer is not None:
            update = self._fetch_update(slot)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            if self.ranks is not None:
                self.ranks.broadcast_(update, src=slot.owner)  # the other ranks apply the same U
            slot.layer.apply_update(update, slot.decay, slot.generator)
            if slot.ring_index is not None:
                # Queued, not run: the event tells the next copy into this buffer when the apply has read it.
                self.update_ring.release(slot.ring_index, self.link.compute_event())
            slot.update_on_device, slot.ring_index = None, None
            self._prefetch_after(slot)
        else:
            self.link.device_wait(slot.to_device_event)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            if self.ranks is not None:
                self.ranks.broadcast_(slot.param.data, src=slot.owner)  # ordered after the copy by the wait above
        slot.pending = False
        slot.job = None

    def _receive(self, slot: _Slot, start: float) -> None:
        """Main thread: take a tensor's update from the rank that stepped it, and apply it as that rank does."""
        if slot.layer is not None:
            index = self.update_ring.claim() if self.update_ring is not None else None
            if index is None:
                update = torch.empty(slot.layer.compressed_shape, dtype=self.link_dtype, device=self.device)
            else:
                # The broadcast writes it in compute-stream order, after the apply that last read it: no wait.
                update = self.update_ring.view(index, slot.layer.compressed_shape)
            self.ranks.broadcast_(update, src=slot.owner)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
            slot.layer.apply_update(update, slot.decay, slot.generator)
            if index is not None:
                self.update_ring.release(index, self.link.compute_event())
        else:
            self.ranks.broadcast_(slot.param.data, src=slot.owner)
            slot.timeline.add("device_wait", slot.name, start, time.perf_counter())
        slot.pending = False

    def _update_source(self, slot: _Slot) -> Tensor:
        """The host tensor a projected update crosses from: ``Z`` in the link dtype."""
        return slot.host_update if slot.host_update is not None else slot.host_param

    def _fetch_update(self, slot: _Slot) -> Tensor:
        """The device tensor holding ``slot``'s finished update, ordered before the compute that reads it."""
        if self.update_ring is None:
            return self._update_source(slot)  # the device is the host: read where the host step wrote it
        if slot.update_on_device is None:
            self._start_fetch(slot)  # not prefetched
        self.link.device_wait(slot.to_device_event)  # the compute stream waits; the host does not
        return slot.update_on_device

    def _start_fetch(self, slot: _Slot) -> None:
        """Issue the host→device copy of a finished update into a ring buffer (a one-off buffer if none is free)."""
        start = time.perf_counter()
        shape = slot.layer.compressed_shape
        index = self.update_ring.claim()
        if index is None:
            self.update_ring.fallbacks += 1
            destination, after = torch.empty(shape, dtype=self.link_dtype, device=self.device), None
        else:
            destination, after = self.update_ring.view(index, shape), self.update_ring.last_read[index]
        slot.to_device_event = self.link.to_device(self._update_source(slot), destination, after=after)
        slot.update_on_device, slot.ring_index = destination, index
        slot.timeline.add("link_to_device", slot.name, start, time.perf_counter())

    def _prefetch_after(self, slot: _Slot) -> None:
        """Start the copies of the next finished updates in forward order, as far as the ring has free buffers, so
        the next layers' updates are on the device before their forwards ask for them."""
        ring = self.update_ring
        if ring is None:
            return
        position = self._projected_position[id(slot)]
        for later in self._projected_slots[position + 1: position + 1 + len(ring.buffers)]:
            if not ring.free:
                return
            if later.pending and later.update_on_device is None and later.job is not None and later.job.done.is_set():
                self.worker.check()
                self._start_fetch(later)
                ring.prefetched += 1

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

    def _skip_step(self, norm: Tensor) -> None:
        self._clip, self._last_norm = None, None
        self._roll_back_speculation()  # the host state must be as if this step never began
        if self.ranks is not None:
            self.ranks.reset()
        if self.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                f"Non-finite gradient (global norm {float(norm)}) at optimizer step {self.telemetry.steps}. The host "
                f"state was not touched. Pass on_nonfinite='skip' to the strategy to skip such steps instead."
            )
        for slot in self.slots:
            self.link.host_wait(slot.to_host_event)  # copies already under way must land before S is cleared
            slot.to_host_event = None
        for layer in self.projected_layers:
            layer.zero_grad()
        self._timeline = StepTimeline()
        self._round += 1
        self.telemetry.skipped_steps += 1
        self.telemetry.last = StepTelemetry(skipped=1.0)
        self.telemetry.last_timeline = None  # a skipped step has no timeline of its own
        self.telemetry.complete_step()
        # Never silent: a run whose steps are all skipped would otherwise look like one that merely stopped learning.
        warnings.warn(
            f"Skipped an optimizer step: a gradient is non-finite (global norm {float(norm)}); weights and host "
            f"state are untouched. {self.telemetry.skipped_steps} step(s) skipped so far, {self.telemetry.steps} "
            f"taken (logged as offload/skipped_steps). Lower the learning rate, clip gradients (gradient_clip_val), "
            f"or pass on_nonfinite='raise' to stop at the first one.",
            NonFiniteStepWarning,
            stacklevel=2,
        )
        self._step_start = time.perf_counter()

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
        :attr:`~lightning_offload.telemetry.OffloadTelemetry.device_persistent_bytes`). Counted from the tensors'
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
        if state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(
                "This optimizer state was not written by this version of lightning_offload's OffloadOptimizer; "
                "resume with the version and strategy that wrote the checkpoint."
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


def _thread_minor_faults() -> int:
    """Minor page faults of the calling thread so far (Linux's per-thread count; 0 where there is none)."""
    if _RUSAGE_THREAD is None:
        return 0
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def _host_adam(tensor: Tensor, hparams: dict[str, Any]) -> torch.optim.Adam:
    # One fused Adam per tensor, so each tensor steps on its own as soon as its gradient arrives; the CPU fused
    # kernel is ~2.6x faster than foreach here (DESIGN.md §8).
    return torch.optim.Adam([{"params": [tensor], **hparams}], fused=True)
