"""The chunks of :func:`lightning_offload.causal_lm_loss`: one autograd Function over the head and the cross-entropy,
a chunk of tokens at a time, and the arithmetic of one chunk."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # Hugging Face's causal LMs skip labels equal to this in the loss


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its head's output before the loss (Hugging Face applies it in the logits' dtype).

    Attributes:
        softcap: ``cap · tanh(z / cap)`` (Gemma-2's ``final_logit_softcapping``), or ``None``.
        scale: a factor the logits are multiplied by (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``),
            or ``None``.
    """

    softcap: float | None = None
    scale: float | None = None

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        """The transform a Hugging Face model's ``config`` asks for."""
        scale = getattr(config, "logit_scale", None)
        granite = getattr(config, "logits_scaling", None)
        if granite is not None:
            scale = 1.0 / granite
        return cls(softcap=getattr(config, "final_logit_softcapping", None), scale=scale)

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HeadChunks:
    """How the chunks of one loss call run their head: the module, the logit transform, the chunk length."""

    def __init__(self, head: nn.Module, transform: LogitTransform, chunk: int,
                 hidden_requires_grad: bool = False) -> None:
        self.head = head
        self.transform = transform
        self.chunk = chunk
        # A projected head (lsp/linear.py) makes its own compressed gradient: its module runs in backward too. A
        # plain Linear's products are done here, its gradient summed over the chunks and returned once.
        self.projected = getattr(head, "_lsp_state", None)
        self.plain_linear = self.projected is None and type(head) is nn.Linear
        #: For a plain Linear whose gradients are wanted: which (hidden states, weight, bias) forward makes them for.
        wanted = (hidden_requires_grad, *(p.requires_grad for p in self.dense_parameters()))
        self.eager = wanted if self.plain_linear and torch.is_grad_enabled() and any(wanted) else None

    def dense_parameters(self) -> list[Tensor]:
        """The head's parameters whose gradient this loss returns (all but a projected weight)."""
        if self.plain_linear:
            return [p for p in (self.head.weight, self.head.bias) if p is not None]
        projected_weight = self.projected.weight if self.projected is not None else None
        return [p for p in self.head.parameters() if p is not projected_weight]

    def slices(self, tokens: int) -> Iterator[slice]:
        for start in range(0, tokens, self.chunk):
            yield slice(start, min(start + self.chunk, tokens))

    def logits(self, hidden: Tensor) -> Tensor:
        """One chunk's transformed logits, by the head module itself (its forward hooks run: the offload engine
        applies a pending update of the head there)."""
        return self.transform(self.head(hidden))


class ChunkedHeadLoss(torch.autograd.Function):
    """The summed cross-entropy of the head over token chunks, divided by ``divisor``.

    A plain ``nn.Linear`` head's gradients are made in forward, chunk by chunk, as the logits are (the products the
    unchunked loss's backward would run, no more), and scaled by the incoming gradient in backward. Any other head
    (a projected one adds into its ``S`` as its own backward runs) has each chunk's logits recomputed in backward, under
    the forward's autocast state.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, targets: Tensor, divisor: int | Tensor, spec: HeadChunks,
                *params: Tensor) -> Tensor:
        ctx.spec = spec
        if spec.eager is not None:
            total, ctx.gradients = _loss_and_gradients(spec, hidden, targets, divisor, params)
            return total / divisor
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for part in spec.slices(hidden.shape[0]):
            logits = spec.logits(hidden[part]).float()
            total += F.cross_entropy(logits, targets[part], ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.divisor = divisor
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.save_for_backward(hidden, targets)
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.spec.eager is not None:
            return _eager_backward(ctx, grad)
        hidden, targets = ctx.saved_tensors
        spec: HeadChunks = ctx.spec
        params = spec.dense_parameters()
        wanted = list(ctx.needs_input_grad[4:])
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        param_grads: list[Tensor | None] = [torch.zeros_like(p) if want else None for p, want in zip(params, wanted)]
        scale = grad.float() / ctx.divisor
        parts = list(spec.slices(hidden.shape[0]))
        if spec.projected is not None and spec.projected.weight.requires_grad:
            # Each chunk's backward counts as one of the projected head's: its gradient is complete (its transfer
            # starts) once, after the last chunk has added into its S.
            spec.projected.expect_backwards(len(parts))
        enabled, dtype = ctx.autocast  # Lightning's mixed precision wraps the step, not backward: recompute under it
        with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
            for part in parts:
                chunk_grads = _chunk_backward(spec, hidden[part], targets[part], scale, params, wanted)
                if grad_hidden is not None:
                    grad_hidden[part] = chunk_grads[0]
                for total, chunk_grad in zip(param_grads, chunk_grads[1:]):
                    if total is not None and chunk_grad is not None:
                        total += chunk_grad
        return (grad_hidden, None, None, None, *param_grads)


def _loss_and_gradients(spec: HeadChunks, hidden: Tensor, targets: Tensor, divisor: int | Tensor,
                        params: tuple[Tensor, ...]) -> tuple[Tensor, list[Tensor | None]]:
    """A plain Linear head's summed loss, and the gradients of the hidden states and of its weight and bias for an
    incoming gradient of 1, made chunk by chunk in forward."""
    weight, bias = params[0], params[1] if len(params) > 1 else None
    want_hidden, want_weight, want_bias = (list(spec.eager) + [False])[:3]
    scale = 1.0 / divisor if isinstance(divisor, (int, float)) else divisor.float().reciprocal()
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = torch.zeros_like(weight) if want_weight else None
    grad_bias = torch.zeros_like(bias) if bias is not None and want_bias else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for part in spec.slices(hidden.shape[0]):
        chunk = hidden[part]
        summed, grad_logits = _loss_and_logit_gradient(spec.head(chunk), targets[part], scale, spec.transform)
        total += summed
        if grad_hidden is not None:
            grad_hidden[part] = grad_logits @ weight.to(grad_logits.dtype)
        if grad_weight is not None:
            _add_product(grad_weight, grad_logits.t(), chunk.to(grad_logits.dtype))
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
    return total, [grad_hidden, grad_weight, grad_bias][:1 + len(params)]


def _add_product(total: Tensor, left: Tensor, right: Tensor) -> None:
    """``total += left @ right``, in place where the dtypes allow (no temporary the size of the head)."""
    if total.dtype == left.dtype == right.dtype:
        total.addmm_(left, right)
    else:  # autocast's products are in its dtype, the gradient in the parameter's
        total += left @ right


def _eager_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    """The gradients forward made, times the incoming one (in place: each is this graph's own)."""
    gradients, ctx.gradients = ctx.gradients, None
    if gradients is None:
        raise RuntimeError("lightning_offload.causal_lm_loss(): backward through the same loss twice "
                           "(retain_graph=True) is not supported; compute the loss again.")
    if not (grad.device.type == "cpu" and float(grad) == 1.0):  # 1 is the usual case: no pass over the head's size
        for gradient in gradients:
            if gradient is not None:
                gradient.mul_(grad.to(gradient.dtype))
    return (gradients[0], None, None, None, *gradients[1:])


def _chunk_backward(spec: HeadChunks, hidden: Tensor, targets: Tensor, scale: Tensor, params: list[Tensor],
                    wanted: list[bool]) -> list[Tensor | None]:
    """One chunk's gradients, its head run again: of its hidden states, then of each of ``params`` (``None`` where not
    wanted)."""
    leaf = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        logits = spec.head(leaf)
    _, grad_logits = _loss_and_logit_gradient(logits.detach(), targets, scale, spec.transform)
    inputs = [leaf] + [p for p, want in zip(params, wanted) if want]
    grads = list(torch.autograd.grad(logits, inputs, grad_logits, allow_unused=True))
    out: list[Tensor | None] = [grads.pop(0)]
    out += [grads.pop(0) if want else None for want in wanted]
    return out


def _loss_and_logit_gradient(logits: Tensor, targets: Tensor, scale: float | Tensor,
                             transform: LogitTransform) -> tuple[Tensor, Tensor]:
    """One chunk's summed loss and its gradient with respect to the raw logits, times ``scale`` (in the logits'
    dtype, as autograd would give it)."""
    if transform.softcap is not None or transform.scale is not None:
        leaf = logits.detach().requires_grad_(True)
        with torch.enable_grad():
            summed = F.cross_entropy(transform(leaf).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
            return summed.detach(), torch.autograd.grad(summed * scale, leaf)[0]
    # Untransformed logits: the softmax's gradient written directly, in place over the log-softmax, in the order
    # autograd's log-softmax backward computes it (exp(log p)·s − s at the target); cross_entropy's autograd would hold
    # the gradient per log-probability and the gradient again beside it: twice the memory and the passes.
    kept = (targets != IGNORE_INDEX).to(torch.float32)
    rows = torch.arange(targets.shape[0], device=targets.device)
    safe_targets = torch.where(targets != IGNORE_INDEX, targets, 0)
    log_probabilities = torch.log_softmax(logits.float(), dim=-1)
    summed = -(log_probabilities[rows, safe_targets] * kept).sum()
    weights = kept * scale
    gradient = log_probabilities.exp_().mul_(weights.unsqueeze(1))
    gradient[rows, safe_targets] -= weights
    return summed, gradient.to(logits.dtype)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    if not torch.amp.is_autocast_available(device_type):  # the meta device (the planner's measurement)
        return False, torch.float32
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
