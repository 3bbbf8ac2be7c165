"""The host worker: one thread (or, with the CPU as the device, the calling thread) that runs the engine's host
jobs in order and hands a failure back to the main thread, which never hangs on a dead worker."""

from __future__ import annotations

import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable


from lightning_offload.engine.figures.phases import DISABLED, PhaseClock
from lightning_offload.engine.lanes.thread_split import ThreadSplit

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
        split: the host's share of the cores, where the device is a CPU thread too (the simulated link).
    """

    def __init__(self, name: str = "lightning_offload-host", leave_main_a_core: bool = False,
                 inline: bool = False, phases: PhaseClock = DISABLED, split: ThreadSplit | None = None) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.leave_main_a_core = leave_main_a_core
        self.inline = inline
        self.phases = phases  # the engine's phase clock: charges the jobs to host_adam
        self._closed = False
        # The latest job submitted for each key (a slot): what wait_for waits on.
        self._latest: dict[int, Job] = {}
        self.cpus: list[int] | None = None  # the cores this worker (and the threads its kernels start) may use
        self.split = split
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if inline:
            return
        self._thread.start()
        # A loop that ends without close() (the process just exits) would leave the thread waiting on its queue while
        # the interpreter tears down torch's thread pools under it: the process aborted ("terminate called without an
        # active exception"). Stopped at exit, or when the worker is collected, whichever comes first.
        weakref.finalize(self, _stop_thread, self._jobs, self._thread)

    def _restrict_cpus(self) -> None:
        if self.split is not None:
            # The device is the main thread on the other cores (the simulated link): the host keeps to its own.
            self.split.apply_to_worker()
            self.cpus = list(self.split.host_cpus)
            return
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

    def submit(self, fn: Callable[[], None], label: str = "", key: object = None) -> Job:
        """Queue ``fn`` (or, inline, run it now); returns its job (the latest of ``key``'s, where one is given)."""
        self.check()
        job = Job(fn, label)
        if key is not None:
            self._latest[id(key)] = job
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

    def wait_for(self, key: object) -> None:
        """Block until the latest job submitted for ``key`` ran (at once when there is none, or it ran already)."""
        job = self._latest.get(id(key))
        if job is not None and not job.done.is_set():
            self.wait(job)

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
