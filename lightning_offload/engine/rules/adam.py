"""Adam and AdamW as the engine's host rule: each tensor stepped by its own fused ``torch.optim.Adam``, the
user's choice of decoupled (AdamW) or coupled (Adam's L2) weight decay kept."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.rules.host_rule import HostRule, register_host_rule
from lightning_offload.inner_optimizers import step_unhooked


class OneTensorAdam(torch.optim.Adam):
    """torch's fused Adam over one tensor, whose steps after the first call torch's fused kernel as
    ``torch.optim.Adam.step`` does (the same call, so the same bits) without its generic per-step Python, which on a
    CPU cost about twice the kernel itself on a small tensor, paid by every offloaded tensor at every step. The first
    step (which creates the state), a closure, amsgrad, tensor hyper-parameters and a gradient scaler take torch's own
    step."""

    def step(self, closure: Any = None) -> Any:  # noqa: D102  (the class docstring says it)
        if closure is not None or not self.direct():
            return step_unhooked(self, torch.optim.Adam)
        _fused_step([self])
        return None

    def direct(self) -> bool:
        """Whether this step can be the fused kernel's call alone: the state exists, a gradient is there, and no
        amsgrad, tensor hyper-parameter or gradient scaler asks for torch's own step."""
        group = self.param_groups[0]
        (param,) = group["params"]
        beta1, beta2 = group["betas"]
        return not (not self.state.get(param) or param.grad is None or group["amsgrad"]
                    or any(isinstance(value, Tensor) for value in (group["lr"], beta1, beta2))
                    or getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None)


def _fused_step(optimizers: Sequence[OneTensorAdam]) -> None:
    """One fused-kernel call over the tensors of ``optimizers`` (each :meth:`OneTensorAdam.direct`), which share their
    hyper-parameters: the kernel steps each tensor on its own, so the bits are each one's alone."""
    group = optimizers[0].param_groups[0]
    params = [optimizer.param_groups[0]["params"][0] for optimizer in optimizers]
    states = [optimizer.state[param] for optimizer, param in zip(optimizers, params)]
    beta1, beta2 = group["betas"]
    fused = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    with torch.no_grad():
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)  # as torch's _fused_adam: the step counts before the kernel reads it
        fused(params, [param.grad for param in params], [state["exp_avg"] for state in states],
              [state["exp_avg_sq"] for state in states], [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
              beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
              grad_scale=None, found_inf=None)


def step_together(optimizers: Sequence[Optimizer]) -> None:
    """Step ``optimizers`` (built by this rule, over one user group and one kind of decay, their hyper-parameters
    copied in): those that can, in one fused call per device and dtype (a launch on a GPU, ~10 µs of Python on a CPU,
    for all of them); the rest by torch's own step."""
    together: dict[tuple[Any, ...], list[OneTensorAdam]] = {}
    for optimizer in optimizers:
        if isinstance(optimizer, OneTensorAdam) and optimizer.direct():
            param = optimizer.param_groups[0]["params"][0]
            together.setdefault((param.device, param.dtype), []).append(optimizer)
        else:
            step_unhooked(optimizer)
    for batch in together.values():
        _fused_step(batch)


def _fused_adam(tensor: Tensor, hparams: dict[str, Any], decoupled: bool) -> Optimizer:
    # Fused: the CPU fused kernel is ~2.6x faster than foreach here (docs/design.md, "Host Adam in the compressed
    # space"), and on a GPU one launch steps the tensor.
    return OneTensorAdam([{"params": [tensor], **hparams, "decoupled_weight_decay": decoupled}], fused=True)


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
    step_together=step_together,
))
