"""Adam and AdamW as the engine's host rule: each tensor stepped by its own fused ``torch.optim.Adam``, the
user's choice of decoupled (AdamW) or coupled (Adam's L2) weight decay kept."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.rules.host_rule import HostRule, register_host_rule


def _fused_adam(tensor: Tensor, hparams: dict[str, Any], decoupled: bool) -> Optimizer:
    # Fused: the CPU fused kernel is ~2.6x faster than foreach here (docs/design.md, "Host Adam in the compressed
    # space"), and on a GPU one launch steps the tensor.
    return torch.optim.Adam([{"params": [tensor], **hparams, "decoupled_weight_decay": decoupled}], fused=True)


def _decoupled(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _check(optimizer: Optimizer) -> None:
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("differentiable"):
            raise ValueError(
                "capturable/differentiable Adam cannot be offloaded: the host Adam is neither. Create the optimizer "
                "without capturable=True and differentiable=True."
            )


ADAM = register_host_rule(HostRule(
    name="Adam",
    optimizers=(torch.optim.Adam, torch.optim.AdamW),
    hparams=("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    first_moments=("exp_avg",),
    second_moments=("exp_avg_sq", "max_exp_avg_sq"),
    build=_fused_adam,
    decoupled=_decoupled,
    moments=2,  # exp_avg, exp_avg_sq (amsgrad's maximum is a third)
    step_bytes=4,  # the fused kernel keeps each tensor's step as a float32 tensor
    check=_check,
    rows=True,
    scaled=True,
))
