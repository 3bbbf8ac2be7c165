"""Row gradients of host matrices (MEFT's adapter keys and values), summed into host accumulators during backward
on the engine's one host worker, while the main thread goes on with device work.

Order on the worker is submission order, which is all the synchronisation the host state needs:

1. during backward, each adapter's key and value gradients are copied device→host (on a GPU: on the link's copy
   stream, into a reused pinned buffer) and a job adds them into the adapter's accumulators;
2. at the optimizer step the main thread waits for those jobs (:meth:`RowGradients.flush`), checks the gradients,
   and queues one Adam job per adapter on the same worker, after the other slots' host jobs;
3. the next forward waits, adapter by adapter, only for the job of the adapter it is about to run (its slot's
   :meth:`~lightning_offload.engine.row_blocks_slot.RowBlocksSlot.wait`), so the first layers compute while the host
   is still updating the last ones.

A failure on the worker is re-raised on the main thread at the next wait (see :class:`HostWorker`).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import torch

from lightning_offload.engine.pipeline import HostWorker, Job, Link


class _PinnedPool:
    """Reusable page-locked staging buffers (a fresh pinned allocation costs several times a copy into one)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # the worker returns buffers while the main thread takes them

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.dtype == dtype and buffer.numel() >= numel:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)


class RowGradients:
    """Row-gradient landing and host row jobs on an offload engine's worker and link, shared by the MEFT adapters of
    one model.

    Args:
        worker: the engine's host worker (its one thread: no second worker runs beside it).
        link: the engine's device↔host link (its copy stream orders the device→host gradient copies on a GPU).
    """

    def __init__(self, worker: HostWorker, link: Link) -> None:
        self.worker = worker
        self.link = link
        self._staging = _PinnedPool() if self.link.is_cuda else None
        self._last: Job | None = None
        self.gradients_queued = 0  # row gradients handed to the worker so far (a cached norm checks it is current)
        # Σ‖g‖² of the gradients summed since the last step, taken as each lands (while the rows are at hand), and
        # whether it is the squared norm of the sums: true while no row received two gradients (no accumulation).
        self._square_sum = 0.0
        self._square_sum_is_norm = True
        self._busy_seconds = 0.0
        self._lock = threading.Lock()  # the busy-time counter is written by the worker, read by the main thread
        # The row slots whose gradients land here, and this step's touched blocks per slot (their idle rows zeroed)
        # and row-gradient norm once computed: keyed by how many gradients had been queued by then, so a later
        # micro-batch invalidates them.
        self.slots: list[Any] = []
        self._prepared: tuple[int, list[torch.Tensor]] | None = None
        self._norm: torch.Tensor | None = None
        self._taken = 0  # slots that took (or dropped) their blocks this step

    # ---------------------------------------------------------------------------------------------- gradients
    def accumulate(self, rows: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor,
                   written: torch.Tensor) -> None:
        """Queue ``accumulator[rows] += grad`` (called from an autograd hook; returns without waiting).

        Rows not yet ``written`` this step are copied into rather than added to (their old contents are a consumed
        step's), and become written. The gradient crosses the link in its own dtype (bf16 under autocast) and is
        widened on the host.
        """
        grad = grad.detach()
        self.gradients_queued += 1
        if self._staging is None:
            # CPU "device": the gradient already is host memory; the job keeps it alive until it has been added.
            self._last = self.worker.submit(partial(self._add_rows, rows, grad, accumulator, written, None, None,
                                                    None), "grad")
            return
        buffer = self._staging.take(grad.numel(), grad.dtype)
        staged = buffer[: grad.numel()].view_as(grad)
        # The copy stream waits for backward to have produced the gradient; the job waits for the copy to land.
        # `grad` rides along in the job so the caching allocator cannot reuse its memory before the copy read it.
        landed = self.link.to_host(grad, staged)
        self._last = self.worker.submit(partial(self._add_rows, rows, staged, accumulator, written, landed, grad,
                                                buffer), "grad")

    def _add_rows(self, rows: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor, written: torch.Tensor,
                  landed: Any, source: torch.Tensor | None, buffer: torch.Tensor | None) -> None:
        # `source` (the device gradient) is only held, never read here: its memory must outlive the copy.
        start = time.perf_counter()
        self.link.host_wait(landed)
        grad = grad.to(accumulator.dtype)
        fresh = ~written[rows]
        if bool(fresh.all()):  # the step's first gradient of these rows (every row, without accumulation)
            accumulator.index_copy_(0, rows, grad)
            if self._square_sum_is_norm:  # once rows were summed the norm is read from the sums: no dot needed
                flat = grad.reshape(-1)
                square = float(torch.dot(flat, flat))
                with self._lock:
                    self._square_sum += square
        else:
            if bool(fresh.any()):
                accumulator.index_copy_(0, rows[fresh], grad[fresh])
                accumulator.index_add_(0, rows[~fresh], grad[~fresh])
            else:
                accumulator.index_add_(0, rows, grad)
            with self._lock:
                self._square_sum_is_norm = False  # summed rows: the norm must be read from the sums themselves
        written[rows] = True
        if buffer is not None:
            self._staging.give_back(buffer)  # type: ignore[union-attr]
        self.record(time.perf_counter() - start)

    def landed_square_sum(self) -> float | None:
        """Σ‖g‖² of the row gradients summed since :meth:`start_step`, when that is the squared norm of their sums
        (no row received two), else ``None`` (call after :meth:`flush`)."""
        with self._lock:
            return self._square_sum if self._square_sum_is_norm else None

    def start_step(self) -> None:
        """The step's gradients are consumed (or dropped): the next gradients start a new sum."""
        with self._lock:
            self._square_sum, self._square_sum_is_norm = 0.0, True

    def flush(self) -> None:
        """Block until every queued gradient has been added (before reading the accumulators)."""
        if self._last is not None:
            self.worker.wait(self._last)
            self._last = None
        self.worker.check()

    # ---------------------------------------------------------------------------------------------- the step
    def step_blocks(self) -> list[torch.Tensor]:
        """Each row slot's touched blocks for this step, their idle rows zeroed in the accumulators (once per step).

        A block is stepped whole, so its rows without a gradient this step must read zero; their accumulator rows may
        still hold a consumed step's sum (the step's first gradient of a row is copied in, never added to a zeroed
        row), so exactly those rows are zeroed here.
        """
        self.flush()
        if self._prepared is None or self._prepared[0] != self.gradients_queued:
            self._prepared, self._norm = (self.gradients_queued, [slot.touched_blocks() for slot in self.slots]), None
        return self._prepared[1]

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """2-norm of this step's summed row gradients (fp32, on the host; waits for the host to finish summing).

        Once per step, shared by the non-finite check and norm clipping: summed as the gradients landed (no pass over
        the accumulators) when no row received two gradients this step, else read in place over the touched blocks'
        slices (no other row has a gradient). A non-finite gradient makes it non-finite.
        """
        step_blocks = self.step_blocks()  # a new micro-batch's gradients reset the cached norm with the blocks
        if self._norm is None:
            landed = self.landed_square_sum()
            if landed is not None:
                squares = torch.tensor(landed, dtype=torch.float64)
            else:
                squares = torch.stack([torch.zeros((), dtype=torch.float64)] + [
                    slot.square_sum(blocks) for slot, blocks in zip(self.slots, step_blocks)]).sum()
            self._norm = squares.sqrt().float()
        return self._norm

    def take(self, slot: Any) -> torch.Tensor:
        """``slot``'s blocks of this step, taken by its step (or dropped, when the step is skipped); once every slot
        has taken its own, the next gradients start a new step."""
        blocks = self.step_blocks()[self.slots.index(slot)]
        self._taken += 1
        if self._taken == len(self.slots):
            self._prepared = self._norm = None
            self._taken = 0
            self.start_step()
        return blocks

    # ---------------------------------------------------------------------------------------------- telemetry
    def record(self, seconds: float) -> None:
        """Count ``seconds`` of host work on rows (a gradient sum, a row step)."""
        with self._lock:
            self._busy_seconds += seconds

    def take_busy_seconds(self) -> float:
        """Seconds the worker spent on gradients and updates since the last call."""
        with self._lock:
            seconds, self._busy_seconds = self._busy_seconds, 0.0
        return seconds

    def release(self) -> None:
        """Forget the jobs queued so far (the worker is the engine's: it stops with the engine)."""
        self._last = None
