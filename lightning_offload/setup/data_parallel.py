"""What every data-parallel face does at set-up, Trainer's DDP and Fabric's alike: the gradient bucket size, and rank 0's
weights and fitted projectors made every rank's (through torch.distributed or the strategy's own broadcast)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_offload.lsp.projector import SparseProjector


def bucket_bytes(bucket_mb: float) -> int:
    """``bucket_mb`` MiB as bytes (at least one).

    Raises:
        ValueError: for a value that is not a positive number.
    """
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be a positive number of MiB per gradient bucket, got {bucket_mb!r}.")
    return max(1, int(bucket_mb * 2**20))


@torch.no_grad()
def broadcast_weights(module: torch.nn.Module) -> None:
    """Every rank's parameters and buffers made rank 0's (what DistributedDataParallel's wrapper does at set-up)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def broadcast_projectors(broadcast: Callable[[Any, int], Any], proj_out: SparseProjector, proj_in: SparseProjector,
                         norm_ratio: float, second_moment_scale: float
                         ) -> tuple[SparseProjector, SparseProjector, float, float]:
    """Rank 0's fitted projectors and figures on every rank, through ``broadcast(obj, src)`` (a strategy's)."""
    device = proj_out.indices.device
    # Through the CPU: a pickled device tensor would be restored on rank 0's device number on every rank.
    payload = (proj_out.to("cpu"), proj_in.to("cpu"), float(norm_ratio), float(second_moment_scale))
    out, inp, ratio, scale = broadcast(payload, 0)
    return out.to(device), inp.to(device), ratio, scale
