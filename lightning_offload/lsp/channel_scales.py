"""The full-rank update rule ``update="scaled"``: Adam's moments kept for a random projection of the gradient, one
learning-rate scale per channel of the full gradient (APOLLO's channel-wise rule, arXiv 2412.05270), offloaded.

For a weight ``W`` (``o × i``) with gradient ``G``, ``n = min(o, i)`` is the smaller side and the channels are the rows
or columns along the larger one. ``P`` (``r × n``, entries ``N(0, 1/r)``) projects each channel of ``G`` to ``r``
numbers, ``R = G·Pᵀ`` (``channels × r``). The host keeps Adam's moments of ``R`` only and returns, per channel,
``s_j = ‖R̃_j‖ / ‖R_j‖`` with ``R̃ = m̂ / (√v̂ + ε)``; the device applies the full-rank update
``W ← W·(1 − lr·λ) − lr·α·diag(s)·G`` with ``α = √(n / r)``. A norm-growth limiter keeps ``‖diag(s)·G‖`` from growing
more than ``γ``-fold per step (:func:`channel_scales`). ``P`` is redrawn every ``redraw_every`` steps, the moments kept.
``rank`` gives the host elements of ``update="projected"``: ``rank=0.25`` projects each channel to ``n/16`` numbers.

Where ``r = 1`` the weight takes one scale, ``s = ‖R̃‖_F / ‖R‖_F`` (APOLLO-Mini's tensor-wise rule): a channel's
``‖R_j‖`` is then one projection ``|⟨G_j, p⟩|``, near zero for some channels at every step, and its inverse would make
their updates arbitrarily large.

This module holds the device's arithmetic (projection, application) and the host's (scales, limiter);
:class:`~lightning_offload.engine.slots.scaled_slot.ScaledSlot` moves them between the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_offload.lsp.layouts import weight_shape
from lightning_offload.lsp.rounding import copy_stochastic_rounded_
from lightning_offload.lsp.targets import compressed_size

# Elements per block of a low-precision weight's fp32 temporary while the update is applied (as lsp/linear.py's).
_BLOCK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 22}


def scaled_projection_size(out_features: int, in_features: int, rank: int | float) -> int:
    """``r``: the projected size of each channel that keeps the host elements of ``update="projected"`` at ``rank``
    (``⌈rank·o⌉·⌈rank·i⌉ / max(o, i)``, rounded, between 1 and the smaller side)."""
    compressed = compressed_size(out_features, rank) * compressed_size(in_features, rank)
    return max(1, min(min(out_features, in_features), round(compressed / max(out_features, in_features))))


@dataclass(frozen=True)
class ScaledRule:
    """The rule's own settings (the strategies' ``redraw_every`` and ``norm_growth_limit``).

    Attributes:
        redraw_every: steps between draws of ``P`` (its moments are kept).
        norm_growth_limit: ``γ``, the most the update's norm may grow per step, or ``None`` for no limiter.
    """

    redraw_every: int = 200
    norm_growth_limit: float | None = 1.01


class ScaledWeight:
    """One weight trained by the scaled rule: its module (left as it is: the full gradient fills ``weight.grad``), its
    channel layout and its projection ``P``.

    Args:
        name: the module's qualified name.
        module: a projectable layer (``nn.Linear``, Hugging Face ``Conv1D``: any registered layout's).
        rank: the strategies' ``rank`` (see :func:`scaled_projection_size`).
        seed: seeds every draw of ``P`` (with ``position`` and the draw's number).
        position: the weight's number among the scaled ones (distinct draws per weight).
        rule: the rule's settings.
        device: where ``P`` lives.
    """

    def __init__(self, name: str, module: nn.Module, rank: int | float, seed: int, position: int, rule: ScaledRule,
                 device: torch.device) -> None:
        self.name = name
        self.module = module
        self.rule = rule
        self.seed = int(seed)
        self.position = int(position)
        rows, cols = module.weight.shape
        out_features, in_features = weight_shape(module)
        #: The stored weight's dimension that holds the channels: the larger side; the stored rows when square (as
        #: APOLLO's code takes them: a Linear's output side, a ``Conv1D``'s input side).
        self.channel_dim = 0 if rows >= cols else 1
        self.channels = module.weight.shape[self.channel_dim]
        self.projected_side = module.weight.shape[1 - self.channel_dim]
        self.rank = scaled_projection_size(out_features, in_features, rank)
        #: ``α = √(n/r)``: gives the scaled update the size of a dense Adam update at the user's learning rate.
        self.alpha = math.sqrt(self.projected_side / self.rank)
        self.device = device
        self.draw_number = -1
        self.projection = self.draw(0)

    @property
    def weight(self) -> nn.Parameter:
        """The module's weight parameter."""
        return self.module.weight

    def draw(self, number: int) -> Tensor:
        """``P`` of draw ``number`` (seeded by the seed, the position and the number: a resume redraws it exactly)."""
        if number != self.draw_number:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.position) * 1_000_003 + number)
            drawn = torch.randn(self.rank, self.projected_side, generator=generator, dtype=torch.float32)
            drawn /= math.sqrt(self.rank)
            self.projection, self.draw_number = drawn.to(self.device), number
        return self.projection

    def draw_for_step(self, steps_taken: int) -> None:
        """Make ``P`` the draw of the step after ``steps_taken`` taken steps."""
        self.draw(steps_taken // self.rule.redraw_every)

    def nbytes(self) -> int:
        """Device bytes held for this weight (``P``)."""
        return self.projection.numel() * self.projection.element_size()

    @torch.no_grad()
    def project(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        """``R = G·Pᵀ`` (``channels × r``, in the gradient's dtype) and each channel's ``‖G_j‖²`` (fp32), on the
        device, from the stored gradient ``grad``."""
        by_channel = grad if self.channel_dim == 0 else grad.t()
        projected = by_channel @ self.projection.to(grad.dtype).t()
        squares = torch.linalg.vector_norm(grad, dim=1 - self.channel_dim, dtype=torch.float32).square()
        return projected, squares

    @torch.no_grad()
    def apply(self, grad: Tensor, scales: Tensor, step_size: float, decay: float,
              generator: torch.Generator | None) -> None:
        """``W ← W·decay − step_size·diag(s)·G`` along the channels, in place on the device (``step_size = ±lr·α``):
        fp32 weights in two passes without a temporary, low-precision ones block by block in fp32, rounded
        stochastically (round-to-nearest would drop updates below half an ulp)."""
        weight = self.weight.data
        scales = scales.to(weight.device, torch.float32)
        if weight.dtype == torch.float32:
            if decay != 1.0:
                weight.mul_(decay)
            weight.addcmul_(grad, scales.unsqueeze(1 - self.channel_dim), value=-step_size)
            return
        rows, row_length = weight.shape
        block = max(1, _BLOCK_ELEMENTS.get(weight.device.type, _BLOCK_ELEMENTS["cuda"]) // max(row_length, 1))
        for start in range(0, rows, block):
            here = slice(start, min(start + block, rows))
            row_scales = scales[here].unsqueeze(1) if self.channel_dim == 0 else scales.unsqueeze(0)
            value = grad[here].float().mul_(row_scales).mul_(-step_size)
            if decay != 1.0:
                value.add_(weight[here], alpha=decay)
            else:
                value.add_(weight[here])
            copy_stochastic_rounded_(weight[here], value, generator)


def bias_correction(betas: tuple[float, float], step: int) -> float:
    """``√(1 − β₂ᵗ) / (1 − β₁ᵗ)``: what Adam's bias correction multiplies ``m / √v`` by at step ``t``."""
    return math.sqrt(1.0 - betas[1] ** step) / (1.0 - betas[0] ** step)


def channel_scales(direction: Tensor, gradient_norms: Tensor, channel_squares: Tensor, last_norm: float | None,
                   limit: float | None, correction: float = 1.0) -> tuple[Tensor, float]:
    """Host: each channel's scale (one for them all where ``r = 1``) and the update's norm after the limiter.

    The limiter acts as APOLLO's code (``apollo-torch``'s ``APOLLOAdamW``): on ``diag(s)·G`` built from the moments
    without their bias correction, ``s / correction``; the correction is applied after it, as a step size, so the
    limiter does not hold back the correction's own growth over the first steps.

    Args:
        direction: Adam's bias-corrected direction ``±R̃`` (``channels × r``; only its row norms are read).
        gradient_norms: ``‖R_j‖`` of the unclipped projected gradient (the device's ``G`` is unclipped too, so
            clipping reaches the update only through the moments, exactly as for a clipped ``G``).
        channel_squares: ``‖G_j‖²`` of the device's unclipped gradient.
        last_norm: the norm of the update applied at the last step, or ``None`` before the first.
        limit: ``γ``, or ``None`` for no limiter.
        correction: :func:`bias_correction` of the step ``direction`` was made at.

    Returns:
        The scales ``s`` (fp32, ``channels``, the correction in them) and the norm ``‖diag(s)·G‖ / correction`` of the
        uncorrected update they give, to compare the next one with.
    """
    if direction.shape[1] == 1:
        # r = 1: one scale for the weight (see the module's docstring); none when its whole projection is zero.
        numerator, denominator = torch.linalg.vector_norm(direction), torch.linalg.vector_norm(gradient_norms)
        scale = numerator / denominator if float(denominator) > 0 else torch.zeros_like(numerator)
        scales = scale.expand(gradient_norms.shape).clone()
    else:
        numerators = torch.linalg.vector_norm(direction, dim=1)
        # A channel whose projected gradient is exactly zero carries no scale (its gradient row is zero almost surely).
        scales = torch.where(gradient_norms > 0,
                             numerators / gradient_norms.clamp_min(torch.finfo(torch.float32).tiny),
                             torch.zeros_like(numerators))
    norm = float(torch.sqrt((scales.square() * channel_squares).sum())) / correction
    # Against a zero last norm (a step whose gradient was all zero) nothing can be compared: no limit then.
    if limit is not None and last_norm and norm > limit * last_norm:
        scales.mul_(limit * last_norm / norm)
        norm = limit * last_norm
    return scales, norm
