"""A run's Trainer and its fit: the Trainer built on the offload policy's strategy with the run's callbacks and
loggers, the fit between evaluations (and the held-out loss beside them), and the run's report (the summary written,
printed and logged). :func:`lightning_offload.cli.train.train` strings them together."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from lightning_offload.cli.interrupt import StopOnInterrupt
from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.reporting.run_record import RunRecorder, write_summary
from lightning_offload.reporting.summary import format_summary

log = logging.getLogger(__name__)


def instantiate_dict(node: DictConfig | None, what: str) -> list[Any]:
    """Instantiates every ``_target_`` entry of a ``name: {...}`` group (callbacks, loggers)."""
    if not node:
        return []
    if not isinstance(node, DictConfig):
        raise TypeError(f"{what} must be a mapping of name -> {{_target_: ...}}, got {node!r}.")
    objects = []
    for name, entry in node.items():
        if isinstance(entry, DictConfig) and "_target_" in entry:
            objects.append(hydra.utils.instantiate(entry, _convert_="all"))
        elif entry is not None:
            raise TypeError(f"{what}.{name} has no _target_; every entry must name the class to build.")
    return objects


@contextlib.contextmanager
def _without_lightning_banner() -> Iterator[None]:
    """Builds an evaluation Trainer without Lightning's info lines ("GPU available", tips): the run's own Trainer
    printed them once already."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def evaluate(cfg: DictConfig, module: pl.LightningModule, datamodule: pl.LightningDataModule,
             trainer: pl.Trainer) -> dict[str, float]:
    """The task's validation metrics of ``module`` on ``datamodule`` now."""
    if trainer.world_size > 1:
        # Several ranks: every rank evaluates its share with the run's own trainer (the metrics are all-reduced); a
        # trainer of rank 0's alone would wait forever in that reduction.
        (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
        return {key: float(value) for key, value in metrics.items()}
    # A plain single-device trainer: evaluation needs no offload machinery, and logs nothing by itself (the
    # recorder writes the result into the run's history and train() logs it). No inference mode: metric states reset
    # under it would become inference tensors that the fit loop's own validations could no longer update.
    fast = bool(cfg.trainer.get("fast_dev_run"))
    with _without_lightning_banner():
        trainer = pl.Trainer(accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision,
                             limit_val_batches=1 if fast else cfg.trainer.get("limit_val_batches"), logger=False,
                             enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                             inference_mode=False)
    (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    return {key: float(value) for key, value in metrics.items()}


@dataclass
class Run:
    """What :func:`train` builds around the module: the Trainer and the callbacks and loggers that watch it."""

    trainer: pl.Trainer
    callbacks: list[Any]
    loggers: list[Any]
    recorder: RunRecorder
    interrupt: StopOnInterrupt

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C stopped the fit (at a step, with a checkpoint)."""
        return self.interrupt.stopped_at_step is not None


@dataclass
class Evaluations:
    """The task's metrics and the held-out loss before and after the fit, and the fit's seconds."""

    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    heldout_before: float | None = None
    heldout_after: float | None = None
    train_seconds: float = 0.0


def build_trainer(cfg: DictConfig, policy: OffloadPolicy, run_dir: Path) -> Run:
    """The Trainer on the policy's strategy, with the configured callbacks and loggers, the policy's callbacks, the
    run's recorder and the Ctrl-C handler; the config logged as hyper-parameters."""
    recorder = RunRecorder(run_dir, resume=cfg.get("ckpt_path") is not None)
    interrupt = StopOnInterrupt(run_dir / "checkpoints" / "last.ckpt")
    configured = instantiate_dict(cfg.get("callbacks"), "callbacks")
    callbacks = configured + policy.callbacks(configured) + [recorder, interrupt]
    loggers = instantiate_dict(cfg.get("logger"), "logger")
    if not loggers:
        # Lightning refuses a LearningRateMonitor without a logger; with `logger=null` there is nothing to monitor into.
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    has_checkpoints = any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks)
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, strategy=policy.strategy, callbacks=callbacks,
                                                  logger=loggers or False, enable_checkpointing=has_checkpoints)
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return Run(trainer, callbacks, loggers, recorder, interrupt)


def fit_between_evaluations(cfg: DictConfig, module: pl.LightningModule, datamodule: pl.LightningDataModule,
                             heldout: pl.LightningDataModule | None, run: Run) -> Evaluations:
    """Evaluate (unless resuming, or ``eval_before=false``), fit, evaluate (unless the last validation was at the
    last step, or Ctrl-C stopped the fit); the held-out loss beside each."""
    found = Evaluations()
    resuming = cfg.get("ckpt_path") is not None
    if cfg.get("eval_before", True) and not resuming:
        found.before = evaluate(cfg, module, datamodule, run.trainer)
        run.recorder.record_validation(step=0, metrics=found.before)
        if heldout is not None:
            # After the task's own evaluation: MEFT fixes its input statistics on the first batch it sees.
            found.heldout_before = evaluate(cfg, module, heldout, run.trainer).get("val/loss")
    start = time.perf_counter()
    with run.interrupt.catching_ctrl_c():
        run.trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    found.train_seconds = time.perf_counter() - start
    if resuming:
        # The evaluation before training is the one at step 0 in the run's history, when it is there.
        first = next((r for r in run.recorder.previous if r["kind"] == "val" and r["step"] == 0), None)
        found.before = {k: v for k, v in first.items() if k.startswith("val/")} if first else {}
    last = run.recorder.last_validation()
    if last is not None and last["step"] == run.trainer.global_step:
        found.after = {k: v for k, v in last.items() if k.startswith("val/")}
    elif not run.interrupted:
        # (Stopped by Ctrl-C at a step without a validation: no evaluation delays the stop, minutes on a CPU; the
        # resumed run evaluates on its schedule and at its end.)
        found.after = evaluate(cfg, module, datamodule, run.trainer)
        run.recorder.record_validation(step=run.trainer.global_step, metrics=found.after)
    if heldout is not None and not run.interrupted:
        found.heldout_after = evaluate(cfg, module, heldout, run.trainer).get("val/loss")
    return found


def report(run_dir: Path, summary: dict[str, Any], run: Run, evaluations: Evaluations) -> dict[str, float]:
    """Write the summary into the run directory, print it, log its figures as ``summary/*``; the run's metrics."""
    write_summary(run_dir, summary)
    if run.interrupted:
        # Into the run's log file too (the summary below goes to the terminal only).
        log.warning("Resume with: %s", summary["resume_command"])
    print("\n" + format_summary(summary))
    scalars = {f"summary/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float)) and v is not None}
    for logger in run.loggers:
        logger.log_metrics(scalars, step=run.trainer.global_step)
        logger.save()
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items()}
    metrics.update({f"val_before/{k.removeprefix('val/')}": v for k, v in evaluations.before.items()})
    metrics.update(evaluations.after)
    metrics.update(scalars)
    return metrics
