"""The single-device offload strategies, ``lsp_offload`` (:class:`LSPOffloadStrategy`) and ``zero_offload``
(:class:`ZeroOffloadStrategy`): :class:`~lightning_offload.faces.trainer.offload_base.OffloadMixin` on Lightning's
single-device strategy, registered by :mod:`lightning_offload.registries`.

At set-up they swap the Adam/AdamW of ``configure_optimizers`` for an
:class:`~lightning_offload.engine.optimizer.OffloadOptimizer` with host state, and ``lsp_offload`` rebinds the forward
of each selected Linear/Conv1D so its backward yields a compressed gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_offload.faces.trainer.offload_base import OffloadMixin
from lightning_offload.lsp.projector import ProjectorFactory, random_projector
from lightning_offload.setup.settings import (
    NonFinitePolicy, OffloadSettings, keyword_settings, refuse_unknown_settings)
from lightning_offload.setup.settings_docs import NOT_WITHOUT_PROJECTION, documents_settings


def default_device() -> torch.device:
    """CUDA when present, else the CPU (which then plays the device's part)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class SingleDeviceOffload(OffloadMixin, SingleDeviceStrategy):
    """The offload machinery on Lightning's single-device strategy: what ``lsp_offload``, ``zero_offload`` and
    ``meft_offload`` share; more than one device is refused. A strategy on it builds its ``OffloadSettings`` first,
    then calls this constructor and ``_configure_offload(settings)``.

    Args:
        device: the training device. Default: ``None`` (as the Trainer's ``accelerator``; CUDA when present, else CPU).
        accelerator, checkpoint_io, precision_plugin: Lightning's (filled in by the Trainer). Default: ``None``.
    """

    #: The registered name of this strategy's form for several devices and nodes (None: it has none).
    data_parallel_form: str | None = None

    def __init__(self, device: torch.device | str | None = None, *, accelerator: Accelerator | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None) -> None:
        self._auto_device = device is None
        super().__init__(
            device=default_device() if device is None else device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # ---------------------------------------------------------------------------------------------------- device
    @property
    @override
    def accelerator(self) -> Accelerator | None:
        return self._accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Accelerator | None) -> None:
        self._accelerator = accelerator
        # A strategy built from its registered name gets no device: follow the accelerator the Trainer chose.
        if self._auto_device and accelerator is not None:
            kind = type(accelerator).__name__
            if kind == "CPUAccelerator":
                self._root_device = torch.device("cpu")
            elif kind == "CUDAAccelerator" and torch.cuda.is_available():
                self._root_device = torch.device("cuda", torch.cuda.current_device())

    @override
    def setup_environment(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        connector = getattr(trainer, "_accelerator_connector", None)
        requested = len(getattr(connector, "_parallel_devices", None) or [None])
        num_nodes = getattr(connector, "_num_nodes_flag", 1) or 1
        if requested > 1 or num_nodes > 1:
            # Lightning would quietly train on the first device only.
            raise ValueError(
                f"strategy {self.strategy_name!r} trains on one device, but the Trainer asks for {requested} "
                f"device(s) on {num_nodes} node(s). "
                + (f"Use strategy='{self.data_parallel_form}' (the same offload on Lightning's DDP, after `import "
                   f"lightning_offload`) for several devices or nodes, or pass devices=1."
                   if self.data_parallel_form else "It has no multi-device form yet: pass devices=1 (and num_nodes=1).")
            )
        super().setup_environment()
        self._add_refit_callback(trainer)

    @override
    def _prepare_model(self) -> None:
        self.model = self._setup_model(self.model)


@documents_settings()
class LSPOffloadStrategy(SingleDeviceOffload):
    """Single-device training whose optimizer work runs on the host, on LSP-compressed gradients.

    Registered as ``strategy="lsp_offload"``; build it to change the settings. ``configure_optimizers`` returns one
    ``torch.optim.Adam``/``AdamW``, stepped on the host; precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``.

    Args:
        device: the training device. Default: ``None`` (as the Trainer's ``accelerator``; CUDA when present, else CPU).
        accelerator, checkpoint_io, precision_plugin: Lightning's (filled in by the Trainer). Default: ``None``.
        <offload settings>

    Example::

        import lightning.pytorch as pl
        from lightning_offload import LSPOffloadStrategy

        strategy = LSPOffloadStrategy(rank=0.125, density=4, projectors="random", embeddings="host")
        trainer = pl.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=1000)
        trainer.fit(module)  # configure_optimizers returns one torch.optim.AdamW
    """

    strategy_name = "lsp_offload"
    data_parallel_form = "lsp_offload_ddp"

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        projection: bool = True,
        rank: int | float = 0.25,
        density: int = 8,
        min_dim: int = 128,
        target_modules: Sequence[str] | None = None,
        exclude_modules: Sequence[str] = (),
        projectors: str = "random",
        projector_factory: ProjectorFactory = random_projector,
        seed: int = 0,
        on_nonfinite: NonFinitePolicy = "skip",
        log_telemetry: bool = True,
        pipelined: bool = True,
        link_dtype: str = "fp32",
        update_buffers: int | None = None,
        speculative: bool | None = None,
        free_sent_gradients: bool | None = None,
        embeddings: str | None = None,
        head: str | None = None,
        vectors: str | None = None,
        update: str = "projected",
        redraw_every: int = 200,
        norm_growth_limit: float | None = 1.01,
        kernels: str = "auto",
        **unknown: Any,
    ) -> None:
        refuse_unknown_settings(type(self).__name__, unknown, keyword_settings(type(self)))  # a misspelt one: named
        settings = OffloadSettings.from_arguments(locals())  # first: a bad setting is refused before any set-up
        super().__init__(device, accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._configure_offload(settings)


@documents_settings(exclude=NOT_WITHOUT_PROJECTION)
class ZeroOffloadStrategy(SingleDeviceOffload):
    """Dense host Adam with full gradients over the link: the ZeRO-Offload-style baseline.

    :class:`SingleDeviceOffload` with ``projection=False``, beside :class:`LSPOffloadStrategy`, not a kind of it; the
    projection settings are refused. Registered as ``strategy="zero_offload"``.

    Args:
        device: the training device. Default: ``None`` (as the Trainer's ``accelerator``; CUDA when present, else CPU).
        <offload settings>
        accelerator, checkpoint_io, precision_plugin: Lightning's (filled in by the Trainer). Default: ``None``.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import ZeroOffloadStrategy

        trainer = pl.Trainer(strategy=ZeroOffloadStrategy(link_dtype="bf16"), precision="bf16-mixed")
        trainer.fit(module)  # or simply pl.Trainer(strategy="zero_offload")
    """

    strategy_name = "zero_offload"
    data_parallel_form = "zero_offload_ddp"

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        seed: int = 0,
        on_nonfinite: NonFinitePolicy = "skip",
        log_telemetry: bool = True,
        pipelined: bool = True,
        link_dtype: str = "fp32",
        speculative: bool | None = None,
        free_sent_gradients: bool | None = None,
        embeddings: str | None = None,
        head: str | None = None,
        vectors: str | None = None,
        **unknown: Any,
    ) -> None:
        # The projection settings are not parameters here: nothing is projected, and they are refused by name.
        refuse_unknown_settings(type(self).__name__, unknown, keyword_settings(type(self)), projects=False)
        settings = OffloadSettings.from_arguments({**locals(), "projection": False})  # first: refused before set-up
        super().__init__(device, accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._configure_offload(settings)
