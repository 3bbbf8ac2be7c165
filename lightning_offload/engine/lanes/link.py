"""The link between device and host: copies on their own streams, ordered by events where the device has them (on a
machine without a GPU plain copies, or the simulated asynchronous link of :mod:`.simulated_link`), and the ring of
device buffers compressed updates land in.

What waits for what is the link's to say (:attr:`Link.asynchronous`), not the device type's: the slots and the step
order their work by the link's events whatever the device, so the same code runs on a GPU and under the simulation.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.timeline import StepTimeline


@dataclass(frozen=True)
class CopyLabel:
    """Where a copy's busy time is recorded: the step's timeline (lane ``link_to_host`` or ``link_to_device``) under
    the copied tensor's name."""

    timeline: StepTimeline
    name: str


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

    @property
    def asynchronous(self) -> bool:
        """Whether copies complete after they are issued (a GPU's copy streams, the simulated link): updates then land
        in a ring of device buffers and host steps may start during backward. With the CPU as the device (this class,
        not simulated) a copy is done when issued."""
        return self.is_cuda

    def to_host(self, source: Tensor, destination: Tensor, label: CopyLabel | None = None) -> Any:
        """Start copying a device tensor into a host buffer; returns an event (``None`` when already done).

        The caller need not keep ``source`` alive (the caching allocator holds its memory until the copy has read
        it), but must not modify it in place before the event completed (see :meth:`device_wait`).

        Args:
            label: where the copy's time is recorded (on a GPU, the time its issue took).
        """
        start = time.perf_counter()
        if not self.is_cuda:
            destination.copy_(source)
            _record(label, "link_to_host", start)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.to_host_stream):
            # The copy stream must not read the gradient before the compute stream finished writing it.
            self.to_host_stream.wait_event(produced)
            destination.copy_(source, non_blocking=True)
            # Memory allocated on the compute stream and read here: when its last reference goes, the allocator
            # waits for this stream's work queued so far before handing the memory out again.
            source.record_stream(self.to_host_stream)
            event = self.to_host_stream.record_event()
        _record(label, "link_to_host", start)
        return event

    def to_device(self, source: Tensor, destination: Tensor, after: Any = None, label: CopyLabel | None = None) -> Any:
        """Start copying a host buffer to the device (from the worker thread); returns an event or ``None``.

        Args:
            after: a device event the copy must wait for (the last compute use of ``destination``).
            label: where the copy's time is recorded (on a GPU, the time its issue took).
        """
        start = time.perf_counter()
        if not self.is_cuda:
            destination.copy_(source)
            _record(label, "link_to_device", start)
            return None
        with torch.cuda.stream(self.to_device_stream):
            if after is not None:
                self.to_device_stream.wait_event(after)
            destination.copy_(source, non_blocking=True)
            event = self.to_device_stream.record_event()
        _record(label, "link_to_device", start)
        return event

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

    def close(self) -> None:
        """Stop what the link runs of its own (nothing here: the simulated link's copy threads)."""


def _record(label: CopyLabel | None, lane: str, start: float) -> None:
    if label is not None:
        label.timeline.add(lane, label.name, start, time.perf_counter())


#: Share of the device's memory the update ring takes at most by default (:func:`default_update_buffers`).
RING_MEMORY_SHARE = 1 / 64


def default_update_buffers(layers: int, largest_bytes: int, device_memory: int) -> int:
    """The update ring's buffers when ``update_buffers=None`` and the link copies asynchronously: one per projected
    layer (``layers``), so that every update can cross as soon as its host step ends, during backward, instead of
    when its layer's next forward nears; at most :data:`RING_MEMORY_SHARE` of ``device_memory`` (bytes; 0: unknown)
    in buffers of ``largest_bytes``, and never fewer than 4."""
    if device_memory <= 0 or largest_bytes <= 0:
        return min(layers, 4)
    return max(min(layers, 4), min(layers, int(device_memory * RING_MEMORY_SHARE) // largest_bytes))


def device_memory_bytes(device: torch.device) -> int:
    """The device's memory in bytes: a GPU's total, or the host's for the CPU (0 where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class UpdateRing:
    """Device buffers that compressed updates land in on their way to being applied, shared by all layers.

    A buffer is claimed for one update (its copy from the host is issued into it, by the host worker as soon as the
    update is computed, or by the main thread), and released once the kernels that apply the update have been queued,
    with an event marking them. A copy into a released buffer waits, on the copy stream, for that event: the buffer is
    reused only after the previous update was read, and the host never blocks for it. When every buffer is claimed,
    the worker leaves the copy to the main thread, which falls back to a one-off allocation, so a ring never stalls a
    step.

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
        self._lock = threading.Lock()  # the worker claims buffers while the main thread claims and releases them
        # Per buffer: the compute-stream event after the kernels that last read it (None: never used, or CPU).
        self.last_read: list[Any] = [None] * count
        self.fallbacks = 0  # updates that found no free buffer (a one-off allocation instead)
        self.prefetched = 0  # copies started ahead of the layer's forward

    def claim(self) -> int | None:
        """A free buffer's number, or ``None`` when all are claimed."""
        with self._lock:
            return self._free.pop(0) if self._free else None

    @property
    def free(self) -> int:
        """Buffers not claimed now."""
        with self._lock:
            return len(self._free)

    def view(self, index: int, shape: tuple[int, ...]) -> Tensor:
        """Buffer ``index`` as a tensor of ``shape``."""
        return self.buffers[index][: math.prod(shape)].view(shape)

    def release(self, index: int, read_done: Any) -> None:
        """Return buffer ``index``; ``read_done`` is the event after the kernels that read it."""
        with self._lock:
            self.last_read[index] = read_done
            self._free.append(index)

    def nbytes(self) -> int:
        """Device bytes of the ring."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers)
