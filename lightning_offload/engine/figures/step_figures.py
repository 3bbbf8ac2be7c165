"""The figures of the engine's steps as they happen: the timeline being collected during a backward, the launched
step whose figures complete once its host work is done, and the running totals the strategies log."""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_offload.engine.figures.telemetry import OffloadTelemetry, StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline, TimelineRecorder


class StepFigures:
    """What the engine's steps cost, kept step by step.

    Attributes:
        telemetry: the running figures (:class:`~lightning_offload.engine.figures.telemetry.OffloadTelemetry`).
        timelines: the last steps' timelines (a Chrome trace on request).
        timeline: the timeline of the step being collected (its backward's sends and speculative jobs).
    """

    def __init__(self) -> None:
        self.telemetry = OffloadTelemetry()
        self.timelines = TimelineRecorder()
        self.timeline = StepTimeline()
        # The launched step whose figures complete at the next synchronize (its host work may still run).
        self._launched: tuple[StepTelemetry, StepTimeline] | None = None
        self._step_start = time.perf_counter()

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's figures are still to complete."""
        return self._launched is not None

    def restart_clock(self) -> None:
        """Start the next step's device lane now."""
        self._step_start = time.perf_counter()

    def backward_ended(self) -> None:
        """The step's forward and backward are done: their span is the device lane's."""
        end = time.perf_counter()
        self.timeline.add("device", "forward+backward", self._step_start, end)
        self.timeline.backward_end = end

    def launched(self, step: StepTelemetry) -> None:
        """The step was launched with figures ``step``; the next step collects a timeline of its own."""
        self._launched = (step, self.timeline)
        self.timeline = StepTimeline()

    def skipped(self) -> None:
        """The step was skipped: counted, and its timeline dropped (a skipped step has none of its own)."""
        self.timeline = StepTimeline()
        self.telemetry.skipped_steps += 1
        self.telemetry.last = StepTelemetry(skipped=1.0)
        self.telemetry.last_timeline = None
        self.telemetry.complete_step()

    def complete(self, sizes: Callable[[], tuple[int, dict[str, int], int]]) -> None:
        """The launched step's host work is done: complete its figures.

        Args:
            sizes: host state bytes, device persistent bytes by category, and update-ring fallbacks, measured now
                (Adam allocates its moments at the first step, and a refit may change the projectors).
        """
        if self._launched is None:
            return
        (step, timeline), self._launched = self._launched, None
        step.host_optimizer_seconds = timeline.busy("host")
        step.host_share_before_backward_end = timeline.share_before("host", timeline.backward_end)
        telemetry = self.telemetry
        telemetry.last, telemetry.last_timeline = step, timeline
        telemetry.steps += 1
        telemetry.host_state_bytes, telemetry.device_persistent_bytes, telemetry.update_ring_fallbacks = sizes()
        self.timelines.record(telemetry.steps, timeline)
        telemetry.complete_step()
