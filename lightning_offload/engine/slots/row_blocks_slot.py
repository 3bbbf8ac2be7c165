"""Host matrices stepped block by block (MEFT's adapter keys and values) as a slot of the engine: their row gradients
are summed on the host during backward (:mod:`~lightning_offload.engine.rows.row_gradients`), and the step runs
:class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam` on the blocks touched since the last one, on the
engine's worker, under the engine's one norm, clip and skip decision."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings
from lightning_offload.engine.rows.host_row_blocks import HostRowBlocks
from lightning_offload.engine.rows.host_threads import one_thread, team_size
from lightning_offload.engine.rows.native_row_adam import native_row_adam, tail_free
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.engine.rows.row_landing import KeptLayout, RowLanding
from lightning_offload.engine.slots.slot import Clip, JobSettings, Slot

log = logging.getLogger("lightning_offload")


class RowBlocksSlot(Slot):
    """One owner's host row matrices, stepped whole block by whole block at every step the engine takes.

    Args:
        rows: the matrices and their gradient accumulators.
        settings: this step's row Adam hyper-parameters (read on the main thread when the step launches).
        gradients: where the row gradients land (shared by every row slot of the engine).
        lanes: the engine's lanes.
    """

    #: Its gradients arrive through its owner's hooks, and its owner's forward waits for its update.
    routed = False
    #: They crossed during backward, row by row, through :class:`RowGradients`: the step never sends them.
    crosses_by_itself = True

    def __init__(self, rows: HostRowBlocks, settings: Callable[[], RowAdamSettings], gradients: RowGradients,
                 lanes: Lanes) -> None:
        super().__init__(rows.name, rows.matrices[0], {}, lanes, decoupled=True)
        self.rows = rows
        self.row_adam = BlockRowAdam(rows.matrices, rows.block_rows, lr_scales=rows.lr_scales)
        self._settings = settings
        self.gradients = gradients
        self.landings = [RowLanding(accumulator, written, rows.block_rows)
                         for accumulator, written in zip(rows.accumulators, rows.written)]
        gradients.add_slot(self, self.landings)
        self.blocks = torch.zeros(0, dtype=torch.int64)
        # Per matrix, the gradient of each touched block, or where they landed for the native kernel (prepared with
        # the blocks, consumed by the step), and the rows touched then.
        self.block_grads: list[Any] = []
        self.touched_rows = 0
        #: The latest step's figures: rows with a gradient, and rows stepped (whole blocks).
        self.rows_updated = 0
        self.rows_stepped = 0
        self._said_torch_steps = False  # the log said once that the loaded native kernel does not fit these blocks
        # Rows shown with the decay their blocks owe (settle): the blocks, their rows, and each matrix's master values
        # of them, put back before training reads them (unsettle); and the step count they were shown at.
        self.shown: tuple[Tensor, Tensor, list[Tensor]] | None = None
        self.shown_step = -1

    # ------------------------------------------------------------------------------------------------ backward
    def gradient(self) -> Tensor | None:
        return None  # summed on the host: the engine takes its norm from the row gradients (RowGradients.norm)

    def has_grad(self) -> bool:
        return True  # every step taken steps it: its step count advances even when no row was touched

    def gradient_unseen_by_edits(self) -> str | None:
        return "the MEFT adapters' host rows"  # summed on the host, never a param.grad


    def touched_blocks(self) -> Tensor:
        """Main thread, once per step: the touched blocks, each with its gradient per matrix (a block is stepped
        whole: zero in its rows no gradient reached)."""
        with one_thread(self.landings[0].small):
            # Rows touched per block: the blocks, the rows updated, and (a step without accumulation) where the kept
            # gradients' rows lie, all from one count.
            counts = self.rows.touched.view(self.row_adam.num_blocks, self.row_adam.block_rows).sum(dim=1)
            blocks = counts.nonzero().squeeze(1)
            block_list = blocks.tolist()
            layout = KeptLayout(None, counts.index_select(0, blocks).tolist())
            self.touched_rows = sum(layout.per_block)
            self.block_grads = []
            native = self._native()
            for index, landing in enumerate(self.landings):
                if native:  # read where they landed by the kernel: nothing assembled
                    landed, layout = landing.landed_rows(blocks, layout)
                    landed.mirror = self._mirror() if index == 0 else None
                    self.block_grads.append(landed)
                else:
                    grads, layout = landing.block_gradients(blocks, block_list, layout)
                    self.block_grads.append(grads)
        return blocks

    def _native(self) -> bool:
        """Whether the native kernel steps this slot's blocks: it is loaded, and torch's kernel would step a block
        with the threads the step runs with in whole vectors (so both give the same bits)."""
        landing = self.landings[0]
        if native_row_adam() is None:
            return False  # the log said why when the kernel was looked up
        elements, threads = landing.block_rows * landing.accumulator.shape[1], team_size(landing.small)
        if tail_free(elements, threads):
            return True
        if not self._said_torch_steps:
            self._said_torch_steps = True
            log.info("%s: blocks of %d elements are stepped by torch's fused kernel, not the native one (it gives "
                     "torch's bits only for blocks of a multiple of 16 × %d threads); the same results, slower.",
                     self.name, elements, threads)
        return False

    def _mirror(self) -> Tensor | None:
        """The owner's bf16 host copy of the first matrix, when the kernel can rewrite it in place."""
        mirror = self.rows.mirror()
        first = self.rows.matrices[0]
        if mirror is None or mirror.dtype != torch.bfloat16 or mirror.device.type != "cpu" \
                or mirror.shape != first.shape or not mirror.is_contiguous():
            return None
        return mirror

    def square_sum(self, blocks: Tensor) -> Tensor:
        """Σ g² (fp64) of the accumulated gradients over ``blocks`` (read in the accumulators, where every gradient of
        the step is put first)."""
        for landing in self.landings:
            landing.materialize()
        return self.row_adam.grad_norm_squares(self.rows.accumulators, blocks)

    def materialize(self) -> None:
        """Put the step's gradients kept where they landed into the accumulators, for a reader of them (main thread;
        a step in flight, which reads the gradients it was given, is waited for first)."""
        self.wait()
        self.gradients.flush()
        for landing in self.landings:
            landing.materialize()

    # ------------------------------------------------------------------------------------------------ the step
    def settings(self) -> JobSettings:
        # A shallow copy of the fields (the tuple of betas is immutable): dataclasses.asdict copies recursively.
        return dict(vars(self._settings())), 0.0

    def prepare(self, step: StepTelemetry) -> None:
        self.unsettle()  # shown since the forward (a read between backward and step): the step steps the masters
        self.blocks = self.gradients.take(self)
        self.rows_updated = self.touched_rows  # counted with the blocks
        self.rows_stepped = self.blocks.numel() * self.row_adam.block_rows

    def host_step(self, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  speculative: bool = False) -> None:
        """Worker thread: the block Adam step, then the owner's copy of the stepped rows is refreshed and their
        gradients forgotten (not zeroed: the next step's first gradient of a row overwrites it)."""
        start = time.perf_counter()
        hparams = settings[0]
        # A norm coefficient as the float the kernel's gradient scale is solved from (in float64).
        row_clip = None if clip is None else (clip[0], float(clip[1]))
        with one_thread(self.landings[0].small):  # a kernel call per small block: no parallel region each
            mirrored = bool(self.block_grads) and getattr(self.block_grads[0], "mirror", None) is not None
            ranges = self.row_adam.step(self.blocks, self.block_grads, RowAdamSettings(**hparams), row_clip,
                                    zero_grads=False)
            if not mirrored:  # the kernel rewrote the owner's copy of the stepped rows as it stepped them
                self.rows.on_stepped(ranges)
            self.forget(self.blocks)
        self.gradients.record(time.perf_counter() - start)

    def finish(self, start: float) -> None:
        self.timeline.add("device_wait", self.name, start, time.perf_counter())

    def wait(self) -> None:
        """Block until this slot's pending step has run on the host (its owner's forward is about to read the rows)."""
        self.lanes.worker.wait_for(self)

    def abandon_gradient(self) -> None:
        blocks = self.gradients.take(self)
        self.rows_updated, self.rows_stepped = self.touched_rows, 0
        self.forget(blocks)

    def forget(self, blocks: Tensor) -> None:
        """Forget the gradients of ``blocks``: their rows are no longer touched or written, so the next step's first
        gradient overwrites them (a step consumed, or one not taken)."""
        self.rows.touched.view(self.row_adam.num_blocks, self.row_adam.block_rows).index_fill_(0, blocks, False)
        for landing in self.landings:
            landing.forget(blocks)
        self.block_grads = []

    # ------------------------------------------------------------------------------------------------ reads
    @torch.no_grad()
    def settle(self) -> None:
        """Show the decay idle blocks owe: the rows of blocks that owe decoupled decay take their values with it paid,
        at each missed step's own rate (:meth:`BlockRowAdam.decayed_rows`: AdamW's weights, exactly for a block never
        stepped, but for the momentum drift of one stepped and then left idle), the routing copy with them, for
        whatever reads the rows now (``state_dict``, an export, an evaluation forward, a checkpoint). Their masters
        are kept aside and put back before training reads the rows again (:meth:`unsettle`), and the decay ledger
        stays as it is (each block's next step pays it), so training is the same, bit for bit, whether or not
        anything read them. The accumulators get every sum of the step first (a reader of them may come next)."""
        self.materialize()
        adam = self.row_adam
        if self.shown_step == adam.step_count or not adam.decay.active:
            return
        self.unsettle()  # shown at an earlier step: from the masters again
        rows, values = adam.decayed_rows()
        if rows.numel():
            blocks = rows[::adam.block_rows] // adam.block_rows  # whole blocks' rows, in order
            self.shown = (blocks, rows, [matrix[rows] for matrix in self.rows.matrices])
            for matrix, value in zip(self.rows.matrices, values):
                matrix.index_copy_(0, rows, value)
            self.rows.on_stepped(adam.row_ranges(blocks))
        self.shown_step = adam.step_count

    @torch.no_grad()
    def unsettle(self) -> None:
        """Before training reads the rows (a training forward, a step): rows shown with their decay paid get their
        masters back, as training without the read would have them."""
        shown, self.shown, self.shown_step = self.shown, None, -1
        if shown is None:
            return
        blocks, rows, masters = shown
        for matrix, master in zip(self.rows.matrices, masters):
            matrix.index_copy_(0, rows, master)
        self.rows.on_stepped(self.row_adam.row_ranges(blocks))

    def ready(self, training: bool) -> None:
        """Before the owner's forward: its pending update applied, and its rows the masters for a training forward
        (gradients enabled), or shown with the decay they owe for any other (:meth:`settle`), as an embedding's rows
        are (:meth:`~lightning_offload.engine.slots.row_slot.RowSlot.settle`)."""
        self.wait()
        if training:
            self.unsettle()
        else:
            self.settle()

    def keep_shown(self) -> None:
        """The rows are handed back (the engine lets go of them): the decay they owe is paid for good (settled, the
        masters dropped, every block owing nothing)."""
        self.settle()
        self.shown, self.shown_step = None, -1
        self.row_adam.decay.paid()

    def adopted_rows(self) -> None:
        """The owner's rows were loaded (its ``load_state_dict``): they owe no decay of the steps before, as AdamW
        steps on from loaded weights, and no master is put back over them (a checkpoint's host state that follows
        restores the masters and the ledger it was written with)."""
        self.shown, self.shown_step = None, -1
        self.row_adam.decay.paid()

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> list[Tensor]:
        return []  # its matrices, accumulators and moments are reported whole as its owner's (host_rows_bytes)

    def host_state(self) -> dict[str, Any]:
        """The row Adam's state, and the masters of the rows the owner's state dict shows with their decay paid (it
        is settled here first, so that whichever of the two a checkpoint reads first, they agree): a resume puts them
        back under the shown values, and continues as the uninterrupted run, bit for bit."""
        self.settle()
        state = self.row_adam.state_dict()
        if self.shown is not None:
            blocks, rows, masters = self.shown
            state = {**state, "shown_masters": {"blocks": blocks, "rows": rows, "matrices": masters}}
        return state

    @torch.no_grad()
    def load_host_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`host_state` output (load the owner's rows first: the masters of rows saved shown are put
        back over them)."""
        shown = state.get("shown_masters")
        self.shown, self.shown_step = None, -1
        self.row_adam.load_state_dict({key: value for key, value in state.items() if key != "shown_masters"})
        if shown is not None:
            for matrix, master in zip(self.rows.matrices, shown["matrices"]):
                matrix.index_copy_(0, shown["rows"], master)
            self.rows.on_stepped(self.row_adam.row_ranges(shown["blocks"]))

    def check_saved_state(self, saved: dict[str, Any]) -> None:
        """Nothing here: its row Adam checks its own state's layout as it loads it."""
