"""``meft_offload``: trains MEFT adapters whose keys, values and Adam state live on the host.

The adapters (see :mod:`lightning_offload.meft.adapter`) fetch the rows their tokens route to, and a host worker
(:class:`~lightning_offload.meft.row_pipeline.RowPipeline`) sums those rows' gradients into host accumulators while
backward goes on. At the optimizer step this strategy checks the gradients, then queues a block Adam per adapter
(:class:`~lightning_offload.meft.block_adam.BlockRowAdam`) on the worker over the blocks of rows touched since the last
step (the union over the accumulated micro-batches; a block is one expert's neurons unless ``row_block`` says
otherwise), which also refreshes the device's bf16 routing copy of those keys. The next forward waits for an adapter's update only when
it reaches that adapter. Every other trainable parameter (the routers, anything the user left unfrozen) is stepped by
the ``zero_offload`` machinery this strategy inherits: dense host Adam, nothing on the device. Gradient clipping
(``Trainer(gradient_clip_val=...)``) takes the adapter rows into the global norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_offload.engine.clipping import NonFiniteGradientError
from lightning_offload.engine.slot import is_decoupled
from lightning_offload.meft.adapter import MEFTAdapter, RowTraffic, meft_adapters
from lightning_offload.meft.block_adam import BlockRowAdam, Clip, RowAdamSettings
from lightning_offload.meft.row_pipeline import RowPipeline
from lightning_offload.strategies.offload import LSPOffloadStrategy, _as_offload_optimizer
from lightning_offload.strategies.report import OffloadFacts

_STATE_KEY = "meft_host_rows"


class MEFTOffloadStrategy(LSPOffloadStrategy):
    """Single-device training of MEFT adapters with their rows and Adam state on the host.

    Registered as ``strategy="meft_offload"``. Call :func:`~lightning_offload.meft.adapter.inject_meft` on the
    model first; ``configure_optimizers`` returns one ``torch.optim.Adam``/``AdamW`` over the trainable parameters
    (the routers), whose first param group also sets the rows' hyper-parameters unless ``lr``/``weight_decay`` do.
    Every other keyword goes to :class:`~lightning_offload.strategies.offload.LSPOffloadStrategy` with
    ``projection=False``, the ``zero_offload`` machinery that steps the dense parameters; the projection settings
    (``rank``, ``density``, ``min_dim``, ``target_modules``, ``exclude_modules``, ``projectors``,
    ``projector_factory``, ``update_buffers``) do not apply and are refused.

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
                 **kwargs: Any) -> None:
        kwargs["projection"] = False
        super().__init__(device, **kwargs)
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
        self.row_optimizers: list[BlockRowAdam] = []
        # This step's row-gradient norm², once computed (the non-finite check and norm clipping both read it).
        # This step's touched blocks per adapter (their idle rows zeroed) and row-gradient norm, once computed; keyed
        # by how many row gradients had been queued by then, so a later micro-batch invalidates them.
        self._prepared: tuple[int, list[torch.Tensor]] | None = None
        self._row_norm: torch.Tensor | None = None  # belongs to _prepared: reset with it
        self.row_pipeline: RowPipeline | None = None
        self._row_clip: tuple[str, float] | None = None
        self.skipped_row_steps = 0
        self._pending_state: Mapping[str, Any] | None = None
        self._last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ set-up
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
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
        self.row_pipeline = RowPipeline(self.root_device)
        for adapter in self.adapters:
            adapter.row_pipeline = self.row_pipeline
        self.row_optimizers = [BlockRowAdam([a.host.keys, a.host.values], self._block_rows(a),
                                            lr_scales=[self.key_lr_scale, 1.0]) for a in self.adapters]
        # One non-finite decision per step for routers and rows together: the dense optimizer's check includes the
        # rows' norm, and step_rows follows its verdict.
        assert self.offload_optimizer is not None
        self.offload_optimizer.external_grad_norm = self.row_grad_norm
        if self._pending_state is not None:
            self._load_row_state(self._pending_state)
            self._pending_state = None

    # ---------------------------------------------------------------------------------------------- training
    def _block_rows(self, adapter: MEFTAdapter) -> int:
        rows = self.row_block if self.row_block is not None else adapter.config.neurons_per_expert
        if adapter.config.num_neurons % rows:
            raise ValueError(f"meft_offload row_block={rows} does not divide num_neurons="
                             f"{adapter.config.num_neurons}; pick a divisor, e.g. the neurons of one expert "
                             f"({adapter.config.neurons_per_expert}).")
        return rows

    def _settings(self) -> RowAdamSettings:
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

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        except NonFiniteGradientError:
            # on_nonfinite="raise": the dense optimizer stopped before touching anything; neither may the rows.
            self.row_pipeline.flush()
            self._clear_all_rows()
            self.skipped_row_steps += 1
            raise
        self.step_rows()
        if self.log_telemetry and self.lightning_module is not None and self.lightning_module._trainer is not None:
            self.lightning_module.log_dict(self._last_metrics, on_step=True, on_epoch=False, batch_size=1)
        return output

    @torch.no_grad()
    def step_rows(self) -> None:
        """Queue the block Adam on every adapter's touched blocks (public for manual loops; see :meth:`synchronize`).

        Waits for the gradients still being added on the host, skips (or raises on) non-finite ones, applies the
        clipping set up for this step, and leaves each adapter's update running on the host worker: the adapter's
        next forward waits for it. With ``pipelined=False`` the updates are finished before returning.
        """
        assert self.row_pipeline is not None, "step_rows runs after setup_optimizers"
        self.row_pipeline.flush()
        settings = self._settings()
        clip, self._row_clip = self._row_clip, None
        # The step's verdict on routers and rows together (see setup_optimizers); the rows' norm is checked again
        # (it is cached: no second pass) for manual loops that call this without the dense optimizer's step.
        finite = not self.offload_optimizer.last_step_skipped and bool(torch.isfinite(self.row_grad_norm()))
        step_blocks = self._step_blocks()
        self._prepared = self._row_norm = None
        self.row_pipeline.start_step()
        if not finite:
            self.skipped_row_steps += 1
            if self.on_nonfinite == "raise":
                self._clear_all_rows()
                raise NonFiniteGradientError("A MEFT adapter row received an inf/nan gradient; the host rows and "
                                             "their Adam state were not touched. Pass on_nonfinite='skip' to skip "
                                             "such steps instead.")
        rows_moved = bytes_to_device = bytes_to_host = touched_total = stepped_total = routing_bytes = 0
        for index, (adapter, optimizer, blocks) in enumerate(zip(self.adapters, self.row_optimizers, step_blocks)):
            host = adapter.host
            touched_total += int(host.touched.sum())
            if finite:
                stepped = blocks.numel() * optimizer.block_rows
                stepped_total += stepped
                if adapter.routing_keys is not None:
                    routing_bytes += stepped * adapter.hidden_size * adapter.routing_keys.element_size()
            rows_moved += host.traffic.rows
            bytes_to_device += host.traffic.bytes_to_device
            bytes_to_host += host.traffic.bytes_to_host
            host.traffic.rows = host.traffic.bytes_to_device = host.traffic.bytes_to_host = 0
            update = partial(_update_rows, adapter, optimizer, blocks, settings, clip if finite else None, finite)
            adapter.pending_update = self.row_pipeline.submit(update, f"meft rows {index}")
        if not self.pipelined:
            self._wait_for_rows()
        self._last_metrics = {
            "meft/rows_moved": float(rows_moved),
            "meft/rows_updated": float(touched_total),
            # Whole blocks are stepped: the touched rows plus their blocks' idle rows (zero gradient).
            "meft/rows_stepped": float(stepped_total),
            "meft/bytes_host_to_device": float(bytes_to_device),
            "meft/bytes_device_to_host": float(bytes_to_host),
            # The stepped keys' new bf16 routing copy, sent to the device after the update (device routing only).
            "meft/bytes_routing_keys_to_device": float(routing_bytes),
            # Host work finished since the last step: this step's gradient sums and the previous step's updates
            # (this step's own updates are still running when pipelined).
            "meft/host_optimizer_seconds": self.row_pipeline.take_busy_seconds(),
            "meft/adapter_device_bytes": float(self.adapter_device_bytes()),
            "meft/skipped_steps": float(self.skipped_row_steps),
            **self.expert_usage(),
        }

    def _clear_all_rows(self) -> None:
        self._prepared = self._row_norm = None
        if self.row_pipeline is not None:
            self.row_pipeline.start_step()
        for adapter, optimizer in zip(self.adapters, self.row_optimizers):
            _clear_rows(adapter, optimizer, optimizer.blocks_of(adapter.host.touched))

    def _step_blocks(self) -> list[torch.Tensor]:
        """Each adapter's touched blocks for this step, their idle rows zeroed in the accumulators (once per step).

        A block is stepped whole, so its rows without a gradient this step must read zero; their accumulator rows may
        still hold a consumed step's sum (the step's first gradient of a row is copied in, never added to a zeroed
        row), so exactly those rows are zeroed here.
        """
        if self.row_pipeline is not None:
            self.row_pipeline.flush()
        queued = self.row_pipeline.gradients_queued if self.row_pipeline is not None else -1
        if self._prepared is None or self._prepared[0] != queued or queued < 0:
            step_blocks = []
            for adapter, optimizer in zip(self.adapters, self.row_optimizers):
                host = adapter.host
                blocks = optimizer.blocks_of(host.touched)
                in_blocks = optimizer.blocks_mask(blocks)
                for accumulator, written in ((host.grad_keys, host.written_keys),
                                             (host.grad_values, host.written_values)):
                    idle = (in_blocks & ~written).nonzero().squeeze(1)
                    if idle.numel():
                        accumulator.index_fill_(0, idle, 0.0)
                    written[in_blocks] = True  # every row of the stepped blocks now holds this step's sum
                step_blocks.append(blocks)
            self._prepared, self._row_norm = (queued, step_blocks), None
        return self._prepared[1]

    @override
    def on_validation_end(self) -> None:
        # Rows fetched by evaluation crossed the link too, but they are not a training step's traffic: drop them so
        # the next step's telemetry counts only its own micro-batches.
        for adapter in self.adapters:
            adapter.host.traffic = RowTraffic()
        super().on_validation_end()

    def _wait_for_rows(self) -> None:
        for adapter in self.adapters:
            adapter.wait_for_update()
        if self.row_pipeline is not None:
            self.row_pipeline.flush()

    @override
    def synchronize(self) -> None:
        super().synchronize()
        self._wait_for_rows()

    # ------------------------------------------------------------------------------------------------ clipping
    @torch.no_grad()
    def row_grad_norm(self) -> torch.Tensor:
        """2-norm of the accumulated adapter-row gradients of this step (waits for the host to finish summing).

        Once per step, shared by the non-finite check and norm clipping: summed on the host worker as the gradients
        landed (no pass over the accumulators) when no row received two gradients this step, else read in place over
        the touched blocks' slices (no other row has a gradient). A non-finite gradient makes it non-finite.
        """
        step_blocks = self._step_blocks()  # a new micro-batch's gradients reset the cached norm with the blocks
        if self._row_norm is None:
            # Taken as the gradients landed on the host when no row was summed twice; else read from the sums.
            landed = self.row_pipeline.landed_square_sum() if self.row_pipeline is not None else None
            if landed is not None:
                squares = torch.tensor(landed, dtype=torch.float64)
            else:
                squares = torch.stack([torch.zeros((), dtype=torch.float64)] + [
                    optimizer.grad_norm_squares([adapter.host.grad_keys, adapter.host.grad_values], blocks)
                    for adapter, optimizer, blocks in zip(self.adapters, self.row_optimizers, step_blocks)]).sum()
            self._row_norm = squares.sqrt().float()
        return self._row_norm

    @override
    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        # One global norm over routers (and any other dense parameter) and the adapter rows, as
        # torch.nn.utils.clip_grad_norm_ would compute if the rows were ordinary parameters.
        offload = _as_offload_optimizer(optimizer)
        rows = self.row_grad_norm()
        total = torch.linalg.vector_norm(torch.stack([offload.grad_norm().float().cpu(), rows]))
        coef = float(torch.clamp(clip_val / (total + 1e-6), max=1.0))
        offload.set_clip_coefficient(coef, total)
        self._row_clip = ("norm", coef)

    @override
    def _clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        super()._clip_grad_by_value(optimizer, clip_val)
        self._row_clip = ("value", float(clip_val))

    def adapter_device_bytes(self) -> int:
        """Bytes the adapters hold on the device: routers and bf16 routing keys (host rows excluded)."""
        total = 0
        for adapter in self.adapters:
            for t in [*adapter.parameters(), *adapter.buffers()]:
                if t.device.type == self.root_device.type:
                    total += t.numel() * t.element_size()
        return total

    def host_rows_bytes(self) -> int:
        """Bytes of the adapters' host rows: keys, values, their gradient accumulators and Adam moments."""
        # Two matrices (keys, values), each with a gradient accumulator and two Adam moments: 8 N×h fp32 arrays.
        return sum(8 * a.host.keys.numel() * a.host.keys.element_size() for a in self.adapters)

    def host_trainable_parameters(self) -> int:
        """Adapter keys and values: trained, but held on the host rather than as device parameters."""
        return sum(a.host.keys.numel() + a.host.values.numel() for a in self.adapters)

    def expert_usage(self) -> dict[str, float]:
        """Expert-usage statistics since the start of fit: normalised entropy (1 = uniform) and share unused."""
        if not self.adapters:
            return {}
        entropies, unused = [], []
        for adapter in self.adapters:
            counts = adapter.host.expert_counts.double()
            total = counts.sum()
            if total == 0:
                continue
            p = counts[counts > 0] / total
            entropies.append(float(-(p * p.log()).sum() / math.log(counts.numel())))
            unused.append(float((counts == 0).double().mean()))
        if not entropies:
            return {}
        return {"meft/expert_usage_entropy": sum(entropies) / len(entropies),
                "meft/experts_unused_share": sum(unused) / len(unused)}

    def offload_facts(self) -> OffloadFacts:
        """The dense offload's facts and the adapters' host rows (see strategies/report.py)."""
        return replace(
            super().offload_facts(),
            host_trainable_parameters=self.host_trainable_parameters(),
            host_rows_bytes=self.host_rows_bytes(),
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
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self.synchronize()  # the row Adam state must not be read while an update is running
        state = dict(super().optimizer_state(optimizer))
        # The adapter rows' Adam state rides along with the (single) optimizer's state, on the host.
        state[_STATE_KEY] = {"rows": [opt.state_dict() for opt in self.row_optimizers],
                             "skipped": self.skipped_row_steps}
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = [dict(s) for s in checkpoint["optimizer_states"]]
        rows = states[0].pop(_STATE_KEY, None) if states else None
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})
        if rows is None:
            raise ValueError("This checkpoint has no MEFT host state (it was not written by meft_offload).")
        if self.row_optimizers:
            self._load_row_state(rows)
        else:
            self._pending_state = rows

    # ------------------------------------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        # Stop the row worker without running queued updates (the process must be able to exit), and hand the
        # adapters back without waiting on it.
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
            for adapter in self.adapters:
                adapter.row_pipeline = None
                adapter.pending_update = None
            pipeline.close(timeout=5.0 if finish else 1.0)
            for adapter in self.adapters:
                # Handed back for plain backward, which adds to the accumulators as to `.grad`: rows holding a
                # consumed step's sum are zeroed, the sums of micro-batches not yet stepped are kept.
                host = adapter.host
                host.grad_keys[~host.written_keys] = 0
                host.grad_values[~host.written_values] = 0

    def _load_row_state(self, state: Mapping[str, Any]) -> None:
        self._wait_for_rows()
        if len(state["rows"]) != len(self.row_optimizers):
            raise ValueError(f"Checkpoint holds host state for {len(state['rows'])} MEFT adapters, the model has "
                             f"{len(self.row_optimizers)}.")
        for optimizer, rows in zip(self.row_optimizers, state["rows"]):
            optimizer.load_state_dict(rows)
        self.skipped_row_steps = int(state["skipped"])


def _clear_rows(adapter: MEFTAdapter, optimizer: BlockRowAdam, blocks: torch.Tensor) -> None:
    """Forget the gradients of ``blocks``: their rows are no longer touched or written, so the next step's first
    gradient overwrites them (a step consumed, or one not taken)."""
    host = adapter.host
    for start, end in optimizer.row_ranges(blocks):
        host.touched[start:end] = False
        host.written_keys[start:end] = False
        host.written_values[start:end] = False


@torch.no_grad()
def _update_rows(adapter: MEFTAdapter, optimizer: BlockRowAdam, blocks: torch.Tensor, settings: RowAdamSettings,
                 clip: Clip, finite: bool) -> None:
    """Host worker: one adapter's block Adam step, then the routing copy of the stepped keys is refreshed and the
    stepped rows' gradients forgotten (not zeroed: the next step's first gradient overwrites them)."""
    if finite:
        ranges = optimizer.step(blocks, [adapter.host.grad_keys, adapter.host.grad_values], settings, clip,
                                zero_grads=False)
        adapter.refresh_routing_keys(ranges)
    _clear_rows(adapter, optimizer, blocks)
