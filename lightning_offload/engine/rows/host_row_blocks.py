"""Host row matrices an owner (a MEFT adapter) hands the engine to step block by block, and what the owner sees of
their stepping: its side of the engine's row slot, so that an owner names no slot kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from lightning_offload.engine.rows.row_gradients import RowGradients


@dataclass
class HostRowBlocks:
    """Host matrices an owner (a MEFT adapter) hands the engine to step.

    Attributes:
        name: what the slot is called (in checkpoints and errors).
        matrices: fp32 host matrices ``[N, h]`` sharing their row layout, stepped in place.
        accumulators: one per matrix: this step's summed row gradients (valid where ``written``).
        written: one bool ``[N]`` per matrix: the rows of its accumulator holding this step's sum.
        touched: bool ``[N]``: rows that received a gradient since the last step.
        block_rows: rows per block, the unit of stepping.
        lr_scales: per matrix, a factor on the learning rate.
        on_stepped: called on the worker with the ``[start, end)`` row ranges a step changed (a device copy of
            them to refresh), unless the native kernel rewrote ``mirror`` as it stepped them.
        mirror: returns the owner's bf16 host copy of ``matrices[0]`` (``[N, h]``, contiguous), for the native
            kernel to rewrite the stepped rows of in its pass, or ``None`` (the copy is elsewhere, or there is none).
    """

    name: str
    matrices: list[Tensor]
    accumulators: list[Tensor]
    written: list[Tensor]
    touched: Tensor
    block_rows: int
    lr_scales: list[float]
    on_stepped: Callable[[list[tuple[int, int]]], None]
    mirror: Callable[[], Tensor | None] = lambda: None


class RowBlocksStepping(Protocol):
    """The engine's stepping of one owner's :class:`HostRowBlocks`, as the owner uses it (what
    :meth:`~lightning_offload.engine.optimizer.OffloadOptimizer.attach_row_blocks` returns, one per owner).

    Attributes:
        name: the rows' name (:attr:`HostRowBlocks.name`).
        gradients: where the owner's gradient hooks hand row gradients (shared by every owner of the engine).
        rows_updated: rows with a gradient at the latest step.
        rows_stepped: rows the latest step stepped (whole blocks).
    """

    name: str
    gradients: RowGradients
    rows_updated: int
    rows_stepped: int

    def wait(self) -> None:
        """Block until the pending step of these rows has run on the host."""

    def ready(self, training: bool) -> None:
        """Before the owner's forward: the pending step applied, the rows as a training forward or a read sees them."""

    def materialize(self) -> None:
        """Put every gradient of the step into the accumulators, for a reader of them."""

    def keep_shown(self) -> None:
        """The rows are handed back: the decay they owe is paid for good."""

    def adopted_rows(self) -> None:
        """The owner loaded its rows: they owe no decay of the steps before."""
