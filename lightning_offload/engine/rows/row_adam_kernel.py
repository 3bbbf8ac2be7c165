"""How the row Adam (:class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`) drives torch's fused Adam
kernel: the step's settings, the per-block hyper-parameters that fold stored moment scales into one kernel step, and
the workspace a gathered step of scattered rows reads into.

Each block keeps two scales, the true moments being ``s₁·m`` and ``s₂·v`` of the stored ones. A gap only multiplies the
scales by ``β₁^g`` and ``β₂^g``, and one kernel step with per-block hyper-parameters, solved in float64 from the scales
(:func:`scaled_kernel_calls`), gives exactly the true Adam step with the stored second moment at the gradient's scale.
A block never skipped has scales of 1 and is stepped bit for bit as by torch's fused kernel; a block whose ``s₂`` falls
below ``RENORMALIZE_BELOW`` has its moments rescaled once and its scales reset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# A block's second-moment scale below which its stored moments are rescaled in place: far from underflow.
RENORMALIZE_BELOW = 1e-3

# The strategy's per-step clipping: ("norm", coefficient) or ("value", bound), or None.
Clip = tuple[str, float] | None

# One kernel call's hyper-parameters, as keyword pairs (hashable, so blocks that share them share the call).
KernelHyper = tuple[tuple[str, float], ...]


@dataclass
class RowAdamSettings:
    """The hyper-parameters of one row step; the strategies build one per step from the user's param group.

    Attributes:
        lr: learning rate of a matrix whose ``lr_scale`` is 1. Default: ``1e-3``.
        betas: ``(β₁, β₂)``. Default: ``(0.9, 0.999)``.
        eps: added to the denominator. Default: ``1e-8``.
        weight_decay: ``λ``; decoupled (AdamW) or added to the gradient (Adam's L2), per ``decoupled``.
            Default: ``0.0``.
        decoupled: AdamW's decoupled decay rather than Adam's L2. Default: ``True``.
        maximize: ascend instead of descend. Default: ``False``.

    Example::

        settings = RowAdamSettings(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)  # AdamW: decoupled=True
        adam.step(blocks, grads, settings)  # adam: a BlockRowAdam (see its example)
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    maximize: bool = False


def scaled_kernel_calls(blocks: list[int], owed: list[float], scale1: list[float], scale2: list[float],
                        new_scale1: list[float], settings: RowAdamSettings, lr: float,
                        step_count: int) -> dict[tuple[KernelHyper, float], list[int]]:
    """The kernel calls of one learning rate: per distinct (hyper-parameters, gradient scale ``c``), its blocks.

    With ``m = s1·M`` and ``v = s2·W`` stored as ``M`` and ``W``, Adam's true step ``m' = β₁m + (1−β₁)g``,
    ``v' = β₂v + (1−β₂)g²``, ``p' = d·p − lr·(m'/b₁)/(√(v'/b₂) + ε)`` is the kernel's step on ``M, W`` with gradient
    ``g/c``, ``β₁' = β₁s1/s1'``, ``β₂``, ``ε' = ε/c`` and ``lr' = lr·s1'·(1 − β₁'^t)/(b₁·c)``. Decoupled decay owed
    for the steps a block missed folds into the kernel's decay.

    Args:
        blocks: the blocks stepped.
        owed: per block, the factor of decoupled decay it owes for the steps before this one (1: none; at lr 0 the
            caller applies it, since the kernel then steps nothing).
        scale1, scale2: per block, its moment scales decayed to just before this step.
        new_scale1: per block, its first-moment scale after this step.
        settings: the step's hyper-parameters.
        lr: the learning rate of the matrices stepped (``settings.lr`` times their scale).
        step_count: the matrix's step count, this step included.
    """
    beta1, beta2 = settings.betas
    bias1 = 1.0 - beta1**step_count
    calls: dict[tuple[KernelHyper, float], list[int]] = {}
    for block, owe, s1, s2, s1_new in zip(blocks, owed, scale1, scale2, new_scale1):
        if s1 == 1.0 and s2 == 1.0:
            kernel_beta1, kernel_lr, kernel_eps, c = beta1, lr, settings.eps, 1.0
        else:
            c = s2**0.5
            kernel_beta1 = beta1 * s1 / s1_new
            kernel_lr = lr * s1_new * (1.0 - kernel_beta1**step_count) / (bias1 * c)
            kernel_eps = settings.eps / c
        decay = settings.weight_decay
        if settings.decoupled and (owe != 1.0 or (decay and kernel_lr != lr)):
            # What is owed and this step's decay at once; at lr 0 the kernel steps nothing and the caller applies it.
            decay = (1.0 - owe * (1.0 - lr * decay)) / kernel_lr if kernel_lr else 0.0
        elif decay and not settings.decoupled:
            decay = decay / c  # Adam's L2 joins the gradient after the kernel divided it by c
        hyper = (("lr", kernel_lr), ("beta1", kernel_beta1), ("beta2", beta2), ("weight_decay", decay),
                 ("eps", kernel_eps))
        calls.setdefault((hyper, c), []).append(block)
    return calls


def per_block_hyper(calls: dict[tuple[KernelHyper, float], list[int]], count: int, coefficient: float) -> Tensor:
    """The calls of :func:`scaled_kernel_calls` as one float64 row per stepped block: ``lr``, ``β₁``, weight decay,
    ``ε`` and gradient divisor ``c / coefficient`` (the norm clip folded in)."""
    rows: list[list[float]] = [[]] * count
    for (pairs, c), members in calls.items():
        values = dict(pairs)
        row = [values["lr"], values["beta1"], values["weight_decay"], values["eps"], c / coefficient]
        for member in members:
            rows[member] = row
    return torch.tensor(rows, dtype=torch.float64).reshape(count, 5)  # one tensor made, whatever the blocks


def decayed_scales(blocks: Tensor, last_step: Tensor, scales: Tensor, step_count: int,
                   betas: tuple[float, float]) -> tuple[list[float], list[float]]:
    """Per block of ``blocks``, its moment scales (``scales``: ``[2, blocks of the matrix]``) decayed by ``β₁^g``,
    ``β₂^g`` over the ``g`` steps since ``last_step``, to just before step ``step_count``, as Python floats; 1 for
    blocks never stepped. Products in Python round as torch's float64 ones, so the scales are bit for bit the same.
    """
    gaps = (step_count - 1 - last_step.index_select(0, blocks)).double()
    table = torch.cat([scales.index_select(1, blocks), torch.stack([betas[0]**gaps, betas[1]**gaps, gaps])]).tolist()
    never = float(step_count - 1)  # the gap of a block never stepped (last step 0)
    decayed1, decayed2 = [], []
    for s1, s2, decay1, decay2, gap in zip(*table):
        decayed1.append(1.0 if gap == never else s1 * decay1)
        decayed2.append(1.0 if gap == never else s2 * decay2)
    return decayed1, decayed2


def new_first_scales(scale1: list[float], scale2: list[float], beta1: float) -> list[float]:
    """Per block, the first moment's stored scale after a step from decayed scales ``scale1``, ``scale2`` (float64).

    The gradient enters the stored moments divided by ``c = √s2`` (so the stored second moment keeps ``β₂``); the first
    moment's scale after the step is then ``β₁·s1 + (1 − β₁)·c``: exactly 1 for blocks never skipped.
    """
    return [1.0 if s1 == 1.0 and s2 == 1.0 else beta1 * s1 + (1.0 - beta1) * math.sqrt(s2)
            for s1, s2 in zip(scale1, scale2)]


class RowWorkspace:
    """Buffers a gathered step reads the touched rows into (see :meth:`views`), grown by doubling and never shrunk, so
    a step allocates only when it touches more rows than every step before it.

    Args:
        height: the matrix's rows (the most a step can touch).
        width: its columns.
    """

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width
        self.capacity = 0
        self.tensors: list[Tensor] = []

    def views(self, count: int) -> tuple[Tensor, ...]:
        """``count`` rows of: weight, first moment, second moment, factor 1, factor 2, decay, gaps (all fp32), last
        steps (int64) and the decay owed (float64)."""
        if count > self.capacity:
            self.capacity = min(max(count, 2 * self.capacity), self.height)
            # Dtypes spelled out: on a worker thread, the main thread's forward may have changed the default dtype.
            fp32 = torch.float32
            self.tensors = ([torch.empty(self.capacity, self.width, dtype=fp32) for _ in range(3)]
                            + [torch.empty(self.capacity, 1, dtype=fp32) for _ in range(4)]
                            + [torch.empty(self.capacity, dtype=torch.int64),
                               torch.empty(self.capacity, dtype=torch.float64)])
        return tuple(t[:count] for t in self.tensors)
