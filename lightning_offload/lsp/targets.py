"""Which weights LSP-Offload projects (Linear and Hugging Face Conv1D layers chosen by size or name, never a head by
default), why the others are not, and to what size."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_offload.lsp.layouts import is_projectable, weight_shape
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.output_heads import output_heads


def compressed_size(size: int, rank: int | float) -> int:
    """The compressed size of one side of a projected weight: ``⌈rank·size⌉`` (at least 1) for a fractional rank,
    the rank itself for an integer one (which the strategy checks against ``size``)."""
    return max(1, math.ceil(rank * size)) if isinstance(rank, float) else int(rank)


# Name components of task heads in Hugging Face task models (sequence/token/image classification, question
# answering, multiple choice, pre-training heads) and of the usual hand-written ones. A head is freshly initialised
# or small and task-specific: it needs full updates, so compressing its gradient costs the most where it saves the
# least. A module is a head when any component of its qualified name is one of these (``bert.pooler.dense``,
# ``classifier.out_proj``, ``score``).
TASK_HEAD_NAMES = frozenset(
    {"classifier", "pre_classifier", "classification_head", "score", "qa_outputs", "pooler", "cls", "head"}
)


def heads_left_out(model: nn.Module) -> dict[int, str]:
    """The modules never projected by default, by identity, each with the reason the set-up's log gives.

    That is every output head (:func:`~lightning_offload.lsp.output_heads.output_heads`: declared by Hugging Face's
    ``get_output_embeddings`` on any submodule, through PEFT's wrappers, or recognised by its shape) and every
    Linear/Conv1D whose qualified name has a component in :data:`TASK_HEAD_NAMES` (classification, scoring, QA and
    pooler heads). An explicit ``target_modules`` pattern still projects them.
    """
    reasons = {key: f"output head ({head.found_by})" for key, head in output_heads(model).items()}
    for name, module in model.named_modules():
        if is_projectable(module) and not TASK_HEAD_NAMES.isdisjoint(name.split(".")):
            reasons.setdefault(id(module), "task head")
    return reasons


@dataclass
class ProjectionSelection:
    """Which Linear/Conv1D modules are projected, and why each other one is not.

    Attributes:
        selected: qualified name → module, in ``named_modules`` order.
        left_out: qualified name → why it is not projected (``"output head (…)"``, ``"task head"``,
            ``"below min_dim=128 (64×128)"``, ``"exclude_modules"``, ``"frozen"``, ``"not in target_modules"``, …).
    """

    selected: dict[str, nn.Module] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the projected modules as name patterns with counts, and what was kept out, by reason."""
        chosen = ", ".join(f"{pattern} ×{count}" if count > 1 else pattern
                           for pattern, count in name_patterns(self.selected).items()) or "nothing"
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.left_out.items():
            by_reason.setdefault(reason, []).append(name)
        # Frozen layers (a LoRA model's whole base) are counted, not listed: they train nowhere.
        kept = "; ".join(f"{len(names)} frozen" if reason == "frozen" else
                         f"{reason}: " + ", ".join(f"{pattern} ×{count}" if count > 1 else pattern
                                                   for pattern, count in name_patterns(names).items())
                         for reason, names in by_reason.items())
        return f"projects {len(self.selected)} layers: {chosen}" + (f". Not projected: {kept}" if kept else "")


def name_patterns(names: Iterable[str]) -> dict[str, int]:
    """Qualified names grouped by their pattern, indices as ``*`` (``model.layers.*.mlp.up_proj`` → 30), in first-seen
    order: how a stack's layers are named compactly."""
    patterns: dict[str, int] = {}
    for name in names:
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        patterns[pattern] = patterns.get(pattern, 0) + 1
    return patterns


def select_projected_modules(
    model: nn.Module,
    min_dim: int,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> dict[str, nn.Module]:
    """The modules whose weights are projected: :func:`projection_selection`'s ``selected``."""
    return projection_selection(model, min_dim, include, exclude).selected


def projection_selection(
    model: nn.Module,
    min_dim: int,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> ProjectionSelection:
    """Pick the modules whose weights are projected, and say why each other Linear/Conv1D is not.

    Args:
        model: the model (a LightningModule or anything holding the layers).
        min_dim: both weight dims must be at least this large (default selection only).
        include: regular expressions; when given, exactly the Linear/Conv1D modules whose qualified name matches
            one of them (``re.search``) are projected, whatever their size. Each pattern must match something.
        exclude: regular expressions of names never projected (applied after ``include``).

    Returns:
        The selection: trainable weights only, in ``named_modules`` order; output and task heads
        (:func:`heads_left_out`) kept out by default; a module already projected is skipped.

    Raises:
        ValueError: when a pattern matches no projectable module, naming the pattern and some candidates.
    """
    heads = heads_left_out(model)
    selection = ProjectionSelection()
    candidates: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not is_projectable(module) or isinstance(getattr(module, "_lsp_state", None), ProjectedWeight):
            continue
        if module.weight.requires_grad:
            candidates[name] = module
        else:
            selection.left_out[name] = "frozen"
    for pattern in list(include or ()) + list(exclude):
        if not any(re.search(pattern, name) for name in candidates):
            sample = ", ".join(list(candidates)[:5]) or "none"
            raise ValueError(
                f"Projection pattern {pattern!r} matches no trainable Linear/Conv1D module. Candidates look like: "
                f"{sample}. Fix the pattern (it is a regular expression searched in the qualified name)."
            )
    for name, module in candidates.items():
        out_features, in_features = weight_shape(module)
        if include is not None and not any(re.search(p, name) for p in include):
            why = "not in target_modules"
        elif include is None and id(module) in heads:
            why = heads[id(module)]
        elif include is None and min(out_features, in_features) < min_dim:
            why = f"below min_dim={min_dim}"
        elif any(re.search(p, name) for p in exclude):
            why = "exclude_modules"
        else:
            selection.selected[name] = module
            continue
        selection.left_out[name] = why
    return selection
