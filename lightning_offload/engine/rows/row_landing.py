"""Where one host matrix's row gradients land during a step (MEFT's adapter keys, or values), and the gradient of
each block the step then steps.

A step that hands a matrix one gradient (no accumulation: a micro-batch per step) keeps that gradient where it landed,
``[R, h]`` for its ``R`` sorted rows, instead of copying it into the full-size ``[N, h]`` accumulator as it lands: a
block whose rows all have a gradient is stepped straight from its rows of the landed gradient (a view: its rows are
consecutive there), and only blocks with rows left out (stepped whole, those rows with a zero gradient) are assembled
in the accumulator at the step, those rows zeroed and the others copied in. (Routing usually leaves a few of an
expert's neurons out, so most blocks are assembled: the copy is then the one landing it used to be, done at the step.)
A second gradient of the step (accumulation) puts the kept one into the accumulator first, and from then on the step's
sums are added there: a row's first gradient is copied in and marked ``written``, later ones added (so no pass ever
zeroes the rows a step consumed).

The numbers a block is stepped from are the same either way (the same gradient values, zeros where no gradient
came), so the row Adam's results do not depend on which path the step took. Where the row Adam's native kernel
steps the blocks (:mod:`~lightning_offload.engine.rows.native_row_adam`), nothing is assembled: it is told where the
rows lie (:meth:`RowLanding.landed_rows`) and reads them there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_offload.engine.rows.host_threads import SMALL_OP_ELEMENTS
from lightning_offload.engine.rows.native_row_adam import LandedRows

# About what one small tensor op costs beside its work, in fp32 elements copied in the same time (~25 µs on this
# project's CPU within a training step, its code and data out of the caches): how a step picks between copying rows
# block by block and in one op.
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

    Thread discipline: :meth:`land` runs on the engine's worker as gradients arrive; :meth:`block_gradients`,
    :meth:`materialize` and the reads run on the main thread once the worker has added every queued gradient
    (:meth:`~lightning_offload.engine.rows.row_gradients.RowGradients.flush`); :meth:`forget` runs after the step, on
    the worker, before any gradient of the next step can arrive (the next forward waits for the step).

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
        # Whether any row may be marked written (rows are marked only here, and a step's forget clears every block
        # they lie in: the step's blocks are those of every row touched, a superset of the rows that got a gradient).
        # Kept as a flag: a pass over the mask at every gradient cost as much as the rest of landing it.
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
        # Rows are sorted, so a block's rows are consecutive in the kept gradient: a whole block is a view of it.
        # Blocks with rows left out are assembled in the accumulator: those rows zeroed (one op for them all), the
        # others copied in, block by block, or all the kept rows in one op when the blocks left out are so many that
        # their ops would cost more than copying the whole blocks' rows too.
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
        # The rows of the stepped blocks that no gradient reached may hold a consumed step's sum: zeroed (only
        # they), and every row of the blocks then holds this step's sum.
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
