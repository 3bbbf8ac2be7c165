"""The offload machinery every offload strategy shares (:class:`OffloadMixin`): the engine in place of the user's
Adam, precision checks, clipping, synchronisation, checkpoints, reporting and teardown. The single-device strategies
(``lsp_offload``, ``zero_offload``) are in :mod:`lightning_offload.faces.trainer.offload`, the data-parallel ones in
:mod:`lightning_offload.faces.trainer.ddp`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_offload.engine.fitting.projector_fitting import FitAgreement, OneProcess
from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.faces.trainer.refit import ProjectorRefit
from lightning_offload.faces.trainer.weight_readers import weight_readers
from lightning_offload.lsp.kernels.selection import kernel_choices
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.setup.embeddings_head import Placement
from lightning_offload.setup.engine import EngineSetup, Placements, as_offload_optimizer, build_engine
from lightning_offload.setup.precision_check import check_precision
from lightning_offload.setup.projection import compressed_dim
from lightning_offload.setup.report import OffloadFacts, StepFigures
from lightning_offload.setup.settings import OffloadSettings
from lightning_offload.setup.whole_save import save_whole


class OffloadMixin:
    """The offload machinery of the ``lsp_offload``/``zero_offload`` strategies, shared by their single-device and
    data-parallel forms: settings, projection, the :class:`OffloadOptimizer` that replaces the user's Adam, clipping,
    synchronisation, checkpoints and teardown. A strategy class mixes it in before its Lightning base.

    A projector fit's agreement between ranks (:attr:`fit_agreement`) is one process's: every value its own; the DDP
    strategies agree through Lightning's collectives."""

    strategy_name: str
    #: Whether ``embeddings=None`` means ``"sparse"`` under projection (data parallelism cannot step rows sparsely).
    sparse_embeddings_by_default = True

    def _configure_offload(self, settings: OffloadSettings) -> None:
        """Keep the offload settings, validated when ``settings`` was built (the Args of
        :class:`LSPOffloadStrategy`): the one value every reader reads them from; the strategy goes by the name they
        are the preset of (``zero_offload`` for ``projection=False``)."""
        self.settings = settings
        self.strategy_name = type(self).name_for(settings)
        self._compiled_forward = False  # set at set-up: whether the model's forward runs under torch.compile
        self._settle_each_step = False  # set at set-up: whether a callback needs each step's weights right after it
        self._step_end_figures: dict[str, float] = {}  # the latest step's figures_at_step_end()
        self.offload_optimizer: OffloadOptimizer | None = None
        self._engine: EngineSetup | None = None  # the engine and what its set-up changed on the model

    @property
    def fit_agreement(self) -> FitAgreement:
        """How the ranks agree on a projector fit: here one process, every value its own."""
        return OneProcess()

    @property
    def placements(self) -> Placements:
        """Where embeddings and the head train, as asked (the settings, with this strategy's default for
        ``embeddings=None``)."""
        return Placements.of(self.settings, self.sparse_embeddings_by_default)

    @property
    def placement(self) -> Placement:
        """Where embeddings and the head train, as set up (empty before set-up and after teardown)."""
        return self._engine.placement if self._engine is not None else Placement()

    # ------------------------------------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The accelerator connector replaces the plugin after __init__, so validation must live in this setter.
        if plugin is not None:
            check_precision(self.strategy_name, plugin, Precision, (HalfPrecision, MixedPrecision))
            # Clipping must see the compressed gradients too, which the plugin's parameter-based clipping cannot.
            plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
            plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]
        self._precision_plugin = plugin

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        as_offload_optimizer(optimizer).clip_grad_norm_(clip_val)

    def _clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        as_offload_optimizer(optimizer).clip_grad_value_(clip_val)

    # ------------------------------------------------------------------------------------------------ set-up
    def _add_refit_callback(self, trainer: pl.Trainer | None) -> None:
        # Learned projectors need the refit callback. It is added here, before Lightning restores callback states
        # from a checkpoint (and before `setup` hooks), so a resumed run continues the same schedule.
        if self.settings.learns_projectors and trainer is not None:
            if not any(isinstance(callback, ProjectorRefit) for callback in trainer.callbacks):
                refit = ProjectorRefit(seed=self.settings.seed)
                trainer.callbacks.append(refit)
                rank_zero_info(
                    f"{self.strategy_name}: projectors='learned' added {refit!r} to the Trainer's callbacks: it fits "
                    f"the projectors on {refit.num_samples} extra forward/backward passes before the first step, "
                    f"measures their norm ratio on {refit.norm_samples} more, and checks them every "
                    f"{refit.refit_every} steps. Pass your own ProjectorRefit to change this, or "
                    f"projectors='random' for none."
                )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._prepare_model()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Deliberately no `_optimizers_to_device`: Lightning would move every optimizer-state tensor to the device,
        # and the whole point is that this state stays on the host.

    def _prepare_model(self) -> None:
        """What the strategy does to the model on its device before the optimizer is built."""

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy {self.strategy_name!r} takes over exactly one Adam/AdamW optimizer, but "
                f"configure_optimizers returned {len(self.optimizers)}. Return a single optimizer; use param groups "
                f"for different hyper-parameters."
            )
        self._compiled_forward = self._runs_compiled_code()  # configure_model (where users compile) has run
        readers = weight_readers(trainer.callbacks) if self.settings.pipelined else []
        self._settle_each_step = bool(readers)
        if readers:
            rank_zero_info(f"{self.strategy_name}: {', '.join(readers)} may read or write the weights after each step, "
                           f"so each step's updates (and the decay idle embedding rows owe) are applied before the "
                           f"step returns and the callbacks see that step's weights. Results are the same as without "
                           f"them; the host's work no longer overlaps the next forward. Mark a callback that leaves "
                           f"the weights alone with leaves_weights_alone = True to keep the overlap.")
        assert self.lightning_module is not None
        # build_engine validates the optimizer first (Adam/AdamW only), before it changes anything on the model.
        self._engine = build_engine(self.lightning_module, self.optimizers[0], self.settings, self.placements,
                                    self.root_device, self.strategy_name, rank_zero_info, rank_zero_warn,
                                    rank_shards=self._rank_shards())
        self.offload_optimizer = self._engine.optimizer
        self.optimizers = [self.offload_optimizer]

    def _rank_shards(self) -> RankShards | None:
        """What the optimizer shares its work with: nothing for one device (the DDP strategies override this)."""
        return None

    def _compressed_dim(self, name: str, side: str, size: int) -> int:
        return compressed_dim(self.settings, name, side, size)

    @property
    def projected_layers(self) -> dict[str, ProjectedWeight]:
        """The projected weights of the current fit, by the qualified name of each module using one (a weight several
        modules hold: under each name)."""
        if self.offload_optimizer is None:
            return {}
        return {name: layer for layer in self.offload_optimizer.projected_layers
                for name in getattr(layer, "names", [layer.name])}

    # ---------------------------------------------------------------------------------------------- training
    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._settle_each_step:
            self.synchronize()  # a callback reads or writes the weights after the step: they must be this step's
        if self.offload_optimizer is not None:
            self._step_end_figures = self._take_step_end_figures()
        if self.settings.log_telemetry and self.offload_optimizer is not None and self.lightning_module is not None \
                and _trainer_writes_logs_now(self.lightning_module):
            telemetry = self.offload_optimizer.telemetry
            telemetry.device_state_bytes = self.offload_optimizer.device_state_bytes()
            # The engine's figures are those of its latest completed step (a pipelined step completes during the
            # next): none before the first completes, rather than a point of zeros at the start of every chart.
            figures = {**telemetry.metrics(), **self._step_end_figures} if telemetry.completed else \
                self._step_end_figures
            if self.lightning_module._trainer is not None and figures:
                self.lightning_module.log_dict(figures, on_step=True, on_epoch=False, batch_size=1)
        return output

    def _take_step_end_figures(self) -> dict[str, float]:
        """Right after each optimizer step: figures complete at its end, beside the engine's (none here; MEFT's
        rows moved and updated); read once, as they may reset counters."""
        return {}

    def synchronize(self) -> None:
        """Apply every pending update now, and the weight decay row-sparse embeddings' untouched rows owe, so the
        weights are AdamW's (but for the momentum drift of rows a batch left out). The strategy does this itself
        before evaluation, checkpoints and at the end of fit; call it before reading weights from a callback in the
        middle of a pipelined step."""
        if self.offload_optimizer is not None:
            self.offload_optimizer.synchronize()
            self.offload_optimizer.settle_row_decay()

    def _runs_compiled_code(self) -> bool:
        """Whether the module's forward runs under torch.compile (the module compiled whole, which Lightning
        records in ``_compiler_ctx``, or a compiled submodule)."""
        module = self.lightning_module
        if module is None:
            return False
        return getattr(module, "_compiler_ctx", None) is not None or any(
            isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in module.modules())

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.offload_optimizer is not None and self._compiled_forward:
            # torch.compile traces the per-layer pre-forward hooks as no-ops (a wait for the host worker cannot be
            # part of a graph): the compiled forward gets the previous step's updates applied before it starts.
            self.offload_optimizer.synchronize()
        return super().training_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        self.synchronize()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.synchronize()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Ctrl-C or a failure: stop the worker without applying half a step; the process must exit cleanly.
        if self.offload_optimizer is not None:
            self.offload_optimizer.worker.close(timeout=1.0)
        super().on_exception(exception)

    # ---------------------------------------------------------------------------------------------- reporting
    def offload_facts(self) -> OffloadFacts:
        """What a run's summary needs of this strategy beyond its logged figures
        (see lightning_offload/setup/report.py)."""
        scaled = sum(slot.steps_scaled for slot in self.offload_optimizer.slots) \
            if self.offload_optimizer is not None else 0
        return OffloadFacts(gradients_offloaded=self.offload_optimizer is not None,
                            projected_layers=len(self.offload_optimizer.projected_layers if self.offload_optimizer
                                                 is not None else []) + scaled,
                            kernels=kernel_choices(self.projected_layers.values()))

    def figures_at_step_end(self) -> dict[str, float]:
        """Figures complete when the latest step returned (:meth:`_take_step_end_figures`; the engine files its own
        when the step completes)."""
        return dict(self._step_end_figures)

    def completed_step_figures(self, settle: bool = False) -> Sequence[StepFigures]:
        """The engine's figures of recently completed steps, oldest first; ``settle=True`` finishes the step in
        flight first, so that its figures are among them."""
        optimizer = self.offload_optimizer
        if optimizer is None:
            return ()
        if settle and optimizer.step_in_flight:
            self.synchronize()
        return tuple(optimizer.telemetry.completed)

    # -------------------------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The weights saved must include every update already stepped on the host.
        self.synchronize()
        return super().lightning_module_state_dict()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # The base class would load and then move the state to the device; this state stays on the host.
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"Checkpoint holds {len(states)} optimizer states, this run has {len(self.optimizers)}.")
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self.is_global_zero:
            return  # rank 0 writes the checkpoint; Lightning's base saves on rank 0 only as well
        save_whole(filepath, lambda target: super(OffloadMixin, self).save_checkpoint(checkpoint, target,
                                                                                      storage_options))

    @override
    def teardown(self) -> None:
        # Give the user back plain modules: after fit, forward and autograd behave as without the strategy.
        if self._engine is not None:
            self._engine.release()
            self._engine = None  # what it changed on the model is undone: nothing is placed any more
        super().teardown()


def _trainer_writes_logs_now(module: pl.LightningModule) -> bool:
    """Whether the Trainer sends this step's logged values to its loggers (every ``log_every_n_steps``, and at a stop):
    on other steps ``log_dict`` would be thrown away, at ~0.4 ms a figure (Lightning registers each key anew and
    deep-copies it: 11 ms a step for ~26 figures, measured on a 2-core CPU). Without a Trainer's logger connector (an
    unknown Lightning), every step logs."""
    connector = getattr(module._trainer, "_logger_connector", None) if module._trainer is not None else None
    writes = getattr(connector, "should_update_logs", True)
    return bool(writes) or bool(getattr(module._trainer, "fast_dev_run", False))
