"""lightning_offload: fine-tune language models on one commodity GPU by offloading optimizer work to the host.

Importing the package registers the Lightning strategy names ``lsp_offload``, ``zero_offload``, ``meft_offload`` and
the multi-device ``lsp_offload_ddp`` and ``zero_offload_ddp``, for the Trainer and for Fabric (and Fabric's
``meft_offload``); a loop of one's own (or Hugging Face's ``Trainer``) takes :func:`offload`'s optimizer::

    import lightning_offload
    trainer = L.Trainer(strategy="lsp_offload")
    fabric = L.Fabric(strategy="lsp_offload")
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters()))
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_offload.engine.clipping import NonFiniteGradientError, NonFiniteStepWarning
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.lsp.rounding import stochastic_round_to_bf16
from lightning_offload.engine.telemetry import OffloadTelemetry, StepTelemetry
from lightning_offload.lsp.fit import FitSettings, reconstruction_error
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector, random_projector, signed_permutation_projector
from lightning_offload.strategies.refit import ProjectorRefit
from lightning_offload.engine.refit_record import RefitRecord
from lightning_offload.meft.adapter import MEFTAdapter
from lightning_offload.meft.injection import inject_meft, meft_adapters
from lightning_offload.engine.block_row_adam import BlockRowAdam, RowAdamSettings
from lightning_offload.meft.config import MEFTConfig
from lightning_offload.meft.export import load_meft_adapters, meft_state_dict, save_meft_adapters, unload_meft
from lightning_offload.meft.strategy import MEFTOffloadStrategy
from lightning_offload.strategies.hardware_precision import PrecisionChoice, hardware_precision
from lightning_offload.strategies.plain_checkpoint import PlainConversion, to_plain_adamw_checkpoint
from lightning_offload.strategies.ddp import LSPOffloadDDPStrategy, ZeroOffloadDDPStrategy
from lightning_offload.strategies.offload import LSPOffloadStrategy, ZeroOffloadStrategy, register_strategies
from lightning_offload.strategies.settings import OffloadSettings
from lightning_offload.engine.projector_fitting import ProjectorFitting
from lightning_offload.faces.loop import LoopOffloadOptimizer, offload
from lightning_offload.faces.fabric import (
    FabricMEFTOffload, FabricOffload, FabricOffloadDDP, FabricZeroOffload, FabricZeroOffloadDDP)

register_strategies()
# Here: these modules import strategy, not the reverse.
for _strategy in (MEFTOffloadStrategy, LSPOffloadDDPStrategy, ZeroOffloadDDPStrategy):
    _strategy.register_strategies(StrategyRegistry)
for _fabric_strategy in (FabricOffload, FabricZeroOffload, FabricMEFTOffload, FabricOffloadDDP, FabricZeroOffloadDDP):
    _fabric_strategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__version__ = "0.1.0"
__all__ = [
    "FabricMEFTOffload",
    "FabricOffload",
    "FabricOffloadDDP",
    "FabricZeroOffload",
    "FabricZeroOffloadDDP",
    "LoopOffloadOptimizer",
    "OffloadSettings",
    "ProjectorFitting",
    "offload",
    "BlockRowAdam",
    "LSPOffloadDDPStrategy",
    "LSPOffloadStrategy",
    "MEFTAdapter",
    "MEFTConfig",
    "MEFTOffloadStrategy",
    "NonFiniteGradientError",
    "NonFiniteStepWarning",
    "OffloadOptimizer",
    "OffloadTelemetry",
    "PlainConversion",
    "PrecisionChoice",
    "FitSettings",
    "ProjectedWeight",
    "ProjectorRefit",
    "RefitRecord",
    "SparseProjector",
    "StepTelemetry",
    "ZeroOffloadDDPStrategy",
    "ZeroOffloadStrategy",
    "hardware_precision",
    "inject_meft",
    "load_meft_adapters",
    "meft_adapters",
    "meft_state_dict",
    "random_projector",
    "reconstruction_error",
    "RowAdamSettings",
    "register_strategies",
    "save_meft_adapters",
    "signed_permutation_projector",
    "stochastic_round_to_bf16",
    "to_plain_adamw_checkpoint",
    "unload_meft",
]
