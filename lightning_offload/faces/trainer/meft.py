"""``meft_offload``: trains MEFT adapters whose keys, values and Adam state live on the host. Set-up only: each
adapter's rows are a slot of the offload engine (:mod:`lightning_offload.meft.attached`), under the step's one norm,
clip and skip decision; the routers are stepped as ``zero_offload`` steps them. The design: ``docs/meft.md``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_offload.engine.rows.block_row_adam import RowAdamSettings
from lightning_offload.engine.user_optimizer import row_adam_settings
from lightning_offload.faces.trainer.offload import SingleDeviceOffload
from lightning_offload.meft.adapter import MEFTAdapter
from lightning_offload.meft.attached import AdapterRowSettings, AttachedAdapters
from lightning_offload.meft.figures import host_rows_bytes, host_trainable_parameters
from lightning_offload.setup.report import OffloadFacts


class MEFTOffloadStrategy(SingleDeviceOffload):
    """Single-device training of MEFT adapters with their rows and Adam state on the host.

    Registered as ``strategy="meft_offload"``. Call :func:`~lightning_offload.meft.injection.inject_meft` on the
    model first; ``configure_optimizers`` returns one ``torch.optim.Adam``/``AdamW`` over the trainable parameters
    (the routers), whose first param group also sets the rows' hyper-parameters unless ``lr``/``weight_decay`` do.
    The other settings are ``zero_offload``'s, for the dense parameters (``embeddings``, ``head`` and ``vectors`` when
    left trainable); the projection settings do not apply. For the rows: ``on_nonfinite`` applies to them as to the
    dense parameters, ``log_telemetry`` logs their ``meft/*`` figures too, ``pipelined`` also lets their updates run on
    the host while the next forward starts, and fetched rows cross in the forward's compute dtype whatever
    ``link_dtype``.

    Args:
        device: the training device. Default: ``None`` (CUDA when present, else CPU).
        lr: learning rate of the adapter rows. Default: ``None`` (the first param group's, following its scheduler).
        weight_decay: decoupled weight decay of the adapter rows. Default: ``None`` (the first param group's, coupled
            or decoupled as the optimizer's class decides).
        key_lr_scale: the keys' learning rate relative to the values' (keys decide the routing: a smaller step keeps
            each token's neuron set stable while the values learn). Default: ``1.0``.
        row_block: rows per block of the row Adam, the unit it steps (a touched block is stepped whole, its untouched
            rows with a zero gradient as dense AdamW would); divides ``num_neurons``. Default: ``None`` (the neurons
            of one expert, which the routing touches together).
        accelerator, checkpoint_io, precision_plugin: filled in by the Trainer. Default: ``None``.
        <offload settings>

    Example::

        import lightning.pytorch as pl
        from lightning_offload import MEFTConfig, MEFTOffloadStrategy, inject_meft

        inject_meft(model, MEFTConfig(num_neurons=4096))  # freezes the base model
        strategy = MEFTOffloadStrategy(key_lr_scale=0.5, on_nonfinite="raise")
        trainer = pl.Trainer(strategy=strategy, precision="bf16-mixed")  # or strategy="meft_offload"
    """

    presets = ("meft_offload",)  # its own class (the adapters' set-up), registered with the name's preset

    def __init__(self, device: torch.device | str | None = None, *, lr: float | None = None,
                 weight_decay: float | None = None, key_lr_scale: float = 1.0, row_block: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(device, **kwargs)  # the settings first: a misspelt or inapplicable one is refused by name
        self.row_settings = AdapterRowSettings(lr, weight_decay, key_lr_scale, row_block)
        self.attached: AttachedAdapters | None = None

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None and self.offload_optimizer is not None
        averaging = [type(c).__name__ for c in trainer.callbacks
                     if isinstance(c, (pl.callbacks.WeightAveraging, pl.callbacks.StochasticWeightAveraging))]
        if averaging:
            rank_zero_warn(f"meft_offload: {', '.join(averaging)} averages the module's parameters (the routers), not "
                           f"the adapter rows, which live on the host as plain tensors: the adapters keep their last "
                           f"step's rows.")
        self.attached = AttachedAdapters.attach(self.lightning_module, self.offload_optimizer, self._settings,
                                                self.row_settings, pin=self.root_device.type == "cuda")

    def _settings(self) -> RowAdamSettings:
        """The rows' hyper-parameters at this step: the first param group's, or this strategy's lr/weight_decay."""
        optimizer = self.optimizers[0]
        wrapped = getattr(optimizer, "wrapped", optimizer)  # the user's optimizer, inside the offload wrapper
        rows = self.row_settings
        return row_adam_settings(wrapped, optimizer.param_groups[0], rows.lr, rows.weight_decay)

    @property
    def adapters(self) -> list[MEFTAdapter]:
        """The module's adapters (empty before set-up)."""
        return self.attached.adapters if self.attached is not None else []

    def _take_step_end_figures(self) -> dict[str, float]:
        assert self.offload_optimizer is not None and self.attached is not None
        return self.attached.step_figures(self.offload_optimizer.telemetry.skipped_steps, self.root_device)

    def offload_facts(self) -> OffloadFacts:
        """The dense offload's facts and the adapters' host rows (see lightning_offload/setup/report.py)."""
        adapters = self.adapters
        return replace(super().offload_facts(), host_trainable_parameters=host_trainable_parameters(adapters),
                       host_rows_bytes=host_rows_bytes(adapters),
                       adapter_rows=sum(adapter.config.num_neurons for adapter in adapters),
                       adapter_device_bytes=sum(b.numel() * b.element_size() for a in adapters for b in a.buffers()))

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.attached is not None:
            self.attached.release(finish=False)  # not waiting on queued row updates: the process must be able to exit
        super().on_exception(exception)  # then the engine's worker they were queued on is stopped

    @override
    def teardown(self) -> None:
        if self.attached is not None:
            self.attached.release(finish=True)  # the last updates, then plain adapters for the user
        super().teardown()
