"""The device↔host pipeline: copy streams, events, a host worker thread, and a timeline of who was busy when.

Per offloaded tensor, in three hops: its gradient is copied device→host on a copy stream into a preallocated
(pinned) buffer; the host worker thread steps Adam on it; the update is copied host→device on a second copy
stream. Events order the hops; the device waits for an update only right before the layer that owns it runs
forward again. On a machine without a GPU the same code runs with the CPU as the device: copies become plain
memcpy, streams and events become no-ops, and the worker thread still overlaps host work with "device" compute.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.phases import DISABLED, PhaseClock

#: Timeline lanes, in the order a trace viewer shows them.
LANES = ("device", "device_wait", "link_to_host", "host", "link_to_device")

# How often a waiting main thread looks at the worker's health: a worker failure surfaces within this delay.
_POLL_SECONDS = 0.05


class HostWorkerError(RuntimeError):
    """The host worker thread failed; the original exception is chained as ``__cause__``."""


class Job:
    """One unit of host work; ``wait`` blocks until it ran (or the worker died)."""

    def __init__(self, fn: Callable[[], None], label: str) -> None:
        self.fn = fn
        self.label = label
        self.done = threading.Event()


class HostWorker:
    """A daemon thread that runs :class:`Job` s in submission order and reports failures to the main thread.

    A failure is re-raised, with the worker's original traceback, by the next :meth:`wait` or :meth:`check` on the
    main thread; the worker stops taking jobs after a failure so nothing runs on half-updated state.

    With ``inline=True`` there is no thread: :meth:`submit` runs the job at once in the calling thread, with the same
    failure rules. That is the engine's choice when the device is the CPU: the "device" compute already runs on every
    core through its own intra-op threads, so a second thread has no idle core to use; its OpenMP team only competes
    with the main thread's for the same cores (each team spins between kernels), which slowed every kernel of the
    forward, not only the host's (see docs/benchmarks/2026-12-03.md, "Where a step's time goes").

    Args:
        name: the thread's name.
        leave_main_a_core: keep the thread off one core (an accelerator's kernel launches never wait for one).
        inline: run jobs in the submitting thread instead of a worker thread.
        phases: the engine's phase clock.
    """

    def __init__(self, name: str = "lightning_offload-host", leave_main_a_core: bool = False,
                 inline: bool = False, phases: PhaseClock = DISABLED) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.leave_main_a_core = leave_main_a_core
        self.inline = inline
        self.phases = phases  # the engine's phase clock: charges the jobs to host_adam
        self._closed = False
        self.cpus: list[int] | None = None  # the cores this worker (and the threads its kernels start) may use
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if inline:
            return
        self._thread.start()
        # A loop that ends without close() (the process just exits) would leave the thread waiting on its queue while
        # the interpreter tears down torch's thread pools under it: the process aborted ("terminate called without an
        # active exception"). Stopped at exit, or when the worker is collected, whichever comes first.
        weakref.finalize(self, _stop_thread, self._jobs, self._thread)

    def _restrict_cpus(self) -> None:
        # With an accelerator the main thread mostly launches kernels, and a launch that waits for a core delays
        # the device: this thread (and the intra-op threads its first parallel kernel creates, which inherit its
        # affinity) keeps off one core. Linux only; with fewer than 4 cores the host work needs them all.
        if not self.leave_main_a_core or not hasattr(os, "sched_setaffinity"):
            return
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 4:
            os.sched_setaffinity(0, cpus[1:])  # pid 0: the calling thread only
            self.cpus = cpus[1:]

    def _run(self) -> None:
        try:
            self._restrict_cpus()
        except OSError as error:  # a container may forbid it: the worker runs unrestricted
            self.cpus = None
            warnings.warn(f"The host worker could not leave the main thread a core ({error}).", stacklevel=1)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: Job) -> None:
        if self._error is None:
            try:
                with self.phases.phase("host_adam"):
                    job.fn()
            except BaseException as error:  # noqa: BLE001 - handed to the main thread, not swallowed
                self._error = error
        job.done.set()

    def submit(self, fn: Callable[[], None], label: str = "") -> Job:
        """Queue ``fn`` (or, inline, run it now); returns its job."""
        self.check()
        job = Job(fn, label)
        if self.inline:
            self._execute(job)  # a failure is raised by the next wait or check, as from the thread
        else:
            self._jobs.put(job)
        return job

    def check(self) -> None:
        """Raise the worker's failure, if any, in the calling (main) thread."""
        if self._error is not None:
            raise HostWorkerError(f"The host optimizer worker failed: {self._error!r}") from self._error

    def wait(self, job: Job) -> None:
        """Block until ``job`` ran; raise promptly if the worker failed meanwhile."""
        while not job.done.wait(_POLL_SECONDS):
            self.check()
            if not self._thread.is_alive():
                raise HostWorkerError("The host optimizer worker stopped while a job was pending.")
        self.check()

    @property
    def running(self) -> bool:
        """Whether it still takes jobs (not closed)."""
        return not self._closed if self.inline else self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after the queued jobs; never blocks longer than ``timeout``."""
        self._closed = True
        _stop_thread(self._jobs, self._thread, timeout)


def _stop_thread(jobs: queue.SimpleQueue, thread: threading.Thread, timeout: float = 5.0) -> None:
    """Ask a worker thread to stop after its queued jobs, and wait for it (at most ``timeout``)."""
    if thread.is_alive():
        jobs.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)


class Link:
    """Copies between the device and host memory, ordered by streams and events where the device has them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            # Two copy streams so device→host gradient copies and host→device update copies run concurrently
            # with each other and with compute on the default stream.
            self.to_host_stream = torch.cuda.Stream(device)
            self.to_device_stream = torch.cuda.Stream(device)

    def to_host(self, source: Tensor, destination: Tensor) -> Any:
        """Start copying a device tensor into a host buffer; returns an event (``None`` when already done).

        The caller need not keep ``source`` alive (the caching allocator holds its memory until the copy has read
        it), but must not modify it in place before the event completed (see :meth:`device_wait`).
        """
        if not self.is_cuda:
            destination.copy_(source)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.to_host_stream):
            # The copy stream must not read the gradient before the compute stream finished writing it.
            self.to_host_stream.wait_event(produced)
            destination.copy_(source, non_blocking=True)
            # Memory allocated on the compute stream and read here: when its last reference goes, the allocator
            # waits for this stream's work queued so far before handing the memory out again.
            source.record_stream(self.to_host_stream)
            return self.to_host_stream.record_event()

    def to_device(self, source: Tensor, destination: Tensor, after: Any = None) -> Any:
        """Start copying a host buffer to the device (from the worker thread); returns an event or ``None``.

        Args:
            after: a device event the copy must wait for (the last compute use of ``destination``).
        """
        if not self.is_cuda:
            destination.copy_(source)
            return None
        with torch.cuda.stream(self.to_device_stream):
            if after is not None:
                self.to_device_stream.wait_event(after)
            destination.copy_(source, non_blocking=True)
            return self.to_device_stream.record_event()

    def compute_event(self) -> Any:
        """An event marking everything queued so far on the compute stream (``None`` on CPU)."""
        return torch.cuda.current_stream(self.device).record_event() if self.is_cuda else None

    def host_wait(self, event: Any) -> None:
        """Block the calling host thread until ``event`` completed (a copy into host memory landed)."""
        if event is not None:
            event.synchronize()

    def device_wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` without blocking the host."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class UpdateRing:
    """A few device buffers that compressed updates land in on their way to being applied, instead of one per layer.

    A buffer is claimed for one update (its copy from the host is issued into it), and released once the kernels
    that apply the update have been queued, with an event marking them. A copy into a released buffer waits, on the
    copy stream, for that event: the buffer is reused only after the previous update was read, and the host never
    blocks for it. When every buffer is claimed (updates applied out of the order they were fetched in), the caller
    falls back to a one-off allocation, so a ring never stalls a step.

    Args:
        count: number of buffers.
        numel: elements of the largest update.
        dtype: the link dtype updates cross in.
        device: the training device.
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if count < 1:
            raise ValueError(f"An update ring needs at least one buffer, got {count}.")
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
        self._free = list(range(count))
        # Per buffer: the compute-stream event after the kernels that last read it (None: never used, or CPU).
        self.last_read: list[Any] = [None] * count
        self.fallbacks = 0  # updates that found no free buffer (a one-off allocation instead)
        self.prefetched = 0  # copies started ahead of the layer's forward

    def claim(self) -> int | None:
        """A free buffer's number, or ``None`` when all are claimed."""
        return self._free.pop(0) if self._free else None

    @property
    def free(self) -> int:
        """Buffers not claimed now."""
        return len(self._free)

    def view(self, index: int, shape: tuple[int, ...]) -> Tensor:
        """Buffer ``index`` as a tensor of ``shape``."""
        return self.buffers[index][: math.prod(shape)].view(shape)

    def release(self, index: int, read_done: Any) -> None:
        """Return buffer ``index``; ``read_done`` is the event after the kernels that read it."""
        self.last_read[index] = read_done
        self._free.append(index)

    def nbytes(self) -> int:
        """Device bytes of the ring."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers)


@dataclass
class Span:
    """One interval of activity on a lane of the timeline."""

    lane: str
    name: str
    start: float
    end: float


@dataclass
class StepTimeline:
    """Who was busy when during one optimizer step (host clock, seconds).

    Lanes: ``device`` (compute as seen from the main thread), ``link_to_host``, ``host`` (Adam), ``link_to_device``,
    ``device_wait`` (the main thread blocked for an update or the worker).
    """

    spans: list[Span] = field(default_factory=list)
    # When the step's backward ended (host clock); None until then.
    backward_end: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        """Record a span (thread-safe: the worker and the main thread both record)."""
        with self._lock:
            self.spans.append(Span(lane, name, start, end))

    def busy(self, lane: str) -> float:
        """Total seconds recorded on ``lane``."""
        return sum(span.end - span.start for span in self.spans if span.lane == lane)

    def share_before(self, lane: str, moment: float | None) -> float:
        """The share of ``lane``'s busy seconds that lie before ``moment`` (0 when the lane was idle or ``moment``
        is unknown)."""
        total = self.busy(lane)
        if moment is None or total == 0.0:
            return 0.0
        early = sum(max(0.0, min(span.end, moment) - span.start) for span in self.spans if span.lane == lane)
        return early / total

    def chrome_events(self, step: int, origin: float) -> list[dict[str, Any]]:
        """The spans as Chrome-trace "complete" events (microseconds), one thread row per lane."""
        return [
            {
                "name": span.name,
                "cat": span.lane,
                "ph": "X",
                "ts": (span.start - origin) * 1e6,
                "dur": max(span.end - span.start, 0.0) * 1e6,
                "pid": 0,
                "tid": LANES.index(span.lane) if span.lane in LANES else len(LANES),
                "args": {"step": step},
            }
            for span in self.spans
        ]


class TimelineRecorder:
    """Keeps the last ``keep`` step timelines and writes them as a Chrome trace
    (open in chrome://tracing or Perfetto)."""

    def __init__(self, keep: int = 50) -> None:
        self.keep = keep
        self.steps: list[tuple[int, StepTimeline]] = []
        self.origin = time.perf_counter()

    def record(self, step: int, timeline: StepTimeline) -> None:
        """Store a finished step's timeline."""
        self.steps.append((step, timeline))
        del self.steps[: -self.keep]

    def export_chrome_trace(self, path: str) -> None:
        """Write the kept timelines as Chrome-trace JSON."""
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(LANES)
        ]
        for step, timeline in self.steps:
            events += timeline.chrome_events(step, self.origin)
        with open(path, "w") as handle:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)
