"""A module's MEFT adapters with their host rows attached to an offload engine as row slots: attaching them, the
``meft/*`` figures of each step, the rows' state in checkpoints written before they were slots, and handing the
adapters back.

Any face of the engine (the ``meft_offload`` strategy, or a loop of one's own around an
:class:`~lightning_offload.engine.optimizer.OffloadOptimizer`) uses this object; it holds no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.engine.rows.host_row_blocks import RowBlocksStepping
from lightning_offload.engine.rows.row_adam_kernel import RowAdamSettings
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.meft.adapter import MEFTAdapter
from lightning_offload.meft.figures import row_figures
from lightning_offload.meft.injection import meft_adapters

@dataclass(frozen=True)
class AdapterRowSettings:
    """How the adapters' rows are stepped, beside the engine's settings (validated at construction).

    Attributes:
        lr: the rows' own learning rate. Default: ``None`` (the first param group's, following its scheduler).
        weight_decay: the rows' own decoupled weight decay. Default: ``None`` (the first param group's).
        key_lr_scale: the keys' learning rate relative to the values'. Default: ``1.0``.
        row_block: rows per block of the row Adam. Default: ``None`` (one expert's neurons).
    """

    lr: float | None = None
    weight_decay: float | None = None
    key_lr_scale: float = 1.0
    row_block: int | None = None

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"meft_offload lr={self.lr} must be positive (or None to follow the optimizer).")
        if not self.key_lr_scale > 0:
            raise ValueError(f"meft_offload key_lr_scale={self.key_lr_scale} must be positive (1.0: keys and values "
                             f"share the learning rate).")
        if self.row_block is not None and (not isinstance(self.row_block, int) or self.row_block < 1):
            raise ValueError(f"meft_offload row_block={self.row_block!r} must be a positive integer dividing the "
                             f"adapters' num_neurons (or None: one expert's neurons).")


class AttachedAdapters:
    """The adapters of a module, each one's keys and values a row slot of one offload engine.

    Args:
        adapters: the module's adapters.
        slots: their row slots, in the same order.
    """

    def __init__(self, adapters: list[MEFTAdapter], slots: list[RowBlocksStepping]) -> None:
        self.adapters = adapters
        self.slots = slots
        self.gradients: RowGradients | None = slots[0].gradients
        for adapter, slot in zip(adapters, slots):
            adapter.row_pipeline, adapter.rows_slot = self.gradients, slot
            adapter.host.before_read = slot.materialize

    @classmethod
    def attach(cls, module: torch.nn.Module, optimizer: OffloadOptimizer, settings: Callable[[], RowAdamSettings],
               rows: AdapterRowSettings, pin: bool) -> AttachedAdapters:
        """Attach every adapter of ``module`` to ``optimizer``.

        Args:
            module: the model holding the adapters (:func:`~lightning_offload.meft.injection.inject_meft`).
            optimizer: the engine that steps them with everything else.
            settings: the rows' hyper-parameters, read at each step.
            rows: their block size and the keys' learning-rate scale.
            pin: page-lock the host rows (a CUDA device on the other end of the link).

        Raises:
            ValueError: when ``module`` has no adapter, or ``row_block`` does not divide an adapter's neurons.
        """
        adapters = meft_adapters(module)
        if not adapters:
            raise ValueError("strategy 'meft_offload' found no MEFT adapter in the module. Call "
                             "lightning_offload.inject_meft(model, MEFTConfig(...)) on the model first.")
        names = {id(m): name for name, m in module.named_modules()}
        blocks = []
        for adapter in adapters:
            block = rows.row_block if rows.row_block is not None else adapter.config.neurons_per_expert
            if adapter.config.num_neurons % block:
                raise ValueError(f"meft_offload row_block={block} does not divide num_neurons="
                                 f"{adapter.config.num_neurons}; pick a divisor, e.g. the neurons of one expert "
                                 f"({adapter.config.neurons_per_expert}).")
            if pin:
                adapter.pin_host_memory()
            blocks.append(adapter.row_blocks(f"{names[id(adapter)]}.rows", block, float(rows.key_lr_scale)))
        return cls(adapters, optimizer.attach_row_blocks(blocks, settings))

    def step_figures(self, skipped_steps: int, device: torch.device) -> dict[str, float]:
        """The ``meft/*`` figures of the step just taken (the traffic counters are read and reset)."""
        assert self.gradients is not None, "the adapters were handed back"
        return row_figures(self.adapters, self.slots, self.gradients.take_busy_seconds(), skipped_steps, device)

    def release(self, finish: bool) -> None:
        """Hand the adapters back as plain modules (a later backward adds to their accumulators as to ``.grad``).

        Args:
            finish: wait for the queued row updates first (``False`` when unwinding an exception: the process must
                be able to exit).
        """
        gradients, self.gradients = self.gradients, None
        if gradients is None:
            return
        try:
            if finish:
                for slot in self.slots:
                    # After the slot's update: the sums of micro-batches not yet stepped, and the decay idle blocks
                    # owe paid for good (the rows handed back are AdamW's).
                    slot.keep_shown()
        finally:
            gradients.release()
            for adapter in self.adapters:
                adapter.row_pipeline, adapter.rows_slot, adapter.host.before_read = None, None, None
                # Rows holding a consumed step's sum are zeroed; the sums of micro-batches not yet stepped are kept.
                host = adapter.host
                host.grad_keys[~host.written_keys] = 0
                host.grad_values[~host.written_values] = 0
