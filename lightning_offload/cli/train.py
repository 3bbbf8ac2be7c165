"""``train(cfg)``: one run from a composed Hydra config, and the ``lightning-offload-train`` command around it.

The config (``conf/train.yaml`` and its groups) names every object by ``_target_``; this file only wires them:
model → data (which needs the model's tokenizer) → offload policy → LightningModule for the data's task → Trainer,
then evaluates, trains, evaluates, and prints and writes a summary. See the README for the command line.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

import lightning_offload  # noqa: F401  (registers the strategy names)
from lightning_offload.cli.devices import data_parallel_offload
from lightning_offload.cli.failures import error_paragraph, log_to_files, remove_fresh_run_dir
from lightning_offload.cli.fit_run import build_trainer, fit_between_evaluations, report
from lightning_offload.cli.machine_size import RunSize, size_to_machine
from lightning_offload.cli.override_checks import refuse_unknown_strategy_settings
from lightning_offload.cli.plan_run import (
    choice_of_run,
    log_plan,
    plan_mode,
    plan_of_run,
    planned_sequence_length,
    record_errors,
)
from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.cli.precision import resolve_precision
from lightning_offload.cli.resume import check_checkpoint_fits_strategy, read_checkpoint, resume_command
from lightning_offload.cli.trainer_checks import check_trainer_counts
from lightning_offload.models.builders import LanguageModel, check_hf_name_or_path
from lightning_offload.reporting.summary import RunNames, summarize
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


def _heldout_data(cfg: DictConfig, lm: LanguageModel) -> pl.LightningDataModule | None:
    """The data of ``heldout_data`` (text the run never trains on), prepared; ``None`` when not configured."""
    if cfg.get("heldout_data") is None:
        return None
    heldout: pl.LightningDataModule = hydra.utils.instantiate(cfg.heldout_data, tokenizer=lm.tokenizer)
    heldout.prepare_data()
    return heldout


#: Builders of random weights of a shape: a run that only plans builds them on the meta device (it reads shapes only).
SHAPE_BUILDERS = ("lightning_offload.models.builders.llama_shape", "lightning_offload.models.builders.tiny_causal_lm")


def _language_model(cfg: DictConfig, planning_only: bool) -> LanguageModel:
    if planning_only and cfg.model.get("_target_") in SHAPE_BUILDERS:
        with torch.device("meta"):
            return hydra.utils.instantiate(cfg.model)
    return hydra.utils.instantiate(cfg.model)


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
    optim, policy, run_size = _checked_settings(cfg)
    run_dir = _output_dir(cfg)
    _say("Run directory: %s", run_dir)

    mode = plan_mode(cfg)
    lm = _language_model(cfg, planning_only=mode in ("plan", "choose"))
    datamodule: pl.LightningDataModule = hydra.utils.instantiate(cfg.data, tokenizer=lm.tokenizer)
    # Tokenise and cache the data now: a missing dataset fails here, before a trainer or a projector fit is built.
    datamodule.prepare_data()
    heldout = _heldout_data(cfg, lm)
    module = build_module(lm, datamodule, policy, optim)
    if cfg.get("weights_from") is not None:
        # Weights only: the model continues from the checkpoint, the optimizer (and its host state) starts afresh.
        module.load_state_dict(read_checkpoint(cfg.weights_from)["state_dict"])
        _say("Weights loaded from %s; the optimizer starts afresh at step 0.", cfg.weights_from)

    if mode in ("plan", "choose"):
        metrics, objects = _plan_only(cfg, module, policy, mode, planned_sequence_length(datamodule))
        return metrics, {**objects, "datamodule": datamodule}
    run = build_trainer(cfg, policy, run_dir)
    planned = _planned(cfg, module, policy, run.loggers, datamodule) if mode != "off" else None
    evaluations = fit_between_evaluations(cfg, module, datamodule, heldout, run)
    if rank_zero_only.rank != 0:
        # Another rank of a multi-device run: it trained and evaluated its share; rank 0 writes and prints.
        return {}, {"cfg": cfg, "trainer": run.trainer, "module": module}

    names = RunNames(lm.name, getattr(datamodule, "task", None) or type(datamodule).__name__, cfg.offload.name,
                     primary_metric(module))
    summary = summarize(names, module, run.trainer, run.recorder, evaluations.before, evaluations.after,
                        evaluations.train_seconds)
    summary["run_size"] = run_size.record(cfg)
    if run.interrupted:
        summary.update({"interrupted": True, "checkpoint": str(run.interrupt.checkpoint),
                        "resume_command": resume_command(run.interrupt.checkpoint)})
    if heldout is not None:
        summary.update({"heldout_task": getattr(heldout, "task", None) or type(heldout).__name__,
                        "heldout_loss_before": evaluations.heldout_before,
                        "heldout_loss_after": evaluations.heldout_after})
    if planned is not None:
        record_errors(planned, summary, run.loggers, run.trainer.global_step)
    metrics = report(run_dir, summary, run, evaluations)
    objects = {"cfg": cfg, "model": lm, "datamodule": datamodule, "policy": policy, "module": module,
               "trainer": run.trainer, "callbacks": run.callbacks, "loggers": run.loggers, "recorder": run.recorder,
               "summary": summary}
    return metrics, objects


def _plan_only(cfg: DictConfig, module: pl.LightningModule, policy: OffloadPolicy, mode: str,
               seq_len: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``+plan=true`` / ``+plan=choose``: the run's plan (or the chooser's answer) printed, nothing trained."""
    if mode == "choose":
        choice = choice_of_run(cfg, module, seq_len)
        print(choice.table())
        return ({f"plan/{k}": v for k, v in choice.plan.summary_figures().items()} if choice.plan else {},
                {"cfg": cfg, "module": module, "choice": choice})
    found = plan_of_run(cfg, module, policy, seq_len)
    print(found.table())
    return found.figures(), {"cfg": cfg, "module": module, "policy": policy, "plan": found}


def _planned(cfg: DictConfig, module: pl.LightningModule, policy: OffloadPolicy, loggers: list[Any],
             datamodule: pl.LightningDataModule) -> Any:
    """The run's plan, logged; ``None`` (and a warning) when it cannot be planned: a plan never stops a run."""
    try:
        found = plan_of_run(cfg, module, policy, planned_sequence_length(datamodule))
    except Exception as error:  # noqa: BLE001  (a model the planner cannot read still trains)
        log.warning("No plan for this run (%s: %s); it trains as configured.", type(error).__name__, error)
        return None
    log_plan(found, loggers)
    return found


def _checked_settings(cfg: DictConfig) -> tuple[OptimSettings, OffloadPolicy, RunSize]:
    """The run's settings validated, its size fitted to the machine and the offload policy built, before anything
    else is: a bad setting costs no model load, and leaves no run directory.

    Raises:
        SettingsError: naming the setting refused.
    """
    optim = check_optim(cfg.optim)
    check_trainer_counts(cfg.trainer)
    if cfg.trainer.get("strategy") is not None:
        # The offload policy sets the Trainer's strategy: a trainer.strategy (or a sweep over it) would go unread.
        groups = ", ".join(sorted(path.stem for path in (CONFIG_DIR / "offload").glob("*.yaml")))
        raise SettingsError(f"trainer.strategy={cfg.trainer.strategy} is not read: the offload group sets the "
                            f"Trainer's strategy. Choose it with offload=<group> ({groups}; offload=zero for "
                            f"zero_offload, offload=none for plain training), and its settings with "
                            f"offload.strategy.<setting>=.")
    if str(cfg.model.get("_target_", "")).endswith(".hf_causal_lm"):
        # Before the run directory is made: else a path naming nothing fails after it, with the hub's "Repo id ...".
        given = None if OmegaConf.is_missing(cfg.model, "name_or_path") else cfg.model.get("name_or_path")
        try:
            check_hf_name_or_path(given)
        except ValueError as error:
            raise SettingsError(str(error)) from None
    resolve_precision(cfg)
    run_size = size_to_machine(cfg)  # before anything is built from the run's length and block size
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    switched = data_parallel_offload(cfg)
    if switched is not None:
        _say(switched)
    try:
        policy: OffloadPolicy = hydra.utils.instantiate(cfg.offload)
    except Exception as error:  # the policy's and strategy's constructors validate their settings
        raise SettingsError(str(error)) from error
    check_checkpoint_fits_strategy(cfg, policy)
    return optim, policy, run_size


def _finish_wandb() -> None:
    # Lightning leaves the wandb run open after fit; in a multirun the next job must start a new one.
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def _finish_process_group() -> None:
    # Lightning's DDP strategies leave their process group up after fit; the command's run ends here, so the next job
    # of a multirun starts its own and the process exits without torch's warning about a group never destroyed.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
        _finish_process_group()
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
    refuse_unknown_strategy_settings(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
