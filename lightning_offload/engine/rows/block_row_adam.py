"""The one row Adam of the engine: Adam over the rows of fp32 host matrices, stepping only the rows a step touched.

A MEFT adapter's keys and values and a row-sparse embedding both have gradients in a few of many rows; both are
stepped here, with one state layout and one catch-up rule. The rows are split into contiguous blocks, and a step takes
one of two paths:

* **In place, block by block** (:meth:`BlockRowAdam.step`; MEFT, a block being one expert's neurons): the touched
  blocks go to torch's fused Adam kernel as slices of the host matrices, with no gathered copies.
* **Gathered** (:meth:`BlockRowAdam.step_rows`; the embedding, one row per block): thousands of scattered rows would
  be thousands of kernel calls, so they are gathered into a workspace, stepped by one call, and scattered back.

Semantics, against dense AdamW over the whole matrix:

* **A touched block is stepped whole.** Its rows that no token routed to this step get a zero gradient, which is what
  dense AdamW gives them (their moments decay, their weights move on momentum).
* **One step count for the matrix**, so bias corrections are dense AdamW's at every step.
* **Blocks skipped for ``g`` steps catch up** when next touched: their moments are ``β₁^g`` and ``β₂^g`` times what
  they were (what ``g`` zero-gradient steps of dense Adam do to them) and, with decoupled weight decay, their weights
  ``Π (1 − lr_t·λ)`` times over the steps ``t`` they missed, at each step's own learning rate, exact under any
  schedule (:class:`~lightning_offload.engine.rows.row_decay.DecayLedger`). What is not reproduced is the drift of a
  skipped block's weights by its decaying momentum over the gap: it stays where it was.
* Coupled L2 (``Adam(weight_decay=...)``) is added by the kernel to the stepped blocks' gradients only.
* Norm clipping is part of the kernel's gradient scale (the gradient divided by ``1/c``, within an ulp of multiplying
  by ``c``); value clipping clamps the stepped slices first.

In place, the catch-up costs no pass over the moments: each block keeps two moment scales
(:mod:`~lightning_offload.engine.rows.row_adam_kernel`). A gathered step multiplies the gathered moments by their
catch-up factors instead, so a row stepped at every step gets dense fused Adam's arithmetic bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.rows.native_row_adam import LandedRows, native_row_adam, step_landed
from lightning_offload.engine.rows.row_adam_kernel import (
    RENORMALIZE_BELOW, Clip, RowAdamSettings, RowWorkspace, decayed_scales, new_first_scales, per_block_hyper,
    scaled_kernel_calls)
from lightning_offload.engine.rows.row_adam_state import load_row_adam_state
from lightning_offload.engine.rows.row_decay import DecayLedger

__all__ = ["RENORMALIZE_BELOW", "BlockRowAdam", "Clip", "RowAdamSettings"]


class BlockRowAdam:
    """Adam or AdamW over blocks of rows of fp32 host matrices that share their row layout (an adapter's keys and
    values; an embedding, one row per block), stepping only the blocks given.

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

        embedding = BlockRowAdam([torch.randn(50_000, 64)], block_rows=1)  # scattered rows: gathered steps
        embedding.step_rows(torch.tensor([3, 917, 4096]), torch.randn(3, 64), RowAdamSettings(lr=1e-3))
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
        # Per block, true moments = these × stored ones; two rows of one tensor so a step writes both in one op.
        self._scales = torch.ones(2, rows // block_rows, dtype=torch.float64)
        self.scale1, self.scale2 = self._scales.unbind(0)
        # How much decay each block owes, at the learning rates of the steps it missed.
        self.decay = DecayLedger(rows // block_rows, self.lr_scales)
        # The step count the fused kernel reads (one tensor handed for every slice: the kernel only reads it).
        self._step = torch.zeros((), dtype=torch.float32)
        # Each block of every matrix and moment as a view, made lazily: a gathered embedding never uses them.
        self._block_views: tuple[list[tuple[Tensor, ...]], ...] | None = None
        # The same for full-size gradient accumulators given to step(), by the accumulator's id.
        self._grad_views: dict[int, tuple[Tensor, tuple[Tensor, ...]]] = {}
        self._workspace = RowWorkspace(rows, params[0].shape[1])
        self._betas = (0.9, 0.999)  # the latest step's, for reading the moments back (moments())
        self._rows_touched = 0
        # Whether some block's scales differ from 1: a gathered step checks this flag, so it allocates nothing.
        self._scaled = False

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
        return self._ranges(blocks.tolist())

    def _ranges(self, block_list: list[int]) -> list[tuple[int, int]]:
        ranges: list[list[int]] = []
        for block in block_list:
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
    def step(self, blocks: Tensor, grads: Sequence[Tensor | Sequence[Tensor]], settings: RowAdamSettings,
             clip: Clip = None, zero_grads: bool = True) -> list[tuple[int, int]]:
        """One Adam step on ``blocks``, reading their gradients from ``grads`` (one entry per matrix).

        Args:
            blocks: sorted unique int64 block ids (:meth:`blocks_of`).
            grads: per matrix, its ``[N, h]`` fp32 gradient accumulator (zero outside the touched rows), one
                ``[block_rows, h]`` fp32 tensor per block of ``blocks``, or, for every matrix, a
                :class:`~lightning_offload.engine.rows.native_row_adam.LandedRows` (read by the native kernel, with
                ``zero_grads=False``).
            settings: this step's hyper-parameters.
            clip: ``("norm", c)`` scales the gradients by ``c``; ``("value", b)`` clamps them to ``[−b, b]``.
            zero_grads: zero the stepped gradients (``False`` when the caller overwrites them at the next step's
                first gradient instead, as ``meft_offload`` does).

        Returns:
            The ``[start, end)`` row ranges stepped (for refreshing copies of the rows elsewhere).
        """
        if len(grads) != len(self.params):
            raise ValueError(f"Expected {len(self.params)} gradient accumulators, got {len(grads)}.")
        self._begin_step(settings)
        block_list = blocks.tolist()
        if not block_list:
            self._end_step(settings)
            return []  # a step whose batch touched no row (all padding): the count and the decay owed advance
        params, exp_avgs, exp_avg_sqs = self._views()
        landed = [g for g in grads if isinstance(g, LandedRows)]
        if landed and (len(landed) != len(grads) or zero_grads or native_row_adam() is None):
            raise ValueError(f"Gradients where they landed (LandedRows) are read by the native kernel only, for every "
                             f"matrix and with zero_grads=False (they are not written); got {len(landed)} of "
                             f"{len(grads)} matrices, zero_grads={zero_grads}, kernel loaded: "
                             f"{native_row_adam() is not None}. Give per-block tensors or accumulators otherwise.")
        grad_blocks = [] if landed else [self._grads_of_blocks(g, block_list) for g in grads]  # type: ignore[arg-type]
        if clip is not None and clip[0] == "value":
            for pieces in grad_blocks:
                for piece in pieces:
                    piece.clamp_(-clip[1], clip[1])
        coefficient = clip[1] if clip is not None and clip[0] == "norm" else 1.0
        scale1, scale2 = self._decayed_scales(blocks, block_list, settings.betas)
        new_scale1 = new_first_scales(scale1, scale2, settings.betas[0])
        self._step.fill_(self.step_count)
        kernel = torch._fused_adamw_ if settings.decoupled else torch._fused_adam_
        positions = list(range(len(block_list)))
        for lr_scale in dict.fromkeys(self.lr_scales):  # matrices sharing a learning rate share the kernel calls
            matrices = [i for i, s in enumerate(self.lr_scales) if s == lr_scale]
            lr = settings.lr * lr_scale
            calls = scaled_kernel_calls(positions, self._owed_decay(matrices, blocks, lr), scale1, scale2,
                                        new_scale1, settings, lr, self.step_count)
            if landed:  # the same calls, each block's hyper-parameters a row, stepped where the gradients lie
                step_landed(self, matrices, blocks, landed, per_block_hyper(calls, len(block_list), coefficient),
                            settings, clip)
                continue
            # The kernel divides the gradient by its grad_scale: every call's, made as one tensor (if any is not 1).
            grad_scales = [moment_scale / coefficient for _, moment_scale in calls]
            scale_tensors = torch.tensor(grad_scales, dtype=torch.float32).unbind(0) \
                if any(scale != 1.0 for scale in grad_scales) else [None] * len(grad_scales)
            for ((hyper, _), members), grad_scale, scale_tensor in zip(calls.items(), grad_scales, scale_tensors):
                pairs = [(i, block_list[k], k) for i in matrices for k in members]
                kernel([params[i][b] for i, b, _ in pairs], [grad_blocks[i][k] for i, _, k in pairs],
                       [exp_avgs[i][b] for i, b, _ in pairs], [exp_avg_sqs[i][b] for i, b, _ in pairs], [],
                       [self._step] * len(pairs),
                       **dict(hyper), amsgrad=False, maximize=settings.maximize,
                       grad_scale=None if grad_scale == 1.0 else scale_tensor, found_inf=None)
        # The blocks' new scales, both in one write.
        self._scales.index_copy_(1, blocks, torch.tensor([new_scale1, scale2], dtype=torch.float64))
        self._scaled = self._scaled or any(s != 1.0 for s in new_scale1) or any(s != 1.0 for s in scale2)
        if zero_grads and grad_blocks:
            torch._foreach_zero_([piece for pieces in grad_blocks for piece in pieces])
        self.last_step.index_fill_(0, blocks, self.step_count)
        self._end_step(settings, blocks)
        self._rows_touched = len(block_list) * self.block_rows
        return self._ranges(block_list)

    def _grads_of_blocks(self, grads: Tensor | Sequence[Tensor], block_list: list[int]) -> Sequence[Tensor]:
        """One matrix's gradient of each block of ``block_list``: views of a full-size accumulator (its blocks'
        views made once per accumulator), or the per-block gradients given."""
        if not isinstance(grads, Tensor):
            if len(grads) != len(block_list):
                raise ValueError(f"Expected a gradient for each of the {len(block_list)} blocks, got {len(grads)}.")
            return grads
        views = self._grad_views.get(id(grads))
        if views is None or views[0] is not grads:
            views = self._grad_views[id(grads)] = (grads, self._by_block(grads))
        return [views[1][block] for block in block_list]

    def _begin_step(self, settings: RowAdamSettings) -> None:
        self.step_count += 1
        self._betas = settings.betas

    def _end_step(self, settings: RowAdamSettings, stepped: Tensor | None = None) -> None:
        """This step's decay joins what idle blocks owe; ``stepped`` blocks (their kernel applied it) owe nothing."""
        self.decay.advance(settings.lr, settings.weight_decay, settings.decoupled)
        if stepped is not None and settings.lr:  # at lr 0 nothing was paid (see _owed_decay)
            self.decay.paid(stepped)

    def _owed_decay(self, matrices: list[int], blocks: Tensor, lr: float) -> list[float]:
        """Per block, the decay ``matrices`` (sharing a learning rate) owe for earlier steps, for the kernel to fold
        into this step's. At lr 0 the blocks keep owing it, as AdamW moves no weight at lr 0."""
        if not (lr and self.decay.active):
            return [1.0] * blocks.numel()
        return self.decay.owed(matrices[0], blocks).tolist()

    def _views(self) -> tuple[list[tuple[Tensor, ...]], ...]:
        """Per matrix, its blocks, its first moment's and its second moment's, as views (made once)."""
        if self._block_views is None:
            self._block_views = ([self._by_block(p) for p in self.params], [self._by_block(m) for m in self.exp_avg],
                                 [self._by_block(v) for v in self.exp_avg_sq])
        return self._block_views

    @torch.no_grad()
    def step_rows(self, rows: Tensor, grad: Tensor, settings: RowAdamSettings) -> Tensor:
        """One gathered Adam step on scattered rows of a single matrix of one-row blocks (an embedding).

        Args:
            rows: unique int64 row indices.
            grad: their gradients, ``[len(rows), h]`` fp32 contiguous (clipped already: coupled L2 and ``maximize``
                are applied here as ``torch.optim.Adam`` applies them).
            settings: this step's hyper-parameters.

        Returns:
            The stepped rows' new values (a view of the workspace, valid until the next step).
        """
        if self.block_rows != 1 or len(self.params) != 1:
            raise ValueError(f"step_rows steps scattered rows of one matrix of one-row blocks; this one has "
                             f"{len(self.params)} matrices of blocks of {self.block_rows} rows: use step().")
        count = rows.numel()
        self._begin_step(settings)
        self._rows_touched = count
        param, exp_avg_all, exp_avg_sq_all = self.params[0], self.exp_avg[0], self.exp_avg_sq[0]
        if count == 0:
            self._end_step(settings)
            return param[:0]  # a step whose batch touched no row (all padding): the count and the decay owed advance
        weight, exp_avg, exp_avg_sq, factor1, factor2, decay, gaps, last, owed = self._workspace.views(count)
        beta1, beta2 = settings.betas
        torch.index_select(param, 0, rows, out=weight)
        torch.index_select(exp_avg_all, 0, rows, out=exp_avg)
        torch.index_select(exp_avg_sq_all, 0, rows, out=exp_avg_sq)
        # Catch each row's moments up over the steps it missed, as dense Adam's would have been.
        torch.index_select(self.last_step, 0, rows, out=last)
        gaps.copy_(last.unsqueeze(1)).neg_().add_(self.step_count - 1)
        exp_avg.mul_(torch.pow(beta1, gaps, out=factor1))
        exp_avg_sq.mul_(torch.pow(beta2, gaps, out=factor2))
        if self._scaled:
            # Rows last stepped in place keep scaled moments: made true here, as every gathered row's are.
            exp_avg.mul_(self.scale1[rows].float().unsqueeze(1))
            exp_avg_sq.mul_(self.scale2[rows].float().unsqueeze(1))
            self.scale1[rows], self.scale2[rows] = 1.0, 1.0
            self._scaled = bool((self.scale1 != 1.0).any() or (self.scale2 != 1.0).any())
        lr = settings.lr * self.lr_scales[0]
        if self.decay.active and lr:  # at lr 0 the rows keep owing it (nothing moves)
            # The decay each row owes for the steps it missed; the kernel applies this step's.
            weight.mul_(decay.copy_(self.decay.owed(0, rows, out=owed).unsqueeze(1)))
        # Torch's fused Adam/AdamW on the gathered rows, at the matrix's step count.
        self._step.fill_(self.step_count)
        kernel = torch._fused_adamw_ if settings.decoupled else torch._fused_adam_
        kernel([weight], [grad], [exp_avg], [exp_avg_sq], [], [self._step], lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=settings.weight_decay, eps=settings.eps, amsgrad=False, maximize=settings.maximize)
        param.index_copy_(0, rows, weight)
        exp_avg_all.index_copy_(0, rows, exp_avg)
        exp_avg_sq_all.index_copy_(0, rows, exp_avg_sq)
        self.last_step.index_fill_(0, rows, self.step_count)
        self._end_step(settings, rows)
        return weight

    @torch.no_grad()
    def decayed_rows(self) -> tuple[Tensor, list[Tensor]]:
        """The rows that owe decoupled decay, and copies of each matrix's values of them with it paid: AdamW's weights
        but for momentum drift. Reading them changes no later step."""
        owing = (self.decay.marks[0] != self.decay.totals[0]).nonzero().squeeze(1) if self.decay.active else \
            self.last_step[:0]
        rows = owing if self.block_rows == 1 else self.blocks_mask(owing).nonzero().squeeze(1)
        factors = [self.decay.owed(index, owing).float().repeat_interleave(self.block_rows).unsqueeze(1)
                   for index in range(len(self.params))]
        return rows, [matrix[rows] * factor for matrix, factor in zip(self.params, factors)]

    @property
    def rows_touched(self) -> int:
        """Rows the latest step read and wrote."""
        return self._rows_touched

    def state_tensors(self) -> list[Tensor]:
        """Every host tensor this optimizer holds beside the matrices (for memory accounting)."""
        return [*self.exp_avg, *self.exp_avg_sq, self.last_step, self.scale1, self.scale2,
                self.decay.marks, *self._workspace.tensors]

    def _decayed_scales(self, blocks: Tensor, block_list: list[int],
                        betas: tuple[float, float]) -> tuple[list[float], list[float]]:
        """``blocks``' moment scales decayed to just before this step (:func:`decayed_scales`), renormalizing those
        whose second-moment scale fell below :data:`RENORMALIZE_BELOW`."""
        scale1, scale2 = decayed_scales(blocks, self.last_step, self._scales, self.step_count, betas)
        for k, block in enumerate(block_list):
            if scale2[k] < RENORMALIZE_BELOW:
                rows = slice(block * self.block_rows, (block + 1) * self.block_rows)
                for exp_avg, exp_avg_sq in zip(self.exp_avg, self.exp_avg_sq):
                    exp_avg[rows].mul_(scale1[k])
                    exp_avg_sq[rows].mul_(scale2[k])
                scale1[k] = scale2[k] = 1.0
        return scale1, scale2

    def state_dict(self) -> dict[str, Any]:
        """Stored moments and their per-block scales, the step count, each block's last step, and the decay ledger
        (host tensors, shared, not copied)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "scale1": self.scale1, "scale2": self.scale2,
                "step": self.step_count, "last_step": self.last_step, "decay": self.decay.state_dict(),
                "block_rows": self.block_rows, "betas": self._betas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` in place
        (:func:`~lightning_offload.engine.rows.row_adam_state.load_row_adam_state`).

        Raises:
            ValueError: For state of another layout or shape.
        """
        load_row_adam_state(self, state)
