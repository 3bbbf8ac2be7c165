"""Where one host matrix's row gradients land during a step (MEFT's adapter keys, or values), and the gradient of
each block the step then steps.

A step's only gradient of a matrix is kept where it landed (``[R, h]`` for its ``R`` sorted rows): a block whose rows
all have a gradient is stepped from a view of it, and only blocks with rows left out are assembled in the full-size
``[N, h]`` accumulator. A second gradient (accumulation) moves the kept one into the accumulator, where the step's sums
are then added: a row's first gradient is copied in and marked ``written``, so no pass zeroes consumed rows.

Either way a block is stepped from the same numbers. The native kernel
(:mod:`~lightning_offload.engine.rows.native_row_adam`) reads the rows where they lie (:meth:`RowLanding.landed_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_offload.engine.rows.host_threads import SMALL_OP_ELEMENTS
from lightning_offload.engine.rows.native_row_adam import LandedRows

# One small tensor op's overhead, in fp32 elements copied in the same time: picks block-by-block or one-op copies.
OP_COST_ELEMENTS = 65536


@dataclass
class KeptLayout:
    """Where a step's kept rows lie among its blocks, worked out once for the matrices given gradients of the same
    rows (an adapter's keys and values).

    Attributes:
        rows: the kept rows (sorted, unique); ``None`` for the rows touched (fetched for training) since the last step,
            of which the kept rows are a part: all of them when as many.
        per_block: how many of them each stepped block holds, in the blocks' order.
        idle: the rows of the blocks they cover in part that have no gradient (once needed).
    """

    rows: Tensor | None
    per_block: list[int]
    idle: Tensor | None = None


class RowLanding:
    """One matrix's accumulator and this step's landed gradient, if kept.

    Threads: :meth:`land` runs on the engine's worker; the reads run on the main thread once the worker has added every
    queued gradient (:meth:`~lightning_offload.engine.rows.row_gradients.RowGradients.flush`); :meth:`forget` runs on
    the worker after the step, before the next step's gradients (the next forward waits for the step).

    Args:
        accumulator: the full-size ``[N, h]`` fp32 accumulator (valid where ``written``).
        written: bool ``[N]``: rows of ``accumulator`` holding this step's sum.
        block_rows: rows per block, the unit the row Adam steps.
    """

    def __init__(self, accumulator: Tensor, written: Tensor, block_rows: int) -> None:
        self.accumulator = accumulator
        self.written = written
        self.block_rows = block_rows
        self.num_blocks = accumulator.shape[0] // block_rows
        #: Blocks small enough that the row work on them runs on one thread (engine/rows/host_threads.py).
        self.small = block_rows * accumulator.shape[1] < SMALL_OP_ELEMENTS
        #: The step's one gradient, kept where it landed: ``(rows, grad)``, rows sorted and unique.
        self.kept: tuple[Tensor, Tensor] | None = None
        # Whether any row may be marked written: a flag, since a pass over the mask per gradient costs as much as
        # landing it.
        self._written = bool(written.any())
        # The accumulator as [blocks, block_rows, h], and its blocks as views (made once: a view per block).
        self._by_block = accumulator.view(self.num_blocks, block_rows, accumulator.shape[1])
        self._blocks = self._by_block.unbind(0)

    def land(self, rows: Tensor, grad: Tensor, keep: bool, want_square: bool) -> float | None:
        """Worker thread: this step's gradient of ``rows`` (sorted, unique) arrives, fp32.

        Args:
            rows: the rows it is for.
            grad: ``[len(rows), h]``, fp32.
            keep: it may be kept where it is until the step (no staging buffer it must give back).
            want_square: the caller still sums ``Σ g²`` of the step's gradients as they land.

        Returns:
            ``None`` when some of its rows already had a gradient this step (summed: the step's norm must be read
            from the sums), else ``Σ g²`` of ``grad`` (``0.0`` unless ``want_square``).
        """
        if keep and self.kept is None and not self._written:
            self.kept = (rows, grad)  # the step's first gradient of this matrix: stepped from where it is
            return _square(grad) if want_square else 0.0
        self.materialize()
        fresh = ~self.written[rows]
        square: float | None = None
        if bool(fresh.all()):  # the step's first gradient of these rows: copied in, no zeroing ever needed
            self.accumulator.index_copy_(0, rows, grad)
            square = _square(grad) if want_square else 0.0
        elif bool(fresh.any()):
            self.accumulator.index_copy_(0, rows[fresh], grad[fresh])
            self.accumulator.index_add_(0, rows[~fresh], grad[~fresh])
        else:
            self.accumulator.index_add_(0, rows, grad)
        self.written.index_fill_(0, rows, True)
        self._written = True
        return square

    def materialize(self) -> None:
        """Put a kept gradient into the accumulator (its rows marked written), as a second gradient or a reader of
        the accumulator needs."""
        if self.kept is None:
            return
        rows, grad = self.kept
        self.kept = None
        self.accumulator.index_copy_(0, rows, grad)
        self.written.index_fill_(0, rows, True)
        self._written = True

    @torch.no_grad()
    def block_gradients(self, blocks: Tensor, block_list: list[int],
                        layout: KeptLayout | None = None) -> tuple[list[Tensor], KeptLayout | None]:
        """Main thread, at the step: the gradient of each of ``blocks`` (sorted; ``block_list`` the same as a list),
        a ``[block_rows, h]`` tensor each, zero in the rows no gradient reached (a block is stepped whole).

        Args:
            blocks: the step's blocks.
            block_list: the same, as a list.
            layout: the touched rows' layout, or another landing's from this step (an adapter's keys and values get
                their gradients for the same rows): not worked out again when this one kept the same rows.

        Returns:
            The blocks' gradients, and the layout for the next landing: this one's when it kept its gradient, else
            the one given.
        """
        kept_layout = self._kept_layout(blocks, layout)
        if kept_layout is not None:
            return self._from_kept(self.kept[1], block_list, kept_layout), kept_layout  # type: ignore[index]
        return self._from_accumulator(blocks, block_list), layout

    @torch.no_grad()
    def landed_rows(self, blocks: Tensor, layout: KeptLayout | None = None) -> tuple[LandedRows, KeptLayout | None]:
        """Main thread, at the step: where the gradients of ``blocks`` lie, for the native kernel to read them there
        (nothing is copied or zeroed): the kept gradient and its rows, or the accumulator and the rows written.

        Args:
            blocks: the step's blocks (sorted).
            layout: as for :meth:`block_gradients`.

        Returns:
            The gradients' place, and the layout for the next landing (as :meth:`block_gradients`).
        """
        kept_layout = self._kept_layout(blocks, layout)
        if kept_layout is not None:
            rows, grad = self.kept  # type: ignore[misc]
            return LandedRows(grad.contiguous(), rows.contiguous(), None), kept_layout
        return LandedRows(self.accumulator, None, self.written), layout

    def _kept_layout(self, blocks: Tensor, layout: KeptLayout | None) -> KeptLayout | None:
        """The kept gradient's layout among ``blocks`` when the step can read its blocks from it, else ``None`` (no
        gradient kept, or one with rows outside the blocks: then put into the accumulator)."""
        if self.kept is None:
            return None
        rows = self.kept[0]
        if layout is not None and layout.rows is None and sum(layout.per_block) == rows.numel():
            layout = KeptLayout(rows, layout.per_block)  # every touched row got this gradient: the same layout
        elif layout is None or layout.rows is not rows:
            counts = torch.bincount(rows.div(self.block_rows, rounding_mode="floor"), minlength=self.num_blocks)
            layout = KeptLayout(rows, counts.index_select(0, blocks).tolist())
        if sum(layout.per_block) == rows.numel():  # every kept row lies in a stepped block (they were touched)
            return layout
        self.materialize()
        return None

    def _from_kept(self, grad: Tensor, block_list: list[int], layout: KeptLayout) -> list[Tensor]:
        # Rows are sorted, so a whole block is a view of the kept gradient; partial blocks are assembled in the
        # accumulator, copied block by block or in one op, whichever OP_COST_ELEMENTS says is cheaper.
        rows = layout.rows
        out: list[Tensor] = []
        partial: list[tuple[int, int, int]] = []  # (block, start, count) in the kept gradient
        start = 0
        for block, count in zip(block_list, layout.per_block):
            if count == self.block_rows:
                out.append(grad[start:start + count])
            else:
                partial.append((block, start, count))
                out.append(self._blocks[block])
            start += count
        if not partial:
            return out
        if layout.idle is None:
            idle = torch.zeros(self.written.shape, dtype=torch.bool)
            idle.view(self.num_blocks, self.block_rows).index_fill_(0, torch.tensor([b for b, _, _ in partial]), True)
            layout.idle = idle.index_fill_(0, rows, False).nonzero().squeeze(1)
        self.accumulator.index_fill_(0, layout.idle, 0.0)
        whole_elements = (len(block_list) - len(partial)) * self._blocks[0].numel()
        if len(partial) * OP_COST_ELEMENTS < whole_elements:
            for _, first, count in partial:
                if count:
                    self.accumulator.index_copy_(0, rows[first:first + count], grad[first:first + count])
        else:
            self.accumulator.index_copy_(0, rows, grad)
        return out

    def _from_accumulator(self, blocks: Tensor, block_list: list[int]) -> list[Tensor]:
        # The stepped blocks' rows no gradient reached may hold a consumed step's sum: zero only them.
        in_blocks = torch.zeros(self.num_blocks, dtype=torch.bool).index_fill_(0, blocks, True)
        in_blocks = in_blocks.repeat_interleave(self.block_rows)
        idle = (in_blocks & ~self.written).nonzero().squeeze(1)
        if idle.numel():
            self.accumulator.index_fill_(0, idle, 0.0)
        self.written.view(self.num_blocks, self.block_rows).index_fill_(0, blocks, True)
        self._written = True
        return [self._blocks[block] for block in block_list]

    def forget(self, blocks: Tensor) -> None:
        """The step consumed (or dropped) the gradients of ``blocks``: the next step's first gradient of their rows
        overwrites them."""
        self.kept = None
        if self._written:
            self.written.view(self.num_blocks, self.block_rows).index_fill_(0, blocks, False)
            self._written = False


def _square(grad: Tensor) -> float:
    flat = grad.reshape(-1)
    return float(torch.dot(flat, flat))
