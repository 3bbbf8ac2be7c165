"""Learning projector values from sampled gradients, without ever densifying a projector.

For a layer's gradient ``G`` (``o × i``) and projectors ``A`` (``d_o × o``), ``B`` (``d_i × i``), with ``S = A G Bᵀ``,
``K_A = A Aᵀ`` and ``K_B = B Bᵀ``, the subspace's error ``err(G) = ‖AᵀA G BᵀB − G‖_F / ‖G‖_F`` expands as

    err(G)² = (⟨K_A S K_B, S⟩ − 2‖S‖² + ‖G‖²) / ‖G‖²

so one evaluation costs two sparse products (``O((o + d_o)·i·r)``) plus ``d_o × d_i``-sized dense products: the
reconstruction ``AᵀA G BᵀB`` (``o × i``) is never formed. Adam minimises ``err²`` plus a small L2 over the values, the
indices fixed; the values' gradient is a sampled dense-dense product (SDDMM) on the projector's own sparsity pattern.

Memory: besides ``G``, a fit step holds ``A G`` (``d_o × i``) and ``G Bᵀ``-sized intermediates with their gradients and
the Gram matrices, at most ``8·max(d_o·i, o·d_i) + 4·(d_o² + d_i²)`` floats (``tests/test_projector_fit.py`` checks
it); layers are fitted one at a time, so nothing scales with the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_offload.inner_optimizers import step_unhooked
from lightning_offload.lsp.projector import SparseProjector, SparsityPattern


@dataclass(frozen=True)
class FitSettings:
    """How projector values are fitted (built by :class:`~lightning_offload.faces.trainer.refit.ProjectorRefit`, or by
    hand for a :class:`LayerFit`).

    Attributes:
        max_iters: Adam iterations per layer per fit, spread evenly over the sampled gradients. Default: ``24``.
        target_error: a layer stops fitting once its error on the current sample is at most this. Default: ``0.1``.
        lr: Adam learning rate on the values (the initial values are ``±1/√r``). Default: ``0.05``.
        l2: weight of the L2 penalty ``mean(values²)`` on both projectors' values. Default: ``1e-4``.

    Example::

        from lightning_offload import FitSettings, random_projector
        from lightning_offload.lsp.fit import LayerFit, fit_initial_values

        gen, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
        proj_out, proj_in = (fit_initial_values(random_projector(512, 128, 4, gen, cpu)) for _ in range(2))
        fit = LayerFit(proj_out, proj_in, FitSettings(max_iters=48, target_error=0.05))
        before, after = fit.fit(torch.randn(512, 512), iterations=48)  # err on this gradient; fit.projectors()
    """

    max_iters: int = 24
    target_error: float = 0.1
    lr: float = 0.05
    l2: float = 1e-4

    def __post_init__(self) -> None:
        if self.max_iters < 0:
            raise ValueError(f"max_iters={self.max_iters} must be ≥ 0.")
        if not self.target_error >= 0:
            raise ValueError(f"target_error={self.target_error} must be ≥ 0 (a relative error).")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0.")
        if not self.l2 >= 0:
            raise ValueError(f"l2={self.l2} must be ≥ 0.")


class _SparseProduct(torch.autograd.Function):
    """``P · M`` for ``P`` given by a fixed pattern and variable values; differentiable in both."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, pattern: SparsityPattern, matrix: Tensor) -> Tensor:
        ctx.pattern = pattern
        ctx.save_for_backward(values, matrix)
        return torch.sparse.mm(pattern.matrix(values), matrix)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        values, matrix = ctx.saved_tensors
        pattern: SparsityPattern = ctx.pattern
        grad_values = grad_matrix = None
        if ctx.needs_input_grad[0]:
            # ∂/∂P[a, j] = Σ_m grad[a, m]·M[j, m], wanted only on P's pattern: a sampled product (SDDMM).
            sampled = torch.sparse.sampled_addmm(pattern.matrix(values), grad, matrix.t(), beta=0.0)
            grad_values = torch.empty_like(values)
            grad_values[pattern.order.long()] = sampled.values()
        if ctx.needs_input_grad[2]:
            grad_matrix = torch.sparse.mm(pattern.transposed(values), grad)
        return grad_values, None, grad_matrix


def cross_gram(left: SparseProjector, right: SparseProjector) -> Tensor:
    """``L Rᵀ`` (``d_L × d_R``) of two projectors of the same dimension, in fp32, without densifying either."""
    return gram(left.values.float(), left.indices, left.dim_out, right.values.float(), right.indices, right.dim_out)


def gram(
    values: Tensor, indices: Tensor, dim_out: int,
    values_r: Tensor | None = None, indices_r: Tensor | None = None, dim_out_r: int | None = None,
) -> Tensor:
    """``P Pᵀ`` (or ``P Qᵀ``) from the ``r²`` products inside each column: ``O(n·r²)`` work, differentiable, summed in a
    fixed order so the result is bit-identical for any thread count: ``index_add`` on the CPU (where
    ``index_put(accumulate=True)`` adds with atomics in arrival order), ``index_put(accumulate=True)`` on CUDA (where it
    sorts first, and ``index_add`` would use atomics)."""
    if values_r is None:
        values_r, indices_r, dim_out_r = values, indices, dim_out
    n, r = indices.shape
    # int64: the stored indices are narrow (int16), and the flat entry numbers go up to d_L·d_R.
    keys = (indices.long().unsqueeze(2) * dim_out_r + indices_r.long().unsqueeze(1)).reshape(-1)
    products = (values.unsqueeze(2) * values_r.unsqueeze(1)).reshape(-1)
    flat = values.new_zeros(dim_out * dim_out_r)
    if flat.device.type == "cuda":
        flat = flat.index_put((keys,), products, accumulate=True)
    else:
        flat = flat.index_add(0, keys, products)
    return flat.reshape(dim_out, dim_out_r)


def _error_squared(
    a: Tensor, pattern_a: SparsityPattern, idx_a: Tensor, b: Tensor, pattern_b: SparsityPattern, idx_b: Tensor,
    grad: Tensor, grad_sq: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(err(G)², ‖S‖²)`` for projectors with flat values ``a``, ``b`` (see the module docstring)."""
    d_o, d_i = pattern_a.shape[0], pattern_b.shape[0]
    compressed_out = _SparseProduct.apply(a.reshape(-1), pattern_a, grad)  # A G: d_o × i
    s = _SparseProduct.apply(b.reshape(-1), pattern_b, compressed_out.t().contiguous()).t()  # A G Bᵀ: d_o × d_i
    gram_a = gram(a, idx_a, d_o)
    gram_b = gram(b, idx_b, d_i)
    reconstruction_sq = ((gram_a @ s @ gram_b) * s).sum()
    s_sq = s.square().sum()
    return (reconstruction_sq - 2 * s_sq + grad_sq) / grad_sq, s_sq


def _squared_norm(matrix: Tensor) -> Tensor:
    # A dot product of the flat view: no temporary of the gradient's size (``square()`` would allocate one).
    flat = matrix.reshape(-1)
    return torch.dot(flat, flat)


def reconstruction_error(proj_out: SparseProjector, proj_in: SparseProjector, grad: Tensor) -> float:
    """``err(G) = ‖AᵀA G BᵀB − G‖_F / ‖G‖_F`` for a gradient ``G`` (``o × i``), without forming ``AᵀA G BᵀB``; ``nan``
    for a zero or non-finite gradient."""
    with torch.no_grad():
        grad = grad.float()
        grad_sq = _squared_norm(grad)
        if not bool(torch.isfinite(grad_sq)) or float(grad_sq) == 0.0:
            return math.nan  # no subspace to measure against
        err_sq, _ = _error_squared(
            proj_out.values.float(), proj_out.pattern(), proj_out.indices,
            proj_in.values.float(), proj_in.pattern(), proj_in.indices, grad, grad_sq,
        )
    return float(err_sq.clamp_min(0.0).sqrt())


def fit_initial_values(projector: SparseProjector) -> SparseProjector:
    """Rescale a random projector to ``±√(d / (n·r))`` before a fit: then ``AᵀA`` is close to an orthogonal projector
    onto a random ``d``-dimensional subspace, a far better start than the norm-preserving ``±1/√r``."""
    scale = (projector.dim_out / projector.dim_in) ** 0.5
    return SparseProjector(projector.indices, projector.values * scale, projector.dim_out)


class LayerFit:
    """The fit of one layer's two projectors, fed one sampled gradient at a time: trainable copies of the values (the
    indices fixed) and their Adam state, so a fit continues over gradients never held at once.

    Args:
        proj_out: ``A``; its indices are kept, its values are the starting point.
        proj_in: ``B``, likewise.
        settings: iteration budget, target error and step size.
    """

    def __init__(self, proj_out: SparseProjector, proj_in: SparseProjector, settings: FitSettings) -> None:
        self.settings = settings
        self.idx_a, self.idx_b = proj_out.indices, proj_in.indices
        self.pattern_a: SparsityPattern | None = proj_out.pattern()
        self.pattern_b: SparsityPattern | None = proj_in.pattern()
        self.a = proj_out.values.detach().float().clone().requires_grad_(True)
        self.b = proj_in.values.detach().float().clone().requires_grad_(True)
        self.adam = torch.optim.Adam([self.a, self.b], lr=settings.lr)
        self.dims = (proj_out.dim_out, proj_in.dim_out)
        self.iterations = 0
        self.samples_seen = 0
        self.converged = False
        # ‖A G Bᵀ‖/‖G‖ on a sample not yet fitted to (a fitted one overstates it); noisy, so pooled where possible.
        self.norm_ratio = 1.0

    def fit(self, grad: Tensor, iterations: int) -> tuple[float, float]:
        """Run up to ``iterations`` Adam steps on one gradient, stopping once ``err ≤ target_error``.

        Returns:
            ``(error before, error after)`` on this gradient; ``nan`` for a skipped zero or non-finite gradient.
        """
        grad = grad.float()
        grad_sq = _squared_norm(grad)
        if not bool(torch.isfinite(grad_sq)) or float(grad_sq) == 0.0:
            # No subspace in it (an overflowing batch): fitting would destroy the values; skipped, as the step is.
            return math.nan, math.nan
        self.samples_seen += 1
        self.to(grad.device)
        if self.pattern_a is None:
            self.pattern_a = SparsityPattern(self.idx_a, self.dims[0])
            self.pattern_b = SparsityPattern(self.idx_b, self.dims[1])
        errors: list[float] = []
        for step in range(iterations + 1):
            with torch.enable_grad():
                err_sq, s_sq = _error_squared(self.a, self.pattern_a, self.idx_a, self.b, self.pattern_b,
                                              self.idx_b, grad, grad_sq)
                errors.append(float(err_sq.detach().clamp_min(0.0).sqrt()))
                if step == 0 and self.samples_seen > 1 or self.samples_seen == 1:
                    self.norm_ratio = float((s_sq.detach() / grad_sq).sqrt())  # held out, or all there is
                if errors[-1] <= self.settings.target_error:
                    self.converged = True
                    break
                if step == iterations or self.iterations >= self.settings.max_iters:
                    break
                loss = err_sq + self.settings.l2 * (self.a.square().mean() + self.b.square().mean())
                self.adam.zero_grad(set_to_none=True)
                loss.backward()
            step_unhooked(self.adam)  # the user's optimizer hooks are for their step (inner_optimizers.py)
            self.iterations += 1
        return errors[0], errors[-1]

    @property
    def device(self) -> torch.device:
        """Where the fit's values and Adam state are."""
        return self.a.device

    def to(self, device: torch.device | str) -> None:
        """Move the values, their Adam state and the indices to ``device`` in place (the fit's Adam keeps its tensors),
        so a fit over many layers parks each on the host between samples; the CSR structures are rebuilt on use."""
        device = torch.device(device)
        if device == self.device:
            return
        for tensor in (self.a, self.b):
            tensor.data = tensor.data.to(device)
            if tensor.grad is not None:
                tensor.grad = None  # cleared by the next iteration's zero_grad anyway
        for state in self.adam.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device)
        self.idx_a, self.idx_b = self.idx_a.to(device), self.idx_b.to(device)
        self.pattern_a = self.pattern_b = None

    def nbytes(self) -> int:
        """Bytes of the fit's state: values, their Adam moments and the indices (CSR structures excluded)."""
        tensors = [self.a, self.b, self.idx_a, self.idx_b]
        tensors += [v for state in self.adam.state.values() for v in state.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def projectors(self) -> tuple[SparseProjector, SparseProjector]:
        """The fitted ``A`` and ``B`` (same indices, new values)."""
        return (
            SparseProjector(self.idx_a, self.a.detach().clone(), self.dims[0]),
            SparseProjector(self.idx_b, self.b.detach().clone(), self.dims[1]),
        )
