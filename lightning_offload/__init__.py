"""lightning_offload: fine-tune language models on one commodity GPU by offloading optimizer work to the host.

Importing the package registers the Lightning strategy names ``lsp_offload`` and ``zero_offload``::

    import lightning_offload
    trainer = L.Trainer(strategy="lsp_offload")
"""

from lightning_offload.callbacks import ProjectorRefit, RefitRecord
from lightning_offload.lsp.fit import FitSettings, reconstruction_error
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector, random_projector, signed_permutation_projector
from lightning_offload.offload_optimizer import NonFiniteGradientError, OffloadOptimizer
from lightning_offload.rounding import stochastic_round_to_bf16
from lightning_offload.strategy import LSPOffloadStrategy, ZeroOffloadStrategy, register_strategies
from lightning_offload.telemetry import OffloadTelemetry, StepTelemetry

register_strategies()

__version__ = "0.1.0"
__all__ = [
    "LSPOffloadStrategy",
    "NonFiniteGradientError",
    "OffloadOptimizer",
    "OffloadTelemetry",
    "FitSettings",
    "ProjectedWeight",
    "ProjectorRefit",
    "RefitRecord",
    "SparseProjector",
    "StepTelemetry",
    "ZeroOffloadStrategy",
    "random_projector",
    "reconstruction_error",
    "register_strategies",
    "signed_permutation_projector",
    "stochastic_round_to_bf16",
]
