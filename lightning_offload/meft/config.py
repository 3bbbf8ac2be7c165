"""MEFTConfig: the shape and routing of the sparse adapters ``inject_meft`` puts beside each FFN."""

from __future__ import annotations

import re
from dataclasses import dataclass

ROUTING_PLACES = ("device", "host")
EXPERT_CHOICES = ("sequence", "token")


@dataclass
class MEFTConfig:
    """Settings of MEFT adapters.

    Attributes:
        num_neurons: Adapter width ``N`` per FFN (rows of the key and value matrices); a multiple of
            ``num_experts``. Default: ``16384``.
        top_k: Neurons activated per token. Default: ``16``.
        num_experts: ``E`` contiguous groups of ``N/E`` neurons; the router scores groups. Default: ``128``.
        expert_choice: ``"sequence"``: each sequence keeps the ``experts_per_sequence`` experts with the highest mean
            router probability over its tokens, and each token keeps ``experts_per_token`` of those; so a step
            touches at most ``sequences × experts_per_sequence × N/E`` rows per adapter, whatever the sequence
            length. ``"token"``: the MEFT paper's Key-Experts routing, each token keeps its own best experts (the
            rows touched grow with the tokens: ``≈ N(1 − e^(−T·top_k/N))``, nearly all rows for long batches).
            Default: ``"sequence"``.
        experts_per_sequence: Experts a sequence keeps (``expert_choice="sequence"``). Default: ``4``.
        experts_per_token: Experts kept per token (among its sequence's, in sequence mode); the ``top_k`` neurons
            are chosen inside them. Default: ``4``.
        gate_selection: rank a token's candidate neurons by key score times their expert's gate (the MEFT paper's
            code: the router steers the choice) rather than by key score alone (off by default: its effect on
            quality is not measured yet). Default: ``False``.
        target_modules: Regular expression matched (``re.search``) against module names; every match is an FFN
            to put an adapter beside: a module its parent calls, with hidden states in and out (one a module above
            reads instead of calling, ``nn.TransformerEncoderLayer``'s ``linear2``, is refused by ``inject_meft``).
            Default: ``r"(^|\\.)mlp$"`` (the ``mlp`` of each LLaMA / GPT-2 block).
        freeze_base: Freeze every pre-existing parameter, so only adapters (and their routers) train.
            Default: ``True``.
        routing: ``"device"``: key scores from a bf16 copy of the keys on the device (fast, ``N·h·2`` bytes per
            layer); ``"host"``: scores computed on the host from the fp32 keys (no key memory on the device).
            Default: ``"device"``.
        standardize_inputs: The adapter reads ``x = (h − μ)/σ`` instead of the FFN input ``h``: ``μ`` (per feature)
            and ``σ`` (one scale) are measured on the real tokens of the first ``calibration_batches`` batches the
            adapter sees (a running estimate over them, exact from the first batch on, while its values are still
            near zero), then kept fixed and saved with the model. Hidden states share a large common
            direction (about half their norm in SmolLM2), so raw key scores rank the same few neurons first for
            every token and the adapter's capacity collapses onto them; centring spreads the routing over the
            neurons, and the scale puts key scores at O(1) in every layer. Default: ``True``.
        calibration_batches: Batches the standardisation is measured over (1: the first batch alone).
            Default: ``4``.
        key_init_std: Standard deviation of the initial keys; values start at zero, so an injected model computes
            exactly what the base model computes. Default: ``None`` (``1/√h``, ``h`` the FFN's hidden size).
        seed: Seed of the key initialisation. Default: ``0``.

    Example::

        from lightning_offload import MEFTConfig, inject_meft

        config = MEFTConfig(num_neurons=4096, top_k=16, num_experts=64, routing="host")
        adapters = inject_meft(model, config)  # one adapter beside each matching FFN; base frozen
        print(config.neurons_per_expert, config.row_bound(sequences=4, tokens=2048))  # 64 1024
    """

    num_neurons: int = 16384
    top_k: int = 16
    num_experts: int = 128
    expert_choice: str = "sequence"
    experts_per_sequence: int = 4
    experts_per_token: int = 4
    gate_selection: bool = False
    target_modules: str = r"(^|\.)mlp$"
    freeze_base: bool = True
    routing: str = "device"
    standardize_inputs: bool = True
    calibration_batches: int = 4
    key_init_std: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_neurons", "top_k", "num_experts", "experts_per_sequence", "experts_per_token",
                     "calibration_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MEFTConfig.{name}={value!r} must be a positive integer.")
        if self.num_neurons % self.num_experts:
            raise ValueError(f"MEFTConfig.num_neurons={self.num_neurons} must be a multiple of "
                             f"num_experts={self.num_experts} (experts are equal groups of neurons).")
        if self.expert_choice not in EXPERT_CHOICES:
            raise ValueError(f"MEFTConfig.expert_choice={self.expert_choice!r} is not one of {EXPERT_CHOICES}.")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"MEFTConfig.experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}.")
        if self.expert_choice == "sequence" and not (
                self.experts_per_token <= self.experts_per_sequence <= self.num_experts):
            raise ValueError(f"MEFTConfig needs experts_per_token ≤ experts_per_sequence ≤ num_experts with "
                             f"expert_choice='sequence' (a token picks among its sequence's experts); got "
                             f"{self.experts_per_token}, {self.experts_per_sequence}, {self.num_experts}.")
        if self.top_k > self.experts_per_token * self.neurons_per_expert:
            raise ValueError(f"MEFTConfig.top_k={self.top_k} exceeds the {self.experts_per_token} × "
                             f"{self.neurons_per_expert} neurons of the experts a token selects; lower top_k or "
                             f"raise experts_per_token.")
        if self.routing not in ROUTING_PLACES:
            raise ValueError(f"MEFTConfig.routing={self.routing!r} is not one of {ROUTING_PLACES}.")
        try:
            re.compile(self.target_modules)
        except re.error as error:
            raise ValueError(f"MEFTConfig.target_modules={self.target_modules!r} is not a regular expression: "
                             f"{error}.") from error

    @property
    def neurons_per_expert(self) -> int:
        """``N / E``."""
        return self.num_neurons // self.num_experts

    def row_bound(self, sequences: int, tokens: int) -> int:
        """The most rows of one adapter a batch of ``sequences`` sequences and ``tokens`` tokens can touch."""
        by_tokens = tokens * self.top_k
        if self.expert_choice == "sequence":
            by_tokens = min(by_tokens, sequences * self.experts_per_sequence * self.neurons_per_expert)
        return min(by_tokens, self.num_neurons)
