"""Which kind of slot each tensor of the user's param groups gets, and which rank owns it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.ranks import contiguous_owners
from lightning_offload.engine.rules.host_rule import refuse_rule_without_scales, scaled_across_ranks_error
from lightning_offload.engine.slots.dense_slot import DenseSlot
from lightning_offload.engine.slots.projected_slot import ProjectedSlot
from lightning_offload.engine.slots.remote_slot import RemoteSlot
from lightning_offload.engine.slots.row_slot import RowSlot
from lightning_offload.engine.slots.scaled_slot import ScaledSlot
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.lsp.channel_scales import ScaledWeight
from lightning_offload.lsp.linear import ProjectedWeight


def group_positions(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """Each parameter's place in the user's groups (as torch's optimizer numbers them), by identity: what rounding
    seeds and the order of the global norm's terms follow, wherever a tensor is stepped."""
    return {id(param): i for i, param in enumerate(param for group in param_groups for param in group["params"])}


def build_slots(
    param_groups: list[dict[str, Any]], projected: Sequence[ProjectedWeight | ScaledWeight], lanes: Lanes,
    model: torch.nn.Module | None, left_out: set[int], row_sparse: set[int], rounding_seed: int,
    decoupled: Callable[[dict[str, Any]], bool],
) -> list[Slot]:
    """One slot per trained tensor of ``param_groups``, in forward order when ``model`` is given.

    Args:
        projected: the projected weights (a :class:`ScaledWeight` takes the scaled rule).
        left_out: ids of parameters that get no slot (frozen, or stepped on the device).
        row_sparse: ids of embeddings stepped row by row.
        rounding_seed: seeds each projected weight's stochastic-rounding generator (alike on every rank).
        decoupled: whether a group's weight decay is AdamW's.

    Raises:
        ValueError: for a projected layer whose weight the optimizer does not train; for a scaled weight's group with
            Adam's coupled L2; for a scaled weight under data parallelism.
    """
    scaled = any(isinstance(layer, ScaledWeight) for layer in projected)
    if lanes.ranks is not None and scaled:
        raise scaled_across_ranks_error()
    if scaled:
        refuse_rule_without_scales(lanes.rule)
    if row_sparse:
        lanes.rule.refuse_rows("embeddings='sparse'", "embeddings='host'")
    by_param = {id(layer.weight): layer for layer in projected}
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    order = {id(p): i for i, p in enumerate(model.parameters())} if model is not None else {}
    # Each parameter's place in the user's groups, whatever is left out of the slots (stepped on the device, frozen).
    positions = group_positions(param_groups)
    entries = [(param, group, by_param.pop(id(param), None)) for group in param_groups
               for param in group["params"] if id(param) not in left_out]
    here = lanes.ranks.rank if lanes.ranks is not None else 0
    slots: list[Slot] = []
    for (param, group, layer), owner in zip(entries, _owners(entries, order, lanes)):
        name = layer.name if layer is not None else names.get(id(param), f"param{len(slots)}")
        # Seeded by its place in the user's groups, so every rank, and every placement of the other parameters, draws
        # the same roundings for the same tensor.
        generator = torch.Generator(device=lanes.device).manual_seed(rounding_seed * 100_003 + positions[id(param)]) \
            if layer is not None else None
        if owner != here:
            slots.append(RemoteSlot(name, param, group, lanes, decoupled(group), layer, generator, owner))
        elif isinstance(layer, ScaledWeight):
            slots.append(ScaledSlot(name, param, group, lanes, decoupled(group), layer, generator))
        elif layer is not None:
            slots.append(ProjectedSlot(name, param, group, lanes, decoupled(group), layer, generator, owner))
        elif id(param) in row_sparse:
            slots.append(RowSlot(name, param, group, lanes, decoupled(group)))
        else:
            slots.append(DenseSlot(name, param, group, lanes, decoupled(group), owner))
    if by_param:
        unused = ", ".join(layer.name for layer in by_param.values())
        raise ValueError(
            f"Projected layers {unused} have weights that the optimizer does not train; their compressed "
            f"gradients would never be stepped. Add their weights to the optimizer or do not project them."
        )
    if model is not None:
        # Host jobs run in slot order: registration order approximates forward order, so the update the next
        # forward needs first is computed first (param-group order would put every norm after every weight).
        slots.sort(key=lambda slot: order.get(id(slot.param), len(order)))
    return slots


def _owners(entries: list[tuple[Tensor, dict[str, Any], ProjectedWeight | None]], order: dict[int, int],
            lanes: Lanes) -> list[int]:
    """Owner rank of each entry: every rank's host steps about as many elements (contiguous in forward order)."""
    if lanes.ranks is None:
        return [0] * len(entries)
    forward = sorted(range(len(entries)), key=lambda i: order.get(id(entries[i][0]), len(order)))
    sizes = [math.prod(entries[i][2].compressed_shape) if entries[i][2] is not None else entries[i][0].numel()
             for i in forward]
    owners = [0] * len(entries)
    for i, owner in zip(forward, contiguous_owners(sizes, lanes.ranks.world)):
        owners[i] = owner
    return owners
