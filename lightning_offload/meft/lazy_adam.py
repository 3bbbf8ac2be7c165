"""Row-sparse ("lazy") Adam on the host: only the rows a step touched are read and written.

A MEFT adapter has ``N`` rows per matrix but a step touches a few hundred; dense Adam would stream all ``N`` rows of
parameters and both moments through memory every step. Lazy Adam keeps a step count per row, so a row's bias
correction is that of the number of times *it* was updated — exactly what dense Adam would compute for a row that
received a gradient at every one of its steps (and the reason the test compares on rows touched at every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LazyAdamSettings:
    """Adam hyper-parameters (decoupled weight decay, as AdamW)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


class LazyRowAdam:
    """Adam over the rows of host matrices, updating only the rows given at each step.

    Args:
        params: fp32 host matrices ``[N, h]`` updated in place (all with the same ``N``: one row set per step).
        lr_scales: per matrix, a factor on the learning rate (default 1 for each).
    """

    def __init__(self, params: list[torch.Tensor], lr_scales: list[float] | None = None) -> None:
        if not params:
            raise ValueError("LazyRowAdam needs at least one matrix.")
        self.lr_scales = list(lr_scales) if lr_scales is not None else [1.0] * len(params)
        if len(self.lr_scales) != len(params) or not all(scale > 0 for scale in self.lr_scales):
            raise ValueError(f"lr_scales={lr_scales!r} must hold one positive factor per matrix ({len(params)}).")
        rows = params[0].shape[0]
        for p in params:
            if p.device.type != "cpu" or p.dtype != torch.float32 or p.ndim != 2 or p.shape[0] != rows:
                raise ValueError(f"LazyRowAdam keeps fp32 host matrices with {rows} rows; got {tuple(p.shape)} "
                                 f"{p.dtype} on {p.device}.")
        self.params = params
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.steps = torch.zeros(rows, dtype=torch.int64)

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grads: list[torch.Tensor], settings: LazyAdamSettings) -> None:
        """One Adam step on ``rows`` (unique, sorted or not) with their gradients ``grads[i]: [len(rows), h]``."""
        if rows.numel() == 0:
            return
        if len(grads) != len(self.params):
            raise ValueError(f"Expected {len(self.params)} gradients, got {len(grads)}.")
        beta1, beta2 = settings.betas
        self.steps[rows] += 1
        step = self.steps[rows].to(torch.float32).unsqueeze(1)
        bias1 = 1 - beta1**step
        bias2_sqrt = (1 - beta2**step).sqrt()
        for p, m, v, g, scale in zip(self.params, self.exp_avg, self.exp_avg_sq, grads, self.lr_scales):
            lr = settings.lr * scale
            g = g.to(torch.float32)
            p_rows = p[rows]
            if settings.weight_decay:
                p_rows.mul_(1 - lr * settings.weight_decay)
            m_rows = m[rows].mul_(beta1).add_(g, alpha=1 - beta1)
            v_rows = v[rows].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v_rows.sqrt() / bias2_sqrt).add_(settings.eps)
            p_rows.addcdiv_(m_rows, denom * bias1, value=-lr)
            # Scatter back: the gathered rows were copies.
            p[rows], m[rows], v[rows] = p_rows, m_rows, v_rows

    def state_dict(self) -> dict[str, object]:
        """Moments and per-row step counts (host tensors)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores :meth:`state_dict`, in place and on the host."""
        for dst, src in zip(self.exp_avg + self.exp_avg_sq, list(state["exp_avg"]) + list(state["exp_avg_sq"])):
            dst.copy_(src)
        self.steps.copy_(state["steps"])
