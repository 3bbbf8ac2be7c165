"""The host state of each offloaded tensor: a projected weight's compressed variable or a dense parameter's fp32
master, with its host Adam, staging buffers and owner rank (:class:`_Slot`), built for :class:`OffloadOptimizer`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.data_parallel import contiguous_owners
from lightning_offload.engine.pipeline import Job, StepTimeline
from lightning_offload.engine.row_adam import HostRowAdam
from lightning_offload.lsp.linear import ProjectedWeight


# Hyper-parameters copied from each user group into the host optimizers' groups before every step.
_SYNCED_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


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


def is_decoupled(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay is AdamW's decoupled decay (else Adam's L2 on the gradient)."""
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _pinned_zeros(shape: Sequence[int], pin: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    # Pinned host memory lets device↔host copies run by DMA (and asynchronously); pinned pages are only worth it
    # when there is a CUDA device on the other end of the link. Preallocated once: a fresh host allocation costs
    # several times a copy into an existing buffer.
    return torch.zeros(tuple(shape), dtype=dtype, pin_memory=pin)


def _host_adam(tensor: Tensor, hparams: dict[str, Any]) -> torch.optim.Adam:
    # One fused Adam per tensor, so each tensor steps on its own as soon as its gradient arrives; the CPU fused
    # kernel is ~2.6x faster than foreach here (docs/design.md, "Host Adam in the compressed space").
    return torch.optim.Adam([{"params": [tensor], **hparams}], fused=True)


class SlotBuilding:
    """Builds the slots of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer` (one per offloaded tensor).

    A part of :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`, which holds the state these methods
    use (set in its ``__init__``).
    """

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
            decoupled = is_decoupled(self.wrapped, group)
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
