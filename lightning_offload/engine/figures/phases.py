"""Where the engine's own share of a step goes, phase by phase, measured only when asked (benchmarks).

A step's time is the model's forward and backward, which plain training pays too, plus the engine's work: the
projections in forward and backward, the hooks, the sends, the host Adam, the expansion and application of updates,
the launch of the step, its telemetry, and the waits for the host. :class:`PhaseClock` splits the latter by phase, so
that one run on a new machine (a first GPU run above all) says which part costs what.

Phases nest (a send runs inside a backward hook, an inline host step inside the send or the launch); each phase is
charged only its own time, the time of phases inside it going to those. Off by default: a phase then costs one
attribute test. On CUDA an enabled clock synchronizes the device at each phase boundary, so each phase is charged the
kernels it queued; that serializes the step (no overlap of copies and host work with compute), so time a run with the
clock on separately from the run whose step time is quoted.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

#: The phases, in the order a step meets them.
PHASES = ("forward_projection", "backward_projection", "hooks", "send", "step_launch", "host_adam",
          "apply_update", "waits", "telemetry")


class PhaseClock:
    """Seconds of the engine's own work per phase, since the last :meth:`take`.

    Args:
        device: the training device (CUDA: phase boundaries synchronize it while enabled).

    Example::

        clock = optimizer.phases            # an OffloadOptimizer's clock
        clock.enabled = True
        ...                                 # train some steps
        per_phase = clock.take()            # {"forward_projection": 0.012, ...}, then zeroed
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.enabled = False
        self.device = device
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()  # the host worker thread charges host_adam while the main thread charges others
        self._local = threading.local()  # each thread's stack of open phases
        self._phases = {name: _Phase(self, name) for name in PHASES}

    def phase(self, name: str) -> _Phase:
        """A context manager charging its block to ``name`` (one of :data:`PHASES`)."""
        return self._phases[name]

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last call, and start again from zero."""
        with self._lock:
            taken, self._seconds = self._seconds, dict.fromkeys(PHASES, 0.0)
        return taken

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # charge each phase the kernels it queued (see the module docstring)
        return time.perf_counter()

    def _stack(self) -> list[list[Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _begin(self, name: str) -> None:
        now, stack = self._now(), self._stack()
        if stack:
            self._charge(stack[-1][0], now - stack[-1][1])  # the enclosing phase pauses
        stack.append([name, now])

    def _end(self) -> None:
        now, stack = self._now(), self._stack()
        if not stack:
            return  # enabled inside the block: its start was not seen
        name, start = stack.pop()
        self._charge(name, now - start)
        if stack:
            stack[-1][1] = now  # the enclosing phase resumes

    def _charge(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds


class _Phase:
    """One phase's context manager (preallocated: a disabled clock costs one attribute test per use)."""

    __slots__ = ("_clock", "_name", "_open")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self._clock, self._name, self._open = clock, name, threading.local()

    def __enter__(self) -> None:
        opened = self._clock.enabled
        self._open.value = opened
        if opened:
            self._clock._begin(self._name)

    def __exit__(self, *exc: object) -> None:
        if getattr(self._open, "value", False):
            self._clock._end()


#: The clock of layers no engine drives yet (always off).
DISABLED = PhaseClock()
