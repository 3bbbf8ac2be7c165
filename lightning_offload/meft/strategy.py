"""``meft_offload``: trains MEFT adapters whose keys, values and Adam state live on the host.

The adapters (see :mod:`lightning_offload.meft.adapter`) fetch the rows their tokens route to; their row gradients
land on the offload engine's one host worker, summed into host accumulators while backward goes on
(:mod:`lightning_offload.engine.row_gradients`). Each adapter's rows are a slot of the engine
(:class:`~lightning_offload.engine.row_blocks_slot.RowBlocksSlot`): the step's global norm, clipping and skip
decision cover them with every other gradient, and their block Adam
(:class:`~lightning_offload.engine.block_row_adam.BlockRowAdam`) runs on the worker over the blocks of rows touched
since the last step (the union over the accumulated micro-batches; a block is one expert's neurons unless
``row_block`` says otherwise), refreshing the device's bf16 routing copy of those keys. The next forward waits for an
adapter's update only when it reaches that adapter. Every other trainable parameter (the routers, anything the user
left unfrozen) is stepped as ``zero_offload`` steps it: dense host Adam, nothing on the device. This module is the
set-up: which rows, with which hyper-parameters, and the ``meft/*`` figures (:mod:`lightning_offload.meft.figures`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_offload.engine.block_row_adam import BlockRowAdam, RowAdamSettings
from lightning_offload.engine.clipping import NonFinitePolicy
from lightning_offload.engine.row_blocks_slot import RowBlocksSlot
from lightning_offload.engine.row_gradients import RowGradients
from lightning_offload.engine.slot import is_decoupled
from lightning_offload.meft.adapter import MEFTAdapter, RowTraffic
from lightning_offload.meft.injection import meft_adapters
from lightning_offload.meft.figures import host_rows_bytes, host_trainable_parameters, row_figures
from lightning_offload.strategies.offload import SingleDeviceOffload
from lightning_offload.strategies.settings import PROJECTION_SETTINGS, OffloadSettings
from lightning_offload.strategies.report import OffloadFacts

# Where checkpoints written before the rows were slots of the engine kept the rows' Adam state.
_OLD_STATE_KEY = "meft_host_rows"


class MEFTOffloadStrategy(SingleDeviceOffload):
    """Single-device training of MEFT adapters with their rows and Adam state on the host.

    Registered as ``strategy="meft_offload"``. Call :func:`~lightning_offload.meft.injection.inject_meft` on the
    model first; ``configure_optimizers`` returns one ``torch.optim.Adam``/``AdamW`` over the trainable parameters
    (the routers), whose first param group also sets the rows' hyper-parameters unless ``lr``/``weight_decay`` do.
    Every other keyword is an offload setting of :class:`~lightning_offload.strategies.offload.LSPOffloadStrategy`,
    for the dense parameters, stepped as ``zero_offload`` steps them (no projection); the projection settings
    (``rank``, ``density``, ``min_dim``, ``target_modules``, ``exclude_modules``, ``projectors``,
    ``projector_factory``, ``update_buffers``) do not apply and are refused unless left at their defaults.

    Args:
        device: the training device. Default: ``None`` (CUDA when present, else CPU).
        lr: learning rate of the adapter rows. Default: ``None`` (the first param group's, following its scheduler).
        weight_decay: decoupled weight decay of the adapter rows. Default: ``None`` (the first param group's, coupled
            or decoupled as the optimizer's class decides).
        key_lr_scale: the keys' learning rate relative to the values' (keys decide the routing: a smaller step keeps
            each token's neuron set stable while the values learn). Default: ``1.0``.
        row_block: rows per block of the host Adam, the unit it steps. A touched block is stepped whole, its
            untouched rows with a zero gradient as dense AdamW would; smaller blocks step fewer idle rows in more,
            smaller kernel calls. Must divide ``num_neurons``. Default: ``None`` (the neurons of one expert, which
            the routing touches together).
        seed: as for ``zero_offload``: seed of stochastic rounding of the dense parameters. Default: ``0``.
        on_nonfinite: as for ``zero_offload``, for the dense parameters and the rows alike: ``"skip"`` (count and
            skip steps with inf/nan gradients) or ``"raise"``. Default: ``"skip"``.
        log_telemetry: as for ``zero_offload``, plus the ``meft/*`` figures of the rows, every step.
            Default: ``True``.
        pipelined: as for ``zero_offload``, and for the rows: ``True`` lets the row updates run on the host while
            the next forward starts; ``False`` finishes them inside the optimizer step. Default: ``True``.
        link_dtype: as for ``zero_offload`` (the dense parameters' gradients; fetched rows cross in the forward's
            compute dtype). Default: ``"fp32"``.
        speculative: as for ``zero_offload`` (the dense parameters). Default: ``None`` (on for a GPU, off on the
            CPU).
        embeddings: as for ``zero_offload``, when the embeddings are left trainable. Default: ``None`` (``"host"``).
        head: as for ``zero_offload``, when the output head is left trainable. Default: ``None`` (``"host"``).
        accelerator, checkpoint_io, precision_plugin: as for ``LSPOffloadStrategy`` (filled in by the Trainer).
            Default: ``None``.
        projection_settings: ``rank``, ``density``, ``min_dim``, ``target_modules``, ``exclude_modules``,
            ``projectors``, ``projector_factory``, ``update_buffers``: accepted at their defaults only (nothing is
            projected); another value is refused, naming it. Any other keyword is a ``TypeError``. Default: none.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import MEFTConfig, MEFTOffloadStrategy, inject_meft

        inject_meft(model, MEFTConfig(num_neurons=4096))  # freezes the base model
        strategy = MEFTOffloadStrategy(key_lr_scale=0.5, on_nonfinite="raise")
        trainer = pl.Trainer(strategy=strategy, precision="bf16-mixed")  # or strategy="meft_offload"
    """

    strategy_name = "meft_offload"
    data_parallel_form = None

    def __init__(self, device: torch.device | str | None = None, *, lr: float | None = None,
                 weight_decay: float | None = None, key_lr_scale: float = 1.0, row_block: int | None = None,
                 accelerator: Accelerator | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, seed: int = 0, on_nonfinite: NonFinitePolicy = "skip",
                 log_telemetry: bool = True, pipelined: bool = True, link_dtype: str = "fp32",
                 speculative: bool | None = None, embeddings: str | None = None, head: str | None = None,
                 **projection_settings: Any) -> None:
        for name in projection_settings:
            if name not in PROJECTION_SETTINGS:
                raise TypeError(f"MEFTOffloadStrategy.__init__() got an unexpected keyword argument {name!r}"
                                + (" (meft_offload never projects)" if name == "projection" else "") + ".")
        settings = OffloadSettings(projection=False, seed=seed, on_nonfinite=on_nonfinite,
                                   log_telemetry=log_telemetry, pipelined=pipelined, link_dtype=link_dtype,
                                   speculative=speculative, embeddings=embeddings, head=head, **projection_settings)
        super().__init__(device, accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._configure_offload(settings)
        if lr is not None and not lr > 0:
            raise ValueError(f"meft_offload lr={lr} must be positive (or None to follow the optimizer).")
        if not key_lr_scale > 0:
            raise ValueError(f"meft_offload key_lr_scale={key_lr_scale} must be positive (1.0: keys and values "
                             f"share the learning rate).")
        if row_block is not None and (not isinstance(row_block, int) or row_block < 1):
            raise ValueError(f"meft_offload row_block={row_block!r} must be a positive integer dividing the adapters' "
                             f"num_neurons (or None: one expert's neurons).")
        self.lr = lr
        self.weight_decay = weight_decay
        self.key_lr_scale = float(key_lr_scale)
        self.row_block = row_block
        self.adapters: list[MEFTAdapter] = []
        self.row_slots: list[RowBlocksSlot] = []
        self.row_pipeline: RowGradients | None = None
        self._last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ set-up
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None and self.offload_optimizer is not None
        self.adapters = meft_adapters(self.lightning_module)
        if not self.adapters:
            raise ValueError("strategy 'meft_offload' found no MEFT adapter in the module. Call "
                             "lightning_offload.inject_meft(model, MEFTConfig(...)) on the model first.")
        averaging = [type(c).__name__ for c in trainer.callbacks
                     if isinstance(c, (pl.callbacks.WeightAveraging, pl.callbacks.StochasticWeightAveraging))]
        if averaging:
            rank_zero_warn(f"meft_offload: {', '.join(averaging)} averages the module's parameters (the routers), not "
                           f"the adapter rows, which live on the host as plain tensors: the adapters keep their last "
                           f"step's rows.")
        if self.root_device.type == "cuda":
            for adapter in self.adapters:
                adapter.pin_host_memory()
        names = {id(module): name for name, module in self.lightning_module.named_modules()}
        self.row_slots = self.offload_optimizer.attach_row_blocks(
            [a.row_blocks(f"{names[id(a)]}.rows", self._block_rows(a), self.key_lr_scale) for a in self.adapters],
            self._settings)
        self.row_pipeline = self.row_slots[0].gradients
        for adapter, slot in zip(self.adapters, self.row_slots):
            adapter.row_pipeline, adapter.rows_slot = self.row_pipeline, slot

    def _block_rows(self, adapter: MEFTAdapter) -> int:
        rows = self.row_block if self.row_block is not None else adapter.config.neurons_per_expert
        if adapter.config.num_neurons % rows:
            raise ValueError(f"meft_offload row_block={rows} does not divide num_neurons="
                             f"{adapter.config.num_neurons}; pick a divisor, e.g. the neurons of one expert "
                             f"({adapter.config.neurons_per_expert}).")
        return rows

    def _settings(self) -> RowAdamSettings:
        """The rows' hyper-parameters at this step: the first param group's, or this strategy's lr/weight_decay."""
        optimizer = self.optimizers[0]
        wrapped = getattr(optimizer, "wrapped", optimizer)  # the user's optimizer, inside the offload wrapper
        group = optimizer.param_groups[0]
        if group.get("amsgrad", False):
            raise ValueError("meft_offload's host row Adam has no amsgrad: its per-row maxima would have to cross "
                             "the host for every row ever touched. Use amsgrad=False.")
        return RowAdamSettings(
            lr=self.lr if self.lr is not None else float(group["lr"]),
            betas=tuple(group.get("betas", (0.9, 0.999))),
            eps=float(group.get("eps", 1e-8)),
            weight_decay=self.weight_decay if self.weight_decay is not None else float(group.get("weight_decay", 0)),
            # An explicit meft_offload(weight_decay=...) is decoupled, as AdamW's; else the user's optimizer decides.
            decoupled=self.weight_decay is not None or is_decoupled(wrapped, group),
            maximize=bool(group.get("maximize", False)),
        )

    @property
    def row_optimizers(self) -> list[BlockRowAdam]:
        """Each adapter's block row Adam (its slot's)."""
        return [slot.adam for slot in self.row_slots]

    # ---------------------------------------------------------------------------------------------- training
    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.offload_optimizer is not None and self.row_pipeline is not None
        self._last_metrics = row_figures(self.adapters, self.row_slots, self.row_pipeline.take_busy_seconds(),
                                         self.offload_optimizer.telemetry.skipped_steps, self.root_device)
        if self.log_telemetry and self.lightning_module is not None and self.lightning_module._trainer is not None:
            self.lightning_module.log_dict(self._last_metrics, on_step=True, on_epoch=False, batch_size=1)
        return output

    @override
    def on_validation_end(self) -> None:
        # Rows fetched by evaluation crossed the link too, but they are not a training step's traffic: drop them so
        # the next step's telemetry counts only its own micro-batches.
        for adapter in self.adapters:
            adapter.host.traffic = RowTraffic()
        super().on_validation_end()

    # ---------------------------------------------------------------------------------------------- reporting
    def offload_facts(self) -> OffloadFacts:
        """The dense offload's facts and the adapters' host rows (see strategies/report.py)."""
        return replace(
            super().offload_facts(),
            host_trainable_parameters=host_trainable_parameters(self.adapters),
            host_rows_bytes=host_rows_bytes(self.adapters),
            adapter_rows=sum(adapter.config.num_neurons for adapter in self.adapters),
            adapter_device_bytes=sum(b.numel() * b.element_size() for a in self.adapters for b in a.buffers()),
        )

    def figures_at_step_end(self) -> dict[str, float]:
        """The rows' figures of the step just taken (:attr:`last_metrics`)."""
        return self.last_metrics

    @property
    def last_metrics(self) -> dict[str, float]:
        """The figures of the latest step (rows and bytes moved, host time, device bytes, expert usage)."""
        return dict(self._last_metrics)

    # -------------------------------------------------------------------------------------------- checkpoints
    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = [dict(s) for s in checkpoint["optimizer_states"]]
        old_rows = states[0].pop(_OLD_STATE_KEY, None) if states else None
        if old_rows is not None:
            # Written when the rows' Adam state rode beside the engine's: it becomes their slots' state.
            if len(old_rows["rows"]) != len(self.row_slots):
                raise ValueError(f"Checkpoint holds host state for {len(old_rows['rows'])} MEFT adapters, the model "
                                 f"has {len(self.row_slots)}.")
            states[0]["slots"] = [*states[0]["slots"], *(slot.name for slot in self.row_slots)]
            states[0]["host_adam"] = [*states[0]["host_adam"], *old_rows["rows"]]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    # ------------------------------------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        # Hand the adapters back without waiting on queued row updates (the process must be able to exit); the
        # offload strategy then stops the engine's worker they were queued on.
        self._release_rows(finish=False)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        # Finish the last updates, then give the user plain adapters: a later backward adds gradients in the hook.
        self._release_rows(finish=True)
        super().teardown()

    def _release_rows(self, finish: bool) -> None:
        pipeline, self.row_pipeline = self.row_pipeline, None
        if pipeline is None:
            return
        try:
            if finish:
                for adapter in self.adapters:
                    adapter.wait_for_update()
                pipeline.flush()
        finally:
            pipeline.release()
            for adapter in self.adapters:
                adapter.row_pipeline, adapter.rows_slot = None, None
                # Handed back for plain backward, which adds to the accumulators as to `.grad`: rows holding a
                # consumed step's sum are zeroed, the sums of micro-batches not yet stepped are kept.
                host = adapter.host
                host.grad_keys[~host.written_keys] = 0
                host.grad_values[~host.written_values] = 0
