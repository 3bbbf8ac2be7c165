"""The link between device and host: copies on their own streams, ordered by events where the device has them; on
a machine without a GPU plain copies (streams and events are no-ops)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
