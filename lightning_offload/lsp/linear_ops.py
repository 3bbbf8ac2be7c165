"""A projected layer's products, in eager mode (:class:`~lightning_offload.lsp.linear._ProjectedLinearFunction`) and
under ``torch.compile`` (two custom operators), so both compute the same bits.

A compiled model reaches the layer through ``lightning_offload::projected_linear`` and its backward, which the compiler
keeps opaque: the layer's work (native kernels on raw pointers, counting forwards, handing ``S`` to the engine) cannot
be traced, and a trace of it broke the graph at every layer and guarded each layer's state in the one frame all layers
share, so that past 8 layers the compiler gave up on it. The operators take the layer's key (an int, a constant of the
graph) in place of its Python object, and read its weight from it.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_offload.lsp.norm_probe import PROBES
from lightning_offload.lsp.projector import product_dtype_of

#: A :class:`~lightning_offload.lsp.linear.ProjectedWeight` (that module imports this one, so it is not imported here).
ProjectedWeight = Any


def compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would compute in here: the autocast dtype when autocast is on, else the weight's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """A block where ``device_type``'s autocast is off (a no-op context, 30× cheaper, where it is off already): the
    engine's own products run in the dtypes it chose, whatever autocast region it is called from."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def forward_products(state: ProjectedWeight, x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
                     keep: bool, probing: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(y, W in dtype, B Xᵀ, X z)`` of one forward, eager or compiled; ``B Xᵀ`` only when ``keep`` (a weight
    gradient is wanted), ``X z`` only when also ``probing``."""
    # Autocast does not reach inside a custom Function, so cast explicitly; backward then sees forward's dtypes.
    with torch.autocast(x.device.type, enabled=False):
        x_c = x.to(dtype)
        w_c = weight.to(dtype)
        b_c = bias.to(dtype) if bias is not None else None
        out = state.layout.forward(x_c, w_c, b_c)
        # Keep only B Xᵀ for the weight gradient: d_i numbers per token instead of i.
        x_proj = x_probe = None
        if keep:
            with state.phases.phase("forward_projection"):
                x_flat = x_c.detach().reshape(-1, x_c.shape[-1])
                x_proj = state.kernels.compress_tokens(state.proj_in, x_flat)
                state.saved_projection_bytes += x_proj.numel() * x_proj.element_size()
                if probing:
                    # X z (tokens × m), for the norm of G = Δᵀ X while clipping is in use (lsp/norm_probe.py).
                    x_probe = x_flat @ state.norm_probe.probe(x_flat.shape[1], x_flat.device, x_flat.dtype)
                    state.saved_projection_bytes += x_probe.numel() * x_probe.element_size()
    return out, w_c, x_proj, x_probe


def backward_products(state: ProjectedWeight, grad_out: Tensor, w_c: Tensor, x_proj: Tensor | None,
                      x_probe: Tensor | None, input_grad: bool, bias_grad: bool) -> tuple[Tensor | None, Tensor | None]:
    """One backward, eager or compiled: ``S`` (and ``G z``) added to the layer; returns the gradients of the input
    and the bias where asked for."""
    # In forward's dtypes and S in fp32, even where backward runs under an autocast (a backward called inside it).
    with without_autocast(grad_out.device.type):
        grad_out = grad_out.to(w_c.dtype)
        grad_x = None
        if input_grad:
            grad_x = state.layout.input_grad(grad_out, w_c)
        with state.phases.phase("backward_projection"):
            if x_probe is not None:
                # G z = Δᵀ (X z), o × m: added before S, whose completion may start the step's send.
                state.norm_probe.add(
                    (grad_out.reshape(-1, grad_out.shape[-1]).t() @ x_probe.to(grad_out.dtype)).float())
            if x_proj is not None:
                # S = (A Δᵀ)(B Xᵀ)ᵀ in fp32: a fresh tensor, which the layer keeps as its S.
                delta_proj = state.kernels.compress_tokens(state.proj_out, grad_out.reshape(-1, grad_out.shape[-1]))
                state.accumulate(delta_proj.float() @ x_proj.float().t())
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if bias_grad else None
    return grad_x, grad_bias


#: Every live projected layer by its key: what the operators below receive in place of the layer's Python object.
_LAYERS: weakref.WeakValueDictionary[int, ProjectedWeight] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_layer(state: ProjectedWeight) -> int:
    """The key the operators know ``state`` by (held weakly: a layer given back is forgotten)."""
    key = next(_KEYS)
    _LAYERS[key] = state
    return key


def compiled_forward(module: nn.Module, state: ProjectedWeight, x: Tensor) -> Tensor:
    """The forward a compiled model traces: one opaque operator. What it decides here (the dtype, whether this step
    probes) is guarded by the compiler. The operators read the weight from the layer, as the eager Function does: an
    input of the graph, it would be an input of the compiled autograd node, whose backward calls the weight's hooks
    (with ``None``); autograd reaches the layer through its anchor alone, as in eager mode. Nothing in a graph writes
    the weight (updates land between steps), so no read of it can be reordered against a write."""
    out, _, _ = torch.ops.lightning_offload.projected_linear(
        x, module.bias, state.hooks.anchor(x.device), state.key, compute_dtype(x, module.weight),
        state.norm_probe.active)
    return out


@torch.library.custom_op("lightning_offload::projected_linear", mutates_args=())
def _projected_linear_op(x: Tensor, bias: Optional[Tensor], anchor: Tensor, layer: int, dtype: torch.dtype,
                         probing: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, B Xᵀ, X z)`` of the layer keyed ``layer``; ``X z`` is empty when the step does not probe."""
    state = _LAYERS[layer]
    if torch._C._current_graph_task_id() == -1:  # as in eager mode: a recomputation inside backward is not counted
        state.open_backwards += 1
    out, _, x_proj, x_probe = forward_products(state, x, state.weight.detach(), bias, dtype, keep=True,
                                               probing=probing)
    # A custom operator's outputs are fresh and contiguous, as its shape inference below says.
    return out.contiguous(), x_proj.contiguous(), x_probe if x_probe is not None else x.new_empty(0, dtype=dtype)


@_projected_linear_op.register_fake
def _projected_linear_shapes(x: Tensor, bias: Optional[Tensor], anchor: Tensor, layer: int, dtype: torch.dtype,
                             probing: bool) -> tuple[Tensor, Tensor, Tensor]:
    state = _LAYERS[layer]
    out_features = state.layout.weight_shape(state.module)[0]
    tokens = x.numel() // x.shape[-1]
    out = x.new_empty((*x.shape[:-1], out_features), dtype=dtype)
    x_proj = x.new_empty((state.proj_in.dim_out, tokens), dtype=product_dtype_of(x.device, dtype))
    x_probe = x.new_empty((tokens, PROBES) if probing else (0,), dtype=dtype)
    return out, x_proj, x_probe


@torch.library.custom_op("lightning_offload::projected_linear_backward", mutates_args=())
def _projected_linear_backward_op(grad_out: Tensor, x_proj: Tensor, x_probe: Tensor, layer: int, dtype: torch.dtype,
                                  probing: bool, input_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(∂L/∂x, ∂L/∂b, a zero for the anchor)``, each empty where not asked for; ``S`` is added to the layer. The
    weight is cast again as forward cast it (the same bits: it does not change between a forward and its backward)."""
    state = _LAYERS[layer]
    grad_x, grad_bias = backward_products(state, grad_out, state.weight.detach().to(dtype), x_proj,
                                          x_probe if probing else None, input_grad, bias_grad)
    empty = grad_out.new_empty(0)
    return (grad_x.contiguous() if grad_x is not None else empty,
            grad_bias if grad_bias is not None else empty.clone(), grad_out.new_zeros(()))


@_projected_linear_backward_op.register_fake
def _projected_linear_backward_shapes(grad_out: Tensor, x_proj: Tensor, x_probe: Tensor, layer: int,
                                      dtype: torch.dtype, probing: bool, input_grad: bool,
                                      bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    state = _LAYERS[layer]
    out_features, in_features = state.layout.weight_shape(state.module)
    grad_x = grad_out.new_empty((*grad_out.shape[:-1], in_features) if input_grad else (0,), dtype=dtype)
    grad_bias = grad_out.new_empty((out_features,) if bias_grad else (0,), dtype=dtype)
    return grad_x, grad_bias, grad_out.new_zeros(())


def _save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _, bias, _, ctx.layer, ctx.dtype, ctx.probing = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(output[1], output[2])


def _compiled_backward(ctx: Any, grad_out: Tensor, grad_x_proj: Tensor, grad_x_probe: Tensor) -> tuple[Any, ...]:
    x_proj, x_probe = ctx.saved_tensors
    input_grad, bias_grad = ctx.needs_input_grad[0], ctx.has_bias and ctx.needs_input_grad[1]
    grad_x, grad_bias, grad_anchor = torch.ops.lightning_offload.projected_linear_backward(
        grad_out, x_proj, x_probe, ctx.layer, ctx.dtype, ctx.probing, input_grad, bias_grad)
    # The anchor's zero keeps the operator in the compiled backward: a compiler drops an operator none of whose outputs
    # is used (a first layer with no bias whose input needs no gradient), and with it the layer's S.
    return grad_x if input_grad else None, grad_bias if bias_grad else None, grad_anchor, None, None, None


_projected_linear_op.register_autograd(_compiled_backward, setup_context=_save_for_backward)
