"""The offload strategies for Lightning Fabric: ``"lsp_offload"``, ``"zero_offload"``, ``"meft_offload"`` and the
data-parallel ``"lsp_offload_ddp"``, ``"zero_offload_ddp"``, registered by ``import lightning_offload``.

Set-up and hooks only: the engine is set up as for the Trainer (:mod:`lightning_offload.setup.engine`); clipping goes
through it because projected gradients never fill ``param.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_offload.engine.fitting.projector_fitting import FitAgreement, OneProcess, ProjectorFitting
from lightning_offload.engine.lanes.ranks import DEFAULT_BUCKET_BYTES, RankShards
from lightning_offload.engine.user_optimizer import refuse_rows_across_ranks, row_adam_settings
from lightning_offload.meft.attached import AdapterRowSettings, AttachedAdapters
from lightning_offload.setup.data_parallel import RankAgreement, broadcast_weights, bucket_bytes
from lightning_offload.setup.engine import Placements, as_offload_optimizer, build_engine
from lightning_offload.setup.loop_optimizer import LOOP_REFUSED, LoopOffloadOptimizer, loop_settings
from lightning_offload.setup.precision_check import check_precision
from lightning_offload.setup.settings_docs import FaceClass
from lightning_offload.setup.whole_save import save_whole


class FabricOffloadMixin:
    """What Fabric's offload strategies share: the engine in place of the user's Adam/AdamW, precision checks,
    clipping through the engine, checkpoints, teardown. Mixed in before the strategy's Fabric base.
    """

    strategy_name: str
    refused_settings = LOOP_REFUSED
    #: Whether ``embeddings=None`` means ``"sparse"`` under projection (data parallelism cannot step rows sparsely).
    sparse_embeddings_by_default = True

    def _configure_offload(self, settings: Mapping[str, Any], max_grad_norm: float | None,
                           accumulation_steps: int | None, fitting: ProjectorFitting | None, refit_every: int) -> None:
        """Keep the settings, validated (the loop's with them); called by the constructors before their base's. The
        strategy goes by the name they are the preset of (``zero_offload`` for ``projection=False``)."""
        self.settings = type(self).settings_from(settings)
        self.strategy_name = type(self).name_for(self.settings)
        self.loop = loop_settings(self.settings, max_grad_norm, accumulation_steps, refit_every, fitting)
        self.offload_optimizer: LoopOffloadOptimizer | None = None

    def _rank_shards(self) -> RankShards | None:
        """What the engine shares its work with: nothing on one device (the DDP forms override this)."""
        return None

    @property
    def fit_agreement(self) -> FitAgreement:
        """How the ranks agree on a projector fit: here one process, every value its own."""
        return OneProcess()

    # ------------------------------------------------------------------------------------------------ precision
    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric's connector sets the plugin after __init__: checked here (bf16 or fp32 only, as for the Trainer).
        if precision is not None:
            check_precision(self.strategy_name, precision, Precision, (HalfPrecision, MixedPrecision))
        self._precision = precision

    # ------------------------------------------------------------------------------------------------ set-up
    @override
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[torch.nn.Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"strategy {self.strategy_name!r} takes over exactly one Adam/AdamW optimizer, got "
                             f"{len(optimizers)}. Pass a single optimizer; use param groups for different "
                             f"hyper-parameters.")
        module = self.setup_module(module)
        setup = build_engine(module, optimizers[0], self.settings,
                             Placements.of(self.settings, self.sparse_embeddings_by_default), self.root_device,
                             self.strategy_name, rank_zero_info, rank_zero_warn, rank_shards=self._rank_shards(),
                             optimizer_class=LoopOffloadOptimizer)
        optimizer = setup.optimizer
        assert isinstance(optimizer, LoopOffloadOptimizer)
        optimizer.configure_loop(setup, self.loop, self.strategy_name, agreement=self.fit_agreement)
        self._after_engine(module, optimizer)
        self.offload_optimizer = optimizer
        return module, [optimizer], scheduler

    @property
    def projected_layers(self) -> dict[str, Any]:
        """The projected (or scaled) weights of the module set up, by the qualified name of each module using one."""
        if self.offload_optimizer is None:
            return {}
        return {name: layer for layer in self.offload_optimizer.projected_layers
                for name in getattr(layer, "names", [layer.name])}

    def _after_engine(self, module: torch.nn.Module, optimizer: LoopOffloadOptimizer) -> None:
        """What a strategy adds to the engine once it is built (MEFT's adapter rows)."""

    # ------------------------------------------------------------------------------------------------ clipping
    @override
    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError(f"strategy {self.strategy_name!r} clips by the global 2-norm; got norm_type={norm_type}.")
        norm = as_offload_optimizer(optimizer).clip_grad_norm_(float(max_norm))
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of the gradients is {float(norm)}: non-finite, so clipping by it "
                               f"is undefined. Pass error_if_nonfinite=False to let the step be skipped instead.")
        return norm

    @override
    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        as_offload_optimizer(optimizer).clip_grad_value_(float(clip_val))

    # ---------------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if self.offload_optimizer is not None:
            # The weights read next must hold every update already stepped on the host, and the decay rows owe.
            self.offload_optimizer.settle()
        base = super(FabricOffloadMixin, self)
        if not self.is_global_zero:
            base.save_checkpoint(path, state, storage_options, filter)  # its share of the state; rank 0 writes
            return
        save_whole(path, lambda target: base.save_checkpoint(target, state, storage_options, filter))

    @override
    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(state, dict):
            # Modules first: the engine refreshes its fp32 masters from the restored weights.
            state = dict(sorted(state.items(), key=lambda item: not isinstance(item[1], torch.nn.Module)))
        return super().load_checkpoint(path, state, strict, weights_only)

    @override
    def teardown(self) -> None:
        if self.offload_optimizer is not None:
            self.offload_optimizer.close()
            self.offload_optimizer = None
        super().teardown()


class FabricSingleDevice(FabricOffloadMixin, SingleDeviceStrategy, metaclass=FaceClass):
    """Fabric's single-device strategy with the user's Adam/AdamW offloaded to the host: the class
    ``Fabric(strategy="lsp_offload")`` and ``"zero_offload"`` build (their presets:
    :data:`~lightning_offload.setup.settings.PRESETS`), and the machinery ``meft_offload`` shares. Call
    ``optimizer.close()`` when done (it applies what is pending and gives the model back).

    Args:
        device: the training device. Default: ``None`` (CUDA when present, else CPU).
        max_grad_norm: clip every step to this global norm unless ``fabric.clip_gradients`` was called for it.
            Default: ``None``.
        accumulation_steps: training forwards per optimizer step (see :func:`~lightning_offload.faces.loop.offload`).
            Default: ``1``.
        fitting: how projector fits run (``optimizer.fit_projectors``; refused where nothing is projected). Default:
            ``None`` (the seed's defaults).
        refit_every: optimizer steps between refit checks (``optimizer.refit_due``; refused where nothing is projected,
            unless left at its default). Default: ``500``.
        accelerator, checkpoint_io, precision: filled in by Fabric. Default: ``None``.
        <offload settings>
    """

    presets = ("lsp_offload", "zero_offload")

    def __init__(self, device: torch.device | str | None = None, *, max_grad_norm: float | None = None,
                 accumulation_steps: int | None = 1, fitting: ProjectorFitting | None = None, refit_every: int = 500,
                 accelerator: Accelerator | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision: Precision | None = None, **settings: Any) -> None:
        self._configure_offload(settings, max_grad_norm, accumulation_steps, fitting, refit_every)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(torch.device(device), accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision=precision)


class FabricOffload(FabricSingleDevice, preset="lsp_offload"):
    """Fabric's single-device strategy with the user's Adam/AdamW offloaded to the host, on LSP-compressed gradients.

    ``Fabric(strategy="lsp_offload")`` (:class:`FabricSingleDevice` under this name); build it for settings.

    Example::

        fabric = L.Fabric(strategy=FabricOffload(rank=0.25, projectors="learned", max_grad_norm=1.0,
                                                 accumulation_steps=4))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        optimizer.fit_projectors(loader, lambda model, batch: model(**batch).loss)  # learned projectors
        fabric.backward(model(**batch).loss); optimizer.step(); optimizer.zero_grad()
        optimizer.close()
    """


class FabricZeroOffload(FabricSingleDevice, preset="zero_offload"):
    """Fabric's single-device strategy with dense gradients to a host Adam (ZeRO-Offload style).

    ``Fabric(strategy="zero_offload")``: :class:`FabricSingleDevice` with ``projection=False``; the projection settings
    are refused.

    Example::

        fabric = L.Fabric(strategy=FabricZeroOffload(link_dtype="bf16", max_grad_norm=1.0))  # or "zero_offload"
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    """


class FabricMEFTOffload(FabricSingleDevice):
    """Fabric's single-device strategy for MEFT adapters whose rows and Adam state live on the host.

    ``Fabric(strategy="meft_offload")``, after :func:`~lightning_offload.meft.injection.inject_meft`; the user's
    Adam/AdamW over the routers sets the rows' hyper-parameters too, unless ``lr``/``weight_decay`` do.

    Args:
        device: the training device. Default: ``None`` (CUDA when present, else CPU).
        lr: the rows' own learning rate. Default: ``None`` (the first param group's).
        weight_decay: the rows' own decoupled weight decay. Default: ``None`` (the first param group's).
        key_lr_scale: the keys' learning rate relative to the values'. Default: ``1.0``.
        row_block: rows per block of the row Adam. Default: ``None`` (one expert's neurons).
        max_grad_norm: as for :class:`FabricOffload`, over routers and rows. Default: ``None``.
        accumulation_steps: as for :class:`FabricOffload`. Default: ``1``.
        fitting: refused (nothing is projected). Default: ``None``.
        refit_every: refused unless left at its default (nothing is projected). Default: ``500``.
        accelerator, checkpoint_io, precision: filled in by Fabric. Default: ``None``.
        <offload settings>

    Example::

        inject_meft(model, MEFTConfig(num_neurons=4096))  # freezes the base model
        fabric = L.Fabric(strategy="meft_offload")
        routers = [p for p in model.parameters() if p.requires_grad]
        model, optimizer = fabric.setup(model, torch.optim.AdamW(routers, lr=1e-3))
    """

    presets = ("meft_offload",)  # its own class (the adapters' set-up), registered with the name's preset

    def __init__(self, device: torch.device | str | None = None, *, lr: float | None = None,
                 weight_decay: float | None = None, key_lr_scale: float = 1.0, row_block: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.row_settings = AdapterRowSettings(lr, weight_decay, key_lr_scale, row_block)
        self.attached: AttachedAdapters | None = None

    @override
    def _after_engine(self, module: torch.nn.Module, optimizer: LoopOffloadOptimizer) -> None:
        rows = self.row_settings
        self.attached = AttachedAdapters.attach(
            module, optimizer,
            lambda: row_adam_settings(optimizer.wrapped, optimizer.param_groups[0], rows.lr, rows.weight_decay),
            rows, pin=self.root_device.type == "cuda")
        # Closing the optimizer finishes the adapters' last row updates and hands them back first.
        optimizer.loop.on_close.append(lambda attached=self.attached: attached.release(finish=True))


class FabricDataParallel(FabricOffloadMixin, DDPStrategy, metaclass=FaceClass):
    """Fabric's data-parallel strategy with the user's Adam/AdamW offloaded to the hosts, sharded between ranks: the
    class ``Fabric(strategy="lsp_offload_ddp")`` and ``"zero_offload_ddp"`` build. As
    :class:`~lightning_offload.faces.trainer.ddp.DDPOffload` for the Trainer: the engine reduces each gradient to the
    rank that owns its share of the host Adam, which steps it and broadcasts the update.

    Args:
        bucket_mb: largest gradient bucket, in MiB, reduced between ranks as one collective. Default: ``25.0``.
        max_grad_norm: as for :class:`FabricSingleDevice`. Default: ``None``.
        accumulation_steps: as for :class:`FabricSingleDevice`. Default: ``1``.
        fitting: as for :class:`FabricSingleDevice`. Default: ``None``.
        refit_every: as for :class:`FabricSingleDevice`. Default: ``500``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend,
            timeout, start_method: as for Fabric's ``DDPStrategy`` (filled in by Fabric). Default: Fabric's.
        <offload settings>
    """

    presets = ("lsp_offload_ddp", "zero_offload_ddp")
    sparse_embeddings_by_default = False

    def __init__(self, *, bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20, max_grad_norm: float | None = None,
                 accumulation_steps: int | None = 1, fitting: ProjectorFitting | None = None, refit_every: int = 500,
                 accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen", **settings: Any) -> None:
        self._configure_offload(settings, max_grad_norm, accumulation_steps, fitting, refit_every)
        if self.settings.embeddings == "sparse":
            refuse_rows_across_ranks()
        self.bucket_bytes = bucket_bytes(bucket_mb)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        # The engine reduces the gradients itself, so Fabric's no_backward_sync has nothing to hold back.
        self._backward_sync_control = None

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # Not wrapped in DistributedDataParallel (the engine reduces the gradients), so rank 0's weights go out here.
        broadcast_weights(module)
        return module

    @override
    def _rank_shards(self) -> RankShards | None:
        return RankShards(bucket_bytes=self.bucket_bytes)

    @property
    @override
    def fit_agreement(self) -> FitAgreement:
        # Every rank fits to the mean of the ranks' samples and installs rank 0's fit.
        return RankAgreement(lambda grad: self.all_reduce(grad, reduce_op="mean"), self.broadcast)


class FabricOffloadDDP(FabricDataParallel, preset="lsp_offload_ddp"):
    """Fabric's data-parallel strategy with the user's Adam/AdamW offloaded to the hosts, on LSP-compressed gradients.

    ``Fabric(strategy="lsp_offload_ddp")`` (:class:`FabricDataParallel` under this name), as
    :class:`~lightning_offload.faces.trainer.ddp.LSPOffloadDDPStrategy` for the Trainer.

    Example::

        fabric = L.Fabric(devices=2, strategy=FabricOffloadDDP(accumulation_steps=2, max_grad_norm=1.0))
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        loader = fabric.setup_dataloaders(loader)  # each rank its share of every batch
    """


class FabricZeroOffloadDDP(FabricDataParallel, preset="zero_offload_ddp"):
    """Fabric's data-parallel strategy with dense gradients reduced to the rank that owns each tensor's host Adam.

    ``Fabric(strategy="zero_offload_ddp")``: :class:`FabricDataParallel` with ``projection=False``; the projection
    settings are refused.

    Example::

        fabric = L.Fabric(devices=2, strategy=FabricZeroOffloadDDP(bucket_mb=50))  # or "zero_offload_ddp"
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    """
