"""``lsp_offload_ddp``, ``zero_offload_ddp``: the offload strategies on Lightning's DDP, for several devices and nodes.

One process per device (Lightning's launcher and process group), no ``DistributedDataParallel``: in backward the offload
optimizer (:mod:`lightning_offload.engine.lanes.ranks`) reduces each projected weight's compressed gradient ``S``
(linear in the gradient, so summing the ranks' is exact) and the rest's dense gradients, in buckets, to the rank owning
each tensor's host Adam, which broadcasts the update back: each rank's host keeps about ``1/(N·M)`` of the state.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_offload.engine.fitting.projector_fitting import FitAgreement
from lightning_offload.engine.lanes.ranks import DEFAULT_BUCKET_BYTES, RankShards
from lightning_offload.engine.rules.host_rule import scaled_across_ranks_error
from lightning_offload.engine.user_optimizer import refuse_rows_across_ranks
from lightning_offload.faces.trainer.offload_base import OffloadMixin
from lightning_offload.setup.data_parallel import RankAgreement, broadcast_weights, bucket_bytes
from lightning_offload.setup.settings import SCALED_ONLY_SETTINGS, OffloadSettings
from lightning_offload.setup.settings_docs import FaceClass


class DDPOffload(OffloadMixin, DDPStrategy, metaclass=FaceClass):
    """The offload strategies on Lightning's DDP, for several devices and nodes: the class
    ``strategy="lsp_offload_ddp"`` and ``strategy="zero_offload_ddp"`` build (their presets:
    :data:`~lightning_offload.setup.settings.PRESETS`). Every rank draws the same projectors (from ``seed``); learned
    fits use the ranks' mean sampled gradient, installed from rank 0; gradients cross between ranks in ``link_dtype``.
    The scaled rule trains on one process.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
            timeout, start_method: as for Lightning's ``DDPStrategy`` (filled in by the Trainer).
        bucket_mb: largest gradient bucket reduced between ranks as one collective, in MiB. Default: ``25.0`` (DDP's).
        <offload settings>
    """

    presets = ("lsp_offload_ddp", "zero_offload_ddp")
    excluded_settings = SCALED_ONLY_SETTINGS  # the scaled rule trains on one process
    sparse_embeddings_by_default = False

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        **settings: Any,
    ) -> None:
        configured = type(self).settings_from(settings)  # first: refused before the DDP machinery is set up
        if configured.update == "scaled":
            raise scaled_across_ranks_error()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.bucket_bytes = bucket_bytes(bucket_mb)
        self._configure_offload(configured)

    @override
    def _configure_offload(self, settings: OffloadSettings) -> None:
        super()._configure_offload(settings)
        if self.placements.embeddings == "sparse":
            refuse_rows_across_ranks()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # Lightning's DDP: process group, ranks, device
        module = self.lightning_module
        self._add_refit_callback(module._trainer if module is not None else None)

    @override
    def _prepare_model(self) -> None:
        # No DDP wrapper: the offload optimizer reduces the gradients, and rank 0's weights are broadcast here.
        assert self.model is not None
        broadcast_weights(self.model)

    @override
    def _rank_shards(self) -> RankShards | None:
        return RankShards(bucket_bytes=self.bucket_bytes)

    @property
    @override
    def fit_agreement(self) -> FitAgreement:
        # Every rank fits to the ranks' mean sample (Lightning's in-place reduce) and installs rank 0's fit.
        return RankAgreement(lambda grad: self.reduce(grad, reduce_op="mean"), self.broadcast)


class LSPOffloadDDPStrategy(DDPOffload, preset="lsp_offload_ddp"):
    """LSP-Offload on several devices and nodes: compressed gradients between ranks, the host optimizer sharded.

    ``strategy="lsp_offload_ddp"`` (:class:`DDPOffload` under this name).

    Example::

        import lightning.pytorch as pl
        from lightning_offload import LSPOffloadDDPStrategy

        strategy = LSPOffloadDDPStrategy(rank=0.25, projectors="random", bucket_mb=50)
        trainer = pl.Trainer(strategy=strategy, accelerator="gpu", devices=4, precision="bf16-mixed")
        trainer.fit(module)  # or pl.Trainer(strategy="lsp_offload_ddp", devices=4)
    """


class ZeroOffloadDDPStrategy(DDPOffload, preset="zero_offload_ddp"):
    """The ZeRO-Offload-style baseline on several devices and nodes: dense gradients between ranks, reduced to the
    rank that owns each tensor's share of the sharded host Adam.

    ``strategy="zero_offload_ddp"``: :class:`DDPOffload` with ``projection=False``, beside
    :class:`LSPOffloadDDPStrategy`, not a kind of it; the projection settings are refused.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import ZeroOffloadDDPStrategy

        trainer = pl.Trainer(strategy=ZeroOffloadDDPStrategy(bucket_mb=50), devices=2, precision="bf16-mixed")
        trainer.fit(module)  # or pl.Trainer(strategy="zero_offload_ddp", devices=2)
    """
