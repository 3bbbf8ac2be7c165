"""What wrote a checkpoint's optimizer state, and what to do when a run resumes it under another strategy.

The model's weights are the same under every strategy (the ``state_dict`` keys are unchanged), but the optimizer
state is not: plain Lightning saves a ``torch.optim`` state (full-size Adam moments), the offload strategies their
host state (compressed moments for projected weights, host Adam per tensor). Neither continues the other's; both can
start afresh from the other's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The key of the offload optimizer's state format in its saved state.
OFFLOAD_FORMAT_KEY = "format"

WEIGHTS_ONLY = (
    "To continue under this strategy from that checkpoint's weights, with a fresh optimizer (step 0), load only its "
    "weights: `module.load_state_dict(torch.load(path, weights_only=False)['state_dict'])` and call trainer.fit "
    "without ckpt_path (the command line: weights_from=<path> instead of ckpt_path=<path>)."
)


def optimizer_state_kind(state: Mapping[str, Any]) -> str:
    """``"offload"`` for an offload strategy's saved optimizer state, ``"torch"`` for a ``torch.optim`` one,
    ``"unknown"`` otherwise."""
    if OFFLOAD_FORMAT_KEY in state and "slots" in state:
        return "offload"
    if "state" in state and "param_groups" in state:
        return "torch"
    return "unknown"


def checkpoint_kind(checkpoint: Mapping[str, Any]) -> str:
    """The kind of a Lightning checkpoint's first optimizer state (``"none"`` when it holds no optimizer state)."""
    states = checkpoint.get("optimizer_states") or []
    return optimizer_state_kind(states[0]) if states else "none"


def written_with_projection(state: Mapping[str, Any]) -> bool:
    """Whether an offload optimizer state holds projected state (projectors, or the scaled rule's): ``lsp_offload``
    wrote it. ``False``: ``zero_offload`` or ``meft_offload`` did (or an ``lsp_offload`` run that projected nothing)."""
    return bool(state.get("projectors")) or any(
        isinstance(saved, Mapping) and "scaled" in saved for saved in state.get("host_adam") or [])


def other_offload_strategy(written: str, run: str) -> str:
    """The message for an offload checkpoint resumed under the other offload strategy (``written`` wrote it, the run
    has ``run``)."""
    return (f"This checkpoint was written by {written}, and this run trains with {run}: the two keep different host "
            f"state (compressed moments of projected weights against full ones), so neither resumes the other. "
            f"Resume it with {written} (the command line: the offload group that wrote it), or start from its "
            f"weights. " + WEIGHTS_ONLY)


def torch_state_under_offload() -> str:
    """The message for a plain Lightning checkpoint resumed by an offload strategy."""
    return ("This checkpoint was written without an offload strategy: its optimizer state is a plain torch.optim "
            "state (full-size Adam moments), which the offload strategies' host state cannot continue. "
            + WEIGHTS_ONLY)


def offload_state_without_offload(strategy: str) -> str:
    """The message for an offload checkpoint resumed without an offload strategy (``strategy`` names the run's)."""
    return (f"This checkpoint was written by a lightning_offload strategy: its optimizer state is the offload "
            f"strategies' host state, which {strategy} cannot load into a torch.optim optimizer. Resume it with the "
            f"offload strategy and settings that wrote it, or start from its weights only. " + WEIGHTS_ONLY)


def refuse_other_kind(name: str, saved: Mapping[str, Any], scaled: bool, rows: bool) -> None:
    """Refuse a tensor's saved host state when another kind of slot wrote it: the scaled rule's state (it carries
    ``"scaled"``) or a row Adam's (it carries ``"last_step"``) against this run's kind of slot for ``name``.

    Args:
        name: the tensor's name in the model.
        saved: its host state in the checkpoint.
        scaled: whether this run steps it by the scaled rule.
        rows: whether this run steps it row by row.

    Raises:
        ValueError: naming the setting that wrote the state and the one to resume with.
    """
    saved_scaled = "scaled" in saved
    if saved_scaled != scaled:
        rules = ("scaled", "projected") if saved_scaled else ("projected", "scaled")
        raise ValueError(f"The checkpoint stepped {name} with update={rules[0]!r}, this run with "
                         f"update={rules[1]!r}: their host states differ. Resume with update={rules[0]!r}. "
                         + WEIGHTS_ONLY)
    saved_rows = "last_step" in saved  # a row Adam's state, not a torch optimizer's
    if saved_rows != rows:
        raise ValueError(
            f"The checkpoint stepped {name} {'row-sparsely' if saved_rows else 'densely'}, this run "
            f"{'row-sparsely' if rows else 'densely'}: resume with embeddings={'sparse' if saved_rows else 'host'!r}."
        )
