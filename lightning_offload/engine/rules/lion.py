"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") as a ``torch.optim`` optimizer and as
the engine's host rule for it: a user who trains with :class:`Lion` keeps it under every offload strategy.

Per tensor, with gradient ``g`` and one moment ``m``::

    p ← p · (1 − lr·λ) − lr · sign(β₁·m + (1 − β₁)·g)
    m ← β₂·m + (1 − β₂)·g

Its update has the same size in every coordinate and its state is one moment (half of Adam's host bytes). Its weight
decay is decoupled, as AdamW's, so a projected weight's decay is applied to ``W`` on the device as for AdamW. The
row-stepped kinds (``embeddings="sparse"``, MEFT's rows) and ``update="scaled"`` are Adam's arithmetic and refuse it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.rules.host_rule import HostRule, register_host_rule


class Lion(Optimizer):
    """The Lion optimizer (sign of an interpolated momentum, decoupled weight decay).

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr: learning rate (Lion's is typically 3–10× smaller than AdamW's). Default: ``1e-4``.
        betas: ``(β₁, β₂)``: the update's interpolation and the moment's decay. Default: ``(0.9, 0.99)``.
        weight_decay: decoupled weight decay ``λ`` (the weight is multiplied by ``1 − lr·λ``). Default: ``0.0``.
        maximize: ascend the objective instead. Default: ``False``.

    Raises:
        ValueError: for a negative learning rate or weight decay, or betas outside ``[0, 1)``.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, maximize: bool = False) -> None:
        if lr < 0:
            raise ValueError(f"Lion's lr must be >= 0, got {lr}.")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lion's betas must lie in [0, 1), got {betas}.")
        if weight_decay < 0:
            raise ValueError(f"Lion's weight_decay must be >= 0, got {weight_decay}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay,
                                  "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every parameter that has a gradient (``closure`` re-evaluates the loss first, as in torch.optim)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.neg() if group["maximize"] else param.grad
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                if group["weight_decay"]:
                    param.mul_(1.0 - group["lr"] * group["weight_decay"])
                direction = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
                param.add_(direction, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


def _lion_over(tensor: Tensor, hparams: dict[str, Any], decoupled: bool) -> Optimizer:
    return Lion([{"params": [tensor], **hparams}])


LION = register_host_rule(HostRule(
    name="Lion",
    optimizers=(Lion,),
    hparams=("lr", "betas", "weight_decay", "maximize"),
    first_moments=("exp_avg",),
    second_moments=(),
    build=_lion_over,
    decoupled=lambda optimizer, group: True,  # Lion's decay multiplies the weight, always
    moments=1,
    step_bytes=0,  # Lion counts no steps
    one_step_size=True,  # ±lr per element: an expanded step keeps that size (per-element RMS)
))
