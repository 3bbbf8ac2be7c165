"""Who was busy when during a step: each lane's spans, and the recorder of the last steps' timelines (traces)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any


#: Timeline lanes, in the order a trace viewer shows them.
LANES = ("device", "device_wait", "link_to_host", "host_wait", "host", "link_to_device")


@dataclass
class Span:
    """One interval of activity on a lane of the timeline."""

    lane: str
    name: str
    start: float
    end: float


@dataclass
class StepTimeline:
    """Who was busy when during one optimizer step (host clock, seconds).

    Lanes: ``device`` (compute as seen from the main thread), ``link_to_host`` and ``link_to_device`` (each copy's
    time, as the link records it: on a GPU the time its issue took, under the simulated link its busy time),
    ``host_wait`` (the worker blocked for a copy to land), ``host`` (Adam), ``device_wait`` (the main thread blocked
    for an update or the worker).
    """

    spans: list[Span] = field(default_factory=list)
    # When the step's first gradient was sent and when its backward ended (host clock); None until then.
    backward_start: float | None = None
    backward_end: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        """Record a span (thread-safe: the worker and the main thread both record)."""
        with self._lock:
            self.spans.append(Span(lane, name, start, end))

    def busy(self, lane: str) -> float:
        """Total seconds recorded on ``lane``."""
        return sum(span.end - span.start for span in self.spans if span.lane == lane)

    def share_before(self, lane: str, moment: float | None) -> float:
        """The share of ``lane``'s busy seconds that lie before ``moment`` (0 when the lane was idle or ``moment``
        is unknown)."""
        total = self.busy(lane)
        if moment is None or total == 0.0:
            return 0.0
        early = sum(max(0.0, min(span.end, moment) - span.start) for span in self.spans if span.lane == lane)
        return early / total

    def chrome_events(self, step: int, origin: float) -> list[dict[str, Any]]:
        """The spans as Chrome-trace "complete" events (microseconds), one thread row per lane."""
        return [
            {
                "name": span.name,
                "cat": span.lane,
                "ph": "X",
                "ts": (span.start - origin) * 1e6,
                "dur": max(span.end - span.start, 0.0) * 1e6,
                "pid": 0,
                "tid": LANES.index(span.lane) if span.lane in LANES else len(LANES),
                "args": {"step": step},
            }
            for span in self.spans
        ]


class TimelineRecorder:
    """Keeps the last ``keep`` step timelines and writes them as a Chrome trace
    (open in chrome://tracing or Perfetto)."""

    def __init__(self, keep: int = 50) -> None:
        self.keep = keep
        self.steps: list[tuple[int, StepTimeline]] = []
        self.origin = time.perf_counter()

    def record(self, step: int, timeline: StepTimeline) -> None:
        """Store a finished step's timeline."""
        self.steps.append((step, timeline))
        del self.steps[: -self.keep]

    def export_chrome_trace(self, path: str) -> None:
        """Write the kept timelines as Chrome-trace JSON."""
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(LANES)
        ]
        for step, timeline in self.steps:
            events += timeline.chrome_events(step, self.origin)
        with open(path, "w") as handle:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)
