"""Carrying an optimizer's moments (Adam's, Lion's) from an old projected subspace into a new one after a refit.

The host variable ``Z`` parameterises the weight change ``Aᵀ Z B``. When ``A, B`` are replaced by ``A', B'``, the
coordinates ``Z'`` that best express the same weight-space matrix (least squares in the Frobenius norm) are

    Z' = M_A Z M_Bᵀ,   M_A = (A' A'ᵀ)⁺ A' Aᵀ,   M_B = (B' B'ᵀ)⁺ B' Bᵀ

so ``A'ᵀ Z' B'`` is the orthogonal projection of ``Aᵀ Z B`` onto the new subspace, and an unchanged projector maps
to the identity. The first moment is mapped this way; the second moment, a per-coordinate variance, by the
element-squared maps ``v' = (M_A∘M_A) v (M_B∘M_B)ᵀ``, which keeps it non-negative. When projectors have
orthonormal rows (``A Aᵀ = I``) these are the ``M_A = A' Aᵀ`` formulas of docs/design.md, "Refits and the Adam
state rotation".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_offload.lsp.fit import cross_gram
from lightning_offload.lsp.projector import SparseProjector


def coordinate_map(old: SparseProjector, new: SparseProjector) -> Tensor:
    """``M = (N Nᵀ)⁺ N Oᵀ`` (``d_new × d_old``) on the host, in fp32: new coordinates of old ones.

    Only ``d × d`` matrices are formed (from ``O(n·r²)`` products); the pseudo-inverse is taken in fp64 because
    ``N Nᵀ`` of a sparse projector can be poorly conditioned.
    """
    if old.dim_in != new.dim_in:
        raise ValueError(f"Cannot map between projectors of dims {old.dim_in} and {new.dim_in}.")
    gram_new = cross_gram(new, new).to("cpu", torch.float64)
    overlap = cross_gram(new, old).to("cpu", torch.float64)
    return (torch.linalg.pinv(gram_new, hermitian=True) @ overlap).float()


@torch.no_grad()
def rotate_moments(state: dict[str, Any], map_out: Tensor, map_in: Tensor, first: Sequence[str], second: Sequence[str],
                   second_moment_scale: float = 1.0) -> None:
    """Map one compressed tensor's optimizer state in place into new coordinates (host tensors stay on the host).

    What is said below of Adam's ``m`` holds for every entry of ``first`` (moments linear in the gradient: Adam's
    ``exp_avg``, Lion's), and of ``v`` for every entry of ``second`` (moments of squared gradients: Adam's
    ``exp_avg_sq`` and AMSGrad's ``max_exp_avg_sq``); other entries (step counts) are kept.

    The step counter is kept, so Adam's bias correction treats the moments as warm. That holds for the second moment
    only if it keeps its size: between two unrelated subspaces (redrawn indices) the element-squared maps keep little
    of ``v``'s mass, and with the bias correction no longer compensating, the update would run too large until ``v``
    refills (``1/(1 − β₂)`` steps; docs/benchmarks/2026-11-30.md). So ``v`` (and AMSGrad's maximum) is rescaled to its
    total before the map, times ``second_moment_scale``: ``(‖S_new‖/‖S_old‖)²`` when the caller measured how much more
    of the gradient the new projectors keep (a fresh fit keeps more than stale ones). ``m`` is mapped as it is: the
    part of the old direction the new subspace cannot express is lost, and ``m`` refills within ``1/(1 − β₁)`` steps.

    Args:
        state: the optimizer's per-parameter state (``torch.optim.Adam``'s: ``exp_avg``, ``exp_avg_sq``, optional
            ``max_exp_avg_sq``).
        map_out: ``M_A`` (``d_o' × d_o``).
        map_in: ``M_B`` (``d_i' × d_i``).
        first: the keys of moments linear in the gradient (mapped as they are).
        second: the keys of moments of squared gradients (mapped element-squared, their total kept).
        second_moment_scale: factor on ``v``'s total after the map (1: keep it).
    """
    for key in first:
        if key in state:
            state[key].copy_(map_out @ state[key] @ map_in.t())
    squared_out, squared_in = map_out.square(), map_in.square()
    for key in second:
        if key in state:
            old_mass = state[key].double().sum()
            state[key].copy_(squared_out @ state[key] @ squared_in.t())
            new_mass = state[key].double().sum()
            if new_mass > 0:
                state[key].mul_(float(old_mass / new_mass) * second_moment_scale)
