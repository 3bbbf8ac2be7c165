"""The main job sized to the machine: a shorter run where the config's would not finish within 8 minutes.

On a slow CPU (:attr:`Machine.runs_full_main_job`) the run trains fewer steps on shorter blocks and evaluates on fewer.
The rule reads the device, torch's CPU capability and the core count, never a timing, so a machine (and every rank)
always gets the same run. What the user sets wins: a key named on the command line keeps its value, a preset of
:data:`OWN_LENGTH_GROUPS` is not sized, and ``main_job.size_to_machine=false`` turns sizing off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_offload.setup.hardware_precision import uses_cuda

log = logging.getLogger(__name__)

#: What a CPU too slow for the config's run trains instead, by key: fewer steps (their cost barely shrinks with tokens).
SMALL_CPU_RUN: Mapping[str, int] = {"trainer.max_steps": 30, "data.block_size": 64, "data.max_val_blocks": 32}

#: A CPU with at least this many cores runs the config's run whatever its vector width.
FULL_RUN_MIN_CORES = 8

#: Config groups whose options set the run's length themselves.
OWN_LENGTH_GROUPS = ("experiment", "debug", "hparams_search")


@dataclass(frozen=True)
class Machine:
    """What the sizing rule reads of the machine.

    Attributes:
        cuda: the run trains on a CUDA device.
        cpu_capability: torch's CPU capability (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...).
        cores: the cores this process may run on.
    """

    cuda: bool
    cpu_capability: str
    cores: int

    @classmethod
    def this(cls, accelerator: str) -> Machine:
        """This machine, for a Trainer with ``accelerator``."""
        # Not torch's thread count, which Lightning changes in the ranks it launches: every rank must size alike.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cls(uses_cuda(accelerator), torch.backends.cpu.get_cpu_capability(), cores)

    def describe(self) -> str:
        """The machine in a few words, e.g. ``"a CPU with AVX2 (no AVX-512), 2 cores"``."""
        if self.cuda:
            return "a CUDA device"
        width = "AVX-512" if self.has_avx512 else f"{self.cpu_capability} (no AVX-512)"
        return f"a CPU with {width}, {self.cores} core{'s' if self.cores != 1 else ''}"

    @property
    def has_avx512(self) -> bool:
        """Whether torch runs its AVX-512 kernels here."""
        return self.cpu_capability.upper().startswith("AVX512")

    @property
    def runs_full_main_job(self) -> bool:
        """The rule: a CUDA device, a CPU with AVX-512 and 2 cores or more, or any CPU with :data:`FULL_RUN_MIN_CORES`
        cores finishes the config's run within 8 minutes; other CPUs get :data:`SMALL_CPU_RUN`."""
        return self.cuda or (self.has_avx512 and self.cores >= 2) or self.cores >= FULL_RUN_MIN_CORES


@dataclass(frozen=True)
class RunSize:
    """What the run trains on this machine and why.

    Attributes:
        sized: the run is smaller than the config's.
        reason: what decided, in a few words (the machine, or the setting that turned the sizing off).
        settings: the values the sizing set, by config key (empty when not sized).
        replaced: the config's values of those keys.
        kept: the sizing's keys the user set, left as set.
    """

    sized: bool
    reason: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    replaced: Mapping[str, Any] = field(default_factory=dict)
    kept: tuple[str, ...] = ()

    def record(self, cfg: DictConfig) -> dict[str, Any]:
        """The run summary's entry (``summary.json``'s ``run_size``), with :func:`describe`'s line for ``cfg``."""
        return {"sized_to_machine": self.sized, "reason": self.reason, "settings": dict(self.settings),
                "replaced": dict(self.replaced), "kept": list(self.kept), "description": describe(self, cfg)}


def _override_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys a list of Hydra overrides sets (``+``, ``++`` and ``~`` prefixes dropped)."""
    return {item.partition("=")[0].lstrip("+~") for item in overrides}


def choose_size(cfg: DictConfig, machine: Machine, overrides: Sequence[str] = (),
                choices: Mapping[str, Any] | None = None) -> RunSize:
    """What ``cfg``'s run trains on ``machine``, without changing ``cfg``.

    Args:
        cfg: the composed config (``main_job.size_to_machine`` and the keys of :data:`SMALL_CPU_RUN` are read).
        machine: the machine the run trains on.
        overrides: the command line's Hydra overrides (``["trainer.max_steps=100"]``), whose keys keep their values.
        choices: the config groups' chosen options (Hydra's ``runtime.choices``); a run with an option of
            :data:`OWN_LENGTH_GROUPS` is not sized.

    Returns:
        The size: :data:`SMALL_CPU_RUN`'s values for the keys the user did not set, or none with the reason.
    """
    if not OmegaConf.select(cfg, "main_job.size_to_machine", default=True):
        return RunSize(False, "main_job.size_to_machine=false")
    preset = next((f"{group}={choices[group]}" for group in OWN_LENGTH_GROUPS if (choices or {}).get(group)), None)
    if preset is not None:
        return RunSize(False, f"{preset} sets its own length")
    if machine.runs_full_main_job:
        return RunSize(False, machine.describe())
    user_keys = _override_keys(overrides)
    present = {key: OmegaConf.select(cfg, key) for key in SMALL_CPU_RUN}
    present = {key: value for key, value in present.items() if value is not None}  # e.g. no blocks in bible_genre
    settings = {key: SMALL_CPU_RUN[key] for key in present if key not in user_keys}
    return RunSize(bool(settings), machine.describe(), settings, {key: present[key] for key in settings},
                   tuple(key for key in present if key in user_keys))


def _length(cfg: DictConfig, values: Mapping[str, Any] | None = None) -> str:
    """A run's length in words, e.g. "40 steps of 4×128 tokens, evaluations on 64 held-out blocks": ``cfg``'s, or
    with :data:`SMALL_CPU_RUN`'s keys taken from ``values`` where it has them."""
    at = {key: OmegaConf.select(cfg, key) for key in SMALL_CPU_RUN} | dict(values or {})
    words = f"{at['trainer.max_steps']} steps"
    if at["data.block_size"] is not None:
        words += f" of {OmegaConf.select(cfg, 'data.batch_size')}×{at['data.block_size']} tokens"
    if at["data.max_val_blocks"] is not None:
        words += f", evaluations on {at['data.max_val_blocks']} held-out blocks"
    return words


def describe(size: RunSize, cfg: DictConfig) -> str:
    """What the run trains and why, in one line (``cfg`` after :func:`apply_size`), e.g. "30 steps of 4×64 tokens,
    evaluations on 32 held-out blocks, sized to a CPU with AVX2 (no AVX-512), 2 cores"."""
    kept = ", ".join(f"{key}={OmegaConf.select(cfg, key)}" for key in size.kept)
    kept = f" ({kept} as set on the command line)" if kept else ""
    if not size.sized:
        return f"{_length(cfg)}{kept}, not sized ({size.reason})"
    return f"{_length(cfg)}{kept}, sized to {size.reason}"


def apply_size(cfg: DictConfig, size: RunSize) -> None:
    """Writes ``size``'s settings into ``cfg`` (before anything is built from it)."""
    with open_dict(cfg):
        for key, value in size.settings.items():
            OmegaConf.update(cfg, key, value, merge=False)


@rank_zero_only
def _say(message: str, *args: Any) -> None:
    """Logs on rank 0 only: every rank of a multi-device run sizes its run, and one line is enough."""
    log.info(message, *args)


def size_to_machine(cfg: DictConfig, overrides: Sequence[str] | None = None,
                    choices: Mapping[str, Any] | None = None) -> RunSize:
    """Sizes ``cfg``'s run to this machine, in place, and says what it trains in one log line.

    Args:
        cfg: the composed config.
        overrides: the command line's Hydra overrides (their keys keep their values); ``None``: those of the
            command (or :func:`~lightning_offload.cli.train.compose_config` call) that composed ``cfg``.
        choices: the config groups' chosen options; ``None``: that command's.

    Returns:
        The size applied (what the run summary records).
    """
    if (overrides is None or choices is None) and HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        overrides = list(hydra_cfg.overrides.task) if overrides is None else overrides
        choices = dict(hydra_cfg.runtime.choices) if choices is None else choices
    size = choose_size(cfg, Machine.this(str(cfg.trainer.get("accelerator", "auto"))), overrides or (), choices)
    apply_size(cfg, size)
    if size.sized:
        _say("Run size: %s, where the full main job takes over 8 minutes; main_job.size_to_machine=false runs %s.",
             describe(size, cfg), _length(cfg, size.replaced))
    else:
        _say("Run size: %s.", describe(size, cfg))
    return size
