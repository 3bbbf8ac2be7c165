"""``meft_offload``: trains MEFT adapters whose keys, values and Adam state live on the host.

The adapters (see :mod:`lightning_offload.meft.adapter`) fetch the rows their tokens route to and send those rows'
gradients back into host accumulators during backward. At the optimizer step this strategy runs a row-sparse Adam
on the host over exactly the rows touched since the last step (the union over the accumulated micro-batches), then
refreshes the device's bf16 routing copy of those keys. Every other trainable parameter (the routers, anything the
user left unfrozen) is stepped by the ``zero_offload`` machinery this strategy inherits: dense host Adam, nothing on
the device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_offload.meft.adapter import MEFTAdapter, meft_adapters
from lightning_offload.meft.lazy_adam import LazyAdamSettings, LazyRowAdam
from lightning_offload.strategy import LSPOffloadStrategy

_STATE_KEY = "meft_host_rows"


class MEFTOffloadStrategy(LSPOffloadStrategy):
    """Single-device training of MEFT adapters with their rows and Adam state on the host.

    Args:
        device: the training device (``None``: CUDA when present, else CPU).
        lr: learning rate of the adapter rows (``None``: the first param group's, following its scheduler).
        weight_decay: decoupled weight decay of the adapter rows (``None``: the first param group's).
        seed, on_nonfinite, log_telemetry, pipelined, link_dtype: as for ``zero_offload`` (they apply to the
            dense parameters: routers and anything else left trainable).
    """

    strategy_name = "meft_offload"

    def __init__(self, device: torch.device | str | None = None, *, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any) -> None:
        kwargs["projection"] = False
        super().__init__(device, **kwargs)
        if lr is not None and not lr > 0:
            raise ValueError(f"meft_offload lr={lr} must be positive (or None to follow the optimizer).")
        self.lr = lr
        self.weight_decay = weight_decay
        self.adapters: list[MEFTAdapter] = []
        self.row_optimizers: list[LazyRowAdam] = []
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
        if self.root_device.type == "cuda":
            for adapter in self.adapters:
                adapter.pin_host_memory()
        self.row_optimizers = [LazyRowAdam([a.host.keys, a.host.values]) for a in self.adapters]
        if self._pending_state is not None:
            self._load_row_state(self._pending_state)
            self._pending_state = None

    # ---------------------------------------------------------------------------------------------- training
    def _settings(self) -> LazyAdamSettings:
        group = self.optimizers[0].param_groups[0]
        return LazyAdamSettings(
            lr=self.lr if self.lr is not None else float(group["lr"]),
            betas=tuple(group.get("betas", (0.9, 0.999))),
            eps=float(group.get("eps", 1e-8)),
            weight_decay=self.weight_decay if self.weight_decay is not None else float(group.get("weight_decay", 0)),
        )

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.step_rows()
        if self.log_telemetry and self.lightning_module is not None and self.lightning_module._trainer is not None:
            self.lightning_module.log_dict(self._last_metrics, on_step=True, on_epoch=False, batch_size=1)
        return output

    @torch.no_grad()
    def step_rows(self) -> None:
        """Lazy Adam on every adapter's touched rows, then clears the accumulators (public for manual loops)."""
        settings = self._settings()
        start = time.perf_counter()
        rows_moved = bytes_to_device = bytes_to_host = touched_total = 0
        finite = all(torch.isfinite(a.host.grad_keys[a.host.touched]).all()
                     and torch.isfinite(a.host.grad_values[a.host.touched]).all() for a in self.adapters)
        if not finite:
            self.skipped_row_steps += 1
            if self.on_nonfinite == "raise":
                from lightning_offload.offload_optimizer import NonFiniteGradientError

                raise NonFiniteGradientError("A MEFT adapter row received an inf/nan gradient.")
        for adapter, optimizer in zip(self.adapters, self.row_optimizers):
            host = adapter.host
            rows = host.touched.nonzero().squeeze(1)
            if finite and rows.numel():
                optimizer.step(rows, [host.grad_keys[rows], host.grad_values[rows]], settings)
                adapter.refresh_routing_keys(rows)
            host.grad_keys[rows] = 0
            host.grad_values[rows] = 0
            host.touched[rows] = False
            touched_total += rows.numel()
            rows_moved += host.traffic.rows
            bytes_to_device += host.traffic.bytes_to_device
            bytes_to_host += host.traffic.bytes_to_host
            host.traffic.rows = host.traffic.bytes_to_device = host.traffic.bytes_to_host = 0
        self._last_metrics = {
            "meft/rows_moved": float(rows_moved),
            "meft/rows_updated": float(touched_total),
            "meft/bytes_host_to_device": float(bytes_to_device),
            "meft/bytes_device_to_host": float(bytes_to_host),
            "meft/host_optimizer_seconds": time.perf_counter() - start,
            "meft/adapter_device_bytes": float(self.adapter_device_bytes()),
            "meft/skipped_steps": float(self.skipped_row_steps),
            **self.expert_usage(),
        }

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

    @property
    def last_metrics(self) -> dict[str, float]:
        """The figures of the latest step (rows and bytes moved, host time, device bytes, expert usage)."""
        return dict(self._last_metrics)

    # -------------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
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

    def _load_row_state(self, state: Mapping[str, Any]) -> None:
        if len(state["rows"]) != len(self.row_optimizers):
            raise ValueError(f"Checkpoint holds host state for {len(state['rows'])} MEFT adapters, the model has "
                             f"{len(self.row_optimizers)}.")
        for optimizer, rows in zip(self.row_optimizers, state["rows"]):
            optimizer.load_state_dict(rows)
        self.skipped_row_steps = int(state["skipped"])
