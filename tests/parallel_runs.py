"""Independent training runs of one test spread over the machine's cores, each in a process of its own.

A test that compares methods over seeds (the projector defaults' quality tests) trains a small model once per method
and seed. Where such a run's time is mostly Python and small kernels, a second thread gains it almost nothing
(``test_default_projectors``' GPT-2 runs: 5.8 s with two threads, 7.2 s with one, on this project's 2-core CPU),
while a second process doubles the runs done at once. Runs whose time is large matrix products (a real vocabulary's
head) gain as much from the second thread and are left alone.

Every run here uses one thread, wherever it runs and however many run beside it, so its result is the same in a
pool of any size or in the test's own process: the order in which runs finish changes nothing.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import torch

Result = TypeVar("Result")


def _one_thread() -> None:
    torch.set_num_threads(1)


def map_runs(run: Callable[..., Result], calls: Sequence[tuple[Any, ...]], workers: int | None = None) -> list[Result]:
    """``[run(*call) for call in calls]``, the calls spread over ``workers`` processes of one thread each.

    Args:
        run: a function defined at the top of an importable module (the workers import it by name); ``tests/`` is
            on their path, as on the parent's.
        calls: each call's positional arguments (picklable).
        workers: processes to use; ``None``: as many as the cores this process may run on, at most one per call. With
            one, the calls run in this process, on one thread.

    Returns:
        The results in the order of ``calls``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(len(calls), cores) if workers is None else workers
    if workers <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [run(*call) for call in calls]
        finally:
            torch.set_num_threads(threads)
    # Spawned, not forked: the parent has torch's thread pools (and pytest's threads) running, which a forked child
    # would inherit in whatever state they were in.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_one_thread) as pool:
        return list(pool.map(run, *zip(*calls)))
