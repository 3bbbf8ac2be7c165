"""The host side of MEFT's adapters: each adapter's rows, gradient accumulators and traffic counters, and the one
thread that gathers rows for every adapter."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

#: The process's one fetch thread, started at the first gather. It is the process's, not an adapter's or a model's:
#: an idle thread costs nothing, an adapter may be copied or pickled (a thread cannot), and concurrent.futures joins it
#: when the interpreter exits.
_POOL: ThreadPoolExecutor | None = None


def fetch_pool() -> ThreadPoolExecutor:
    """The process's fetch thread (started on first use)."""
    # One host thread gathers rows for every adapter: gathers are memory-bound, more threads would only contend.
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meft-fetch")
    return _POOL


def _forget_fetch_pool() -> None:
    # A forked child (DDP's fork launcher, a fork of one's own) has the pool but not its thread (fork copies only the
    # calling thread), and the pool believes that thread idle: a gather submitted to it would never run, and the
    # forward would wait for it forever. The child starts its own thread at its first gather.
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_fetch_pool)


@dataclass
class RowTraffic:
    """Rows and bytes an adapter moved since the counters were last read."""

    rows: int = 0
    bytes_to_device: int = 0
    bytes_to_host: int = 0


@dataclass
class HostRows:
    """The host side of one adapter: parameters, gradient accumulators and the set of rows touched.

    Without ``meft_offload`` the accumulators sum gradients like ``.grad`` (zero-initialised, added to). Under it, a
    row's accumulator holds this step's sum only where ``written_keys`` / ``written_values`` say so: the step's first
    gradient of a row is copied in rather than added, so no pass ever zeroes the rows a step consumed, and a step's
    only gradient of a matrix is kept where it landed until something reads the accumulators (``before_read``; see
    :meth:`summed_gradients`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    grad_keys: torch.Tensor
    grad_values: torch.Tensor
    touched: torch.Tensor  # bool [N]: rows fetched with gradients enabled since the last step
    written_keys: torch.Tensor  # bool [N]: rows of grad_keys holding this step's sum (under meft_offload)
    written_values: torch.Tensor  # bool [N]: likewise for grad_values
    traffic: RowTraffic = field(default_factory=RowTraffic)
    expert_counts: torch.Tensor | None = None
    #: Under ``meft_offload``: puts the step's gradients kept where they landed into the accumulators.
    before_read: Callable[[], None] | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, expert_counts: torch.Tensor | None) -> HostRows:
        """Rows holding ``keys`` and ``values``, their accumulators zero and no row touched or written."""
        return cls(keys, values, torch.zeros_like(keys), torch.zeros_like(values),
                   *(torch.zeros(keys.shape[0], dtype=torch.bool) for _ in range(3)), expert_counts=expert_counts)

    def summed_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of this step's summed key and value gradients, zero in rows that received none."""
        if self.before_read is not None:
            self.before_read()
        return (self.grad_keys * self.written_keys.unsqueeze(1), self.grad_values * self.written_values.unsqueeze(1))
