"""The decoupled weight decay that blocks of rows owe for the steps they were not stepped, exact under any schedule.

AdamW multiplies every weight by ``1 − lr_t·λ`` at every step ``t``, touched or not. The row Adam
(:class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`) steps only the blocks a batch touched, so a block
idle from step ``a`` to step ``b`` owes ``Π_{a<t≤b} (1 − lr_t·λ)``: a product over the learning rates of the steps it
missed, which a warm-up, a cosine schedule or a schedule through lr 0 make anything but ``(1 − lr·λ)^gap`` at one
step's rate.

:class:`DecayLedger` keeps, per matrix, the running sum ``L_t = Σ_{s≤t} log(1 − lr_s·λ_s)`` in float64 (advanced at
every step of the matrix, a step that touched no row included) and, per block, the value of ``L`` when its decay was
last paid (8 bytes per block and matrix). A block then owes ``exp(L_now − mark)``, whatever the schedule: paid at its
next step, and read without paying it whenever the weights are read (:meth:`BlockRowAdam.decayed_rows`, which an
embedding's slot and a MEFT adapter's slot show on reads), with the same product. A block paid at every step owes
``exp(0) = 1`` exactly, so it keeps torch's fused AdamW arithmetic bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class DecayLedger:
    """Decoupled decay paid and owed by the blocks of matrices stepped block by block.

    Args:
        num_blocks: blocks per matrix.
        lr_scales: per matrix, its factor on the learning rate (its decay per step is ``1 − lr·scale·λ``).
    """

    def __init__(self, num_blocks: int, lr_scales: list[float]) -> None:
        self.lr_scales = list(lr_scales)
        #: Per matrix, ``Σ log(1 − lr_s·scale·λ_s)`` over every step taken so far (float64).
        self.totals = [0.0] * len(lr_scales)
        #: Per matrix and block, the matrix's total when the block's decay was last paid.
        self.marks = torch.zeros(len(lr_scales), num_blocks, dtype=torch.float64)
        #: Whether any block may owe anything (no step has decayed so far: none does, and nothing need be computed).
        self.active = False

    def owed(self, matrix: int, blocks: Tensor, out: Tensor | None = None) -> Tensor:
        """The factors (float64) by which ``blocks`` of matrix ``matrix`` must still be decayed for the steps since
        their decay was last paid (exactly 1 for a block paid at the latest step), written into ``out`` when given
        (a float64 buffer of ``len(blocks)``: a host job allocates nothing)."""
        if out is None:
            return torch.exp(self.totals[matrix] - self.marks[matrix, blocks])
        return torch.index_select(self.marks[matrix], 0, blocks, out=out).neg_().add_(self.totals[matrix]).exp_()

    def advance(self, lr: float, weight_decay: float, decoupled: bool) -> None:
        """A step of the matrices was taken at ``lr`` (with or without rows touched): the decay AdamW applies at it
        joins every matrix's total (nothing for Adam's coupled L2, which is no decay of idle weights).

        Raises:
            ValueError: when ``lr·λ ≥ 1``: the factor would zero or flip every weight.
        """
        if not (decoupled and weight_decay and lr):
            return
        for index, scale in enumerate(self.lr_scales):
            rate = lr * scale * weight_decay
            if rate >= 1.0:
                raise ValueError(f"lr·weight_decay = {rate!r} ≥ 1: decoupled decay would zero or flip every weight "
                                 f"at this step. Lower the learning rate or weight_decay.")
            self.totals[index] += math.log1p(-rate)
        self.active = True

    def paid(self, blocks: Tensor | None = None) -> None:
        """``blocks`` (every block for ``None``) owe nothing up to now."""
        if not self.active:
            return  # no step has decayed: every total and mark is 0 already
        if blocks is not None and len(set(self.totals)) == 1:  # matrices with one history (one lr): one write
            self.marks.index_fill_(1, blocks, self.totals[0])
            return
        for index, total in enumerate(self.totals):
            if blocks is None:
                self.marks[index].fill_(total)
            else:
                self.marks[index].index_fill_(0, blocks, total)

    def state_dict(self) -> dict[str, Any]:
        """The totals and marks (the marks shared, not copied)."""
        return {"totals": list(self.totals), "marks": self.marks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: for another number of matrices or blocks.
        """
        marks = state["marks"]
        if tuple(marks.shape) != tuple(self.marks.shape):
            raise ValueError(f"Row decay state has shape {tuple(marks.shape)}, expected {tuple(self.marks.shape)}: "
                             f"resume with the same model and adapter configuration.")
        self.totals = [float(total) for total in state["totals"]]
        self.marks.copy_(marks)
        self.active = any(total != 0.0 for total in self.totals)
