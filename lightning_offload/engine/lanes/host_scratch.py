"""The fp32 working buffers the host jobs share.

- ``gradient``: the fp32 copy of a gradient that landed narrower, or of a landed gradient that a speculative step
  clips or adds L2 to (the landing buffer must stay as it arrived, in case the step is redone);
- ``variable``: a projected weight's ``Z`` where its update crosses in a narrower link dtype (``Z`` restarts from zero
  at every step and is narrowed into its staging buffer right after it; nothing reads it later).

Each is needed only while its job runs, and the host jobs run one after another on the worker (or inline on the main
thread), so one buffer of each, the size of the largest use, serves every slot: a slot's own would add 4 bytes per
host element, as much as one of Adam's moments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


#: The shared buffers' names.
USES = ("gradient", "variable")


class HostScratch:
    """The shared fp32 working buffers, grown at set-up to the largest size reserved for each use."""

    def __init__(self) -> None:
        self._buffers = {use: torch.empty(0, dtype=torch.float32) for use in USES}

    def reserve(self, numel: int, use: str = "gradient") -> None:
        """Make room for ``numel`` elements for ``use`` (set-up: no host job allocates). Untouched pages cost
        nothing until a job writes them."""
        if numel > self._buffers[use].numel():
            self._buffers[use] = torch.empty(numel, dtype=torch.float32)

    def view(self, shape: Sequence[int], use: str = "gradient", grow: bool = False) -> Tensor:
        """A view of ``use``'s buffer as ``shape`` (host jobs only; its contents are the last job's).

        Args:
            grow: allocate a larger buffer if this one is too small (a use that set-up cannot foresee: a speculative
                step's copy of an fp32 gradient it clamps, once, on the worker).

        Raises:
            RuntimeError: if ``shape`` was never reserved (a slot that skipped :meth:`reserve`) and not ``grow``.
        """
        numel = math.prod(shape)
        if grow:
            self.reserve(numel, use)
        buffer = self._buffers[use]
        if numel > buffer.numel():
            raise RuntimeError(f"The host scratch for the {use} holds {buffer.numel()} elements, fewer than the "
                               f"{numel} of shape {tuple(shape)}: its slot did not reserve them at set-up.")
        return buffer[:numel].view(tuple(shape))

    def buffers(self) -> list[Tensor]:
        """The buffers (counted once in the host state's bytes)."""
        return list(self._buffers.values())
