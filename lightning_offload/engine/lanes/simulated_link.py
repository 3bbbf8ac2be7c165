"""A simulated asynchronous link for the CPU as the device: the GPU path's own code, its ordering and its overlap, run
and measured on a machine without a GPU.

With the CPU as the device the plain :class:`~lightning_offload.engine.lanes.link.Link` copies at once and the host
worker runs inline, so nothing on a CPU exercises what waits for what on a GPU. Under this link the device is the
main thread (its compute synchronous), each direction of the link is a thread of its own that performs the copies in
issue order, each taking ``bytes / bandwidth`` seconds (plus a seeded random jitter), and the host worker is a thread
on its own core. A copy reads its source and writes its destination when its time is up, not when it is issued, so a
missing wait shows: a host job reading its gradient before the copy landed reads the previous step's, an update
applied before its copy arrived applies the previous one, and a host buffer rewritten before the copy read it sends
the new value. The events it returns behave for their holders as CUDA events do (``synchronize``, ``query``).

It is selected by the environment variable :data:`ENVIRONMENT_VARIABLE` when the device is the CPU, read at set-up:
``LIGHTNING_OFFLOAD_SIMULATED_LINK="gbps=G[,jitter_ms=J][,seed=S]"`` (``G``: each direction's bandwidth in 10⁹
bytes/s; ``J``: the most a copy is delayed at random, in ms; ``S``: the jitter's seed). A test and benchmark setting,
said in one log line, never a user default.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.lanes.link import CopyLabel, Link

#: The environment variable that selects the simulated link (see the module docstring).
ENVIRONMENT_VARIABLE = "LIGHTNING_OFFLOAD_SIMULATED_LINK"


@dataclass(frozen=True)
class LinkSpec:
    """What the simulated link does.

    Attributes:
        gbps: each direction's bandwidth, 10⁹ bytes/s.
        jitter_ms: each copy is delayed by a uniform random time up to this (ms).
        seed: the jitter's seed (each direction draws from its own generator).
    """

    gbps: float
    jitter_ms: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """The spec written ``gbps=G[,jitter_ms=J][,seed=S]``.

        Raises:
            ValueError: naming the bad part and the form expected.
        """
        form = f"{ENVIRONMENT_VARIABLE}='gbps=G[,jitter_ms=J][,seed=S]', e.g. 'gbps=2,jitter_ms=3,seed=1'"
        values: dict[str, float] = {}
        for part in filter(None, (piece.strip() for piece in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("gbps", "jitter_ms", "seed") or not value:
                raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r}: {part!r} is not one of gbps=, jitter_ms=, "
                                 f"seed=. Write {form}.")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r}: {key}={value!r} is not a number. Write "
                                 f"{form}.") from None
        if values.get("gbps", 0.0) <= 0:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r}: gbps= must be given and positive (each direction's "
                             f"bandwidth in 10⁹ bytes/s). Write {form}.")
        if values.get("jitter_ms", 0.0) < 0 or values.get("seed", 0.0) != int(values.get("seed", 0.0)):
            raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r}: jitter_ms= must be ≥ 0 and seed= an integer. "
                             f"Write {form}.")
        return cls(values["gbps"], values.get("jitter_ms", 0.0), int(values.get("seed", 0)))

    def describe(self) -> str:
        """The spec in words, for the log."""
        jitter = f", each copy delayed by up to {self.jitter_ms:g} ms at random (seed {self.seed})" \
            if self.jitter_ms else ""
        return f"{self.gbps:g} GB/s each way{jitter}"


def spec_from_environment() -> LinkSpec | None:
    """The simulated link the environment asks for, or ``None`` (see :data:`ENVIRONMENT_VARIABLE`)."""
    text = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    return LinkSpec.parse(text) if text else None


class SimulatedEvent:
    """Completion of one simulated copy (or of compute, which is synchronous: done when made), as a CUDA event is for
    its holder: :meth:`synchronize` blocks until done, :meth:`query` tells without blocking. A copy that failed
    raises its error from :meth:`synchronize`, so no waiter hangs on it."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        if done:
            self._done.set()

    def query(self) -> bool:
        """Whether it completed."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Block until it completed; raise the copy's error if it failed.

        Raises:
            RuntimeError: the copy failed (its error chained).
        """
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"A simulated link copy failed: {self.error!r}") from self.error

    def complete(self, error: BaseException | None = None) -> None:
        """Mark it done (by the copy lane)."""
        self.error = error
        self._done.set()


@dataclass
class _Copy:
    source: Tensor
    destination: Tensor
    after: SimulatedEvent | None
    label: CopyLabel | None
    event: SimulatedEvent


class _CopyLane:
    """One direction of the link: a thread performing its copies in issue order, each ``bytes / bandwidth`` (plus
    jitter) after the previous one ended or after it was issued, whichever is later, and after its ``after`` event."""

    def __init__(self, name: str, spec: LinkSpec, seed: int) -> None:
        self.name = name
        self.bytes_per_second = spec.gbps * 1e9
        self.jitter_seconds = spec.jitter_ms / 1e3
        self._random = random.Random(seed)
        self._copies: queue.SimpleQueue[_Copy | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lightning_offload-link-{name}", daemon=True)
        self._thread.start()
        weakref.finalize(self, _stop_lane, self._copies, self._thread)

    def submit(self, source: Tensor, destination: Tensor, after: Any, label: CopyLabel | None) -> SimulatedEvent:
        event = SimulatedEvent()
        if not self._thread.is_alive():
            raise RuntimeError(f"The simulated link's {self.name} lane is closed; no copy can be issued.")
        # The source is held until the copy reads it, as CUDA's caching allocator holds memory a copy stream uses.
        self._copies.put(_Copy(source, destination, after, label, event))
        return event

    def _run(self) -> None:
        torch.set_num_threads(1)  # a copy engine, not a core: its memcpy must not start a team of threads
        while True:
            copy = self._copies.get()
            if copy is None:
                return
            try:
                if copy.after is not None:
                    copy.after.synchronize()  # the device's last use of the destination came first
                start = time.perf_counter()
                seconds = copy.source.numel() * copy.source.element_size() / self.bytes_per_second
                if self.jitter_seconds:
                    seconds += self._random.uniform(0.0, self.jitter_seconds)
                _sleep_until(start + seconds)
                # Read and written when its time is up: a reader that did not wait sees the old values.
                copy.destination.copy_(copy.source)
                end = time.perf_counter()
                if copy.label is not None:
                    copy.label.timeline.add(self.name, copy.label.name, start, end)
            except BaseException as error:  # noqa: BLE001 - handed to every waiter of this copy, not swallowed
                copy.event.complete(error)
            else:
                copy.event.complete()
            copy.source = copy.destination = None  # type: ignore[assignment]  # memory back to its owner

    def close(self, timeout: float = 5.0) -> None:
        _stop_lane(self._copies, self._thread, timeout)


def _sleep_until(moment: float) -> None:
    """Sleep until ``moment`` (``time.perf_counter``); the last fraction of a millisecond by yielding, as a sleep
    overshoots by about that much."""
    remaining = moment - time.perf_counter()
    if remaining > 2e-4:
        time.sleep(remaining - 1e-4)
    while time.perf_counter() < moment:
        time.sleep(0)


def _stop_lane(copies: queue.SimpleQueue, thread: threading.Thread, timeout: float = 5.0) -> None:
    if thread.is_alive():
        copies.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)


class SimulatedLink(Link):
    """The link of a CPU device as an asynchronous one (see the module docstring).

    Args:
        device: the training device (the CPU).
        spec: bandwidth and jitter.
    """

    def __init__(self, device: torch.device, spec: LinkSpec) -> None:
        super().__init__(device)
        self.spec = spec
        # Each direction its own generator, so one direction's copies do not shift the other's jitter.
        self._to_host = _CopyLane("link_to_host", spec, spec.seed * 2)
        self._to_device = _CopyLane("link_to_device", spec, spec.seed * 2 + 1)

    @property
    def asynchronous(self) -> bool:
        return True

    def to_host(self, source: Tensor, destination: Tensor, label: CopyLabel | None = None) -> SimulatedEvent:
        # Compute is synchronous on the main thread: the source is final when the copy is issued.
        return self._to_host.submit(source, destination, None, label)

    def to_device(self, source: Tensor, destination: Tensor, after: Any = None,
                  label: CopyLabel | None = None) -> SimulatedEvent:
        return self._to_device.submit(source, destination, after, label)

    def compute_event(self) -> SimulatedEvent:
        # The main thread's compute ran as it was called: everything queued so far is done.
        return SimulatedEvent(done=True)

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def device_wait(self, event: Any) -> None:
        # The device is the main thread, whose compute is synchronous: it waits by blocking.
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        self._to_host.close()
        self._to_device.close()


def simulated_link_for(device: torch.device, say: Callable[[str], None], one_process: bool) -> SimulatedLink | None:
    """The simulated link the environment asks for on a CPU ``device`` trained by ``one_process`` (said through
    ``say``, as is a request it does not apply to), else ``None``."""
    spec = spec_from_environment()
    if spec is None:
        return None
    if device.type != "cpu" or not one_process:
        say(f"lightning_offload: {ENVIRONMENT_VARIABLE} is set but not used: it simulates the link of one process "
            f"whose device is the CPU, and this engine's device is {device}"
            + ("" if one_process else " with several ranks (each would take the same cores)") + ".")
        return None
    say(f"lightning_offload: simulated link ({ENVIRONMENT_VARIABLE}): {spec.describe()}; the host worker runs on a "
        f"thread of its own, as on a GPU.")
    return SimulatedLink(device, spec)
