"""Host work made of ops too small for a second thread runs on one: a limit on the calling thread's OpenMP team.

torch runs an op over more than a few thousand elements as an OpenMP parallel region, whatever its size, and its fused
Adam kernel opens one per tensor it is given: a MEFT row step at a small width hands it dozens of 16K-element blocks
per adapter. A region with a second thread costs a fork and a join (microseconds) for a few microseconds of work, and
on a machine whose other core is busy its join waits for that thread's next time slice (milliseconds: measured here,
16 kernel calls on 128 × 128 blocks took 124 ms with two threads and 1.2 ms with one, the other core busy). So such work
runs with a team of one, in the calling thread only: torch's process-wide setting (``torch.set_num_threads``), other
threads and larger work keep their threads.

OpenMP keeps the team size per thread (``omp_set_num_threads`` sets the calling thread's), and torch reads it before
every parallel op; the runtime torch was built with is found among the libraries it loaded. Where there is none (a
build without OpenMP), nothing is limited. Only work whose numbers do not depend on how many threads share it runs
so (elementwise kernels, copies, index writes): a reduction's rounding does (MKL splits a dot product between threads).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

#: Ops below about this many elements gain nothing from a second thread (fork and join cost as much as half the work).
SMALL_OP_ELEMENTS = 1 << 16


@lru_cache(maxsize=1)
def _openmp() -> Any:
    """torch's OpenMP runtime (its ``omp_set_num_threads``/``omp_get_max_threads``), or ``None``."""
    candidates: list[str | None] = [None]  # the symbols already loaded into the process
    candidates += [str(p) for p in sorted((Path(torch.__file__).parent / "lib").glob("lib*omp*.so*"))]
    for name in candidates:
        try:
            runtime = ctypes.CDLL(name)  # an already loaded library is returned, not loaded twice
            runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
            runtime.omp_get_max_threads.restype = ctypes.c_int
            return runtime
        except (OSError, AttributeError):
            continue
    return None


@contextmanager
def one_thread(small: bool = True) -> Iterator[None]:
    """Run the block's torch ops on the calling thread alone when ``small`` (ops of fewer than about
    :data:`SMALL_OP_ELEMENTS` elements each); the thread's team size is put back afterwards.

    Example::

        with one_thread(block_elements < SMALL_OP_ELEMENTS):
            torch._fused_adamw_(...)  # one kernel call per small block: no parallel region each
    """
    runtime = _openmp() if small else None
    threads = torch.get_num_threads() if runtime is not None else 1  # torch sets the thread's team size first
    if threads == 1:
        yield
        return
    runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        runtime.omp_set_num_threads(threads)


def team_size(small: bool) -> int:
    """How many threads a torch op of the calling thread runs with inside ``one_thread(small)``."""
    return 1 if small and _openmp() is not None else torch.get_num_threads()
