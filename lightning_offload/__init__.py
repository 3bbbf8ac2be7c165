"""lightning_offload: fine-tune language models on one commodity GPU by offloading optimizer work to the host.

Importing the package registers the Lightning strategy names ``lsp_offload``, ``zero_offload``, ``meft_offload`` and
the multi-device ``lsp_offload_ddp`` and ``zero_offload_ddp``, for the Trainer and for Fabric, whichever of Lightning
and this package is imported first; a loop of one's own (or Hugging Face's ``Trainer``) takes :func:`offload`'s
optimizer::

    import lightning_offload
    trainer = L.Trainer(strategy="lsp_offload")
    fabric = L.Fabric(strategy="lsp_offload")
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters()))

The public names load on first use (PEP 562), so a plain loop or Hugging Face's ``Trainer`` never imports Lightning
(seconds at import): ``from lightning_offload import offload`` costs about ``import torch``, and the strategies'
names reach Lightning's registries when Lightning is imported (:mod:`lightning_offload.registries`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_offload.registries import register_with_lightning

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports each name on first use
    from lightning_offload.engine.figures.refit_record import RefitRecord
    from lightning_offload.engine.figures.telemetry import OffloadTelemetry, StepTelemetry
    from lightning_offload.engine.fitting.projector_fitting import ProjectorFitting
    from lightning_offload.engine.optimizer import OffloadOptimizer
    from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings
    from lightning_offload.engine.rules.host_rule import HostRule, register_host_rule
    from lightning_offload.engine.rules.lion import Lion
    from lightning_offload.engine.step.clipping import NonFiniteGradientError, NonFiniteStepWarning
    from lightning_offload.lsp.weight_hooks import ProjectedWeightHookWarning
    from lightning_offload.faces.fabric import (
        FabricMEFTOffload, FabricOffload, FabricOffloadDDP, FabricZeroOffload, FabricZeroOffloadDDP)
    from lightning_offload.faces.loop import offload
    from lightning_offload.lm_loss import causal_lm_loss
    from lightning_offload.faces.trainer.ddp import LSPOffloadDDPStrategy, ZeroOffloadDDPStrategy
    from lightning_offload.faces.trainer.meft import MEFTOffloadStrategy
    from lightning_offload.faces.trainer.offload import LSPOffloadStrategy, ZeroOffloadStrategy
    from lightning_offload.faces.trainer.plain_checkpoint import PlainConversion, to_plain_adamw_checkpoint
    from lightning_offload.faces.trainer.refit import ProjectorRefit
    from lightning_offload.lsp.fit import FitSettings, reconstruction_error
    from lightning_offload.lsp.linear import ProjectedWeight
    from lightning_offload.lsp.projector import SparseProjector, random_projector, signed_permutation_projector
    from lightning_offload.lsp.rounding import stochastic_round_to_bf16
    from lightning_offload.meft.adapter import MEFTAdapter
    from lightning_offload.meft.config import MEFTConfig
    from lightning_offload.meft.export import load_meft_adapters, meft_state_dict, save_meft_adapters, unload_meft
    from lightning_offload.meft.injection import inject_meft, meft_adapters
    from lightning_offload.setup.hardware_precision import PrecisionChoice, hardware_precision
    from lightning_offload.setup.loop_optimizer import LoopOffloadOptimizer
    from lightning_offload.planning.calibration import Hardware, calibrate
    from lightning_offload.planning.choose import Choice, choose
    from lightning_offload.planning.plan import plan
    from lightning_offload.planning.report import Plan
    from lightning_offload.setup.settings import OffloadSettings
    from lightning_offload.registries import register_strategies

#: Each public name and the module that defines it (the modules of Lightning-bound names import Lightning).
_SOURCES: dict[str, str] = {
    "BlockRowAdam": "lightning_offload.engine.rows.block_row_adam",
    "RowAdamSettings": "lightning_offload.engine.rows.block_row_adam",
    "HostRule": "lightning_offload.engine.rules.host_rule",
    "register_host_rule": "lightning_offload.engine.rules.host_rule",
    "Lion": "lightning_offload.engine.rules.lion",
    "NonFiniteGradientError": "lightning_offload.engine.step.clipping",
    "NonFiniteStepWarning": "lightning_offload.engine.step.clipping",
    "ProjectedWeightHookWarning": "lightning_offload.lsp.weight_hooks",
    "OffloadOptimizer": "lightning_offload.engine.optimizer",
    "ProjectorFitting": "lightning_offload.engine.fitting.projector_fitting",
    "RefitRecord": "lightning_offload.engine.figures.refit_record",
    "OffloadTelemetry": "lightning_offload.engine.figures.telemetry",
    "StepTelemetry": "lightning_offload.engine.figures.telemetry",
    "FabricMEFTOffload": "lightning_offload.faces.fabric",
    "FabricOffload": "lightning_offload.faces.fabric",
    "FabricOffloadDDP": "lightning_offload.faces.fabric",
    "FabricZeroOffload": "lightning_offload.faces.fabric",
    "FabricZeroOffloadDDP": "lightning_offload.faces.fabric",
    "LoopOffloadOptimizer": "lightning_offload.setup.loop_optimizer",
    "offload": "lightning_offload.faces.loop",
    "causal_lm_loss": "lightning_offload.lm_loss",
    "FitSettings": "lightning_offload.lsp.fit",
    "reconstruction_error": "lightning_offload.lsp.fit",
    "ProjectedWeight": "lightning_offload.lsp.linear",
    "SparseProjector": "lightning_offload.lsp.projector",
    "random_projector": "lightning_offload.lsp.projector",
    "signed_permutation_projector": "lightning_offload.lsp.projector",
    "stochastic_round_to_bf16": "lightning_offload.lsp.rounding",
    "MEFTAdapter": "lightning_offload.meft.adapter",
    "MEFTConfig": "lightning_offload.meft.config",
    "load_meft_adapters": "lightning_offload.meft.export",
    "meft_state_dict": "lightning_offload.meft.export",
    "save_meft_adapters": "lightning_offload.meft.export",
    "unload_meft": "lightning_offload.meft.export",
    "inject_meft": "lightning_offload.meft.injection",
    "meft_adapters": "lightning_offload.meft.injection",
    "MEFTOffloadStrategy": "lightning_offload.faces.trainer.meft",
    "LSPOffloadDDPStrategy": "lightning_offload.faces.trainer.ddp",
    "ZeroOffloadDDPStrategy": "lightning_offload.faces.trainer.ddp",
    "PrecisionChoice": "lightning_offload.setup.hardware_precision",
    "hardware_precision": "lightning_offload.setup.hardware_precision",
    "LSPOffloadStrategy": "lightning_offload.faces.trainer.offload",
    "ZeroOffloadStrategy": "lightning_offload.faces.trainer.offload",
    "register_strategies": "lightning_offload.registries",
    "PlainConversion": "lightning_offload.faces.trainer.plain_checkpoint",
    "to_plain_adamw_checkpoint": "lightning_offload.faces.trainer.plain_checkpoint",
    "ProjectorRefit": "lightning_offload.faces.trainer.refit",
    "OffloadSettings": "lightning_offload.setup.settings",
    "plan": "lightning_offload.planning.plan",
    "Plan": "lightning_offload.planning.report",
    "choose": "lightning_offload.planning.choose",
    "Choice": "lightning_offload.planning.choose",
    "Hardware": "lightning_offload.planning.calibration",
    "calibrate": "lightning_offload.planning.calibration",
}

__version__ = "0.1.0"
__all__ = [
    "BlockRowAdam",
    "calibrate",
    "causal_lm_loss",
    "Choice",
    "choose",
    "FabricMEFTOffload",
    "FabricOffload",
    "FabricOffloadDDP",
    "FabricZeroOffload",
    "FabricZeroOffloadDDP",
    "FitSettings",
    "Hardware",
    "hardware_precision",
    "HostRule",
    "inject_meft",
    "load_meft_adapters",
    "Lion",
    "LoopOffloadOptimizer",
    "LSPOffloadDDPStrategy",
    "LSPOffloadStrategy",
    "meft_adapters",
    "meft_state_dict",
    "MEFTAdapter",
    "MEFTConfig",
    "MEFTOffloadStrategy",
    "NonFiniteGradientError",
    "NonFiniteStepWarning",
    "offload",
    "OffloadOptimizer",
    "OffloadSettings",
    "OffloadTelemetry",
    "Plan",
    "plan",
    "PlainConversion",
    "PrecisionChoice",
    "ProjectedWeight",
    "ProjectedWeightHookWarning",
    "ProjectorFitting",
    "ProjectorRefit",
    "random_projector",
    "reconstruction_error",
    "RefitRecord",
    "register_host_rule",
    "register_strategies",
    "RowAdamSettings",
    "save_meft_adapters",
    "signed_permutation_projector",
    "SparseProjector",
    "StepTelemetry",
    "stochastic_round_to_bf16",
    "to_plain_adamw_checkpoint",
    "unload_meft",
    "ZeroOffloadDDPStrategy",
    "ZeroOffloadStrategy",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here, so later reads are plain lookups."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names too, loaded or not (tab completion and ``help()`` see the whole package)."""
    return sorted(set(globals()) | set(__all__))


register_with_lightning()
