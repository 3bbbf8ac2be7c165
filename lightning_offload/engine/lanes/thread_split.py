"""The CPU's cores split between the device (the main thread) and the host worker, for the simulated link.

On a GPU the device computes on its own silicon and the host worker has the CPU. Under the simulated link
(:mod:`.simulated_link`) both are CPU threads: left to share every core, each one's OpenMP team would spin against the
other's, and neither the overlap nor the step would mean what it means on a GPU. So the cores are split in two
halves, the device's first (on 2 cores: 1 and 1): the main thread keeps to the device's cores with as many torch
threads, the worker thread to the host's. What the main thread had is put back when the engine closes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch


@dataclass
class ThreadSplit:
    """The device's and the host's cores, and what the main thread had before the split.

    Attributes:
        device_cpus: the cores the main thread keeps to.
        host_cpus: the cores the worker thread keeps to.
    """

    device_cpus: list[int]
    host_cpus: list[int]
    _saved: tuple[int, int, set[int]] | None = field(default=None, repr=False)

    @classmethod
    def halves(cls) -> ThreadSplit | None:
        """The cores this process may use split in two (the device's the larger half); ``None`` with one core or where
        affinity cannot be read (not Linux)."""
        if not hasattr(os, "sched_getaffinity"):
            return None
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return None
        device = (len(cores) + 1) // 2
        return cls(cores[:device], cores[device:])

    def describe(self) -> str:
        """The split in words, for the log."""
        return (f"the device on {len(self.device_cpus)} thread(s) (cores {_cores(self.device_cpus)}), the host worker "
                f"on {len(self.host_cpus)} (cores {_cores(self.host_cpus)})")

    def apply_to_main(self) -> None:
        """Keep the calling (main) thread to the device's cores and threads, remembering what it had."""
        thread = threading.get_native_id()
        self._saved = (thread, torch.get_num_threads(), set(os.sched_getaffinity(thread)))
        os.sched_setaffinity(thread, self.device_cpus)
        torch.set_num_threads(len(self.device_cpus))

    def apply_to_worker(self) -> None:
        """Keep the calling (worker) thread, and the threads its first parallel op starts, to the host's cores."""
        os.sched_setaffinity(0, self.host_cpus)  # 0: the calling thread only
        torch.set_num_threads(len(self.host_cpus))

    def restore_main(self) -> None:
        """Give the main thread back its cores and threads (its thread count only when called from it)."""
        if self._saved is None:
            return
        thread, threads, cpus = self._saved
        self._saved = None
        try:
            os.sched_setaffinity(thread, cpus)
        except OSError:  # the thread is gone (an interpreter at exit)
            return
        if threading.get_native_id() == thread:
            torch.set_num_threads(threads)


def _cores(cpus: list[int]) -> str:
    return ", ".join(map(str, cpus))
