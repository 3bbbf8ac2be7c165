"""Which weights LSP-Offload projects (Linear and Hugging Face Conv1D layers chosen by size or name),
and to what size."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from torch import nn

from lightning_offload.lsp.linear import ProjectedWeight, is_hf_conv1d


def compressed_size(size: int, rank: int | float) -> int:
    """The compressed size of one side of a projected weight: ``⌈rank·size⌉`` (at least 1) for a fractional rank,
    the rank itself for an integer one (which the strategy checks against ``size``)."""
    return max(1, math.ceil(rank * size)) if isinstance(rank, float) else int(rank)


def _is_projectable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


# Name components of task heads in Hugging Face task models (sequence/token/image classification, question
# answering, multiple choice, pre-training heads) and of the usual hand-written ones. A head is freshly initialised
# or small and task-specific: it needs full updates, so compressing its gradient costs the most where it saves the
# least. A module is a head when any component of its qualified name is one of these (``bert.pooler.dense``,
# ``classifier.out_proj``, ``score``).
TASK_HEAD_NAMES = frozenset(
    {"classifier", "pre_classifier", "classification_head", "score", "qa_outputs", "pooler", "cls", "head"}
)


def output_heads(model: nn.Module) -> set[int]:
    """Identities of the modules that produce a model's output, never projected by default.

    That is every module Hugging Face's ``get_output_embeddings`` returns (the LM head, found on any submodule, so
    a LightningModule holding a transformers model under any attribute name is covered) and every Linear/Conv1D
    whose qualified name has a component in :data:`TASK_HEAD_NAMES` (classification, scoring, QA and pooler heads).
    An explicit ``target_modules`` pattern still projects them.
    """
    heads: set[int] = set()
    for name, module in model.named_modules():
        getter = getattr(module, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module):
            heads.add(id(head))
        if _is_projectable(module) and not TASK_HEAD_NAMES.isdisjoint(name.split(".")):
            heads.add(id(module))
    return heads


def select_projected_modules(
    model: nn.Module,
    min_dim: int,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> dict[str, nn.Module]:
    """Pick the modules whose weights are projected.

    Args:
        model: the model (a LightningModule or anything holding the layers).
        min_dim: both weight dims must be at least this large (default selection only).
        include: regular expressions; when given, exactly the Linear/Conv1D modules whose qualified name matches
            one of them (``re.search``) are projected, whatever their size. Each pattern must match something.
        exclude: regular expressions of names never projected (applied after ``include``).

    Returns:
        Qualified name → module, in ``named_modules`` order; trainable weights only; output and task heads
        (:func:`output_heads`) excluded by default; a module already projected is skipped.

    Raises:
        ValueError: when a pattern matches no projectable module, naming the pattern and some candidates.
    """
    heads = output_heads(model)
    candidates = {
        name: module
        for name, module in model.named_modules()
        if _is_projectable(module) and module.weight.requires_grad and not isinstance(
            getattr(module, "_lsp_state", None), ProjectedWeight
        )
    }
    for pattern in list(include or ()) + list(exclude):
        if not any(re.search(pattern, name) for name in candidates):
            sample = ", ".join(list(candidates)[:5]) or "none"
            raise ValueError(
                f"Projection pattern {pattern!r} matches no trainable Linear/Conv1D module. Candidates look like: "
                f"{sample}. Fix the pattern (it is a regular expression searched in the qualified name)."
            )
    selected: dict[str, nn.Module] = {}
    for name, module in candidates.items():
        if include is not None:
            chosen = any(re.search(p, name) for p in include)
        else:
            out_features, in_features = ProjectedWeight.weight_shape(module)
            chosen = min(out_features, in_features) >= min_dim and id(module) not in heads
        if chosen and not any(re.search(p, name) for p in exclude):
            selected[name] = module
    return selected
