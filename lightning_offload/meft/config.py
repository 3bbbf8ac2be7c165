"""MEFTConfig: the shape and routing of the sparse adapters ``inject_meft`` puts beside each FFN."""

from __future__ import annotations

import re
from dataclasses import dataclass

ROUTING_PLACES = ("device", "host")


@dataclass
class MEFTConfig:
    """Settings of MEFT adapters.

    Attributes:
        num_neurons: Adapter width ``N`` per FFN (rows of the key and value matrices).
        top_k: Neurons activated per token.
        num_experts: ``E`` contiguous groups of ``N/E`` neurons; the router scores groups.
        experts_per_token: Groups kept per token; the ``top_k`` neurons are chosen inside them.
        target_modules: Regular expression matched (``re.search``) against module names; every match is an FFN
            to put an adapter beside (default: the ``mlp`` of each LLaMA / GPT-2 block).
        freeze_base: Freeze every pre-existing parameter, so only adapters (and their routers) train.
        routing: ``"device"``: key scores from a bf16 copy of the keys on the device (fast, ``N·h·2`` bytes per
            layer); ``"host"``: scores computed on the host from the fp32 keys (no key memory on the device).
        standardize_inputs: The adapter reads ``x = (h − μ)/σ`` instead of the FFN input ``h``: ``μ`` (per feature)
            and ``σ`` (one scale) are measured on the real tokens of the first batch the adapter sees, while its
            values are still zero, then kept fixed and saved with the model. Hidden states share a large common
            direction (about half their norm in SmolLM2), so raw key scores rank the same few neurons first for
            every token and the adapter's capacity collapses onto them; centring spreads the routing over the
            neurons, and the scale puts key scores at O(1) in every layer.
        key_init_std: Standard deviation of the initial keys (default ``1/√h``); values start at zero, so an
            injected model computes exactly what the base model computes.
        seed: Seed of the key initialisation.
    """

    num_neurons: int = 16384
    top_k: int = 16
    num_experts: int = 128
    experts_per_token: int = 8
    target_modules: str = r"(^|\.)mlp$"
    freeze_base: bool = True
    routing: str = "device"
    standardize_inputs: bool = True
    key_init_std: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_neurons", "top_k", "num_experts", "experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MEFTConfig.{name}={value!r} must be a positive integer.")
        if self.num_neurons % self.num_experts:
            raise ValueError(f"MEFTConfig.num_neurons={self.num_neurons} must be a multiple of "
                             f"num_experts={self.num_experts} (experts are equal groups of neurons).")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"MEFTConfig.experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}.")
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
