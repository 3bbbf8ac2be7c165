"""Activation bytes of a training step, measured rather than guessed: one forward of the model on the ``meta`` device
(shapes only: nothing is allocated, a 6.7B model at 4×512 takes a fraction of a second) under a saved-tensors hook
that adds up every tensor autograd keeps for backward, by storage (views once, parameters never).

The projected layers of ``lsp_offload`` keep ``B Xᵀ`` (``d_i`` numbers per token) in place of their input: during the
measurement their forwards are stood in for by one that saves exactly that (``lsp/linear.py``'s saves), so the count
is the projected run's. Gradient checkpointing keeps each block's input and recomputes one block at a time in
backward: its figure is what the blocks' outside keeps, plus every block's input, plus the largest block's saves.
"""

from __future__ import annotations

import contextlib
import math
import types
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_offload.lm_loss import LogitTransform, base_and_head, check_loss_kind, chunk_transient_bytes, head_loss
from lightning_offload.lsp.layouts import LayerLayout, layout_of


@dataclass(frozen=True)
class Activations:
    """What a step's forward keeps for backward.

    Attributes:
        saved: bytes kept without gradient checkpointing.
        checkpointed: bytes kept with every block checkpointed (inputs kept, one block recomputed at a time).
        transient: what exists beside everything saved at some point of backward: the largest single saved tensor's
            gradient (the logits' under the model's own loss), or the chunked loss's chunk of logit-sized tensors.
        blocks: the transformer blocks found (0 when none: then ``checkpointed`` equals ``saved``).
    """

    saved: int
    checkpointed: int
    transient: int
    blocks: int

    def kept(self, checkpointing: bool) -> int:
        """Bytes kept with or without checkpointing."""
        return self.checkpointed if checkpointing else self.saved


def network_of(model: nn.Module) -> nn.Module:
    """The Hugging Face network inside ``model`` (itself, or the first submodule with a ``config`` and an output
    embedding: a LightningModule holding one).

    Raises:
        TypeError: when there is none (the activations of an arbitrary module cannot be measured without inputs).
    """
    for module in model.modules():
        if hasattr(module, "config") and callable(getattr(module, "get_output_embeddings", None)):
            return module
    raise TypeError(f"plan() measures activations by running a Hugging Face causal LM (a module with a config and "
                    f"get_output_embeddings) on the meta device; {type(model).__name__} holds none. Pass "
                    f"activation_bytes=<bytes kept for backward> to plan it anyway.")


def blocks_of(network: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks: the longest ``ModuleList`` whose members share one type."""
    lists = [m for m in network.modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(child) for child in m}) == 1]
    return max(lists, key=len, default=None)


class _SavesProjection(torch.autograd.Function):
    """A projected layer as ``lsp/linear.py`` runs it, for counting only: its output (its layout's forward), and
    ``B Xᵀ``'s shape saved in place of the input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, layout: LayerLayout, d_in: int,
                product_dtype: torch.dtype) -> Tensor:
        out = layout.forward(x, weight, bias)
        tokens = math.prod(x.shape[:-1])
        ctx.save_for_backward(weight, x.new_empty((d_in, tokens), dtype=product_dtype))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # never run: the measurement has no backward
        raise RuntimeError("the activation measurement has no backward")


class _FusedAttention(torch.autograd.Function):
    """Scaled dot-product attention as a fused (flash / memory-efficient) kernel keeps it for backward: the queries,
    keys, values, the output and one fp32 log-sum-exp per query. On the meta device torch runs the math path, which
    would also keep the ``T × T`` attention probabilities that CUDA's (and the CPU's) fused kernels never store."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # never run: the measurement has no backward
        raise RuntimeError("the activation measurement has no backward")


def _fused_attention(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return _FusedAttention.apply(query, key, value)


@contextlib.contextmanager
def _fused_attention_kernels() -> Iterator[None]:
    """Count attention as the fused kernels keep it while the measurement runs (Hugging Face's ``sdpa`` attention
    looks the function up at each call)."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _fused_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _projection_forward(d_in: int, product_dtype: torch.dtype) -> Any:
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        return _SavesProjection.apply(x, self.weight, self.bias, layout_of(self), d_in, product_dtype)
    return forward


def _without_adapter(self: nn.Module, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    # MEFT's adapter routes and fetches host rows by value, which the meta device has none of: its FFN alone is
    # measured (the adapter's own activations, a few rows per token, are not counted).
    return self.ffn(hidden, *args, **kwargs)


@contextlib.contextmanager
def _stand_ins(forwards: Mapping[nn.Module, Any]) -> Iterator[None]:
    """Stand in for the forwards of some modules (module → forward function) while the measurement runs."""
    for module, forward in forwards.items():
        module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        for module in forwards:
            del module.forward


@contextlib.contextmanager
def _without_hf_checkpointing(network: nn.Module) -> Iterator[None]:
    """Measure every block's saves even where the user enabled Hugging Face's gradient checkpointing (the plan works
    out checkpointing itself, from the blocks). A checkpointed forward would keep only the blocks' inputs, and in
    training it runs without a cache, which makes Hugging Face look for packed sequences by reading the meta
    positions' values."""
    enabled = [m for m in network.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for module in enabled:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in enabled:
            module.gradient_checkpointing = True


#: Measurements at one sequence, per network (a measurement is linear in the batch: planning several batch sizes, or a
#: chooser's grid, measures each projection once).
_MEASURED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Activations]] = weakref.WeakKeyDictionary()


def measure_activations(model: nn.Module, batch_size: int, seq_len: int, dtype: torch.dtype,
                        projected: Mapping[str, int] | None = None,
                        product_dtype: torch.dtype = torch.float32, loss: str = "chunked") -> Activations:
    """Bytes a training forward of ``model`` keeps for backward at ``batch_size × seq_len`` tokens: one sequence
    measured (once per network, sequence length, dtype and projection), times the batch.

    Args:
        model: the model or a module holding a Hugging Face causal LM (any device: meta stand-ins are used).
        batch_size: sequences per micro-batch.
        seq_len: tokens per sequence.
        dtype: the compute dtype (floating parameters and buffers take it; bf16-true and bf16-mixed: bf16).
        projected: qualified names (in ``model``) of projected layers and their ``d_i``.
        product_dtype: the dtype projected layers keep ``B Xᵀ`` in (fp32 on the CPU, the compute dtype on CUDA).
        loss: ``"chunked"`` (:func:`lightning_offload.causal_lm_loss`, what the package's task and CLI train with: no
            logits kept, one chunk of them at a time in backward) or ``"model"`` (the model's own loss over the full
            logits).
    """
    check_loss_kind(loss)
    network = network_of(model)
    if not _has_lm_head(network):
        loss = "model"  # a base network (a classifier's decoder): no vocabulary head, no LM loss to chunk
    key = (seq_len, dtype, product_dtype, tuple(sorted((projected or {}).items())),
           tuple(p.requires_grad for p in network.parameters()), loss)
    one = _MEASURED.setdefault(network, {}).get(key)
    if one is None:
        one = _MEASURED[network][key] = _measure(model, network, seq_len, dtype, projected or {}, product_dtype, loss)
    transient = one.transient * batch_size
    if loss == "chunked":  # a chunk's logits do not grow with the batch
        vocab = network.get_output_embeddings().weight.shape[0]
        transient = max(transient, chunk_transient_bytes(batch_size * seq_len, vocab))
    return Activations(one.saved * batch_size, one.checkpointed * batch_size, transient, one.blocks)


def _measure(model: nn.Module, network: nn.Module, seq_len: int, dtype: torch.dtype, projected: Mapping[str, int],
             product_dtype: torch.dtype, loss: str) -> Activations:
    """One sequence's activations (see :func:`measure_activations`)."""
    by_name = dict(model.named_modules())
    stand_ins = {by_name[name]: _projection_forward(d_in, product_dtype) for name, d_in in projected.items()}
    counted: dict[int, int] = {}
    if loss == "chunked":
        stand_ins[network] = _chunked_loss_forward(counted)
    stand_ins.update({m: _without_adapter for m in model.modules() if type(m).__name__ == "MEFTFFN"})
    tensors = {name: _meta_like(t, dtype) for name, t in
               [*network.named_parameters(), *network.named_buffers()]}
    parameters = {tensors[name].untyped_storage()._cdata for name, _ in network.named_parameters()}
    alive: list[Tensor] = []  # keeps each storage alive, so its key is not reused by a later one

    def pack(saved: Tensor) -> Tensor:
        key = saved.untyped_storage()._cdata
        if key not in parameters and key not in counted:
            counted[key] = saved.untyped_storage().nbytes()
            alive.append(saved)
        return saved

    blocks = blocks_of(network)
    marks: list[tuple[int, int, int]] = []  # per block: saved bytes before, after, and its input's bytes
    hooks = []
    if blocks is not None:
        for block in blocks:
            hooks.append(block.register_forward_pre_hook(
                lambda m, args, kwargs: marks.append((sum(counted.values()), 0, _input_bytes(args, kwargs))),
                with_kwargs=True))
            hooks.append(block.register_forward_hook(
                lambda m, args, out: marks.__setitem__(-1, (marks[-1][0], sum(counted.values()), marks[-1][2]))))
    ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    # Hugging Face checks the ids for padding when no mask is given, which reads values the meta ids do not have; a
    # mask would make LLaMA's mask code read its values instead. Without a pad id there is nothing to check.
    pad_token_id = getattr(network.config, "pad_token_id", None)
    network.config.pad_token_id = None
    try:
        hooked = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with _stand_ins(stand_ins), _fused_attention_kernels(), _without_hf_checkpointing(network), hooked:
            functional_call(network, tensors, (), {"input_ids": ids, "labels": ids}, strict=False)
    finally:
        network.config.pad_token_id = pad_token_id
        for hook in hooks:
            hook.remove()
    saved = sum(counted.values())
    per_block = [after - before for before, after, _ in marks]
    outside = saved - sum(per_block)
    checkpointed = outside + sum(size for _, _, size in marks) + max(per_block, default=0) if marks else saved
    return Activations(saved, min(saved, checkpointed), max(counted.values(), default=0), len(marks))


def _has_lm_head(network: nn.Module) -> bool:
    try:
        base_and_head(network)
    except TypeError:
        return False
    return True


def _chunked_loss_forward(counted: dict[int, int]) -> Any:
    """The network's training forward under the chunked loss (the measurement's stand-in for its own forward). What
    the loss keeps until backward is one hidden-state-sized tensor (the head's input, or its gradient made in forward:
    counted under ``counted``'s key -1); what a chunk saves lives only while the chunk runs (the transient's part,
    :func:`~lightning_offload.lm_loss.chunk_transient_bytes`), so the saves inside the loss are not counted."""
    def forward(self: nn.Module, input_ids: Tensor, labels: Tensor) -> Tensor:
        hidden = self.base_model(input_ids=input_ids, return_dict=True).last_hidden_state
        counted[-1] = hidden.numel() * hidden.element_size()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return head_loss(hidden, self.get_output_embeddings(), labels, transform=LogitTransform.of(self.config))
    return forward


def _meta_like(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    stand_in = torch.empty_like(tensor, device="meta", dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    return stand_in.requires_grad_(tensor.requires_grad)


def _input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of a block's hidden-state input (what checkpointing keeps of it)."""
    first = args[0] if args else kwargs.get("hidden_states")
    return first.numel() * first.element_size() if torch.is_tensor(first) else 0
