"""A run's own record on disk: ``history.jsonl`` (one line per step and per validation) and ``summary.json``.

Loggers (wandb, CSV) are for people browsing runs; these two files are for programs: the plot command reads them
from every job of a sweep without depending on which logger the user picked, or on wandb being online.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

HISTORY_FILE = "history.jsonl"
SUMMARY_FILE = "summary.json"


def _scalar(value: Any) -> float | None:
    if torch.is_tensor(value):
        value = value.detach().float().item() if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def host_peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def device_peak_bytes(device: torch.device) -> int | None:
    """Peak memory allocated by tensors on ``device`` since the last reset; ``None`` where torch cannot tell (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> float:
    """Bytes of every tensor in the optimizers' state (on-device AdamW: its moments beside the parameters)."""
    return float(sum(t.numel() * t.element_size() for optimizer in optimizers
                     for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)))


class RunRecorder(pl.Callback):
    """Appends every training step's and every validation's figures to ``<run_dir>/history.jsonl``.

    A step line holds ``step``, ``wall_seconds`` (since the start of ``fit``), ``step_seconds``, the logged
    ``train/*`` metrics and the strategy's ``offload/*`` (and ``meft/*``) telemetry when it has any. A validation line holds ``step``,
    ``wall_seconds`` and the ``val/*`` metrics. Lines are flushed as written, so a crashed run keeps its history.

    Args:
        run_dir: Directory of this run (Hydra's output directory in the CLI); ``None`` keeps the records in memory
            only (``records``).
    """

    def __init__(self, run_dir: str | Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._fit_start: float | None = None
        self._batch_start = 0.0
        self.step_seconds: list[float] = []
        self.telemetry: list[dict[str, float]] = []
        self.records: list[dict[str, Any]] = []

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / HISTORY_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _wall(self) -> float:
        return time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Starts the wall clock (the projector fit, when there is one, counts: it is part of the run's cost)."""
        self._fit_start = time.perf_counter()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Marks the start of a step."""
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Records the step that just finished."""
        seconds = time.perf_counter() - self._batch_start
        self.step_seconds.append(seconds)
        record: dict[str, Any] = {"kind": "train", "step": trainer.global_step, "wall_seconds": self._wall(),
                                  "step_seconds": seconds}
        for key, value in trainer.callback_metrics.items():
            if key.startswith("train/") and (v := _scalar(value)) is not None:
                record[key] = v
        optimizer = getattr(trainer.strategy, "offload_optimizer", None)
        # Pipelined figures complete one step late: record each completed step once.
        if optimizer is not None and optimizer.telemetry.steps > len(self.telemetry):
            metrics = optimizer.telemetry.metrics()
            self.telemetry.append(metrics)
            record.update(metrics)
        # meft_offload's row traffic and expert usage for the step just taken.
        rows = getattr(trainer.strategy, "last_metrics", None)
        if isinstance(rows, dict):
            record.update(rows)
        self._write(record)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Records the validation metrics (skipped during the sanity check and outside ``fit``)."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.record_validation(trainer.global_step, trainer.callback_metrics)

    def record_validation(self, step: int, metrics: dict[str, Any]) -> None:
        """Records an evaluation made outside the fit loop (before training, or after it)."""
        record: dict[str, Any] = {"kind": "val", "step": step, "wall_seconds": self._wall()}
        for key, value in metrics.items():
            if key.startswith("val/") and (v := _scalar(value)) is not None and math.isfinite(v):
                record[key] = v
        self._write(record)

    def last_validation(self) -> dict[str, Any] | None:
        """The latest validation record, if any."""
        return next((r for r in reversed(self.records) if r["kind"] == "val"), None)


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records :class:`RunRecorder` wrote in ``run_dir`` (empty if none)."""
    path = Path(run_dir) / HISTORY_FILE
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Writes ``summary.json`` (write-then-rename, so a reader never sees half a file); returns its path."""
    path = Path(run_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str), encoding="utf-8")
    tmp.replace(path)
    return path


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """``summary.json`` of ``run_dir``, or ``None`` when the run did not finish."""
    path = Path(run_dir) / SUMMARY_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
