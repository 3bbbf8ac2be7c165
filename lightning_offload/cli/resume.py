"""Checkpoints on the command line: where a resumed run writes, whether its strategy can continue the checkpoint,
and the command that resumes an interrupted run."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.engine.checkpoint_kinds import (
    checkpoint_kind,
    offload_state_without_offload,
    other_offload_strategy,
    torch_state_under_offload,
    written_with_projection,
)
from lightning_offload.faces.trainer.offload_base import OffloadMixin
from lightning_offload.tasks.schedule import SettingsError


def run_dir_of_checkpoint(ckpt_path: str | None) -> str | None:
    """The run directory a checkpoint was written in (``<run dir>/checkpoints/<name>.ckpt`` with the run's
    ``history.jsonl`` beside), or ``None`` for no checkpoint or one from elsewhere."""
    if not ckpt_path:
        return None
    folder = Path(ckpt_path).expanduser().resolve().parent
    if folder.name == "checkpoints" and (folder.parent / "history.jsonl").is_file():
        return str(folder.parent)
    return None


def _resume_run_dir(ckpt_path: str | None, fresh: str) -> str:
    # A resumed run continues in its own directory, so its history, summary and plots stay in one place.
    return run_dir_of_checkpoint(ckpt_path) or fresh


def _resume_config_subdir(ckpt_path: str | None, stamp: str) -> str:
    # Keep the first run's .hydra/ config (what it was started with); the resumed one's goes beside it.
    return f".hydra/resumed-{stamp}" if run_dir_of_checkpoint(ckpt_path) else ".hydra"


# Registered at import, before @hydra.main composes conf/hydra/default.yaml, which uses them.
OmegaConf.register_new_resolver("lo_run_dir", _resume_run_dir, replace=True)
OmegaConf.register_new_resolver("lo_config_subdir", _resume_config_subdir, replace=True)


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's contents, on the CPU."""
    # Memory-mapped: only the parts read are loaded (the optimizer state may be several times the weights).
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def check_checkpoint_fits_strategy(cfg: DictConfig, policy: OffloadPolicy) -> None:
    """Refuses, before anything loads, a ``ckpt_path`` whose optimizer state the run's strategy cannot continue (and
    ``ckpt_path`` together with ``weights_from``), saying what to do instead."""
    ckpt_path, weights_from = cfg.get("ckpt_path"), cfg.get("weights_from")
    if ckpt_path is not None and weights_from is not None:
        raise SettingsError(f"ckpt_path={ckpt_path} resumes a run, weights_from={weights_from} starts a new one from "
                            f"a checkpoint's weights: set one of them.")
    for name, path in (("ckpt_path", ckpt_path), ("weights_from", weights_from)):
        if path is not None and not Path(path).is_file():
            raise SettingsError(f"{name}={path} is not a file.")
    if ckpt_path is None:
        return
    checkpoint = read_checkpoint(ckpt_path)
    kind = checkpoint_kind(checkpoint)
    offloads = isinstance(policy.strategy, OffloadMixin)
    if kind == "offload" and not offloads:
        raise SettingsError(offload_state_without_offload(f"offload={cfg.offload.get('name')}"))
    if kind == "torch" and offloads:
        raise SettingsError(torch_state_under_offload())
    if kind == "offload" and offloads:
        state = checkpoint["optimizer_states"][0]
        run_projects = policy.strategy.settings.projection  # what every offload strategy's settings say
        written_projected = written_with_projection(state)
        if written_projected and not run_projects:
            raise SettingsError(other_offload_strategy("lsp_offload", policy.strategy.strategy_name))
        if not written_projected and run_projects:
            # No projected layer in it: zero_offload's state (or that of an lsp_offload run that projected none, which
            # said so when it ran).
            raise SettingsError(other_offload_strategy("zero_offload", policy.strategy.strategy_name))


def resume_command(checkpoint: str | Path) -> str:
    """The command line that continues this run from ``checkpoint``: the same overrides plus ``ckpt_path``."""
    overrides: list[str] = []
    if HydraConfig.initialized():
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("ckpt_path=")]
    return " ".join(["lightning-offload-train", *map(shlex.quote, overrides), shlex.quote(f"ckpt_path={checkpoint}")])
