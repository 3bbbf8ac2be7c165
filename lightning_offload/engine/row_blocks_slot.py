"""Host matrices stepped block by block (MEFT's adapter keys and values) as a slot of the engine: their row gradients
are summed on the host during backward (:mod:`~lightning_offload.engine.row_gradients`), and the step runs
:class:`~lightning_offload.engine.block_row_adam.BlockRowAdam` on the blocks touched since the last one, on the
engine's worker, under the engine's one norm, clip and skip decision."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.block_row_adam import BlockRowAdam, RowAdamSettings
from lightning_offload.engine.pipeline import StepTimeline
from lightning_offload.engine.row_gradients import RowGradients
from lightning_offload.engine.slot import Clip, JobSettings, Lanes, Slot
from lightning_offload.engine.telemetry import StepTelemetry


@dataclass
class HostRowBlocks:
    """Host matrices an owner (a MEFT adapter) hands the engine to step.

    Attributes:
        name: what the slot is called (in checkpoints and errors).
        matrices: fp32 host matrices ``[N, h]`` sharing their row layout, stepped in place.
        accumulators: one per matrix: this step's summed row gradients (valid where ``written``).
        written: one bool ``[N]`` per matrix: the rows of its accumulator holding this step's sum.
        touched: bool ``[N]``: rows that received a gradient since the last step.
        block_rows: rows per block, the unit of stepping.
        lr_scales: per matrix, a factor on the learning rate.
        on_stepped: called on the worker with the ``[start, end)`` row ranges a step changed (a device copy of
            them to refresh).
    """

    name: str
    matrices: list[Tensor]
    accumulators: list[Tensor]
    written: list[Tensor]
    touched: Tensor
    block_rows: int
    lr_scales: list[float]
    on_stepped: Callable[[list[tuple[int, int]]], None]


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

    def __init__(self, rows: HostRowBlocks, settings: Callable[[], RowAdamSettings], gradients: RowGradients,
                 lanes: Lanes) -> None:
        super().__init__(rows.name, rows.matrices[0], {}, lanes, decoupled=True)
        self.rows = rows
        self.adam = BlockRowAdam(rows.matrices, rows.block_rows, lr_scales=rows.lr_scales)
        self._settings = settings
        self.gradients = gradients
        gradients.slots.append(self)
        self.blocks = torch.zeros(0, dtype=torch.int64)
        #: The latest step's figures: rows with a gradient, and rows stepped (whole blocks).
        self.rows_updated = 0
        self.rows_stepped = 0

    # ------------------------------------------------------------------------------------------------ backward
    def gradient(self) -> Tensor | None:
        return None  # summed on the host: the engine takes its norm from the row gradients (RowGradients.norm)

    def has_grad(self) -> bool:
        return True  # every step taken steps it: its step count advances even when no row was touched

    def send(self, round_: int, timeline: StepTimeline) -> None:
        self.sent_round = round_  # its gradients crossed during backward, row by row

    def is_sent(self, round_: int) -> bool:
        return True

    def touched_blocks(self) -> Tensor:
        """Main thread, once per step: the touched blocks, with their rows that had no gradient zeroed and marked
        written (a block is stepped whole)."""
        blocks = self.adam.blocks_of(self.rows.touched)
        in_blocks = self.adam.blocks_mask(blocks)
        for accumulator, written in zip(self.rows.accumulators, self.rows.written):
            idle = (in_blocks & ~written).nonzero().squeeze(1)
            if idle.numel():
                accumulator.index_fill_(0, idle, 0.0)
            written[in_blocks] = True  # every row of the stepped blocks now holds this step's sum
        return blocks

    def square_sum(self, blocks: Tensor) -> Tensor:
        """Σ g² (fp64) of the accumulated gradients over ``blocks``."""
        return self.adam.grad_norm_squares(self.rows.accumulators, blocks)

    # ------------------------------------------------------------------------------------------------ the step
    def settings(self) -> JobSettings:
        return asdict(self._settings()), 0.0

    def prepare(self, step: StepTelemetry) -> None:
        self.rows_updated = int(self.rows.touched.sum())
        self.blocks = self.gradients.take(self)
        self.rows_stepped = self.blocks.numel() * self.adam.block_rows

    def host_step(self, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  speculative: bool = False) -> None:
        """Worker thread: the block Adam step, then the owner's copy of the stepped rows is refreshed and their
        gradients forgotten (not zeroed: the next step's first gradient of a row overwrites it)."""
        start = time.perf_counter()
        hparams = settings[0]
        # A norm coefficient as the float the kernel's gradient scale is solved from (in float64).
        row_clip = None if clip is None else (clip[0], float(clip[1]))
        ranges = self.adam.step(self.blocks, self.rows.accumulators, RowAdamSettings(**hparams), row_clip,
                                zero_grads=False)
        self.rows.on_stepped(ranges)
        self.forget(self.blocks)
        self.gradients.record(time.perf_counter() - start)

    def finish(self, start: float) -> None:
        self.timeline.add("device_wait", self.name, start, time.perf_counter())

    def wait(self) -> None:
        """Block until this slot's pending step has run on the host (its owner's forward is about to read the rows)."""
        if self.pending and self.job is not None:
            self.lanes.worker.wait(self.job)

    def abandon_gradient(self) -> None:
        self.rows_updated, self.rows_stepped = int(self.rows.touched.sum()), 0
        self.forget(self.gradients.take(self))

    def forget(self, blocks: Tensor) -> None:
        """Forget the gradients of ``blocks``: their rows are no longer touched or written, so the next step's first
        gradient overwrites them (a step consumed, or one not taken)."""
        for start, end in self.adam.row_ranges(blocks):
            self.rows.touched[start:end] = False
            for written in self.rows.written:
                written[start:end] = False

    def settle(self) -> None:
        self.gradients.flush()  # the accumulators are read next (a checkpoint, an evaluation): no sum half-added

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> list[Tensor]:
        return []  # its matrices, accumulators and moments are reported whole as its owner's (host_rows_bytes)

    def host_state(self) -> dict[str, Any]:
        return self.adam.state_dict()

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.adam.load_state_dict(state)
