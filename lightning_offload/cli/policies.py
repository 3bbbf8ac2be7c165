"""Offload policies: what the Hydra ``offload`` group chooses — the strategy, and what trains the large layers.

A policy bundles the three things that differ between the methods compared side by side (docs/cli.md, "The methods
compared"):

- the Lightning strategy (``lsp_offload``, ``zero_offload`` or Lightning's own ``"auto"`` for on-device AdamW);
- the *method* applied to the projectable layers: ``full`` (train them, however the strategy does it), ``frozen``,
  ``lora`` (``peft`` adapters), ``galore`` (``galore-torch``'s low-rank-gradient AdamW) or ``meft`` (wide sparse
  adapters beside each FFN, base frozen, trained by ``meft_offload``) or ``adapter`` (a dense parallel adapter beside
  each FFN, base frozen, on the device);
- the ``ProjectorRefit`` settings used when the strategy learns its projectors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_offload.cli.baselines import (
    add_lora,
    add_parallel_adapters,
    freeze_projectable,
    galore_optimizer,
    layer_param_groups,
)
from lightning_offload.faces.trainer.meft import MEFTOffloadStrategy
from lightning_offload.faces.trainer.offload import LSPOffloadStrategy
from lightning_offload.meft.config import MEFTConfig
from lightning_offload.meft.injection import inject_meft

log = logging.getLogger(__name__)

METHODS = ("full", "frozen", "lora", "galore", "meft", "adapter")


@dataclass
class OffloadPolicy:
    """One row of a side-by-side comparison.

    Attributes:
        name: Short label used in run names, logs and plots (``lsp``, ``zero``, ``none``, ``galore``, ``lora``).
        strategy: A strategy instance or a registered name (``"auto"``: Lightning's single-device strategy).
        method: ``full``, ``frozen``, ``lora`` or ``galore`` (see the module docstring).
        projected_lr: Learning rate of the projectable layers (and LoRA adapters); ``None``: the run's lr.
        lora_rank: LoRA rank.
        lora_alpha: LoRA scaling numerator (``None``: ``2·rank``).
        lora_train_others: With LoRA, keep training embeddings, norms and head (``False``: adapters only).
        galore_rank: GaLore rank.
        galore_scale: GaLore update scale.
        galore_update_proj_gap: Steps between GaLore's projection refreshes.
        fused_adam: Use torch's fused AdamW for on-device optimizers (the fastest CPU kernel).
        adapter_width: Neurons of each dense parallel adapter (``method="adapter"``).
        meft: The :class:`~lightning_offload.meft.config.MEFTConfig` of ``method="meft"``.
        refit: The ``ProjectorRefit`` callback to use when the strategy's projectors are learned (``None``: the
            strategy adds one with the default schedule); ignored otherwise.
    """

    name: str
    strategy: Any = "auto"
    method: str = "full"
    projected_lr: float | None = None
    lora_rank: int = 12
    lora_alpha: float | None = None
    lora_train_others: bool = True
    galore_rank: int = 36
    galore_scale: float = 0.25
    galore_update_proj_gap: int = 200
    fused_adam: bool = True
    adapter_width: int = 512
    meft: MEFTConfig | None = None
    refit: pl.Callback | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"offload.method={self.method!r} is not one of {METHODS}.")
        if self.method in ("lora", "galore") and self._projects:
            raise ValueError(f"offload.method={self.method!r} trains the projectable layers itself; combine it with "
                             f"offload.strategy=auto or zero_offload, not a projecting lsp_offload strategy.")
        if self.method == "meft" and not isinstance(self.strategy, MEFTOffloadStrategy):
            raise ValueError("offload.method='meft' keeps the adapter rows on the host and needs "
                             "offload.strategy=meft_offload (offload=meft configures both).")
        if self.method == "meft" and self.meft is None:
            self.meft = MEFTConfig()
        for key in ("lora_rank", "galore_rank", "galore_update_proj_gap", "adapter_width"):
            if getattr(self, key) < 1:
                raise ValueError(f"offload.{key}={getattr(self, key)} must be a positive integer.")

    @property
    def learns_projectors(self) -> bool:
        """Whether the strategy projects gradients with learned projectors (so ``refit`` applies)."""
        return isinstance(self.strategy, LSPOffloadStrategy) and self.strategy.settings.learns_projectors

    @property
    def _projects(self) -> bool:
        """Whether the strategy compresses gradients with LSP projectors."""
        return isinstance(self.strategy, LSPOffloadStrategy) and self.strategy.settings.projection

    def callbacks(self, configured: Sequence[pl.Callback] = ()) -> list[pl.Callback]:
        """The callbacks this policy adds to a run whose config already has ``configured``: its ``refit`` where the
        strategy learns its projectors, unless the config's callbacks hold a ``ProjectorRefit`` of their own (that
        one is the run's: one route to the refit callback, said in the log)."""
        if self.refit is None or not self.learns_projectors:
            return []
        own = next((callback for callback in configured if isinstance(callback, type(self.refit))), None)
        if own is not None:
            log.info("The run's callbacks hold %r: offload.refit (%r) is not added.", own, self.refit)
            return []
        return [self.refit]

    def prepare(self, network: nn.Module) -> nn.Module:
        """Applies the method to the network to be trained (freezes layers or wraps it with LoRA); returns it."""
        if self.method == "frozen":
            freeze_projectable(network)
        elif self.method == "lora":
            network = add_lora(network, self.lora_rank, alpha=self.lora_alpha, train_others=self.lora_train_others)
        elif self.method == "meft":
            inject_meft(network, self.meft)
        elif self.method == "adapter":
            add_parallel_adapters(network, self.adapter_width)
        return network

    def optimizer_factory(self, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                          eps: float = 1e-8) -> Callable[[nn.Module], torch.optim.Optimizer]:
        """Builds the run's optimizer from the network: AdamW with the layer lr split, or GaLore-AdamW."""

        def build(network: nn.Module) -> torch.optim.Optimizer:
            if self.method == "galore":
                return galore_optimizer(network, lr=lr, projected_lr=self.projected_lr, rank=self.galore_rank,
                                        scale=self.galore_scale, update_proj_gap=self.galore_update_proj_gap,
                                        weight_decay=weight_decay, betas=betas, eps=eps)
            groups = layer_param_groups(network, lr, self.projected_lr, weight_decay)
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=self.fused_adam)

        return build
