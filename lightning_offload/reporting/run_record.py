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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_offload.setup.report import StepFigures, facts_of, figures_at_step_end, figures_of

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
    ``train/*`` metrics and the strategy's ``offload/*`` (and ``meft/*``) telemetry when it has any. A validation
    line holds ``step``, ``wall_seconds`` and the ``val/*`` metrics. Lines are appended as soon as they are complete
    (see below: at most one step late), and a run that fails with an exception writes every line it has.

    A pipelined offload optimizer finishes a step's host work during the next step, so that step's ``offload/*``
    figures arrive one step late. Its line waits for them (with any line after it, to keep the order) and carries
    them under its own step number; the last step's figures are collected at the end of training, so even a
    one-step run (``fast_dev_run``) reports its link bytes and host state.

    A resumed run (``resume=True``) continues the history already in ``run_dir``: lines after the step it resumes
    from (written after that checkpoint, by the run that then stopped) are dropped, and the wall clock continues
    from the last line kept, so the history reads as one run.

    Args:
        run_dir: Directory of this run (Hydra's output directory in the CLI); ``None`` keeps the records in memory
            only (``records``).
        resume: this fit resumes from a checkpoint written in ``run_dir``.

    Attributes:
        records: this session's lines, in order.
        previous: a resumed run's lines kept from before it (empty otherwise).
        start_step: the optimizer step training started from (0, or the checkpoint's).
    """

    #: Reads no weights after a step, or applies pending updates itself first
    #: (see lightning_offload/faces/trainer/weight_readers.py).
    leaves_weights_alone = True

    def __init__(self, run_dir: str | Path | None, resume: bool = False) -> None:
        # With several ranks, rank 0 writes the run's files (Lightning's launcher puts the others' rank in their
        # environment, which rank_zero_only reads at import).
        self.run_dir = Path(run_dir) if run_dir is not None and rank_zero_only.rank == 0 else None
        self.resume = resume
        self.previous: list[dict[str, Any]] = []
        self.start_step = 0
        self._wall_offset = 0.0
        self._fit_start: float | None = None
        self._batch_start = 0.0
        self.step_seconds: list[float] = []
        self.telemetry: list[dict[str, float]] = []
        self.records: list[dict[str, Any]] = []
        # Lines not yet on disk, in order, each with whether it still waits for its step's offload figures: from the
        # oldest step whose figures are to come. ``records`` holds them already; figures are added in place.
        self._waiting: list[tuple[dict[str, Any], bool]] = []
        self._last_global_step = -1
        self._collected = 0  # the latest optimizer step whose offload figures were taken
        self._awaits_figures = False

    def _write(self, record: dict[str, Any], awaits_figures: bool = False) -> None:
        self.records.append(record)
        self._waiting.append((record, awaits_figures))
        self._settle(completed=None)

    def _settle(self, completed: int | None) -> None:
        """Writes the waiting lines, in order, up to the first that still awaits its figures: any awaiting line for
        ``completed=None``, else one of a step after ``completed`` (the optimizer steps whose figures are in)."""
        ready = 0
        for record, awaits in self._waiting:
            if awaits and (completed is None or record["step"] > completed):
                break
            ready += 1
        done, self._waiting = self._waiting[:ready], self._waiting[ready:]
        if self.run_dir is None or not done:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / HISTORY_FILE, "a", encoding="utf-8") as f:
            for record, _ in done:
                f.write(json.dumps(record) + "\n")

    def _wall(self) -> float:
        return self._wall_offset + (time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Starts the wall clock (the projector fit, when there is one, counts: it is part of the run's cost)."""
        self._fit_start = time.perf_counter()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Notes the step training starts from; a resumed run takes up the history it continues."""
        self.start_step = self._last_global_step = self._collected = trainer.global_step
        # Whether each optimizer step's line waits for the offload figures its host work files when it completes.
        self._awaits_figures = facts_of(trainer.strategy).gradients_offloaded
        if self.resume and self.run_dir is not None:
            self._continue_history(self.start_step)

    def _continue_history(self, step: int) -> None:
        path = self.run_dir / HISTORY_FILE  # type: ignore[operator]
        earlier = read_history(self.run_dir)  # type: ignore[arg-type]
        self.previous = [r for r in earlier if r.get("step", 0) <= step]
        dropped = len(earlier) - len(self.previous)
        if dropped:
            # Written after the checkpoint by the run that stopped: this run redoes those steps.
            temporary = path.with_suffix(".jsonl.partial")
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.previous)
            temporary.replace(path)  # atomic: a crash here leaves the old history, never half of one
        self._wall_offset = max((r.get("wall_seconds", 0.0) for r in self.previous), default=0.0)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Marks the start of a step."""
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Records the step (or micro-batch) that just finished."""
        seconds = time.perf_counter() - self._batch_start
        self.step_seconds.append(seconds)
        record: dict[str, Any] = {"kind": "train", "step": trainer.global_step, "wall_seconds": self._wall(),
                                  "step_seconds": seconds}
        for key, value in trainer.callback_metrics.items():
            if key.startswith("train/") and (v := _scalar(value)) is not None:
                record[key] = v
        # meft_offload's row traffic and expert usage for the step just taken.
        record.update(figures_at_step_end(trainer.strategy))
        # The line that ends an optimizer step (global_step moved) is the one its offload figures belong to;
        # accumulation's earlier micro-batches carry none.
        ends_step = trainer.global_step != self._last_global_step
        self._last_global_step = trainer.global_step
        self._write(record, awaits_figures=self._awaits_figures and ends_step)
        self._collect(figures_of(trainer.strategy))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Collects the last step's offload figures and writes every waiting line."""
        # The strategy settles pending host work right after this hook; settling first lets the last figures in (and
        # those settled since the last step: an evaluation synchronizes).
        self._collect(figures_of(trainer.strategy, settle=True))
        self._flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A failed run keeps every line it has, figures or not."""
        self._flush()

    def _collect(self, figures: Sequence[StepFigures]) -> None:
        """Attaches newly completed offload figures to their step's line and writes the lines that are settled."""
        for number, metrics in figures:
            if number <= self._collected:
                continue
            self._collected = number
            self.telemetry.append(metrics)
            for index in range(len(self._waiting) - 1, -1, -1):
                record, awaits = self._waiting[index]
                if awaits and record["step"] == number:
                    record.update(metrics)
                    self._waiting[index] = (record, False)
                    break
        self._settle(self._collected)  # every step up to the latest filed one has completed

    def _flush(self) -> None:
        self._waiting = [(record, False) for record, _ in self._waiting]
        self._settle(completed=None)

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
