"""The size of a projected layer's update expanded back to the weight: the factor that gives ``Aᵀ U B`` a dense
update's scale (Adam), or the per-element RMS of the host's update (a rule of one step size per element, Lion)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_offload.lsp.projector import SparseProjector


def update_scale(proj_out: SparseProjector, proj_in: SparseProjector) -> float:
    """The factor ``c`` that gives the expanded update ``c·Aᵀ U B`` the scale of a dense Adam update.

    Adam's update ``U`` has roughly the same magnitude in every coordinate, and so does a dense AdamW update of
    ``W``. For ``U`` with i.i.d. entries of variance ``σ²``, ``E‖Aᵀ U B‖² = σ²·‖A‖²_F·‖B‖²_F``, while a dense update
    has ``‖·‖² ≈ σ²·o·i``; so ``c = √(o·i) / (‖A‖_F·‖B‖_F)``. Random draws (``±1/√r`` values, unit columns) and
    signed permutations have ``c = 1`` exactly, so their arithmetic is untouched; a learned fit, which brings
    ``AᵀA`` close to an orthogonal projector (rows of unit norm), shrinks the update by about the compression
    ratio, and ``c`` restores it, so learned projectors train at the user's own learning rate.

    ``c`` is a parameterisation ``W = W₀ + c·AᵀZB``: Adam is invariant to the gradient's scale (up to ``eps``), so
    ``c`` changes only the size of the step in weight space, exactly as the learning rate would.
    """
    out_features, in_features = proj_out.dim_in, proj_in.dim_in
    norms = float(proj_out.values.double().norm()) * float(proj_in.values.double().norm())
    if norms == 0.0 or not math.isfinite(norms):
        return 1.0
    scale = math.sqrt(out_features * in_features) / norms
    # A random draw's ±1/√r values are exact only up to fp32 rounding, which leaves c at 1 ± 1.2e-7 for some densities
    # (6, 7, 9): such a c is 1, so random projectors' arithmetic stays untouched, bit for bit.
    if abs(scale - 1.0) <= 1e-6:
        return 1.0
    return float(torch.tensor(scale, dtype=torch.float32))  # the precision it is applied in


#: Rows of ``W`` whose expanded update measures its per-element RMS for a rule of one step size (Lion): evenly
#: spaced, so the measurement is the same at every step and on every rank.
RMS_SAMPLE_ROWS = 256


def match_element_rms_(half: Tensor, row_projector: SparseProjector, update: Tensor) -> None:
    """Scale ``half`` in place so that the update it expands to, ``Pᵀ·half``, has the per-element RMS of ``update``.

    Lion steps every element of a dense weight by exactly ``lr``. Expanding its compressed step ``U`` (entries
    ``±lr``) sums several of them per element through the projectors, which keep the norm only on average over
    independent signs; the signs of one step are not independent (they follow the gradient), so the expanded step's
    RMS runs above ``lr`` (docs/benchmarks/2026-12-06.md). The RMS is measured on :data:`RMS_SAMPLE_ROWS` evenly spaced
    rows of ``W`` (``r`` rows of ``half`` gathered per row: a few percent of the apply's own work), without a read
    back to the host.

    Args:
        half: the small side expanded (``d × cols`` fp32, the rows ``row_projector`` expands).
        row_projector: the projector that expands ``half``'s rows into ``W``'s rows.
        update: the host's update ``U`` (fp32), whose per-element RMS the expanded update takes.
    """
    rows = row_projector.indices.shape[0]
    sample = torch.linspace(0, rows - 1, min(rows, RMS_SAMPLE_ROWS), device=half.device).round().long()
    indices, values = row_projector.indices[sample].long(), row_projector.values[sample].detach().float()
    expanded = torch.zeros(len(sample), half.shape[1], dtype=torch.float32, device=half.device)
    for nonzero in range(indices.shape[1]):  # one k × cols product per nonzero of a column: no k × r × cols temporary
        expanded.addcmul_(half[indices[:, nonzero]], values[:, nonzero].unsqueeze(1))
    measured, wanted = expanded.square().mean().sqrt(), update.square().mean().sqrt()
    half.mul_(torch.where(measured > 0, wanted / measured, torch.ones_like(measured)))
