"""Benchmark runs through the command line's own entry, :func:`lightning_offload.cli.train.train`: overrides in,
measurements out; and the callbacks that time the steps of a benchmark's own Trainer.

The benchmark scripts (``scripts/benchmark_*.py``) describe a run as Hydra overrides of the command line's config,
the same ones a user would type, and read back what the run measured. :func:`recipe_overrides` is the fixed
SmolLM2/``bible_lm`` recipe they share (no loggers, no progress bar, evaluation only before and after training);
:func:`method_overrides` names each compared method in the config's own terms. Benchmark-only, so it lives beside
the scripts, not in the package: they import it by its bare name (``from benchmark_run import …``), as they import
``harness``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_offload.engine.figures.phases import PHASES
from lightning_offload.setup.report import phase_clock_of


class StepClock(pl.Callback):
    """Wall time of each training step, batch start to batch end (the optimizer step included), for benchmark
    scripts that build their own Trainer. On CUDA the device is synchronised at both ends, so a step's time includes
    the kernels it queued.

    It reads no weights, and says so (``leaves_weights_alone``): a callback that may read them after each step makes
    the offload strategies apply every update before the step returns, and the clock would time that slower mode
    instead of the one users get.
    """

    leaves_weights_alone = True

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def _sync(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync(trainer)
        self.seconds.append(time.perf_counter() - self._start)


class PhaseReader(pl.Callback):
    """Reads the offload engine's phase clock (lightning_offload/engine/figures/phases.py) after every steady step.

    On the CPU an enabled clock costs two clock reads per phase (no synchronisation), so a timed run may keep it on;
    on CUDA it synchronizes at every phase boundary, so its run is not the one whose step time is quoted.

    Args:
        warmup: steps before the clock is switched on.
    """

    leaves_weights_alone = True  # reads figures, never weights: pipelining stays on

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        clock = phase_clock_of(trainer.strategy)
        if clock is not None and trainer.global_step == self.warmup:
            clock.take()  # the warm-up steps' share is dropped
            clock.enabled = True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        clock = phase_clock_of(trainer.strategy)
        if clock is not None and clock.enabled:
            self.steps.append(clock.take())

    def medians(self) -> dict[str, float]:
        """Median seconds per step of each phase over the steady steps."""
        return {phase: statistics.median(step[phase] for step in self.steps) for phase in PHASES} if self.steps else {}


#: The methods the benchmarks compare, by the names their tables use.
METHODS = ("none", "adamw", "frozen", "zero_offload", "lsp_offload", "lsp_learned", "lsp_random", "galore", "lora")


@dataclass
class BenchmarkRun:
    """What one run measured (the run's ``summary.json`` figures plus per-step times and lanes).

    Attributes:
        overrides: the overrides the run was composed from.
        eval_loss_before, eval_loss_after: held-out loss before and after training.
        step_seconds: wall time of every training step, in order.
        median_step_seconds: median over the steps after the first two (warm-up).
        bytes_device_to_host_per_step, bytes_host_to_device_per_step: median link bytes per step each way.
        host_optimizer_seconds_per_step: median host Adam time per step.
        host_state_bytes, device_state_bytes: optimizer state on the host and on the device.
        trainable_parameters: parameters the run trained.
        projected_layers: layers ``lsp_offload`` projected (0 otherwise).
        timeline_seconds_per_step: median busy seconds per pipeline lane (offload strategies).
        host_share_before_backward_end: median share of a step's host Adam time spent before its backward ended
            (speculative host steps).
        initial_fit_seconds, initial_fit_error, initial_fitted_error: the initial projector fit (learned
            projectors): its time, and the mean error of its starting point and of the fitted projectors (held out).
        train_seconds: wall time of ``fit``.
    """

    overrides: list[str]
    eval_loss_before: float
    eval_loss_after: float
    step_seconds: list[float] = field(default_factory=list)
    median_step_seconds: float = float("nan")
    bytes_device_to_host_per_step: float = 0.0
    bytes_host_to_device_per_step: float = 0.0
    host_optimizer_seconds_per_step: float = 0.0
    host_state_bytes: float = 0.0
    device_state_bytes: float = 0.0
    trainable_parameters: int = 0
    projected_layers: int = 0
    timeline_seconds_per_step: dict[str, float] = field(default_factory=dict)
    host_share_before_backward_end: float = 0.0
    initial_fit_seconds: float = 0.0
    initial_fit_error: float = float("nan")
    initial_fitted_error: float = float("nan")
    train_seconds: float = 0.0


def recipe_overrides(*, steps: int, batch_size: int = 4, block_size: int = 128, eval_blocks: int = 64,
                     precision: str = "bf16-mixed", lr: float = 1e-4, weight_decay: float = 0.0, seed: int = 0,
                     model: str = "smollm2_135m") -> list[str]:
    """The benchmarks' fixed recipe: ``model`` fine-tuned on ``bible_lm``, evaluated before and after only."""
    return [
        f"model={model}", "data=bible_lm", "logger=none", "callbacks=none",
        f"trainer.max_steps={steps}", f"trainer.precision={precision}",
        "trainer.val_check_interval=null", f"trainer.limit_val_batches={max(1, eval_blocks // batch_size)}",
        "trainer.enable_model_summary=false", "+trainer.enable_progress_bar=false",
        f"trainer.log_every_n_steps={max(1, steps)}",
        f"data.batch_size={batch_size}", f"data.block_size={block_size}", f"data.max_val_blocks={eval_blocks}",
        f"optim.lr={lr}", f"optim.weight_decay={weight_decay}", f"seed={seed}",
    ]


def method_overrides(method: str, *, rank: float = 0.25, density: int = 8, projected_lr: float | None = None,
                     pipelined: bool = True, link_dtype: str = "fp32", lora_rank: int = 12,
                     galore_rank: int = 36, speculative: bool | None = None, embeddings: str | None = None,
                     head: str | None = None) -> list[str]:
    """The offload policy of one compared method, as overrides.

    ``none``/``adamw`` is plain (fused) AdamW on the device; ``frozen`` trains everything but the layers
    ``lsp_offload`` would project; ``lsp_learned`` and ``lsp_random`` differ in the projectors, ``lsp_offload`` keeps
    the package's default kind (random);
    ``galore`` and ``lora`` train those layers their own way, on the device.

    Raises:
        ValueError: for a method not in :data:`METHODS`.
    """
    lr = [f"offload.projected_lr={projected_lr}"] if projected_lr is not None else []
    pipeline = [f"offload.strategy.pipelined={str(pipelined).lower()}",
                f"offload.strategy.speculative={'null' if speculative is None else str(speculative).lower()}",
                f"offload.strategy.link_dtype={link_dtype}"]
    pipeline += [f"offload.strategy.{key}={value}" for key, value in (("embeddings", embeddings), ("head", head))
                 if value is not None]  # None: the config's default
    lsp = [f"offload.strategy.rank={rank}", f"offload.strategy.density={density}", *pipeline]
    if method in ("none", "adamw"):
        return ["offload=none", *lr]
    if method == "frozen":
        return ["offload=none", "offload.method=frozen", *lr]
    if method == "zero_offload":
        return ["offload=zero", *pipeline, *lr]
    if method == "lsp_offload":
        return ["offload=lsp", *lsp, *lr]
    if method == "lsp_learned":
        return ["offload=lsp", "offload.strategy.projectors=learned", *lsp, *lr]
    if method == "lsp_random":
        return ["offload=lsp", "offload.strategy.projectors=random", *lsp, *lr]
    if method == "galore":
        return ["offload=galore", f"offload.galore_rank={galore_rank}", *lr]
    if method == "lora":
        return ["offload=lora", f"offload.lora_rank={lora_rank}", *lr]
    raise ValueError(f"method={method!r} is not one of {METHODS}.")


def run_benchmark(overrides: Sequence[str], output_dir: str | Path | None = None) -> BenchmarkRun:
    """Compose the config with ``overrides``, run :func:`~lightning_offload.cli.train.train`, return what it measured.

    Args:
        overrides: Hydra overrides (e.g. ``recipe_overrides(...) + method_overrides(...)``).
        output_dir: the run directory (``history.jsonl``, ``summary.json``); default: a temporary one, removed
            after the run.
    """
    from lightning_offload.cli.train import compose_config, train

    with tempfile.TemporaryDirectory(prefix="lightning_offload_bench_") as scratch:
        cfg = compose_config(overrides, output_dir if output_dir is not None else scratch)
        _, objects = train(cfg)
    summary: dict[str, Any] = objects["summary"]
    recorder = objects["recorder"]
    telemetry = recorder.telemetry
    steady = telemetry[2:] or telemetry  # the first steps include warm-up
    lanes = [key for key in (telemetry[-1] if telemetry else {}) if key.startswith("offload/timeline/")]
    return BenchmarkRun(
        overrides=list(overrides),
        eval_loss_before=float(summary["loss_before"]),
        eval_loss_after=float(summary["loss_after"]),
        step_seconds=list(recorder.step_seconds),
        median_step_seconds=float(summary["median_step_seconds"] or float("nan")),
        bytes_device_to_host_per_step=float(summary["link_bytes_to_host_per_step"]),
        bytes_host_to_device_per_step=float(summary["link_bytes_to_device_per_step"]),
        host_optimizer_seconds_per_step=float(summary["host_optimizer_seconds_per_step"]),
        host_state_bytes=float(summary["host_state_bytes"]),
        device_state_bytes=float(summary["device_state_bytes"]),
        trainable_parameters=int(summary["trainable_parameters"]),
        projected_layers=int(summary["projected_layers"]),
        timeline_seconds_per_step={key.removeprefix("offload/timeline/"):
                                   statistics.median(t[key] for t in steady if key in t) for key in lanes},
        host_share_before_backward_end=statistics.median(
            [t.get("offload/host_share_before_backward_end", 0.0) for t in steady] or [0.0]),
        initial_fit_seconds=float(summary.get("projector_fit_seconds", 0.0)),
        initial_fit_error=float(summary.get("projector_error_drawn", float("nan"))),
        initial_fitted_error=float(summary.get("projector_error_fitted", float("nan"))),
        train_seconds=float(summary["train_seconds"]),
    )
