"""The single-device offload strategies: :class:`SingleDeviceOffload`, the one class ``strategy="lsp_offload"`` and
``strategy="zero_offload"`` build, each with its preset (as Lightning's ``deepspeed_stage_2_offload`` builds
``DeepSpeedStrategy`` with ``stage=2, offload_optimizer=True``), and its preset classes :class:`LSPOffloadStrategy` and
:class:`ZeroOffloadStrategy`, to build with settings:
:class:`~lightning_offload.faces.trainer.offload_base.OffloadMixin` on Lightning's single-device strategy, registered by
:mod:`lightning_offload.registries`.

At set-up they swap the Adam/AdamW of ``configure_optimizers`` for an
:class:`~lightning_offload.engine.optimizer.OffloadOptimizer` with host state, and ``lsp_offload`` rebinds the forward
of each selected Linear/Conv1D so its backward yields a compressed gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_offload.faces.trainer.offload_base import OffloadMixin
from lightning_offload.setup.settings import data_parallel_form
from lightning_offload.setup.settings_docs import FaceClass


def default_device() -> torch.device:
    """CUDA when present, else the CPU (which then plays the device's part)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class SingleDeviceOffload(OffloadMixin, SingleDeviceStrategy, metaclass=FaceClass):
    """Single-device training whose optimizer work runs on the host: the class ``strategy="lsp_offload"`` and
    ``strategy="zero_offload"`` build (their presets: :data:`~lightning_offload.setup.settings.PRESETS`), and the
    machinery ``meft_offload`` shares; more than one device is refused.

    Args:
        device: the training device. Default: ``None`` (as the Trainer's ``accelerator``; CUDA when present, else CPU).
        accelerator, checkpoint_io, precision_plugin: Lightning's (filled in by the Trainer). Default: ``None``.
        <offload settings>
    """

    presets = ("lsp_offload", "zero_offload")

    def __init__(self, device: torch.device | str | None = None, *, accelerator: Accelerator | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None,
                 **settings: Any) -> None:
        configured = type(self).settings_from(settings)  # first: a bad setting is refused before any set-up
        self._auto_device = device is None
        super().__init__(
            device=default_device() if device is None else device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._configure_offload(configured)

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
            form = data_parallel_form(self.strategy_name)
            raise ValueError(
                f"strategy {self.strategy_name!r} trains on one device, but the Trainer asks for {requested} "
                f"device(s) on {num_nodes} node(s). "
                + (f"Use strategy='{form}' (the same offload on Lightning's DDP, after `import "
                   f"lightning_offload`) for several devices or nodes, or pass devices=1."
                   if form else "It has no multi-device form yet: pass devices=1 (and num_nodes=1).")
            )
        super().setup_environment()
        self._add_refit_callback(trainer)

    @override
    def _prepare_model(self) -> None:
        self.model = self._setup_model(self.model)


class LSPOffloadStrategy(SingleDeviceOffload, preset="lsp_offload"):
    """Single-device training whose optimizer work runs on the host, on LSP-compressed gradients.

    ``strategy="lsp_offload"`` (:class:`SingleDeviceOffload` under this name); build it to change the settings.
    ``configure_optimizers`` returns one ``torch.optim.Adam``/``AdamW``, stepped on the host; precision:
    ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import LSPOffloadStrategy

        strategy = LSPOffloadStrategy(rank=0.125, density=4, projectors="random", embeddings="host")
        trainer = pl.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=1000)
        trainer.fit(module)  # configure_optimizers returns one torch.optim.AdamW
    """


class ZeroOffloadStrategy(SingleDeviceOffload, preset="zero_offload"):
    """Dense host Adam with full gradients over the link: the ZeRO-Offload-style baseline.

    ``strategy="zero_offload"``: :class:`SingleDeviceOffload` with ``projection=False``, beside
    :class:`LSPOffloadStrategy`, not a kind of it; the projection settings are refused.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import ZeroOffloadStrategy

        trainer = pl.Trainer(strategy=ZeroOffloadStrategy(link_dtype="bf16"), precision="bf16-mixed")
        trainer.fit(module)  # or simply pl.Trainer(strategy="zero_offload")
    """
