"""MEFT adapters: a wide key/value memory beside each FFN, kept on the host, of which each token reads ``top_k`` rows.

``out = FFN(h) + Σ_{i ∈ S(x)} g_{e(i)}(x) · ReLU(x·k_i) · v_i`` with ``x = (h − μ)/σ`` the FFN input standardised
(a per-layer mean and scale measured on the first batch), and ``S(x)`` the token's routed neuron set: the router
scores the ``E`` experts (contiguous groups of neurons); each sequence keeps the ``experts_per_sequence`` with the
highest mean router probability over its tokens (``expert_choice="sequence"``, which bounds the rows a batch touches
by its number of sequences; ``"token"`` lets every token choose among all ``E``, as the MEFT paper does); the token
keeps its ``experts_per_token`` best of those, their logits become a non-negative gate (a softmax, scaled to average
1), and the ``top_k`` neurons with the highest key score inside the kept experts are activated. ``V`` starts at zero,
so an injected model equals the base model.

Placement: the fp32 keys and values (and, in the strategy, their Adam state) live on the host. A forward gathers
only the union of the rows its tokens selected, sends them to the device as leaf tensors, and a gradient hook on
each leaf adds its gradient into host accumulators (row-indexed), so only touched rows ever cross the link, both ways.
Routing runs before the FFN, and the host gathers the selected rows on a fetch thread while the FFN computes.
"""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_offload.engine.row_blocks_slot import HostRowBlocks, RowBlocksSlot
from lightning_offload.engine.row_gradients import RowGradients
from lightning_offload.meft.config import MEFTConfig


@dataclass
class Routing:
    """Where each token goes: ``neurons [T, k]`` (global row ids), their gates ``[T, k]`` and ``valid [T]``."""

    neurons: torch.Tensor
    gates: torch.Tensor
    experts: torch.Tensor
    valid: torch.Tensor


def sequence_experts(router_logits: torch.Tensor, config: MEFTConfig, valid: torch.Tensor,
                     sequences: int) -> torch.Tensor:
    """``[B, P]``: the ``experts_per_sequence`` experts of each of the ``B`` sequences, by mean router probability
    over the sequence's real tokens (a sequence of padding only keeps the first experts: it routes nothing)."""
    with torch.no_grad():
        probabilities = torch.softmax(router_logits.detach().float(), dim=-1).view(sequences, -1, config.num_experts)
        weights = valid.view(sequences, -1, 1).to(probabilities.dtype)
        return (probabilities * weights).sum(dim=1).topk(config.experts_per_sequence, dim=-1).indices


def select_experts(router_logits: torch.Tensor, config: MEFTConfig, valid: torch.Tensor | None = None,
                   sequences: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``experts_per_token`` best experts ``[T, e]`` and their non-negative gates ``[T, e]``.

    With ``expert_choice="sequence"`` a token chooses among its sequence's experts (:func:`sequence_experts`; the
    ``T`` tokens are ``sequences`` equal runs), else among all ``E``. The gates are a softmax over the kept logits
    scaled by ``e``, so they average 1: with a uniform router each selected neuron contributes ``ReLU(x·k)·v``
    unscaled, as in the ungated adapter, and the gate only redistributes weight between a token's experts (a plain
    softmax would shrink every contribution, and with it the effective learning rate of the values, by ``e``).
    """
    if config.expert_choice == "sequence":
        tokens = router_logits.shape[0]
        if valid is None:
            valid = torch.ones(tokens, dtype=torch.bool, device=router_logits.device)
        allowed = sequence_experts(router_logits, config, valid, sequences)  # [B, P]
        per_token = allowed.repeat_interleave(tokens // sequences, dim=0)  # [T, P]
        top_logits, slot = router_logits.gather(1, per_token).topk(config.experts_per_token, dim=-1)
        experts = per_token.gather(1, slot)
    else:
        top_logits, experts = router_logits.topk(config.experts_per_token, dim=-1)
    gates = torch.softmax(top_logits.float(), dim=-1) * config.experts_per_token
    return experts, gates


def select_neurons(expert_scores: torch.Tensor, experts: torch.Tensor, expert_gates: torch.Tensor,
                   config: MEFTConfig, valid: torch.Tensor) -> Routing:
    """The ``top_k`` neurons of each token by key score, inside its kept experts.

    With ``config.gate_selection`` the key scores are multiplied by their expert's gate before the top-k (as the
    MEFT paper's code does), so the router steers which neurons fire, not only how much they count.

    Args:
        expert_scores: ``[T, e, N/E]`` key scores of the neurons of each token's kept experts (no gradient needed).
        experts, expert_gates: from :func:`select_experts`.
        config: the adapter settings.
        valid: ``[T]`` bool, False for padding; padded tokens get zero gates (and fetch nothing).
    """
    per_expert = config.neurons_per_expert
    ranked = expert_scores.float()
    if config.gate_selection:
        ranked = ranked * expert_gates.detach().float().unsqueeze(2)
    local = ranked.reshape(expert_scores.shape[0], -1).topk(config.top_k, dim=-1).indices
    slot = torch.div(local, per_expert, rounding_mode="floor")  # which of the token's kept experts
    neurons = experts.gather(1, slot) * per_expert + local % per_expert
    gates = expert_gates.gather(1, slot) * valid.unsqueeze(1).to(expert_gates.dtype)
    return Routing(neurons, gates, experts, valid)


def route(hidden: torch.Tensor, router_logits: torch.Tensor, key_scores: torch.Tensor, config: MEFTConfig,
          valid: torch.Tensor, sequences: int = 1) -> Routing:
    """Key-Experts routing of flattened tokens from the scores of *all* neurons (the reference form).

    Adapters score only the neurons of each token's kept experts (:meth:`MEFTAdapter.prefetch`), ``E/e`` times
    less work; both give the same routing.

    Args:
        hidden: ``[T, h]`` token states (only used for its shape and device).
        router_logits: ``[T, E]`` expert scores (differentiable: the gates carry the router's gradient).
        key_scores: ``[T, N]`` scores ``x·k_i`` of every neuron (no gradient needed: selection only).
        config: the adapter settings.
        valid: ``[T]`` bool, False for padding; padded tokens select nothing and get zero gates.
        sequences: how many equal runs of tokens the ``T`` are (``expert_choice="sequence"``).

    Returns:
        The selected neurons (exactly ``top_k`` per token, all within the token's ``experts_per_token`` experts),
        their gates, the selected experts and ``valid``.
    """
    experts, expert_gates = select_experts(router_logits, config, valid, sequences)
    blocks = key_scores.reshape(hidden.shape[0], config.num_experts, config.neurons_per_expert)
    expert_scores = blocks.gather(1, experts.unsqueeze(2).expand(-1, -1, config.neurons_per_expert))
    return select_neurons(expert_scores, experts, expert_gates, config, valid)


def expert_key_scores(x: torch.Tensor, experts: torch.Tensor, keys: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, e, N/E]`` scores of each token against the keys of its kept experts only.

    Tokens are grouped by expert so each expert's keys are read once, in one GEMM with the tokens that kept it:
    ``T·e·(N/E)·h`` multiply-adds instead of the ``T·N·h`` of scoring every key.

    Args:
        x: ``[T, h]`` adapter inputs, on the device of ``keys`` and in their dtype.
        experts: ``[T, e]`` kept experts per token.
        keys: ``[N, h]`` keys (device bf16 copy or host fp32).
        num_experts: ``E``.
    """
    tokens, kept = experts.shape
    blocks = keys.view(num_experts, -1, keys.shape[1])
    pairs = experts.reshape(-1).to(keys.device)
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=num_experts).tolist()
    owners = torch.div(order, kept, rounding_mode="floor")  # token of each (token, expert) pair, grouped by expert
    chunks, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            chunks.append(x.index_select(0, owners[start:start + count]) @ blocks[expert].T)
            start += count
    grouped = torch.cat(chunks) if chunks else x.new_zeros(0, blocks.shape[1])
    scores = torch.empty_like(grouped)
    scores[order] = grouped
    return scores.view(tokens, kept, -1)


@dataclass
class _Prefetch:
    """A routed batch whose rows are being gathered on the host fetch thread."""

    routing: Routing
    x: torch.Tensor  # [T, h] the adapter's (standardised) input
    rows: torch.Tensor  # sorted unique row ids (host)
    index: torch.Tensor  # [T, k] positions in ``rows``
    gathered: Future


_POOL: ThreadPoolExecutor | None = None


def _fetch_pool() -> ThreadPoolExecutor:
    # One host thread gathers rows for every adapter: gathers are memory-bound, more threads would only contend.
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meft-fetch")
    return _POOL


@dataclass
class RowTraffic:
    """Rows and bytes an adapter moved since the counters were last read."""

    rows: int = 0
    bytes_to_device: int = 0
    bytes_to_host: int = 0


@dataclass
class _HostRows:
    """The host side of one adapter: parameters, gradient accumulators and the set of rows touched.

    Without ``meft_offload`` the accumulators sum gradients like ``.grad`` (zero-initialised, added to). Under it, a
    row's accumulator holds this step's sum only where ``written_keys`` / ``written_values`` say so: the step's first
    gradient of a row is copied in rather than added, so no pass ever zeroes the rows a step consumed (see
    :meth:`summed_gradients`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    grad_keys: torch.Tensor
    grad_values: torch.Tensor
    touched: torch.Tensor  # bool [N]: rows fetched with gradients enabled since the last step
    written_keys: torch.Tensor  # bool [N]: rows of grad_keys holding this step's sum (under meft_offload)
    written_values: torch.Tensor  # bool [N]: likewise for grad_values
    traffic: RowTraffic = field(default_factory=RowTraffic)
    expert_counts: torch.Tensor | None = None

    def summed_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of this step's summed key and value gradients, zero in rows that received none."""
        return (self.grad_keys * self.written_keys.unsqueeze(1), self.grad_values * self.written_values.unsqueeze(1))


class MEFTAdapter(nn.Module):
    """The sparse adapter of one FFN. Trainable on the device: the router only; keys/values live on the host.

    :func:`inject_meft` builds one per FFN and puts it beside it; ``forward(hidden)`` returns the adapter's
    contribution, added to the FFN's output. The keys start random and the values at zero, so a new adapter adds
    exactly zero.

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
        self.host = _HostRows(keys, values, torch.zeros_like(keys), torch.zeros_like(values),
                              *(torch.zeros(config.num_neurons, dtype=torch.bool) for _ in range(3)),
                              expert_counts=torch.zeros(config.num_experts, dtype=torch.int64))
        # Device routing reads a bf16 copy of the keys; a buffer so `.to(device)` moves it, non-persistent because the
        # fp32 host keys are the truth (saved in the state dict by the hooks below).
        self.register_buffer("routing_keys", keys.to(torch.bfloat16) if config.routing == "device" else None,
                             persistent=False)
        # Standardisation of the adapter's input (see MEFTConfig.standardize_inputs): measured over the first batches,
        # then constants saved with the model so a resumed or evaluated model reads its input exactly as training did.
        # The running sums (fp64: token counts reach millions) are saved too, so a run resumed mid-calibration goes on.
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
        self.rows_slot: RowBlocksSlot | None = None

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
        # This batch's real tokens join the running sums; μ and σ are those of every calibration token so far
        # (σ² = Σ‖h‖²/(T·H) − ‖μ‖²/H). The first batch comes while V is still zero, the next few while it is small.
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

        The first ``calibration_batches`` calls calibrate ``μ``/``σ`` on their real tokens (``valid``) unless they
        were loaded.
        """
        if not self.config.standardize_inputs:
            return flat
        if not self._calibrated:
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
        self.wait_for_update()
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
        gathered = _fetch_pool().submit(self._gather, rows, pin, link_dtype(x))
        return _Prefetch(routing, x, rows, index, gathered)

    def _gather(self, rows: torch.Tensor, pin: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # On the fetch thread: copy the selected rows out of the host matrices, in the dtype they will be used in
        # (pinned, so a GPU copy is async).
        keys = self.host.keys.index_select(0, rows).to(dtype)
        values = self.host.values.index_select(0, rows).to(dtype)
        return (keys.pin_memory(), values.pin_memory()) if pin else (keys, values)

    def mix(self, hidden: torch.Tensor, fetch: _Prefetch) -> torch.Tensor:
        """The adapter's output from the prefetched rows (waits for the fetch thread; re-raises its errors)."""
        x = fetch.x
        keys, values = self._to_device(fetch.rows, *fetch.gathered.result(), x.device)
        # Scores against the fetched rows as one GEMM, then keep each token's own k: gathering k rows per token
        # instead would materialise (and save for backward) a [T, k, h] copy of the keys and of the values.
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
        h.traffic.rows += rows.numel()
        h.traffic.bytes_to_device += 2 * rows.numel() * self.hidden_size * keys.element_size()
        if torch.is_grad_enabled():
            keys.requires_grad_(True)
            values.requires_grad_(True)
            keys.register_hook(self._gradient_sink(rows, h.grad_keys, h.written_keys))
            values.register_hook(self._gradient_sink(rows, h.grad_values, h.written_values))
            h.touched[rows] = True
        return keys, values

    def wait_for_update(self) -> None:
        """Block until the host has finished this adapter's pending row update (no-op when none is pending)."""
        if self.rows_slot is not None:
            self.rows_slot.wait()

    def row_blocks(self, name: str, block_rows: int, key_lr_scale: float) -> HostRowBlocks:
        """The host rows as the offload engine steps them, under ``name``: keys and values, block by block (keys at
        ``key_lr_scale`` times the values' learning rate), the routing copy of stepped keys refreshed after each
        step."""
        h = self.host
        return HostRowBlocks(name, [h.keys, h.values],
                             [h.grad_keys, h.grad_values], [h.written_keys, h.written_values], h.touched, block_rows,
                             [key_lr_scale, 1.0], self.refresh_routing_keys)

    def _gradient_sink(self, rows: torch.Tensor, accumulator: torch.Tensor, written: torch.Tensor) -> Any:
        def sink(grad: torch.Tensor) -> None:
            # Row gradients are summed into the host accumulator (over micro-batches); nothing stays on the device.
            self.host.traffic.bytes_to_host += grad.numel() * grad.element_size()
            if self.row_pipeline is not None:
                self.row_pipeline.accumulate(rows, grad, accumulator, written)  # copied and added off the main thread
            else:
                accumulator.index_add_(0, rows, grad.detach().float().cpu())

        return sink

    # ------------------------------------------------------------------ state dict: host rows, saved on the host
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self.wait_for_update()  # never save rows the host is half-way through updating
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
        for start, end in ranges:
            # Narrowed to bf16 on the host, so the link carries 2 bytes per element.
            self.routing_keys[start:end] = self.host.keys[start:end].to(self.routing_keys.dtype).to(
                self.routing_keys.device)


def link_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype fetched rows cross the link in: autocast's compute dtype when it is on, else the input's.

    Under autocast the matmuls would cast fp32 rows to bf16 anyway, and their gradients come back as exactly those
    bf16 values: sending bf16 halves the bytes (and the device memory of the fetched rows) and changes no number.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class MEFTFFN(nn.Module):
    """An FFN with its MEFT adapter beside it: ``ffn(h) + adapter(h)``."""

    def __init__(self, ffn: nn.Module, adapter: MEFTAdapter) -> None:
        super().__init__()
        self.ffn = ffn
        self.adapter = adapter

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The FFN's output plus the adapter's."""
        fetch = self.adapter.prefetch(hidden)  # rows are gathered on the host while the FFN computes
        return self.ffn(hidden, *args, **kwargs) + self.adapter.mix(hidden, fetch)


def ffn_hidden_size(ffn: nn.Module) -> int:
    """The hidden size an FFN reads and writes (LLaMA and GPT-2 MLPs, or anything whose first Linear reads it)."""
    if hasattr(ffn, "hidden_size"):  # LlamaMLP
        return int(ffn.hidden_size)
    config = getattr(ffn, "config", None)
    if config is not None and hasattr(config, "hidden_size"):
        return int(config.hidden_size)
    first = next((m for m in ffn.modules() if isinstance(m, nn.Linear)), None)
    if first is not None:
        return first.in_features
    conv = next((m for m in ffn.modules() if type(m).__name__ == "Conv1D"), None)
    if conv is not None:
        return int(conv.weight.shape[0])  # HF Conv1D stores [in, out]
    raise TypeError(f"Cannot tell the hidden size of {type(ffn).__name__}; MEFT supports LLaMA and GPT-2 MLPs.")


def find_ffns(model: nn.Module, target_modules: str) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module whose name matches ``target_modules`` (``re.search``).

    Raises:
        ValueError: If nothing matches.
    """
    pattern = re.compile(target_modules)
    targets = [(name, module) for name, module in model.named_modules() if name and pattern.search(name)]
    if not targets:
        raise ValueError(f"target_modules={target_modules!r} matches no module of {type(model).__name__}; LLaMA "
                         f"and GPT-2 FFNs are named like 'model.layers.0.mlp'.")
    return targets


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Puts ``new`` where the submodule ``name`` was, on the device of the module it replaces."""
    param = next(model.get_submodule(name).parameters(), None)
    if param is not None:
        new.to(param.device)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def inject_meft(model: nn.Module, config: MEFTConfig) -> list[MEFTAdapter]:
    """Puts a MEFT adapter beside every FFN whose name matches ``config.target_modules``.

    The base model is frozen when ``config.freeze_base`` (the default); adapters' routers are the only new device
    parameters. A forward pre-hook on ``model`` hands its ``attention_mask`` to the adapters, so padding never
    routes. Returns the adapters in module order.

    Args:
        model: the base model (a Hugging Face LLaMA or GPT-2 model, or anything whose FFNs match); changed in place.
        config: the adapters' settings; ``MEFTConfig()`` for its defaults.

    Raises:
        ValueError: If no module matches, or the model already has adapters.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import MEFTConfig, inject_meft

        adapters = inject_meft(model, MEFTConfig(num_neurons=4096))  # one per FFN; the base is frozen
        trainer = pl.Trainer(strategy="meft_offload", precision="bf16-mixed")
        trainer.fit(module)  # a LightningModule around model; configure_optimizers: AdamW, as usual
    """
    if any(isinstance(m, MEFTFFN) for m in model.modules()):
        raise ValueError("This model already has MEFT adapters; inject_meft once per model.")
    targets = find_ffns(model, config.target_modules)
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    if config.freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
    generator = torch.Generator().manual_seed(config.seed)
    adapters = []
    for name, ffn in targets:
        adapter = MEFTAdapter(ffn_hidden_size(ffn), config, generator)
        replace_submodule(model, name, MEFTFFN(ffn, adapter))
        adapters.append(adapter)

    def hand_over_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        for adapter in adapters:
            adapter.attention_mask = mask if torch.is_tensor(mask) and mask.ndim == 2 else None

    hook = model.register_forward_pre_hook(hand_over_mask, with_kwargs=True)
    # What unload_meft (lightning_offload.meft.export) needs to give the base back exactly as it was.
    model.__dict__["_meft_injection"] = MEFTInjection(config, [name for name, _ in targets], hook, requires_grad,
                                                      model.__dict__.get("save_pretrained"))
    if callable(getattr(model, "save_pretrained", None)):
        model.__dict__["save_pretrained"] = _refuse_save_pretrained
    return adapters


@dataclass
class MEFTInjection:
    """What :func:`inject_meft` changed on a model, kept on it so the base can be given back exactly.

    Attributes:
        config: the adapters' settings.
        ffn_names: the qualified names of the FFNs that got an adapter.
        mask_hook: the forward pre-hook that hands the attention mask to the adapters.
        requires_grad: each base parameter's ``requires_grad`` before injection froze it.
        instance_save_pretrained: a ``save_pretrained`` the user had set on the instance (``None``: the class's).
    """

    config: MEFTConfig
    ffn_names: list[str]
    mask_hook: Any
    requires_grad: dict[str, bool]
    instance_save_pretrained: Any = None


def _refuse_save_pretrained(*args: Any, **kwargs: Any) -> None:
    raise ValueError(
        "This model has MEFT adapters beside its FFNs (their weights are saved under mlp.ffn.*), so the base class's "
        "from_pretrained would load random FFNs from it. Save the adapters on their own with "
        "lightning_offload.save_meft_adapters(model, 'adapters.pt') and the base with "
        "lightning_offload.unload_meft(model).save_pretrained(path); later, from_pretrained(path) and "
        "lightning_offload.load_meft_adapters(model, 'adapters.pt') give the trained model back.")


def meft_adapters(model: nn.Module) -> list[MEFTAdapter]:
    """The MEFT adapters of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MEFTAdapter)]
