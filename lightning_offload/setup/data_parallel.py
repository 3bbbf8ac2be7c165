"""What every data-parallel face does, Trainer's DDP and Fabric's alike: the gradient bucket size, rank 0's weights made
every rank's at set-up, and how the ranks agree on a projector fit (:class:`RankAgreement`, over the strategy's own
collectives)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

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


class RankAgreement:
    """How data-parallel ranks agree on a projector fit (a
    :class:`~lightning_offload.engine.fitting.projector_fitting.FitAgreement`), through a strategy's collectives: every
    rank fits to the mean of the ranks' sampled gradients, and installs rank 0's decisions and projectors.

    Args:
        mean: the mean of a tensor over the ranks (the strategy's reduce or all-reduce).
        broadcast: ``broadcast(obj, src)``, rank ``src``'s object on every rank (the strategy's).
    """

    def __init__(self, mean: Callable[[Tensor], Tensor], broadcast: Callable[[Any, int], Any]) -> None:
        self._mean = mean
        self._broadcast = broadcast

    def reduce_sampled_gradient(self, grad: Tensor) -> Tensor:
        """Every rank fits to the mean of the ranks' samples, as to one larger batch."""
        return self._mean(grad)

    def agree(self, value: Any) -> Any:
        """Rank 0's value of a decision, on every rank."""
        return self._broadcast(value, 0)

    def agree_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float,
                         second_moment_scale: float) -> tuple[SparseProjector, SparseProjector, float, float]:
        """Rank 0's fitted projectors, on every rank."""
        return broadcast_projectors(self._broadcast, proj_out, proj_in, norm_ratio, second_moment_scale)
