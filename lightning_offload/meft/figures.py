"""The ``meft/*`` figures of a step, and the adapters' host-row sizes ``meft_offload`` reports."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_offload.engine.rows.host_row_blocks import RowBlocksStepping
from lightning_offload.meft.adapter import MEFTAdapter


def row_figures(adapters: Sequence[MEFTAdapter], slots: Sequence[RowBlocksStepping], host_seconds: float,
                skipped_steps: int, device: torch.device) -> dict[str, float]:
    """The rows' figures of the step just taken (and the traffic counters read, so the next step counts its own).

    Args:
        adapters: the model's adapters, in the order of ``slots``.
        slots: their row slots (their latest step's rows updated and stepped).
        host_seconds: host work on rows since the last step (gradient sums and row updates).
        skipped_steps: steps skipped so far for non-finite gradients (one decision for routers and rows).
        device: the training device (the adapters' bytes on it are counted).
    """
    rows_moved = bytes_to_device = bytes_to_host = routing_bytes = 0
    for adapter, slot in zip(adapters, slots):
        traffic = adapter.host.traffic
        rows_moved += traffic.rows
        bytes_to_device += traffic.bytes_to_device
        bytes_to_host += traffic.bytes_to_host
        traffic.rows = traffic.bytes_to_device = traffic.bytes_to_host = 0
        if adapter.routing_keys is not None:
            routing_bytes += slot.rows_stepped * adapter.hidden_size * adapter.routing_keys.element_size()
    return {
        "meft/rows_moved": float(rows_moved),
        "meft/rows_updated": float(sum(slot.rows_updated for slot in slots)),
        # Whole blocks are stepped: the touched rows plus their blocks' idle rows (zero gradient).
        "meft/rows_stepped": float(sum(slot.rows_stepped for slot in slots)),
        "meft/bytes_host_to_device": float(bytes_to_device),
        "meft/bytes_device_to_host": float(bytes_to_host),
        # The stepped keys' new bf16 routing copy, sent to the device after the update (device routing only).
        "meft/bytes_routing_keys_to_device": float(routing_bytes),
        # Host work finished since the last step: this step's gradient sums and the previous step's updates
        # (this step's own updates are still running when pipelined).
        "meft/host_optimizer_seconds": host_seconds,
        "meft/adapter_device_bytes": float(adapter_device_bytes(adapters, device)),
        "meft/skipped_steps": float(skipped_steps),
        **expert_usage(adapters),
    }


def adapter_device_bytes(adapters: Sequence[MEFTAdapter], device: torch.device) -> int:
    """Bytes the adapters hold on the device: routers and bf16 routing keys (host rows excluded)."""
    return sum(t.numel() * t.element_size() for adapter in adapters
               for t in [*adapter.parameters(), *adapter.buffers()] if t.device.type == device.type)


def host_rows_bytes(adapters: Sequence[MEFTAdapter]) -> int:
    """Bytes of the adapters' host rows: keys, values, their gradient accumulators and Adam moments."""
    # Two matrices (keys, values), each with a gradient accumulator and two Adam moments: 8 N×h fp32 arrays.
    return sum(8 * a.host.keys.numel() * a.host.keys.element_size() for a in adapters)


def host_trainable_parameters(adapters: Sequence[MEFTAdapter]) -> int:
    """Adapter keys and values: trained, but held on the host rather than as device parameters."""
    return sum(a.host.keys.numel() + a.host.values.numel() for a in adapters)


def expert_usage(adapters: Sequence[MEFTAdapter]) -> dict[str, float]:
    """Expert-usage statistics since the start of fit: normalised entropy (1 = uniform) and share unused, averaged
    over the adapters that routed any token (computed for them all at once: a step's figures cost a few ops)."""
    counts = [adapter.host.expert_counts for adapter in adapters]
    if not counts or len({c.numel() for c in counts}) != 1:
        return _expert_usage_each(counts)
    counts_ = torch.stack(counts).double()  # [adapters, experts]
    totals = counts_.sum(dim=1, keepdim=True)
    used = totals.squeeze(1) > 0
    if not bool(used.any()):
        return {}
    p = counts_[used] / totals[used]
    terms = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    entropy = -terms.sum(dim=1) / math.log(counts_.shape[1])
    unused = (counts_[used] == 0).double().mean(dim=1)
    return {"meft/expert_usage_entropy": float(entropy.mean()), "meft/experts_unused_share": float(unused.mean())}


def _expert_usage_each(counts: Sequence[torch.Tensor]) -> dict[str, float]:
    """:func:`expert_usage` for adapters with different numbers of experts, one at a time."""
    entropies, unused = [], []
    for adapter_counts in counts:
        c = adapter_counts.double()
        total = c.sum()
        if total == 0:
            continue
        p = c[c > 0] / total
        entropies.append(float(-(p * p.log()).sum() / math.log(c.numel())))
        unused.append(float((c == 0).double().mean()))
    if not entropies:
        return {}
    return {"meft/expert_usage_entropy": sum(entropies) / len(entropies),
            "meft/experts_unused_share": sum(unused) / len(unused)}
