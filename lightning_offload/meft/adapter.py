"""MEFT adapters: a wide key/value memory beside each FFN, kept on the host, of which each token reads ``top_k`` rows.

``out = FFN(h) + Σ_{i ∈ S(x)} g_{e(i)}(x) · ReLU(x·k_i) · v_i`` with ``x = (h − μ)/σ`` the standardised FFN input
and ``S(x)`` the token's routed neuron set: the router picks experts (contiguous groups of neurons) per sequence, then
per token, and the ``top_k`` neurons with the highest key score inside them are activated, gated
(:mod:`lightning_offload.meft.routing`). ``V`` starts at zero, so an injected model equals the base model.

The fp32 keys and values live on the host. A forward sends only the rows its tokens selected to the device, gathered
on a fetch thread while the FFN computes, and their gradients come back to host accumulators by hooks, so only
touched rows cross the link. :func:`~lightning_offload.meft.injection.inject_meft` puts the adapters in a model.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_offload.engine.rows.host_row_blocks import HostRowBlocks, RowBlocksStepping
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.meft.config import MEFTConfig
from lightning_offload.meft.host_rows import HostRows, fetch_pool
from lightning_offload.meft.routing import Routing, expert_key_scores, select_experts, select_neurons


@dataclass
class _Prefetch:
    """A routed batch whose rows are being gathered on the host fetch thread."""

    routing: Routing
    x: torch.Tensor  # [T, h] the adapter's (standardised) input
    rows: torch.Tensor  # sorted unique row ids (host)
    index: torch.Tensor  # [T, k] positions in ``rows``
    gathered: Future


class MEFTAdapter(nn.Module):
    """The sparse adapter of one FFN. Trainable on the device: the router only; keys/values live on the host.

    :func:`inject_meft` builds one per FFN; ``forward(hidden)`` returns the contribution added to the FFN's output.

    Args:
        hidden_size: ``h``, the size of the hidden states the FFN reads and writes.
        config: the adapter's shape and routing (:class:`~lightning_offload.meft.config.MEFTConfig`).
        generator: CPU generator of the key initialisation (``inject_meft`` seeds it with ``config.seed``).

    Example::

        adapter = MEFTAdapter(576, MEFTConfig(num_neurons=1024, num_experts=32), torch.Generator().manual_seed(0))
        out = adapter(torch.randn(2, 10, 576))  # (2, 10, 576); zero until the values have trained
        adapter.host.keys.shape  # (1024, 576), fp32 on the host; adapter.router is the device parameter
    """

    def __init__(self, hidden_size: int, config: MEFTConfig, generator: torch.Generator) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        std = config.key_init_std if config.key_init_std is not None else hidden_size**-0.5
        keys = torch.randn(config.num_neurons, hidden_size, generator=generator) * std
        values = torch.zeros(config.num_neurons, hidden_size)
        # The router starts at each expert's mean key, so expert and key scores agree before any training.
        self.router = nn.Linear(hidden_size, config.num_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(keys.view(config.num_experts, -1, hidden_size).mean(dim=1))
        self.host = HostRows.holding(keys, values, torch.zeros(config.num_experts, dtype=torch.int64))
        # Device routing's bf16 copy of the keys: a buffer to move with the module, not saved (the host keys are).
        self.register_buffer("routing_keys", keys.to(torch.bfloat16) if config.routing == "device" else None,
                             persistent=False)
        # Input standardisation (MEFTConfig.standardize_inputs), saved with the model, running sums (fp64) included,
        # so a resumed or evaluated model reads its input as training did.
        self.register_buffer("input_mean", torch.zeros(hidden_size))
        self.register_buffer("input_inv_scale", torch.ones(()))
        self.register_buffer("input_calibrated", torch.tensor(not config.standardize_inputs))
        self.register_buffer("input_sum", torch.zeros(hidden_size, dtype=torch.float64))
        self.register_buffer("input_square_sum", torch.zeros((), dtype=torch.float64))
        self.register_buffer("input_tokens", torch.zeros((), dtype=torch.float64))
        self.register_buffer("input_batches", torch.zeros((), dtype=torch.int64))
        # A host-side mirror of `input_calibrated`: reading the buffer on a GPU would synchronise every forward.
        self._calibrated = not config.standardize_inputs
        self.attention_mask: torch.Tensor | None = None  # set per forward by the model's pre-hook (padding)
        # Set by meft_offload: gradients land through the offload engine's worker, and the forward waits for this
        # adapter's row step there (its slot). Without them (plain backward) gradients are added right in the hook.
        self.row_pipeline: RowGradients | None = None
        self.rows_slot: RowBlocksStepping | None = None
        # The engine's rows per block, and the routing copy's and host keys' blocks as views (see _routing_views).
        self._row_block: int | None = None
        self._block_views: tuple[Any, ...] | None = None

    def pin_host_memory(self) -> None:
        """Page-locks the host rows so gathers can be copied to a GPU asynchronously."""
        h = self.host
        h.keys, h.values = h.keys.pin_memory(), h.values.pin_memory()

    # ------------------------------------------------------------------ forward
    def _valid_tokens(self, tokens: int, device: torch.device) -> torch.Tensor:
        mask = self.attention_mask
        if mask is not None and mask.numel() == tokens:
            return mask.reshape(-1).to(device=device, dtype=torch.bool)
        return torch.ones(tokens, dtype=torch.bool, device=device)

    @torch.no_grad()
    def _calibrate(self, flat: torch.Tensor, valid: torch.Tensor) -> None:
        # μ and σ of every calibration token so far (σ² = Σ‖h‖²/(T·H) − ‖μ‖²/H).
        tokens = (flat[valid] if valid.any() else flat).double()
        self.input_sum.add_(tokens.sum(dim=0))
        self.input_square_sum.add_(tokens.pow(2).sum())
        self.input_tokens.add_(tokens.shape[0])
        self.input_batches.add_(1)
        mean = self.input_sum / self.input_tokens
        variance = (self.input_square_sum / self.input_tokens - mean.pow(2).sum()) / mean.numel()
        self.input_mean.copy_(mean)
        self.input_inv_scale.copy_(1.0 / variance.clamp_min(1e-12).sqrt())
        if int(self.input_batches) >= self.config.calibration_batches:
            self.input_calibrated.fill_(True)
            self._calibrated = True

    def adapter_input(self, flat: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """``x = (h − μ)/σ`` for flattened states ``[T, h]`` (``h`` itself when ``standardize_inputs`` is off).

        The first ``calibration_batches`` training-mode calls calibrate ``μ``/``σ`` on their real tokens (``valid``)
        unless loaded; eval mode adds nothing, so the run does not depend on when anything was evaluated.
        """
        if not self.config.standardize_inputs:
            return flat
        if not self._calibrated and self.training:
            self._calibrate(flat, valid if valid is not None else torch.ones(flat.shape[0], dtype=torch.bool,
                                                                             device=flat.device))
        return (flat - self.input_mean.to(flat.dtype)) * self.input_inv_scale.to(flat.dtype)

    def _key_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, N]`` scores of every neuron (the reference form; the forward scores only the kept experts)."""
        with torch.no_grad():
            if self.routing_keys is not None:
                return x.to(self.routing_keys.dtype) @ self.routing_keys.T
            return (x.detach().float().cpu() @ self.host.keys.T).to(x.device)

    def _expert_key_scores(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.routing_keys is not None:
                return expert_key_scores(x.to(self.routing_keys.dtype), experts, self.routing_keys,
                                         self.config.num_experts)
            # Host routing: the fp32 host keys, no key memory on the device; only [T, e, N/E] scores come back.
            scores = expert_key_scores(x.detach().float().cpu(), experts.cpu(), self.host.keys,
                                       self.config.num_experts)
            return scores.to(x.device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution for ``hidden [..., h]`` (same shape)."""
        return self.mix(hidden, self.prefetch(hidden))

    def prefetch(self, hidden: torch.Tensor) -> _Prefetch:
        """Routes the tokens now and starts gathering their rows on the host fetch thread.

        :class:`MEFTFFN` calls this before running the FFN, so the host gather (and, on a GPU, the pinned staging)
        overlaps the FFN's compute; :meth:`mix` then waits for the rows.
        """
        self.wait_for_update(reading=not torch.is_grad_enabled())
        flat = hidden.reshape(-1, self.hidden_size)
        valid = self._valid_tokens(flat.shape[0], flat.device)
        x = self.adapter_input(flat, valid)
        sequences = hidden.shape[0] if hidden.ndim == 3 else 1  # [B, S, h]; flat tokens form one sequence
        experts, expert_gates = select_experts(self.router(x), self.config, valid, sequences)
        routing = select_neurons(self._expert_key_scores(x, experts), experts, expert_gates, self.config, valid)
        with torch.no_grad():
            self.host.expert_counts += torch.bincount(routing.experts[valid].reshape(-1).cpu(),
                                                      minlength=self.config.num_experts)
        rows, local = torch.unique(routing.neurons[valid], return_inverse=True)
        index = torch.zeros_like(routing.neurons)
        index[valid] = local
        rows = rows.cpu()
        pin = flat.device.type == "cuda"
        gathered = fetch_pool().submit(self._gather, rows, pin, link_dtype(x))
        return _Prefetch(routing, x, rows, index, gathered)

    def _gather(self, rows: torch.Tensor, pin: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # On the fetch thread, in the dtype they will be used in; pinned, so the GPU copy is async.
        keys = self.host.keys.index_select(0, rows).to(dtype)
        values = self.host.values.index_select(0, rows).to(dtype)
        return (keys.pin_memory(), values.pin_memory()) if pin else (keys, values)

    def mix(self, hidden: torch.Tensor, fetch: _Prefetch) -> torch.Tensor:
        """The adapter's output from the prefetched rows (waits for the fetch thread; re-raises its errors)."""
        x = fetch.x
        keys, values = self._to_device(fetch.rows, *fetch.gathered.result(), x.device)
        # One GEMM against the fetched rows, then each token's own k: avoids saving [T, k, h] copies for backward.
        scores = (x @ keys.T).gather(1, fetch.index)  # [T, k]
        activation = torch.relu(scores) * fetch.routing.gates.to(scores.dtype)
        mixing = torch.zeros(x.shape[0], fetch.rows.numel(), dtype=activation.dtype, device=x.device)
        out = mixing.scatter(1, fetch.index, activation) @ values  # padded tokens have zero gates: they add nothing
        return out.reshape(hidden.shape)

    def _to_device(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.host
        pinned = device.type == "cuda"
        keys = keys.to(device, non_blocking=pinned)
        values = values.to(device, non_blocking=pinned)
        if self.training:  # an evaluation's fetches are not a training step's traffic (the meft/* figures)
            h.traffic.rows += rows.numel()
            h.traffic.bytes_to_device += 2 * rows.numel() * self.hidden_size * keys.element_size()
        if torch.is_grad_enabled():
            keys.requires_grad_(True)
            values.requires_grad_(True)
            keys.register_hook(self._gradient_sink(rows, h.grad_keys, h.written_keys))
            values.register_hook(self._gradient_sink(rows, h.grad_values, h.written_values))
            h.touched[rows] = True
        return keys, values

    def wait_for_update(self, reading: bool | None = None) -> None:
        """Block until the host has finished this adapter's pending row update, if any; ``reading=True`` (a read, an
        evaluation) also shows the decay idle blocks owe (:meth:`RowBlocksStepping.ready`)."""
        if self.rows_slot is not None and reading is None:
            self.rows_slot.wait()
        elif self.rows_slot is not None:
            self.rows_slot.ready(training=not reading)

    def row_blocks(self, name: str, block_rows: int, key_lr_scale: float) -> HostRowBlocks:
        """The host rows as the offload engine steps them, under ``name`` (keys at ``key_lr_scale`` times the values'
        learning rate), the routing copy of stepped keys refreshed after each step."""
        h = self.host
        self._row_block = block_rows
        return HostRowBlocks(name, [h.keys, h.values],
                             [h.grad_keys, h.grad_values], [h.written_keys, h.written_values], h.touched, block_rows,
                             [key_lr_scale, 1.0], self.refresh_routing_keys, self._host_routing_keys)

    def _host_routing_keys(self) -> torch.Tensor | None:
        """The routing copy of the keys when it lies on the host (a CPU device): the row step may rewrite the stepped
        rows of it as it steps them, rounded to bf16 as a copy into it rounds them."""
        keys = self.routing_keys
        return keys if keys is not None and keys.device.type == "cpu" else None

    def _gradient_sink(self, rows: torch.Tensor, accumulator: torch.Tensor, written: torch.Tensor) -> Any:
        def sink(grad: torch.Tensor) -> None:
            # Row gradients are summed into the host accumulator (over micro-batches); nothing stays on the device.
            self.host.traffic.bytes_to_host += grad.numel() * grad.element_size()
            if self.row_pipeline is not None:
                self.row_pipeline.accumulate(rows, grad, accumulator, written)  # copied and added off the main thread
            else:
                accumulator.index_add_(0, rows, grad.detach().float().cpu())

        return sink

    # ------------------------------------------------------------------ copies: deepcopy, AveragedModel, torch.save
    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, AveragedModel, ``torch.save``) is a plain adapter: its rows as a read shows them, fresh
        gradient accumulators, and no engine behind it."""
        self.wait_for_update(reading=True)
        state = self.__dict__.copy()
        rows = self.host
        state["host"] = HostRows.holding(rows.keys.clone(), rows.values.clone(),
                                         None if rows.expert_counts is None else rows.expert_counts.clone())
        state.update(row_pipeline=None, rows_slot=None, _row_block=None, _block_views=None, attention_mask=None)
        return state

    # ------------------------------------------------------------------ state dict: host rows, saved on the host
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self.wait_for_update(reading=True)  # never save rows half-way through an update, or owing decay unshown
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "keys"] = self.host.keys
        destination[prefix + "values"] = self.host.values

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        self.wait_for_update()  # an update still running would overwrite the loaded rows
        for name in ("keys", "values"):
            key = prefix + name
            if key in state_dict:
                getattr(self.host, name).copy_(state_dict[key])
            elif strict:
                missing_keys.append(key)
        if self.rows_slot is not None:
            self.rows_slot.adopted_rows()  # the loaded rows owe no decay of earlier steps
        self.refresh_routing_keys()
        super()._load_from_state_dict({k: v for k, v in state_dict.items() if k not in (prefix + "keys",
                                                                                         prefix + "values")},
                                      prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self._calibrated = bool(self.input_calibrated)  # once per load, not per forward

    @torch.no_grad()
    def refresh_routing_keys(self, ranges: list[tuple[int, int]] | None = None) -> None:
        """Copies updated host keys (all, or the ``[start, end)`` row ranges given) into the device routing copy."""
        if self.routing_keys is None:
            return
        if ranges is None:
            ranges = [(0, self.config.num_neurons)]
        if self.routing_keys.device.type == "cpu":  # one op for every range, each rounded to bf16 as it is copied
            torch._foreach_copy_(*self._routing_views(ranges))
            return
        for start, end in ranges:  # narrowed to bf16 on the host, so the link carries 2 bytes per element
            self.routing_keys[start:end] = self.host.keys[start:end].to(self.routing_keys.dtype).to(
                self.routing_keys.device)

    def _routing_views(self, ranges: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The routing copy's and the host keys' rows of ``ranges``: views of whole row blocks (made once per key
        tensor, a step then slices nothing) when every range is made of the blocks the engine steps, else slices."""
        block = self._row_block
        if block is None or any(start % block or end % block for start, end in ranges):
            return ([self.routing_keys[start:end] for start, end in ranges],
                    [self.host.keys[start:end] for start, end in ranges])
        if self._block_views is None or self._block_views[0] is not self.routing_keys \
                or self._block_views[1] is not self.host.keys:
            blocks = self.config.num_neurons // block
            self._block_views = (self.routing_keys, self.host.keys,
                                 self.routing_keys.view(blocks, block, -1).unbind(0),
                                 self.host.keys.view(blocks, block, -1).unbind(0))
        _, _, routing, keys = self._block_views
        stepped = [b for start, end in ranges for b in range(start // block, end // block)]
        return [routing[b] for b in stepped], [keys[b] for b in stepped]


def link_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype fetched rows cross the link in: autocast's compute dtype when it is on, else the input's.

    Under autocast the matmuls would cast fp32 rows to bf16 anyway, so sending bf16 halves the bytes at no cost.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
