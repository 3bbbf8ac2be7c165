"""``train(cfg)``: one run from a composed Hydra config, and the ``lightning-offload-train`` command around it.

The config (``conf/train.yaml`` and its groups) names every object by ``_target_``; this file only wires them:
model → data (which needs the model's tokenizer) → offload policy → LightningModule for the data's task → Trainer,
then evaluates, trains, evaluates, and prints and writes a summary. See the README for the command line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

import lightning_offload  # noqa: F401  (registers the strategy names)
from lightning_offload.cli.failures import error_paragraph, log_to_files, remove_fresh_run_dir
from lightning_offload.cli.interrupt import StopOnInterrupt
from lightning_offload.cli.machine_size import size_to_machine
from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.cli.precision import resolve_precision
from lightning_offload.cli.resume import check_checkpoint_fits_strategy, read_checkpoint, resume_command
from lightning_offload.faces.trainer.offload import SingleDeviceOffload
from lightning_offload.models.builders import LanguageModel
from lightning_offload.reporting.run_record import RunRecorder, write_summary
from lightning_offload.reporting.summary import RunNames, format_summary, summarize
from lightning_offload.tasks.causal_lm import CausalLMModule
from lightning_offload.tasks.classifier import SequenceClassifierModule, decoder_of
from lightning_offload.tasks.schedule import OptimSettings, SettingsError

log = logging.getLogger(__name__)

#: The repository's ``conf/`` directory (the package is installed editable from a checkout; see the README).
CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"


@rank_zero_only
def _say(message: str, *args: Any) -> None:
    """Logs on rank 0 only: each rank of a multi-device run runs this command, and one line is enough."""
    log.info(message, *args)


def check_optim(optim: DictConfig) -> OptimSettings:
    """The run's optimizer settings, validated (before anything is built: a bad setting costs no model load).

    Raises:
        SettingsError: naming the setting, its value and a valid example.
    """
    return OptimSettings.from_mapping(OmegaConf.to_container(optim, resolve=True))


def build_module(lm: LanguageModel, datamodule: pl.LightningDataModule, policy: OffloadPolicy,
                 optim: OptimSettings | DictConfig) -> pl.LightningModule:
    """The LightningModule for the data's task: a classifier for labelled data, else a causal LM.

    The policy's method (frozen layers, LoRA) is applied to the network that trains, and its optimizer factory
    (AdamW with the projected-layer lr, or GaLore) builds the optimizer with the run's Adam settings.
    """
    if not isinstance(optim, OptimSettings):
        optim = check_optim(optim)
    factory = policy.optimizer_factory(optim.lr, optim.weight_decay, optim.betas, optim.eps)
    settings = dict(lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas, eps=optim.eps,
                    warmup_steps=optim.warmup_steps, warmup_ratio=optim.warmup_ratio, decay=optim.decay,
                    min_lr_ratio=optim.min_lr_ratio, optimizer_factory=factory)
    num_classes = getattr(datamodule, "num_classes", None)
    if num_classes is not None:
        decoder = policy.prepare(decoder_of(lm.network))
        return SequenceClassifierModule(decoder, hidden_size=lm.network.config.hidden_size, num_classes=num_classes,
                                        **settings)
    return CausalLMModule(policy.prepare(lm.network), exact_match=getattr(datamodule, "task", "") == "bible_qa",
                          **settings)


def primary_metric(module: pl.LightningModule) -> str:
    """The evaluation metric the summary reports for ``module``'s task."""
    if isinstance(module, SequenceClassifierModule):
        return "val/acc"
    if isinstance(module, CausalLMModule) and module.hparams.exact_match:
        return "val/exact_match"
    return "val/loss"


def _instantiate_dict(node: DictConfig | None, what: str) -> list[Any]:
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


def _evaluate(cfg: DictConfig, module: pl.LightningModule, datamodule: pl.LightningDataModule,
              trainer: pl.Trainer) -> dict[str, float]:
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


def _heldout_data(cfg: DictConfig, lm: LanguageModel) -> pl.LightningDataModule | None:
    """The data of ``heldout_data`` (text the run never trains on), prepared; ``None`` when not configured."""
    if cfg.get("heldout_data") is None:
        return None
    heldout: pl.LightningDataModule = hydra.utils.instantiate(cfg.heldout_data, tokenizer=lm.tokenizer)
    heldout.prepare_data()
    return heldout


def _data_parallel_target(target: str) -> str | None:
    """The class path of the DDP form (``data_parallel_form``, from Lightning's registry) of the single-device offload
    strategy at ``target``; ``None`` for one without, or for another strategy."""
    strategy_class = hydra.utils.get_class(target) if target.startswith("lightning_offload.") else None
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, SingleDeviceOffload)
            and strategy_class.data_parallel_form is not None):
        return None
    form = StrategyRegistry[strategy_class.data_parallel_form]["strategy"]
    return f"{form.__module__}.{form.__qualname__}"


def _device_count(devices: Any) -> int | None:
    """How many devices a Trainer ``devices`` setting names (``None`` for "auto" or -1, decided by Lightning)."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices)
    return None


def _data_parallel_offload(cfg: DictConfig) -> None:
    """With ``trainer.devices`` > 1 or ``trainer.num_nodes`` > 1, switch ``lsp``/``zero`` to their DDP strategies
    (``lsp_offload_ddp``/``zero_offload_ddp``), which cannot step embeddings row-sparsely: said in the log."""
    devices = _device_count(cfg.trainer.get("devices", 1)) or 1
    nodes = int(cfg.trainer.get("num_nodes", 1) or 1)
    strategy = cfg.offload.get("strategy")
    if (devices <= 1 and nodes <= 1) or not isinstance(strategy, DictConfig):
        return
    target = _data_parallel_target(strategy.get("_target_", ""))
    if target is None:
        return  # other strategies say themselves whether they run on several devices
    with open_dict(cfg):
        strategy._target_ = target
        if strategy.get("embeddings") == "sparse":
            strategy.embeddings = "host"
    _say("%d device(s) × %d node(s): offload=%s runs as %s (embeddings=%s: row-sparse embeddings are "
             "single-device only).", devices, nodes, cfg.offload.get("name"), target.rsplit(".", 1)[1],
             strategy.get("embeddings"))


def _output_dir(cfg: DictConfig) -> Path:
    path = cfg.paths.get("output_dir") if "paths" in cfg else None
    if path is None:
        path = HydraConfig.get().runtime.output_dir
    return Path(path)


def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs one experiment: evaluate, fit, evaluate; prints, logs and writes the summary.

    Args:
        cfg: The composed config (``conf/train.yaml`` with overrides).

    Returns:
        ``(metrics, objects)``: the final metrics (the trainer's callback metrics plus ``summary/*``), and the
        objects built (``cfg``, ``model``, ``datamodule``, ``policy``, ``module``, ``trainer``, ``callbacks``,
        ``loggers``, ``recorder``) with the run's ``summary`` (what ``summary.json`` holds).
    """
    # The settings first, before anything is built: a bad one costs no model load, and leaves no run directory.
    optim = check_optim(cfg.optim)
    resolve_precision(cfg)
    run_size = size_to_machine(cfg)  # before anything is built from the run's length and block size
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    _data_parallel_offload(cfg)
    try:
        policy: OffloadPolicy = hydra.utils.instantiate(cfg.offload)
    except Exception as error:  # the policy's and strategy's constructors validate their settings
        raise SettingsError(str(error)) from error
    check_checkpoint_fits_strategy(cfg, policy)
    run_dir = _output_dir(cfg)
    _say("Run directory: %s", run_dir)

    lm: LanguageModel = hydra.utils.instantiate(cfg.model)
    datamodule: pl.LightningDataModule = hydra.utils.instantiate(cfg.data, tokenizer=lm.tokenizer)
    # Tokenise and cache the data now: a missing dataset fails here, before a trainer or a projector fit is built.
    datamodule.prepare_data()
    heldout = _heldout_data(cfg, lm)
    module = build_module(lm, datamodule, policy, optim)
    if cfg.get("weights_from") is not None:
        # Weights only: the model continues from the checkpoint, the optimizer (and its host state) starts afresh.
        module.load_state_dict(read_checkpoint(cfg.weights_from)["state_dict"])
        _say("Weights loaded from %s; the optimizer starts afresh at step 0.", cfg.weights_from)

    resuming = cfg.get("ckpt_path") is not None
    recorder = RunRecorder(run_dir, resume=resuming)
    interrupt = StopOnInterrupt(run_dir / "checkpoints" / "last.ckpt")
    callbacks = _instantiate_dict(cfg.get("callbacks"), "callbacks") + policy.callbacks() + [recorder, interrupt]
    loggers = _instantiate_dict(cfg.get("logger"), "logger")
    if not loggers:
        # Lightning refuses a LearningRateMonitor without a logger; with `logger=null` there is nothing to monitor into.
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    has_checkpoints = any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks)
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, strategy=policy.strategy, callbacks=callbacks,
                                                  logger=loggers or False, enable_checkpointing=has_checkpoints)
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    before: dict[str, float] = {}
    heldout_before: float | None = None
    if cfg.get("eval_before", True) and cfg.get("ckpt_path") is None:
        before = _evaluate(cfg, module, datamodule, trainer)
        recorder.record_validation(step=0, metrics=before)
        if heldout is not None:
            # After the task's own evaluation: MEFT fixes its input statistics on the first batch it sees.
            heldout_before = _evaluate(cfg, module, heldout, trainer).get("val/loss")
    start = time.perf_counter()
    with interrupt.catching_ctrl_c():
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    train_seconds = time.perf_counter() - start
    if resuming:
        # The evaluation before training is the one at step 0 in the run's history, when it is there.
        first = next((r for r in recorder.previous if r["kind"] == "val" and r["step"] == 0), None)
        before = {k: v for k, v in first.items() if k.startswith("val/")} if first else {}
    last = recorder.last_validation()
    interrupted = interrupt.stopped_at_step is not None
    if last is not None and last["step"] == trainer.global_step:
        after = {k: v for k, v in last.items() if k.startswith("val/")}
    elif interrupted:
        # Stopped by Ctrl-C at a step without a validation: no evaluation delays the stop (minutes on a CPU); the
        # resumed run evaluates on its schedule and at its end.
        after = {}
    else:
        after = _evaluate(cfg, module, datamodule, trainer)
        recorder.record_validation(step=trainer.global_step, metrics=after)
    heldout_after = (_evaluate(cfg, module, heldout, trainer).get("val/loss")
                     if heldout is not None and not interrupted else None)
    if rank_zero_only.rank != 0:
        # Another rank of a multi-device run: it trained and evaluated its share; rank 0 writes and prints.
        return {}, {"cfg": cfg, "trainer": trainer, "module": module}

    summary = summarize(RunNames(lm.name, getattr(datamodule, "task", None) or type(datamodule).__name__,
                                 cfg.offload.name, primary_metric(module)),
                        module, trainer, recorder, before, after, train_seconds)
    summary["run_size"] = run_size.record(cfg)
    if interrupted:
        summary.update({"interrupted": True, "checkpoint": str(interrupt.checkpoint),
                        "resume_command": resume_command(interrupt.checkpoint)})
    if heldout is not None:
        summary.update({"heldout_task": getattr(heldout, "task", None) or type(heldout).__name__,
                        "heldout_loss_before": heldout_before, "heldout_loss_after": heldout_after})
    write_summary(run_dir, summary)
    if interrupted:
        # Into the run's log file too (the summary below goes to the terminal only).
        log.warning("Resume with: %s", summary["resume_command"])
    print("\n" + format_summary(summary))
    scalars = {f"summary/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float)) and v is not None}
    for logger in loggers:
        logger.log_metrics(scalars, step=trainer.global_step)
        logger.save()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics.update({f"val_before/{k.removeprefix('val/')}": v for k, v in before.items()})
    metrics.update(after)
    metrics.update(scalars)
    objects = {"cfg": cfg, "model": lm, "datamodule": datamodule, "policy": policy, "module": module,
               "trainer": trainer, "callbacks": callbacks, "loggers": loggers, "recorder": recorder,
               "summary": summary}
    return metrics, objects


def _finish_wandb() -> None:
    # Lightning leaves the wandb run open after fit; in a multirun the next job must start a new one.
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def metric_value(metrics: dict[str, Any], name: str | None) -> float | None:
    """The value a sweeper optimises, with a clear error when the run did not produce it."""
    if not name:
        return None
    if name not in metrics:
        raise KeyError(f"optimized_metric={name!r} was not produced by this run; available: {sorted(metrics)}.")
    return float(metrics[name])


def compose_config(overrides: Sequence[str] = (), output_dir: str | Path | None = None) -> DictConfig:
    """The command line's config with ``overrides``, composed from Python (benchmarks, notebooks, tests).

    Args:
        overrides: Hydra overrides, as on the command line (``["offload=zero", "trainer.max_steps=50"]``).
        output_dir: the run directory (history, summary); default: the directory Hydra's settings name.

    Returns:
        The config :func:`train` takes, with ``paths.output_dir`` and ``trainer.precision`` resolved.
    """
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=null_group_overrides(list(overrides)), return_hydra_config=True)
    HydraConfig().set_config(cfg)  # ${hydra:...} interpolations resolve against it, as in a command-line run
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir) if output_dir is not None else cfg.hydra.run.dir
        del cfg["hydra"]  # the task function never sees the hydra node
    resolve_precision(cfg)  # `precision: auto` is this package's: the Trainer the config builds takes a concrete one
    return cfg


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        metrics, _ = train(cfg)
    except SettingsError as error:
        # A refused setting: the message is the whole story (no traceback to keep), and no run happened.
        if cfg.get("ckpt_path") is None:  # a resumed run's directory holds its earlier results
            remove_fresh_run_dir(_output_dir(cfg))
        shown = error.__cause__ if error.__cause__ is not None else error
        raise SystemExit(f"lightning-offload-train: {error_paragraph(shown)}") from None
    except Exception as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        where = log_to_files(log, "The run failed.", error)
        raise SystemExit(f"lightning-offload-train: {error_paragraph(error)}"
                         + (f"\n(Traceback in {where}; HYDRA_FULL_ERROR=1 prints it here.)" if where else "")) from None
    finally:
        _finish_wandb()
    return metric_value(metrics, cfg.get("optimized_metric"))


def null_group_overrides(args: list[str]) -> list[str]:
    """``GROUP=null`` → ``GROUP=none`` for config groups that have a ``none`` option (``logger=null``).

    Hydra refuses ``null`` for a config group with a bare ``ValueError``; ``none`` is the option that turns the group
    off, so the spelling users reach for first works too.
    """
    out = []
    for arg in args:
        group, sep, value = arg.partition("=")
        if sep and value == "null" and group.isidentifier() and (CONFIG_DIR / group / "none.yaml").is_file():
            arg = f"{group}=none"
        out.append(arg)
    return out


def main() -> None:
    """The ``lightning-offload-train`` command (and ``python scripts/train.py``): Hydra overrides as arguments."""
    if not (CONFIG_DIR / "train.yaml").is_file():
        raise SystemExit(f"lightning-offload-train: the configs are not at {CONFIG_DIR}. The command reads the "
                         f"repository's conf/ directory: install from a checkout with `pip install -e .`.")
    sys.argv[1:] = null_group_overrides(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
