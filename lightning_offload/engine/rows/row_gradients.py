"""Row gradients of host matrices (MEFT's adapter keys and values), summed into host accumulators during backward on the
engine's one host worker while the main thread computes.

Order on the worker is submission order, which is all the synchronisation the host state needs:

1. in backward, each adapter's key and value gradients are copied device→host (on a GPU: on the link's copy stream, into
   a reused pinned buffer) and a job lands them (:class:`~lightning_offload.engine.rows.row_landing.RowLanding`);
2. at the optimizer step the main thread waits for those jobs (:meth:`RowGradients.flush`), checks the gradients, and
   queues one Adam job per adapter on the same worker, after the other slots' host jobs;
3. the next forward waits only for the job of the adapter it is about to run (its slot's ``wait``), so the first layers
   compute while the host still updates the last ones.

A failure on the worker is re-raised on the main thread at the next wait (:class:`HostWorker`).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import torch

from lightning_offload.engine.lanes.link import Link
from lightning_offload.engine.lanes.worker import HostWorker, Job
from lightning_offload.engine.rows.row_landing import RowLanding


class _PinnedPool:
    """Reusable page-locked staging buffers (a fresh pinned allocation costs several times a copy into one)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin  # page-locked where a CUDA device reads them; plain memory under the simulated link
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # the worker returns buffers while the main thread takes them

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.dtype == dtype and buffer.numel() >= numel:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)


class RowGradients:
    """Row-gradient landing and host row jobs of one model's MEFT adapters, on an offload engine's worker and link.

    Args:
        worker: the engine's host worker (its one thread: no second worker runs beside it).
        link: the engine's device↔host link (its copy stream orders the device→host gradient copies on a GPU).
        squares_on_device: take each gradient's ``Σg²`` on the device before its copy, rather than on the host as it
            lands. Default: on a GPU only (one small reduction beside backward's kernels spares the host a second pass
            over every landed gradient; on the CPU "device" both are the same cores).
    """

    def __init__(self, worker: HostWorker, link: Link, squares_on_device: bool | None = None) -> None:
        self.worker = worker
        self.link = link
        # Gradients are staged where the link copies asynchronously (the device's memory is not the host's, or is
        # simulated so); with the CPU as the device they already are host memory.
        self._staging = _PinnedPool(pin=self.link.is_cuda) if self.link.asynchronous else None
        # Where Σg² is taken is arithmetic, not ordering: the same under the simulated link as without it.
        self._squares_on_device = self.link.is_cuda if squares_on_device is None else squares_on_device
        # The device 2-norms (fp32) of the gradients handed over since the last step: appended in backward (on a GPU,
        # autograd's device thread) and read on the main thread once backward has returned, so never both at once.
        self._device_norms: list[torch.Tensor] = []
        self._last: Job | None = None
        self.gradients_queued = 0  # row gradients handed to the worker so far (a cached norm checks it is current)
        # Σ‖g‖² of the gradients landed this step, and whether it is the sums' squared norm (no row received two).
        self._square_sum = 0.0
        self._square_sum_is_norm = True
        self._busy_seconds = 0.0
        self._lock = threading.Lock()  # the busy-time counter is written by the worker, read by the main thread
        # The row slots landing here, each accumulator's landing (by id: hooks hand over the accumulator), and this
        # step's prepared blocks and norm, keyed by the gradients queued so a later micro-batch invalidates them.
        self.slots: list[Any] = []
        self.landings: dict[int, RowLanding] = {}
        self._prepared: tuple[int, list[torch.Tensor]] | None = None
        self._norm: torch.Tensor | None = None
        self._taken = 0  # slots that took (or dropped) their blocks this step

    # ---------------------------------------------------------------------------------------------- gradients
    def add_slot(self, slot: Any, landings: list[RowLanding]) -> None:
        """``slot``'s gradients land here, each of its accumulators through its landing."""
        self.slots.append(slot)
        self.landings.update((id(landing.accumulator), landing) for landing in landings)

    def accumulate(self, rows: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor,
                   written: torch.Tensor) -> None:
        """Queue ``accumulator[rows] += grad`` from an autograd hook, without waiting. A matrix's only gradient of the
        step is kept where it landed; otherwise rows not yet ``written`` this step are copied into, not added to
        (:class:`~lightning_offload.engine.rows.row_landing.RowLanding`). The gradient crosses the link in its own dtype
        and is widened on the host.
        """
        grad = grad.detach()
        landing = self.landings[id(accumulator)]
        self.gradients_queued += 1
        if self._squares_on_device:
            # Queued on the current stream after the kernel that made the gradient, before its copy: no wait here.
            self._device_norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        if self._staging is None:
            # CPU "device": the gradient already is host memory; the job keeps it alive until the step.
            self._last = self.worker.submit(partial(self._add_rows, rows, grad, landing, None, None, None), "grad")
            return
        buffer = self._staging.take(grad.numel(), grad.dtype)
        staged = buffer[: grad.numel()].view_as(grad)
        # The copy stream waits for backward to have produced the gradient; the job waits for the copy to land.
        # `grad` rides along in the job so the caching allocator cannot reuse its memory before the copy read it.
        landed = self.link.to_host(grad, staged)
        self._last = self.worker.submit(partial(self._add_rows, rows, staged, landing, landed, grad, buffer), "grad")

    def _add_rows(self, rows: torch.Tensor, grad: torch.Tensor, landing: RowLanding, landed: Any,
                  source: torch.Tensor | None, buffer: torch.Tensor | None) -> None:
        # `source` (the device gradient) is only held, never read here: its memory must outlive the copy.
        start = time.perf_counter()
        self.link.host_wait(landed)
        # With the process's threads, not one (engine/rows/host_threads.py): the squared norm taken here is a dot
        # product, whose rounding depends on the thread count, and the step's norm (clipping) must not change.
        widened = grad if grad.dtype == landing.accumulator.dtype else grad.to(landing.accumulator.dtype)
        # A staging buffer goes back to its pool now, so a gradient still in it is added, not kept.
        square = landing.land(rows, widened, keep=buffer is None or widened is not grad,
                              want_square=self._square_sum_is_norm and not self._squares_on_device)
        if square is None or self._square_sum_is_norm:
            with self._lock:
                if square is None:
                    self._square_sum_is_norm = False  # summed rows: the norm must be read from the sums themselves
                else:
                    self._square_sum += square
        if buffer is not None:
            self._staging.give_back(buffer)  # type: ignore[union-attr]
        self.record(time.perf_counter() - start)

    def landed_square_sum(self) -> float | None:
        """Σ‖g‖² of the row gradients summed since :meth:`start_step`, when that is the squared norm of their sums
        (no row received two), else ``None`` (call after :meth:`flush`)."""
        with self._lock:
            if not self._square_sum_is_norm:
                return None
            square_sum = self._square_sum
        if self._device_norms:
            # One read of the device's norms: it waits only for kernels whose gradients the flush saw land.
            square_sum += float(torch.stack(self._device_norms).double().square().sum())
        return square_sum

    def start_step(self) -> None:
        """The step's gradients are consumed (or dropped): the next gradients start a new sum."""
        with self._lock:
            self._square_sum, self._square_sum_is_norm = 0.0, True
        self._device_norms = []

    def flush(self) -> None:
        """Block until every queued gradient has been added (before reading the accumulators)."""
        if self._last is not None:
            self.worker.wait(self._last)
            self._last = None
        self.worker.check()

    # ---------------------------------------------------------------------------------------------- the step
    def step_blocks(self) -> list[torch.Tensor]:
        """Each row slot's touched blocks for this step, their gradients prepared (once per step: main-thread host
        work on rows, counted with the worker's in :meth:`take_busy_seconds`)."""
        self.flush()
        if self._prepared is None or self._prepared[0] != self.gradients_queued:
            start = time.perf_counter()
            self._prepared, self._norm = (self.gradients_queued, [slot.touched_blocks() for slot in self.slots]), None
            self.record(time.perf_counter() - start)
        return self._prepared[1]

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """2-norm of this step's summed row gradients (fp32, on the host, once summed), shared by the non-finite check
        and norm clipping: summed as the gradients landed when no row received two, else read over the touched blocks'
        slices."""
        step_blocks = self.step_blocks()  # a new micro-batch's gradients reset the cached norm with the blocks
        if self._norm is None:
            landed = self.landed_square_sum()
            if landed is not None:
                squares = torch.tensor(landed, dtype=torch.float64)
            else:
                start = time.perf_counter()
                squares = torch.stack([torch.zeros((), dtype=torch.float64)] + [
                    slot.square_sum(blocks) for slot, blocks in zip(self.slots, step_blocks)]).sum()
                self.record(time.perf_counter() - start)
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
        """Count ``seconds`` of host work on rows (a gradient sum, a step's blocks prepared, a row step)."""
        with self._lock:
            self._busy_seconds += seconds

    def take_busy_seconds(self) -> float:
        """Seconds of host work on rows since the last call: the worker's gradient sums and updates, and the main
        thread's preparing of each step's blocks."""
        with self._lock:
            seconds, self._busy_seconds = self._busy_seconds, 0.0
        return seconds

    def release(self) -> None:
        """Forget the jobs queued so far (the worker is the engine's: it stops with the engine)."""
        self._last = None
        self._device_norms = []
