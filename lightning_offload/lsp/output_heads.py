"""A model's output heads, found wherever the user's model keeps them.

The output head maps the last hidden states to the vocabulary. It is not projected by the layer selection (a small
head projected cost measured runs a fifth of AdamW's gain); ``head=`` places it, by default by its size (dense on the
host, projected from 2**27 elements: setup/embeddings_head.py). So it must be found in every model a user brings,
not only in a bare Hugging Face model:

1. **Declared**: what any submodule's ``get_output_embeddings()`` returns (a Hugging Face model, under any attribute
   of a LightningModule). A wrapper returned there (PEFT's ``ModulesToSaveWrapper``, which keeps the frozen original
   and a trainable copy per adapter; a LoRA layer) is looked into: every Linear/Conv1D inside it is a head.
2. **By shape**, only when nothing declares a head (a plain ``nn.Module`` LM, Lightning's demo ``Transformer``): a
   Linear/Conv1D that holds an ``nn.Embedding``'s weight (tied), or whose weight has the transposed shape of one
   (``hidden → vocabulary``). Several layers of that shape are a stack's layers, not a head (a position embedding of
   ``max_len × hidden`` matches every ``hidden → 4·hidden`` FFN layer of a model with ``max_len = 4·hidden``); among
   them, the one module outside any indexed container (no all-digit component in its name: ``lm_head`` beside
   ``layers.3.q_proj`` when the vocabulary equals the hidden size) is the head, else none is.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# is_projectable is re-exported: its import path of before the layouts (lsp/layouts) decided it.
from lightning_offload.lsp.layouts import is_projectable, weight_shape


@dataclass(frozen=True)
class OutputHead:
    """One output head of a model.

    Attributes:
        name: its qualified name in the model.
        module: the Linear/Conv1D.
        found_by: how it was recognised, for the log (``"get_output_embeddings"``, ``"shape of embedding 'emb'"``).
    """

    name: str
    module: nn.Module
    found_by: str


def output_heads(model: nn.Module) -> dict[int, OutputHead]:
    """The output heads of ``model`` by module identity, in ``named_modules`` order (see the module docstring)."""
    names = {id(module): name for name, module in model.named_modules()}
    heads = _declared_heads(model, names)
    return heads if heads else _heads_by_shape(model, names)


def _declared_heads(model: nn.Module, names: dict[int, str]) -> dict[int, OutputHead]:
    heads: dict[int, OutputHead] = {}
    for owner_name, owner in model.named_modules():
        getter = getattr(owner, "get_output_embeddings", None)
        if not callable(getter):
            continue
        try:
            head = getter()
        except (NotImplementedError, AttributeError):  # a base class that declares the method but has no head
            continue
        if not isinstance(head, nn.Module) or id(head) not in names:
            continue
        owner_label = owner_name or type(owner).__name__
        for inner in head.modules():
            if is_projectable(inner) and id(inner) in names and id(inner) not in heads:
                wrapped = "" if inner is head else f", inside its {type(head).__name__}"
                heads[id(inner)] = OutputHead(names[id(inner)], inner,
                                              f"{owner_label}.get_output_embeddings(){wrapped}")
    return heads


def _heads_by_shape(model: nn.Module, names: dict[int, str]) -> dict[int, OutputHead]:
    layers = [(name, module) for name, module in model.named_modules() if is_projectable(module)]
    heads: dict[int, OutputHead] = {}
    for embedding_name, embedding in model.named_modules():
        if not isinstance(embedding, nn.Embedding):
            continue
        tied = [(name, module) for name, module in layers if module.weight is embedding.weight]
        for name, module in tied:
            heads.setdefault(id(module), OutputHead(name, module, f"holds the weight of embedding {embedding_name!r}"))
        vocabulary, hidden = embedding.weight.shape
        shaped = [(name, module) for name, module in layers
                  if weight_shape(module) == (vocabulary, hidden) and id(module) not in heads]
        if len(shaped) > 1:
            # A stack's layers repeat their shape under indexed containers; a head sits outside them.
            shaped = [(name, module) for name, module in shaped if not any(part.isdigit() for part in name.split("."))]
        if len(shaped) == 1:
            name, module = shaped[0]
            heads[id(module)] = OutputHead(name, module, f"maps {hidden} features to the {vocabulary} rows of "
                                                         f"embedding {embedding_name!r}")
    order = {key: position for position, key in enumerate(names)}
    return {key: heads[key] for key in sorted(heads, key=order.__getitem__)}
