"""MEFT's routing: which experts each sequence and token keeps, and which ``top_k`` neurons inside them each token
activates (the math only; :class:`~lightning_offload.meft.adapter.MEFTAdapter` runs it in its forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
