"""A causal language model's loss without its logits: the output head and the cross-entropy run chunk by chunk of
tokens, so no ``tokens × vocabulary`` tensor exists in forward or backward (Hugging Face's loss holds several at once:
the logits, their fp32 copy, the softmax and its gradient).

The head's gradient stays what its placement makes it. A plain ``nn.Linear`` head's gradients are made in forward, chunk
by chunk, and backward only scales them: one dense weight gradient, its hooks called once a step. A head projected by
``lsp_offload`` recomputes each chunk's logits in its own backward (one more head product a step, where projection saved
one) and adds into its ``S``: no dense ``vocab × hidden`` gradient, and the layer is complete after the last chunk.

Results equal Hugging Face's ``ForCausalLMLoss`` (labels shifted by one, ``-100`` ignored, the mean over target tokens
or the sum over ``num_items_in_batch``) to the rounding of summing in another order; soft-capped (Gemma-2) and scaled
(Cohere, Granite) logits are applied as those models apply them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_offload.lm_loss.chunks import IGNORE_INDEX, ChunkedHeadLoss, HeadChunks, LogitTransform

__all__ = ["IGNORE_INDEX", "LOSS_KINDS", "LogitTransform", "base_and_head", "causal_lm_loss", "check_loss_kind",
           "chunk_transient_bytes", "default_chunk_tokens", "head_loss", "head_predictions", "hidden_and_head",
           "shifted_targets"]


#: Bytes of fp32 logits one chunk may hold by default: enough for the head's products to run at full speed.
DEFAULT_CHUNK_BYTES = 64 * 2**20

#: Logit-sized tensors one chunk holds at once: logits, their fp32 copy, the log-softmax that becomes the gradient.
CHUNK_TENSORS = 3


#: How a causal LM's loss is computed: by :func:`causal_lm_loss` (``"chunked"``) or by the model itself (``"model"``).
LOSS_KINDS = ("chunked", "model")


def check_loss_kind(loss: str) -> None:
    """Raise a ValueError when ``loss`` is not one of :data:`LOSS_KINDS`."""
    if loss not in LOSS_KINDS:
        raise ValueError(f"loss={loss!r} is not 'chunked' (lightning_offload.causal_lm_loss: the head and the loss by "
                         f"chunks of tokens) or 'model' (the model's own loss over all the logits).")


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for ``vocab_size``: as many as fit :data:`DEFAULT_CHUNK_BYTES` of fp32 logits (at least one)."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * vocab_size))


def chunk_transient_bytes(tokens: int, vocab_size: int, chunk_tokens: int | None = None) -> int:
    """Bytes one chunk's backward holds beyond what forward kept, for ``tokens`` tokens a step (the planner's count)."""
    chunk = min(tokens, _chunk_tokens(chunk_tokens, vocab_size))
    return CHUNK_TENSORS * 4 * chunk * vocab_size


def causal_lm_loss(model: nn.Module, batch: Mapping[str, Any], *, num_items_in_batch: int | Tensor | None = None,
                   chunk_tokens: int | None = None) -> Tensor:
    """The causal-LM loss of a Hugging Face model on ``batch``, without materialising its logits.

    Call it in a LightningModule's ``training_step`` or a Hugging Face ``Trainer``'s ``compute_loss`` (docs/loops.md).

    Args:
        model: a Hugging Face causal LM (``LlamaForCausalLM``, ``GPT2LMHeadModel``, …): its ``base_model`` gives the
            final hidden states and its ``get_output_embeddings()`` is the head.
        batch: ``input_ids`` (or ``inputs_embeds``), ``labels`` and any other input the base model takes
            (``attention_mask``, ``position_ids``); a ``num_items_in_batch`` entry is not passed on.
        num_items_in_batch: the divisor of the summed loss (Hugging Face's gradient accumulation passes the target
            tokens of all micro-batches); ``None`` averages over this batch's target tokens.
        chunk_tokens: tokens per chunk; ``None`` sizes chunks to 64 MiB of fp32 logits.

    Returns:
        The scalar loss, differentiable with respect to the model's parameters.

    Raises:
        TypeError: for a ``batch`` that is not a mapping of the model's inputs, a model with no separate base model and
            head, or one wrapped by ``DistributedDataParallel``.
        ValueError: when ``batch`` has no ``labels``.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"causal_lm_loss(model, batch): batch must be a mapping of the model's inputs, as a Hugging "
                        f"Face tokenizer or collator makes it, with 'input_ids' (or 'inputs_embeds') and 'labels' (the "
                        f"token ids to predict, -100 where ignored; shifted here as Hugging Face shifts them), and any "
                        f"other input such as 'attention_mask'; got {_described(batch)}. For a tensor of token ids: "
                        f"causal_lm_loss(model, {{'input_ids': ids, 'labels': ids}}).")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError("causal_lm_loss() runs the model's base and head directly, which would bypass "
                        f"{type(model).__name__}'s gradient synchronisation: pass the model it wraps, under a "
                        "strategy that synchronises gradients itself (lsp_offload_ddp, Lightning's DDP around a "
                        "LightningModule), or use the model's own loss.")
    if "labels" not in batch:
        raise ValueError("causal_lm_loss() needs batch['labels'] (the token ids to predict, -100 where ignored).")
    hidden, head = hidden_and_head(model, batch)
    return head_loss(hidden, head, batch["labels"], transform=LogitTransform.of(model.config),
                     num_items_in_batch=num_items_in_batch, chunk_tokens=chunk_tokens)


def _described(value: object) -> str:
    """A value as an error names it: a tensor by its shape and dtype, a sequence by its items' kinds."""
    if isinstance(value, Tensor):
        return f"a Tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(item).__name__ for item in value[:4])})"
    return f"a {type(value).__name__}"


def hidden_and_head(model: nn.Module, batch: Mapping[str, Any]) -> tuple[Tensor, nn.Module]:
    """The final hidden states of a Hugging Face causal LM on ``batch`` (its base model's output; ``labels`` and
    ``num_items_in_batch`` are not passed on), and its output head.

    Raises:
        TypeError: for a model with no separate base model and head.
    """
    if getattr(model, "_orig_mod", None) is not None or getattr(model, "_compiled_call_impl", None) is not None:
        warnings.warn("causal_lm_loss() runs the model's base model and its head itself, so torch.compile around the "
                      "whole model is bypassed (it runs uncompiled). Compile the base model instead, e.g. "
                      "model.model.compile() (or each block).", stacklevel=3)
    base, head = base_and_head(model)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_items_in_batch")}
    out = base(**inputs, return_dict=True)
    if getattr(out, "last_hidden_state", None) is None:
        raise TypeError(f"causal_lm_loss(): {type(base).__name__}, the base model of {type(model).__name__}, returned "
                        f"{type(out).__name__}, not hidden states; use the model's own loss for this model.")
    return out.last_hidden_state, head


def base_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A Hugging Face causal LM's base model (the final hidden states) and output head.

    Raises:
        TypeError: for a model with no separate base model and head.
    """
    unwrap = getattr(model, "get_base_model", None)
    if callable(unwrap):  # PEFT's PeftModel: the Hugging Face model it wraps, its adapters injected in place
        model = unwrap()
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if base is None or base is model or head is None:
        raise TypeError(f"causal_lm_loss() needs a Hugging Face causal LM with a base model and an output head "
                        f"(LlamaForCausalLM, GPT2LMHeadModel, ...); {type(model).__name__} has "
                        f"{'no base model' if base is None or base is model else 'no output embeddings'}.")
    return base, head


def shifted_targets(labels: Tensor) -> Tensor:
    """Each position's target, flattened: the next label, ``-100`` after each row's last (Hugging Face's shift)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


def head_loss(hidden: Tensor, head: nn.Module, labels: Tensor, *, transform: LogitTransform = LogitTransform(),
              num_items_in_batch: int | Tensor | None = None, chunk_tokens: int | None = None) -> Tensor:
    """The causal-LM loss of ``head(hidden)`` against ``labels``, computed chunk by chunk of tokens.

    Args:
        hidden: the final hidden states, ``batch × sequence × hidden``.
        head: the output head (an ``nn.Linear``, possibly projected by ``lsp_offload``).
        labels: ``batch × sequence`` token ids, ``-100`` where ignored; shifted here as Hugging Face does.
        transform: what the model does to the logits before the loss.
        num_items_in_batch: the divisor of the summed loss; ``None``: this batch's target tokens.
        chunk_tokens: tokens per chunk; ``None`` sizes chunks to 64 MiB of fp32 logits.
    """
    targets = shifted_targets(labels.to(hidden.device))
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = _chunk_tokens(chunk_tokens, head.weight.shape[0])
    divisor = (targets != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    spec = HeadChunks(head, transform, chunk, hidden_requires_grad=flat.requires_grad)
    return ChunkedHeadLoss.apply(flat, targets, divisor, spec, *spec.dense_parameters())


def _chunk_tokens(chunk_tokens: int | None, vocab_size: int) -> int:
    if chunk_tokens is None:
        return default_chunk_tokens(vocab_size)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1 (or None: chunks of 64 MiB of fp32 logits).")
    return chunk_tokens


@torch.no_grad()
def head_predictions(hidden: Tensor, head: nn.Module, labels: Tensor, *, transform: LogitTransform = LogitTransform(),
                     chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Evaluation without the logits: each position's summed loss and whether its argmax is its target.

    Returns:
        ``(loss, correct)``, both ``batch × sequence`` (loss 0 where the target is ignored, as at each row's end).
    """
    targets = shifted_targets(labels.to(hidden.device))
    flat = hidden.reshape(-1, hidden.shape[-1])
    spec = HeadChunks(head, transform, _chunk_tokens(chunk_tokens, head.weight.shape[0]))
    losses = torch.empty(targets.shape, dtype=torch.float32, device=flat.device)
    correct = torch.empty(targets.shape, dtype=torch.bool, device=flat.device)
    for part in spec.slices(flat.shape[0]):
        logits = spec.logits(flat[part]).float()
        losses[part] = F.cross_entropy(logits, targets[part], ignore_index=IGNORE_INDEX, reduction="none")
        correct[part] = logits.argmax(-1) == targets[part]
    return losses.view(labels.shape), correct.view(labels.shape)
