"""The offload strategy a run's device count asks for: with ``trainer.devices`` > 1 or ``trainer.num_nodes`` > 1, a
single-device offload strategy becomes its form on Lightning's DDP (its ``data_parallel_form``), said in the log."""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig, ListConfig, open_dict

from lightning_offload.faces.trainer.offload import SingleDeviceOffload
from lightning_offload.registries import trainer_names
from lightning_offload.setup.settings import data_parallel_form


def _data_parallel_target(target: str) -> str | None:
    """The class path of the DDP form (``data_parallel_form``, its class from the registries' table) of the
    single-device offload strategy at ``target``; ``None`` for one without, or for another strategy."""
    strategy_class = hydra.utils.get_class(target) if target.startswith("lightning_offload.") else None
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, SingleDeviceOffload)):
        return None
    form = data_parallel_form(strategy_class.strategy_name)
    public = next((entry.public for entry in trainer_names() if entry.name == form), None)
    return f"{public.__module__}.{public.__qualname__}" if public is not None else None


def _device_count(devices: Any) -> int | None:
    """How many devices a Trainer ``devices`` setting names (``None`` for "auto" or -1, decided by Lightning)."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices)
    return None


def data_parallel_offload(cfg: DictConfig) -> str | None:
    """With ``trainer.devices`` > 1 or ``trainer.num_nodes`` > 1, switch ``lsp``/``zero`` to their DDP strategies
    (``lsp_offload_ddp``/``zero_offload_ddp``), which cannot step embeddings row-sparsely.

    Returns:
        The line for the run's log that says so, or ``None`` when nothing was switched.
    """
    devices = _device_count(cfg.trainer.get("devices", 1)) or 1
    nodes = int(cfg.trainer.get("num_nodes", 1) or 1)
    strategy = cfg.offload.get("strategy")
    if (devices <= 1 and nodes <= 1) or not isinstance(strategy, DictConfig):
        return None
    target = _data_parallel_target(strategy.get("_target_", ""))
    if target is None:
        return None  # other strategies say themselves whether they run on several devices
    with open_dict(cfg):
        strategy._target_ = target
        if strategy.get("embeddings") == "sparse":
            strategy.embeddings = "host"
    return (f"{devices} device(s) × {nodes} node(s): offload={cfg.offload.get('name')} runs as "
            f"{target.rsplit('.', 1)[1]} (embeddings={strategy.get('embeddings')}: row-sparse embeddings are "
            f"single-device only).")
