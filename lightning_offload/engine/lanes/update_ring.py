"""A ring of device buffers compressed updates land in on their way to being applied, shared by all layers."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


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
