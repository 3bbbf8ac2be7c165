"""A run's plan (:func:`lightning_offload.planning.plan.plan`) from its config: printed instead of training
(``+plan=true``; ``+plan=choose`` runs the chooser), or logged beside the run's telemetry at its start and compared with
what the run measured at its end (the run summary's ``plan`` and ``plan_errors``; ``plan_error/*`` in every logger).

``+plan=false`` skips planning. The device's memory is the run device's unless ``+plan_device_memory=24GiB`` names
another; ``+plan_hardware=h200`` predicts the step on a named profile instead of this machine.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.planning.calibration import PROFILES, host_memory
from lightning_offload.planning.choose import Choice, choose
from lightning_offload.planning.plan import plan
from lightning_offload.planning.report import Plan, prediction_errors
from lightning_offload.setup.settings import OffloadSettings

log = logging.getLogger(__name__)
#: Settings the plan leaves out: they change no byte and no second of a step it predicts.
_NOT_PLANNED = ("projection", "log_telemetry", "projector_factory", "on_nonfinite", "seed")


def plan_mode(cfg: DictConfig) -> str | None:
    """``"plan"`` or ``"choose"`` when the run only plans, ``"off"`` when it does not plan at all, else ``None``
    (train, with the plan logged).

    Raises:
        ValueError: for another value of ``plan``.
    """
    value = cfg.get("plan")
    if value is None:
        return None
    if value is True or str(value).lower() in ("true", "plan"):
        return "plan"
    if value is False or str(value).lower() == "false":
        return "off"
    if str(value).lower() == "choose":
        return "choose"
    raise ValueError(f"plan={value!r}: use +plan=true (print the run's plan, no training), +plan=choose (the settings "
                     f"that fit best) or +plan=false (no plan logged).")


def policy_strategy(policy: OffloadPolicy) -> tuple[str, dict[str, Any]]:
    """The policy's strategy as ``plan`` takes it: its name (a DDP form planned per device) and the settings that
    differ from their defaults."""
    strategy = policy.strategy
    if isinstance(strategy, str):
        return ("auto" if strategy in ("auto", "single_device") else strategy), {}
    name = str(type(strategy).strategy_name).removesuffix("_ddp")
    settings: OffloadSettings = strategy.settings
    defaults = OffloadSettings(projection=settings.projection)
    return name, {key: value for key, value in vars(settings).items()
                  if key not in _NOT_PLANNED and value != getattr(defaults, key)}


def _device_memory(cfg: DictConfig) -> int | str:
    given = cfg.get("plan_device_memory")
    if given is not None:
        return given
    if torch.cuda.is_available() and cfg.trainer.get("accelerator") in ("gpu", "cuda", "auto"):
        return torch.cuda.get_device_properties(0).total_memory
    return host_memory()  # the CPU "device" is the host's memory


def planned_sequence_length(datamodule: Any) -> int:
    """Tokens per sequence a run's plan is made for: a packed language-modelling set's block size, else the task
    set's longest training example (what a padded batch reaches at most).

    Raises:
        ValueError: for a data module that says neither.
    """
    block = getattr(datamodule, "block_size", None)
    if block is not None:
        return int(block)
    longest = getattr(datamodule, "longest_sequence", None)
    if callable(longest):
        return int(longest())
    raise ValueError(f"{type(datamodule).__name__} says no sequence length to plan for (a block_size attribute or a "
                     f"longest_sequence() method).")


def plan_of_run(cfg: DictConfig, module: torch.nn.Module, policy: OffloadPolicy, seq_len: int) -> Plan:
    """The plan of the run ``cfg`` describes, for its built module (the policy's method applied) and strategy, at
    ``seq_len`` tokens per sequence (:func:`planned_sequence_length`)."""
    strategy, settings = policy_strategy(policy)
    network = next(m for m in module.modules() if hasattr(m, "config"))
    hardware = cfg.get("plan_hardware")
    if hardware is not None and hardware not in PROFILES:
        raise ValueError(f"plan_hardware={hardware!r} is not a known profile; use one of {sorted(PROFILES)}.")
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.get("accelerator") in ("gpu", "cuda", "auto") \
        else "cpu"
    return plan(module, strategy, batch_size=int(cfg.data.batch_size), seq_len=seq_len,
                device_memory=_device_memory(cfg), precision=str(cfg.trainer.precision),
                gradient_checkpointing=_checkpointing(network),
                hardware=hardware, device=device, **settings)


def _checkpointing(network: torch.nn.Module) -> bool:
    """Whether the network recomputes its blocks in backward (transformers 5 renamed the flag)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(network)):
            return bool(getattr(network, name))
    return False


def choice_of_run(cfg: DictConfig, module: torch.nn.Module, seq_len: int) -> Choice:
    """The chooser over the run's model, sequence length and precision (``+plan=choose``)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return choose(module, seq_len=seq_len, device_memory=_device_memory(cfg),
                  precision=str(cfg.trainer.precision), hardware=cfg.get("plan_hardware"), device=device)


def log_plan(found: Plan, loggers: list[Any]) -> None:
    """The plan into the log and every logger, as step 0's ``plan/*`` figures."""
    log.info("The run's plan:\n%s", found.table())
    for logger in loggers:
        logger.log_metrics(found.figures(), step=0)


def record_errors(found: Plan, summary: dict[str, Any], loggers: list[Any], step: int) -> dict[str, float]:
    """The plan and each prediction's error against the run's summary, into the summary and every logger."""
    errors = prediction_errors(found.figures(), summary)
    summary["plan"] = found.record()
    summary["plan_errors"] = errors
    for logger in loggers:
        logger.log_metrics(errors, step=step)
    if errors:
        bound = " (predicted as a lower bound: on a CPU the model's own Python, autograd and elementwise work are " \
            "not modelled)" if found.step_is_lower_bound else ""
        log.info("Prediction errors ((measured − predicted) / predicted): %s",
                 ", ".join(f"{k.removeprefix('plan_error/')} {v:+.1%}" + (bound if k.endswith("step_seconds") else "")
                           for k, v in errors.items()))
    return errors
