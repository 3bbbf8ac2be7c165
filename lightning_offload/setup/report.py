"""What the offload strategies tell a run's reporting: their per-step figures, a few facts and the projector fits'
records, as typed values.

The CLI and :mod:`lightning_offload.reporting` build the run summary and the per-step records from these alone:
they never read a strategy's optimizer, adapters or other internals. A strategy that is not an offload strategy
(Lightning's own) reports nothing: :func:`facts_of` gives empty facts and :func:`figures_of` no figures for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lightning_offload.engine.figures.phases import PhaseClock
from lightning_offload.engine.figures.refit_record import RefitRecord

#: ``(optimizer step number, figures)``: the figures the engine filed when the step's host work completed.
StepFigures = tuple[int, dict[str, float]]


@dataclass(frozen=True)
class OffloadFacts:
    """What a run's summary needs of the strategy beyond the figures it logs each step.

    Attributes:
        gradients_offloaded: gradients and optimizer state leave the device tensor by tensor (none persist there).
            Default: ``False``.
        projected_layers: layers whose gradients are compressed by LSP projectors (or, under ``update="scaled"``,
            projected for the scaled rule's host moments). Default: ``0``.
        host_trainable_parameters: trained values held on the host as plain tensors, not module parameters (MEFT's
            adapter rows); Lightning's model summary does not count them. Default: ``0``.
        host_rows_bytes: bytes of those rows with their gradient accumulators and Adam moments. Default: ``0``.
        adapter_rows: rows (neurons) of every MEFT adapter together. Default: ``0``.
        adapter_device_bytes: bytes MEFT adapters keep on the device (routers, routing keys, input statistics).
            Default: ``0``.
        kernels: the kernel chosen for each distinct product of the projected layers
            (:func:`~lightning_offload.lsp.kernels.selection.kernel_choices`). Default: none.
    """

    gradients_offloaded: bool = False
    projected_layers: int = 0
    host_trainable_parameters: int = 0
    host_rows_bytes: int = 0
    adapter_rows: int = 0
    adapter_device_bytes: int = 0
    kernels: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class ReportsOffload(Protocol):
    """The reporting face of an offload strategy (``lsp_offload``, ``zero_offload``, ``meft_offload`` and the DDP
    forms provide it)."""

    def offload_facts(self) -> OffloadFacts:
        """The facts of the run as set up now."""

    def figures_at_step_end(self) -> dict[str, float]:
        """Figures complete when an optimizer step returns (MEFT's rows moved and updated); ``{}`` when none."""

    def completed_step_figures(self, settle: bool = False) -> Sequence[StepFigures]:
        """The engine's figures of recently completed steps, oldest first (a pipelined step completes during the
        next one). ``settle=True`` first finishes the step in flight, so that its figures are among them."""


@runtime_checkable
class RecordsFits(Protocol):
    """The reporting face of a projector-fit schedule (the Trainer's ``ProjectorRefit`` callback provides it)."""

    def fit_history(self) -> Sequence[RefitRecord]:
        """What each fit or refit check did, oldest first."""


def fit_records_of(callbacks: Sequence[Any]) -> Sequence[RefitRecord]:
    """The fit records of the first of ``callbacks`` that fitted projectors, oldest first; none when none did."""
    for callback in callbacks:
        if isinstance(callback, RecordsFits) and callback.fit_history():
            return callback.fit_history()
    return ()


def facts_of(strategy: Any) -> OffloadFacts:
    """``strategy``'s facts, or empty ones for a strategy that offloads nothing."""
    return strategy.offload_facts() if isinstance(strategy, ReportsOffload) else OffloadFacts()


def figures_of(strategy: Any, settle: bool = False) -> Sequence[StepFigures]:
    """``strategy``'s completed step figures, or none for a strategy that offloads nothing."""
    return strategy.completed_step_figures(settle) if isinstance(strategy, ReportsOffload) else ()


def figures_at_step_end(strategy: Any) -> dict[str, float]:
    """``strategy``'s figures complete at the end of a step, or none for a strategy that offloads nothing."""
    return strategy.figures_at_step_end() if isinstance(strategy, ReportsOffload) else {}


def phase_clock_of(strategy: Any) -> PhaseClock | None:
    """The phase clock of ``strategy``'s engine (:mod:`~lightning_offload.engine.figures.phases`), or ``None`` for a
    strategy that offloads nothing or has not built its engine yet."""
    return getattr(getattr(strategy, "offload_optimizer", None), "phases", None)
