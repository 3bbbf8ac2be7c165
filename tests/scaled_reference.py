"""The scaled rule (``update="scaled"``) written from its definition with torch only, as an optimizer over plain
parameters: what the engine's offloaded form must equal. Nothing of ``lightning_offload`` is imported here.

For a chosen weight ``W`` (stored ``rows × cols``; a Hugging Face ``Conv1D`` stores ``in × out``) with gradient ``G``:
the channels are the larger side of the stored weight (its rows when square, as APOLLO's code takes them: a Linear's
output side, a ``Conv1D``'s input side), ``n`` the other side, ``r = round(⌈ρ·out⌉·⌈ρ·in⌉ / max(out, in))`` for the
rank ``ρ``; draw ``d`` of ``P`` is
``randn(r, n) / √r`` from a CPU generator seeded ``(seed·1000003 + position)·1000003 + d``, the draw in use after
``t`` steps is ``t // redraw_every``. Per step: ``R = G_c·Pᵀ`` (``G_c``: channels as rows), bias-corrected Adam
moments of ``R`` give ``R̃ = m̂ / (√v̂ + ε)``, ``s_j = ‖R̃_j‖ / ‖R_j‖`` (where ``r = 1``, one scale
``‖R̃‖_F / ‖R‖_F`` for every channel), ``U = diag(s / k)·G_c`` with Adam's bias correction
``k = √(1 − β₂ᵗ) / (1 − β₁ᵗ)`` taken out (the moments' own ``m / √v``, as APOLLO's code limits it), whose norm may grow
at most ``γ``-fold over the last step's, and ``W_c ← W_c·(1 − lr·λ) − lr·k·√(n/r)·U``. Every other parameter: AdamW.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _math_shape(module: nn.Module) -> tuple[int, int]:
    rows, cols = module.weight.shape
    return (cols, rows) if type(module).__name__ == "Conv1D" else (rows, cols)


class ScaledAdamWReference(torch.optim.Optimizer):
    """AdamW with the scaled rule on the weights of ``modules`` (in the order given: their positions).

    Args:
        model: the model whose parameters are trained.
        modules: the modules whose weights take the rule, in position order.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (one group; a scheduler may drive ``lr``).
        rank, seed, redraw_every, limit: the rule's settings (``limit=None``: no limiter).
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, rank: float = 0.25, seed: int = 0,
                 redraw_every: int = 200, limit: float | None = 1.01) -> None:
        params = list(model.parameters())
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rule: dict[int, dict[str, Any]] = {}
        for position, module in enumerate(modules):
            out_features, in_features = _math_shape(module)
            n = min(out_features, in_features)
            r = max(1, min(n, round(math.ceil(rank * out_features) * math.ceil(rank * in_features)
                                    / max(out_features, in_features))))
            rows, cols = module.weight.shape
            channel_dim = 0 if rows >= cols else 1  # stored dimension of the channels
            self.rule[id(module.weight)] = dict(position=position, n=n, r=r, channel_dim=channel_dim, steps=0,
                                                m=None, v=None, last_norm=None)
        self.seed, self.redraw_every, self.limit = seed, redraw_every, limit
        others = [p for p in params if id(p) not in self.rule]
        self.adamw = torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def draw(self, info: dict[str, Any]) -> torch.Tensor:
        number = info["steps"] // self.redraw_every
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + info["position"]) * 1_000_003 + number)
        return torch.randn(info["r"], info["n"], generator=generator) / math.sqrt(info["r"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        group = self.param_groups[0]
        self.adamw.param_groups[0].update({key: group[key] for key in ("lr", "betas", "eps", "weight_decay")})
        self.adamw.step()
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            info = self.rule.get(id(p))
            if info is None or p.grad is None:
                continue
            grad = p.grad.float() if info["channel_dim"] == 0 else p.grad.float().t()  # channels as rows
            projected = grad @ self.draw(info).t()
            if info["m"] is None:
                info["m"], info["v"] = torch.zeros_like(projected), torch.zeros_like(projected)
            info["m"].mul_(beta1).add_(projected, alpha=1 - beta1)
            info["v"].mul_(beta2).addcmul_(projected, projected, value=1 - beta2)
            t = info["steps"] + 1
            direction = (info["m"] / (1 - beta1 ** t)) / ((info["v"] / (1 - beta2 ** t)).sqrt() + group["eps"])
            if info["r"] == 1:
                scales = (direction.norm() / projected.norm()).expand(projected.shape[0])
            else:
                scales = direction.norm(dim=1) / projected.norm(dim=1)
            correction = math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
            update = (scales / correction).unsqueeze(1) * grad
            norm = float(update.norm())
            if self.limit is not None and info["last_norm"] and norm > self.limit * info["last_norm"]:
                update = update * (self.limit * info["last_norm"] / norm)
                norm = self.limit * info["last_norm"]
            info["last_norm"] = norm
            weight = p.data if info["channel_dim"] == 0 else p.data.t()
            weight.mul_(1 - group["lr"] * group["weight_decay"])
            weight.add_(update, alpha=-group["lr"] * correction * math.sqrt(info["n"] / info["r"]))
            info["steps"] = t
        return loss
