"""The three products of a projected layer written as dense torch, the definition every kernel is held to.

A projector ``P`` (``d × n``) is its ``indices`` and ``values`` (``n × r``: column ``j`` of ``P`` has the weight
``values[j, s]`` at row ``indices[j, s]``) and ``dim_out = d``. These functions form ``P`` densely: for tests and the
kernels' checks at load, never on the training path.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dense_projector(indices: Tensor, values: Tensor, dim_out: int) -> Tensor:
    """``P`` as a dense ``dim_out × n`` fp32 matrix."""
    n = indices.shape[0]
    dense = torch.zeros(dim_out, n, dtype=torch.float32, device=values.device)
    columns = torch.arange(n, device=values.device).unsqueeze(1).expand_as(indices)
    dense[indices.long(), columns] = values.float()
    return dense


def compress_tokens(indices: Tensor, values: Tensor, dim_out: int, x: Tensor) -> Tensor:
    """``P · xᵀ`` (``dim_out × T``) for token-major ``x`` (``T × n``): ``B Xᵀ`` in forward, ``A Δᵀ`` in backward."""
    return dense_projector(indices, values, dim_out) @ x.float().t()


def expand_columns(indices: Tensor, values: Tensor, dim_out: int, matrix: Tensor) -> Tensor:
    """``M · P`` (``k × n``) for ``M`` of ``k × dim_out``: the small side of an update, ``U B``."""
    return matrix.float() @ dense_projector(indices, values, dim_out)


def updated_rows(weight: Tensor, indices: Tensor, values: Tensor, half: Tensor, decay: float) -> Tensor:
    """``W·decay + Pᵀ·H`` in fp32 (``P`` of ``dim_out × rows``, ``H`` of ``dim_out × cols``), before any rounding
    into the weight's dtype."""
    delta = dense_projector(indices, values, half.shape[0]).t() @ half.float()
    return weight.float() * decay + delta
