"""Adam over MEFT adapter rows, block by block, in place: torch's fused Adam kernel on row slices, no gathered copies.

A MEFT adapter's keys and values have ``N`` rows, of which a step touches a few experts' worth. Gathering the touched
rows of the weights, both moments and the gradient, stepping the copies and scattering them back streams every element
through memory three times over, plus index arithmetic. Here the rows are split into contiguous blocks (by default one
expert's neurons, so routing touches whole blocks), and a step hands the touched blocks to torch's fused Adam kernel as
slices of the host matrices: one pass that reads the gradient, weight and moments and writes the weight and moments in
place.

Semantics, against dense AdamW over the whole matrix:

* **A touched block is stepped whole.** Its rows that no token routed to this step get a zero gradient, which is what
  dense AdamW gives them (their moments decay, their weights move on momentum).
* **One step count for the matrix**, so bias corrections are dense AdamW's at every step.
* **Blocks skipped for ``g`` steps catch up** when next touched: their moments are ``β₁^g`` and ``β₂^g`` times what
  they were (what ``g`` zero-gradient steps of dense Adam do to them) and, with decoupled weight decay, their weights
  ``(1 − lr·λ)^g`` times (at the current ``lr``). What is not reproduced is the drift of a skipped block's weights by
  its decaying momentum over the gap: it stays where it was.
* Coupled L2 (``Adam(weight_decay=...)``) is added by the kernel to the stepped blocks' gradients only.
* Norm clipping is part of the kernel's gradient scale (the gradient divided by ``1/c``, within an ulp of multiplying
  by ``c``); value clipping clamps the stepped slices first.

The catch-up costs no pass over the moments: each block keeps two scales, the true moments being ``s₁·m`` and ``s₂·v``
of the stored ones. A gap only multiplies the scales by ``β₁^g`` and ``β₂^g``, and a step of the kernel with per-block
hyper-parameters (its ``β₁``, learning rate, ``ε``, weight decay and gradient scale, solved in float64 from the scales)
gives exactly the true Adam step in the stored representation, with ``β₂`` unchanged and the gradient scaled by
``1/√s₂``, so the stored second moment stays at the gradient's scale. A block that was never skipped has scales of 1
and is stepped with the user's hyper-parameters unchanged, bit for bit torch's fused kernel; a block whose ``s₂``
decays below :data:`RENORMALIZE_BELOW` (thousands of skipped steps) has its moments rescaled once and its scales reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# The strategy's per-step clipping: ("norm", coefficient) or ("value", bound), or None.
Clip = tuple[str, float] | None

# A block's second-moment scale below which its stored moments are rescaled in place (its scales reset to 1): far
# from underflow, and reached only after thousands of skipped steps at β₂ = 0.999.
RENORMALIZE_BELOW = 1e-3


@dataclass
class RowAdamSettings:
    """The hyper-parameters of one row step (taken from the user's optimizer at each step).

    ``meft_offload`` builds one at every step from the first param group of the user's optimizer (and its own
    ``lr``/``weight_decay`` when given); build one yourself to drive :class:`BlockRowAdam` by hand.

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


class BlockRowAdam:
    """Adam or AdamW over blocks of rows of fp32 host matrices that share their row layout (an adapter's keys and
    values), stepping only the blocks given.

    Args:
        params: fp32 host matrices ``[N, h]``, updated in place; all with the same ``N``.
        block_rows: rows per block (divides ``N``): the unit of stepping.
        lr_scales: per matrix, a factor on the learning rate. Default: ``None`` (1 for each).

    Example::

        keys, values = torch.randn(1024, 64), torch.zeros(1024, 64)
        adam = BlockRowAdam([keys, values], block_rows=32, lr_scales=[0.5, 1.0])
        grads = [torch.zeros_like(keys), torch.zeros_like(values)]
        grads[1][:40] = torch.randn(40, 64)  # rows 0–39 touched: blocks 0 and 1 are stepped
        adam.step(adam.blocks_of(grads[1].ne(0).any(dim=1)), grads, RowAdamSettings(lr=1e-3))
    """

    def __init__(self, params: list[Tensor], block_rows: int, lr_scales: list[float] | None = None) -> None:
        if not params:
            raise ValueError("BlockRowAdam needs at least one matrix.")
        rows = params[0].shape[0]
        for p in params:
            if p.device.type != "cpu" or p.dtype != torch.float32 or p.ndim != 2 or p.shape[0] != rows:
                raise ValueError(f"BlockRowAdam steps fp32 host matrices with {rows} rows; got {tuple(p.shape)} "
                                 f"{p.dtype} on {p.device}.")
        if not isinstance(block_rows, int) or block_rows < 1 or rows % block_rows:
            raise ValueError(f"block_rows={block_rows!r} must be a positive divisor of the {rows} rows (e.g. the "
                             f"neurons of one expert).")
        self.lr_scales = list(lr_scales) if lr_scales is not None else [1.0] * len(params)
        if len(self.lr_scales) != len(params) or not all(scale > 0 for scale in self.lr_scales):
            raise ValueError(f"lr_scales={lr_scales!r} must hold one positive factor per matrix ({len(params)}).")
        self.params = params
        self.block_rows = block_rows
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.step_count = 0
        # The step at which each block was last stepped (0: never), for the catch-up over its gap.
        self.last_step = torch.zeros(rows // block_rows, dtype=torch.int64)
        # Per block, the true first and second moments are these times the stored ones (see the module docstring).
        self.scale1 = torch.ones(rows // block_rows, dtype=torch.float64)
        self.scale2 = torch.ones(rows // block_rows, dtype=torch.float64)
        # The step count the fused kernel reads (one tensor handed for every slice: the kernel only reads it).
        self._step = torch.zeros((), dtype=torch.float32)
        # Each block of every matrix and moment as a view, made once: a step hands them to the kernel as they are.
        self._param_blocks = [self._by_block(p) for p in params]
        self._exp_avg_blocks = [self._by_block(m) for m in self.exp_avg]
        self._exp_avg_sq_blocks = [self._by_block(v) for v in self.exp_avg_sq]
        self._betas = (0.9, 0.999)  # the latest step's, for reading the moments back (moments())

    def _by_block(self, matrix: Tensor) -> tuple[Tensor, ...]:
        """``matrix``'s blocks as ``[block_rows, h]`` views (one call, whatever the block count)."""
        return matrix.view(self.last_step.numel(), self.block_rows, matrix.shape[1]).unbind(0)

    @property
    def num_blocks(self) -> int:
        """``N / block_rows``."""
        return self.last_step.numel()

    def blocks_of(self, touched_rows: Tensor) -> Tensor:
        """Sorted ids of the blocks that hold any of ``touched_rows`` (a bool ``[N]`` mask)."""
        return touched_rows.view(self.num_blocks, self.block_rows).any(dim=1).nonzero().squeeze(1)

    def blocks_mask(self, blocks: Tensor) -> Tensor:
        """Bool ``[N]``: the rows of ``blocks``."""
        mask = torch.zeros(self.num_blocks, dtype=torch.bool)
        mask[blocks] = True
        return mask.repeat_interleave(self.block_rows)

    def row_ranges(self, blocks: Tensor) -> list[tuple[int, int]]:
        """``[start, end)`` row ranges covering ``blocks`` (sorted, unique), neighbouring blocks merged."""
        ranges: list[list[int]] = []
        for block in blocks.tolist():
            start = block * self.block_rows
            if ranges and ranges[-1][1] == start:
                ranges[-1][1] = start + self.block_rows
            else:
                ranges.append([start, start + self.block_rows])
        return [(start, end) for start, end in ranges]

    def moments(self, index: int = 0) -> tuple[Tensor, Tensor]:
        """Matrix ``index``'s first and second moments as dense Adam would hold them after the latest step (copies:
        the stored moments times each block's scales, decayed over the steps since the block was last stepped)."""
        gaps = (self.step_count - self.last_step).double()
        beta1, beta2 = self._betas
        scale1 = (self.scale1 * beta1**gaps).repeat_interleave(self.block_rows).unsqueeze(1)
        scale2 = (self.scale2 * beta2**gaps).repeat_interleave(self.block_rows).unsqueeze(1)
        return ((self.exp_avg[index].double() * scale1).float(), (self.exp_avg_sq[index].double() * scale2).float())

    @torch.no_grad()
    def grad_norm_squares(self, grads: list[Tensor], blocks: Tensor) -> Tensor:
        """Sum of squares (fp64 scalar) of ``grads`` over the rows of ``blocks``, read in place (no masked copies)."""
        slices = [g[start:end] for g in grads for start, end in self.row_ranges(blocks)]
        if not slices:
            return torch.zeros((), dtype=torch.float64)
        norms = torch.stack(torch._foreach_norm(slices)).double()
        return norms.pow(2).sum()

    @torch.no_grad()
    def step(self, blocks: Tensor, grads: list[Tensor], settings: RowAdamSettings, clip: Clip = None,
             zero_grads: bool = True) -> list[tuple[int, int]]:
        """One Adam step on ``blocks``, reading their rows of the full-size gradient accumulators ``grads`` (one per
        matrix) and, with ``zero_grads``, zeroing those rows afterwards, ready for the next step's sums.

        Args:
            blocks: sorted unique int64 block ids (:meth:`blocks_of`).
            grads: ``[N, h]`` fp32 gradient accumulators, one per matrix, zero outside the touched rows.
            settings: this step's hyper-parameters.
            clip: ``("norm", c)`` scales the gradients by ``c``; ``("value", b)`` clamps them to ``[−b, b]``.
            zero_grads: zero the stepped rows of ``grads`` (``False`` when the caller overwrites them at the next
                step's first gradient instead, as ``meft_offload`` does).

        Returns:
            The ``[start, end)`` row ranges stepped (for refreshing copies of the rows elsewhere).
        """
        if len(grads) != len(self.params):
            raise ValueError(f"Expected {len(self.params)} gradient accumulators, got {len(grads)}.")
        self.step_count += 1
        self._betas = settings.betas
        ranges = self.row_ranges(blocks)
        if not ranges:
            return []  # a step whose batch touched no row (all padding): only the count advances
        grad_blocks = [self._by_block(g) for g in grads]
        block_list = blocks.tolist()
        grad_slices = [g[block] for g in grad_blocks for block in block_list]
        if clip is not None and clip[0] == "value":
            for piece in grad_slices:
                piece.clamp_(-clip[1], clip[1])
        coefficient = clip[1] if clip is not None and clip[0] == "norm" else 1.0
        gaps, scale1, scale2 = self._decayed_scales(blocks, settings.betas)
        new_scale1 = self._new_first_scales(scale1, scale2, settings.betas[0])
        self._step.fill_(self.step_count)
        kernel = torch._fused_adamw_ if settings.decoupled else torch._fused_adam_
        for lr_scale in dict.fromkeys(self.lr_scales):  # matrices sharing a learning rate share the kernel calls
            matrices = [i for i, s in enumerate(self.lr_scales) if s == lr_scale]
            calls = self._calls(blocks, gaps, scale1, scale2, new_scale1, settings, settings.lr * lr_scale)
            for (hyper, moment_scale), members in calls.items():
                pairs = [(i, block) for i in matrices for block in members]
                grad_scale = moment_scale / coefficient  # the kernel divides the gradient by it
                kernel([self._param_blocks[i][b] for i, b in pairs], [grad_blocks[i][b] for i, b in pairs],
                       [self._exp_avg_blocks[i][b] for i, b in pairs],
                       [self._exp_avg_sq_blocks[i][b] for i, b in pairs], [], [self._step] * len(pairs),
                       **dict(hyper), amsgrad=False, maximize=settings.maximize,
                       grad_scale=None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32),
                       found_inf=None)
        self.scale1[blocks] = new_scale1
        self.scale2[blocks] = scale2
        if zero_grads:
            torch._foreach_zero_(grad_slices)
        self.last_step[blocks] = self.step_count
        return ranges

    def _decayed_scales(self, blocks: Tensor, betas: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor]:
        """Gaps of ``blocks`` and their moment scales decayed over them, to just before this step (float64).

        Blocks never stepped have zero moments, whose scale is arbitrary: 1. Blocks whose second-moment scale fell
        below :data:`RENORMALIZE_BELOW` get their stored moments rescaled here, and scales of 1.
        """
        last = self.last_step[blocks]
        gaps = (self.step_count - 1 - last).double()
        fresh = last == 0
        scale1 = torch.where(fresh, 1.0, self.scale1[blocks] * betas[0]**gaps)
        scale2 = torch.where(fresh, 1.0, self.scale2[blocks] * betas[1]**gaps)
        small = scale2 < RENORMALIZE_BELOW
        if small.any():
            for block, s1, s2 in zip(blocks[small].tolist(), scale1[small].tolist(), scale2[small].tolist()):
                rows = slice(block * self.block_rows, (block + 1) * self.block_rows)
                for exp_avg, exp_avg_sq in zip(self.exp_avg, self.exp_avg_sq):
                    exp_avg[rows].mul_(s1)
                    exp_avg_sq[rows].mul_(s2)
            scale1 = torch.where(small, 1.0, scale1)
            scale2 = torch.where(small, 1.0, scale2)
        return gaps, scale1, scale2

    @staticmethod
    def _new_first_scales(scale1: Tensor, scale2: Tensor, beta1: float) -> Tensor:
        # The gradient enters the stored moments divided by c = √s2 (so the stored second moment keeps β₂); the
        # first moment's scale after the step is then β₁·s1 + (1 − β₁)·c. Exactly 1 for blocks never skipped.
        exact = (scale1 == 1.0) & (scale2 == 1.0)
        return torch.where(exact, 1.0, beta1 * scale1 + (1.0 - beta1) * scale2.sqrt())

    def _calls(self, blocks: Tensor, gaps: Tensor, scale1: Tensor, scale2: Tensor, new_scale1: Tensor,
               settings: RowAdamSettings, lr: float) -> dict[tuple[tuple[tuple[str, float], ...], float], list[int]]:
        """The kernel calls of one learning rate: per distinct (hyper-parameters, gradient scale ``c``), the blocks
        they step. With ``m = s1·M`` and ``v = s2·W`` stored as ``M`` and ``W``, Adam's true step
        ``m' = β₁m + (1−β₁)g``, ``v' = β₂v + (1−β₂)g²``, ``p' = d·p − lr·(m'/b₁)/(√(v'/b₂) + ε)`` is the kernel's
        step on ``M, W`` with gradient ``g/c``, ``β₁' = β₁s1/s1'``, ``β₂``, ``ε' = ε/c`` and
        ``lr' = lr·s1'·(1 − β₁'^t)/(b₁·c)``; decoupled decay over the gap folds into the kernel's decay. Blocks never
        skipped get the user's hyper-parameters unchanged."""
        beta1, beta2 = settings.betas
        bias1 = 1.0 - beta1**self.step_count
        calls: dict[tuple[tuple[tuple[str, float], ...], float], list[int]] = {}
        for block, gap, s1, s2, s1_new in zip(blocks.tolist(), gaps.tolist(), scale1.tolist(), scale2.tolist(),
                                              new_scale1.tolist()):
            if s1 == 1.0 and s2 == 1.0:
                kernel_beta1, kernel_lr, kernel_eps, c = beta1, lr, settings.eps, 1.0
            else:
                c = s2**0.5
                kernel_beta1 = beta1 * s1 / s1_new
                kernel_lr = lr * s1_new * (1.0 - kernel_beta1**self.step_count) / (bias1 * c)
                kernel_eps = settings.eps / c
            decay = settings.weight_decay
            if decay and settings.decoupled and (gap or kernel_lr != lr):
                # g + 1 steps of decay at once; at lr 0 (a schedule passing through it) the kernel steps nothing and
                # nothing decays, so there is nothing to fold in (and no lr to divide by).
                decay = (1.0 - (1.0 - lr * decay)**(gap + 1)) / kernel_lr if kernel_lr else 0.0
            elif decay and not settings.decoupled:
                decay = decay / c  # Adam's L2 joins the gradient after the kernel divided it by c
            hyper = (("lr", kernel_lr), ("beta1", kernel_beta1), ("beta2", beta2), ("weight_decay", decay),
                     ("eps", kernel_eps))
            calls.setdefault((hyper, c), []).append(block)
        return calls

    def state_dict(self) -> dict[str, Any]:
        """Stored moments and their per-block scales, the step count and each block's last step (host tensors,
        shared, not copied)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "scale1": self.scale1, "scale2": self.scale2,
                "step": self.step_count, "last_step": self.last_step, "block_rows": self.block_rows,
                "betas": self._betas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` in place.

        Raises:
            ValueError: For state of another layout: per-row step counts (the lazy row Adam this replaced) or
                another block size.
        """
        if "steps" in state and "last_step" not in state:
            raise ValueError("This MEFT checkpoint holds per-row Adam step counts, written by lightning_offload's "
                             "earlier lazy row Adam; its state does not carry over to the block Adam (one step count, "
                             "moments caught up over gaps). Resume it with the release that wrote it, or load only "
                             "the model's weights (its state_dict) and start the optimizer afresh.")
        if int(state["block_rows"]) != self.block_rows:
            raise ValueError(f"This MEFT checkpoint steps blocks of {state['block_rows']} rows, the strategy "
                             f"{self.block_rows}: resume with meft_offload(row_block={state['block_rows']}).")
        for name in ("exp_avg", "exp_avg_sq"):
            for dst, src in zip(getattr(self, name), state[name]):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"MEFT row Adam state {name} has shape {tuple(src.shape)}, expected "
                                     f"{tuple(dst.shape)}: resume with the same adapter configuration.")
                dst.copy_(src)
        self.last_step.copy_(state["last_step"])
        self.scale1.copy_(state["scale1"])
        self.scale2.copy_(state["scale2"])
        self.step_count = int(state["step"])
        self._betas = tuple(state["betas"])
