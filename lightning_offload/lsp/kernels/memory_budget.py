"""How much memory a kernel trial may take on a device: a share of what is free there now.

The kernel selection times each candidate on a product's own operands, and some candidates need a working set of
their own (the ``dense`` kernel forms the projector densely: ``vocabulary × rank·vocabulary × 4`` bytes for a
projected 152K head, 23 GB). Relying on the allocation to raise is not safe: Linux overcommits, so the process is
killed by the system's OOM killer instead of seeing a ``MemoryError``; and CUDA would be asked for the memory the
model needs next. So a candidate whose working set exceeds this budget is not tried.

Free memory on the CPU is the least of: the kernel's ``MemAvailable``, the cgroup's limit less its usage (a
container's cap), and the address-space limit (``ulimit -v``) less the process's virtual size. On CUDA it is
``torch.cuda.mem_get_info``'s free bytes.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

#: Share of the free memory one trial's working set may take: the trial runs beside the model and its activations.
TRIAL_SHARE = 0.25


def free_bytes(device: torch.device) -> int:
    """Bytes that can be allocated on ``device`` now (see the module docstring); the CPU's own total when nothing
    can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    limits = [_meminfo_bytes("MemAvailable"), _cgroup_free_bytes(), _address_space_free_bytes()]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else _physical_bytes()


def trial_budget_bytes(device: torch.device) -> int:
    """Bytes a kernel trial's own working set may take on ``device``: :data:`TRIAL_SHARE` of :func:`free_bytes`."""
    return int(free_bytes(device) * TRIAL_SHARE)


def _meminfo_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free_bytes() -> int | None:
    """The cgroup (v2) limit less its usage; ``None`` without a limit."""
    folder = Path("/sys/fs/cgroup")
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _address_space_free_bytes() -> int | None:
    """``RLIMIT_AS`` less the process's virtual size; ``None`` without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
        virtual = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        return None
    return max(0, soft - virtual)


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30  # an unknown machine: assume a small one
