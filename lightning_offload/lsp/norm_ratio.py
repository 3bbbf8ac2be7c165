"""``ρ = ‖S‖/‖G‖`` per projected layer, measured on gradients its projectors were not fitted to.

Gradient clipping needs the full gradient's norm, which never exists for a projected weight: the engine estimates
it as ``‖S‖/ρ`` (:meth:`~lightning_offload.engine.optimizer.OffloadOptimizer.grad_norm`). Two things spoil a careless
measurement of ``ρ``: learned projectors keep far more of the gradients they were fitted to than of any other
(fitting bias), and one batch's ``‖S‖/‖G‖`` moves a lot from batch to batch. So ``ρ`` is pooled over several batches
none of which the fit used, as ``√(mean_b ‖S_b‖²/‖G_b‖²)`` (the ratio of sums weighs large-gradient batches up).
Random draws are not measured: their ``ρ = 1`` holds in expectation and a given draw is closer to it than a
measurement on a few batches. Either figure holds for the gradients of the moment only:
:mod:`lightning_offload.lsp.norm_probe` keeps it true as training goes on. Measurements:
docs/benchmarks/2026-12-02.md (the clipping norm).
"""

from __future__ import annotations

import math

from torch import Tensor

from lightning_offload.lsp.projector import SparseProjector

# A measured ρ this close to 1 is 1: lossless projectors (signed permutations) keep every norm exactly, and their
# arithmetic must stay bit for bit that of plain Adam.
_EXACT = 1e-6


class NormRatioPool:
    """Per layer, the mean over the gradients added of ``‖A G Bᵀ‖²/‖G‖²``: ``ρ`` is its root."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, int]] = {}

    def add(self, name: str, proj_out: SparseProjector, proj_in: SparseProjector, grad: Tensor) -> None:
        """Add one gradient (``o × i``) of layer ``name`` under the projectors ``proj_out``/``proj_in``; a zero or
        non-finite gradient carries no information and is left out."""
        grad = grad.float()
        grad_sq = float(grad.square().sum())
        if not math.isfinite(grad_sq) or grad_sq == 0.0:
            return
        compressed = proj_in.compress_rows(proj_out.compress_rows(grad).t())
        total, count = self._sums.get(name, (0.0, 0))
        self._sums[name] = (total + float(compressed.square().sum()) / grad_sq, count + 1)

    def ratio(self, name: str) -> float:
        """``ρ`` of layer ``name``; ``nan`` when no usable gradient was added."""
        total, count = self._sums.get(name, (0.0, 0))
        if count == 0:
            return math.nan
        ratio = math.sqrt(total / count)
        return 1.0 if abs(ratio - 1.0) <= _EXACT else ratio
