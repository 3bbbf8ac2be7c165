"""The row Adam's checkpointed state read back
(:meth:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam.load_state_dict`), state written by earlier releases
read as today's layout, or refused with the way to resume."""

from __future__ import annotations

from typing import Any

import torch

from lightning_offload.engine.rows.row_decay import DecayLedger


def load_row_adam_state(adam: Any, state: dict[str, Any]) -> None:
    """Restore ``adam`` (a :class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`) in place from its
    ``state_dict()``, or from state of earlier releases (:func:`upgrade_row_adam_state`).

    Raises:
        ValueError: For state of another layout or shape.
    """
    state = upgrade_row_adam_state(state, adam.block_rows, adam._betas)
    for name in ("exp_avg", "exp_avg_sq"):
        for dst, src in zip(getattr(adam, name), state[name]):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"Row Adam state {name} has shape {tuple(src.shape)}, expected "
                                 f"{tuple(dst.shape)}: resume with the same model and adapter configuration.")
            dst.copy_(src)
    adam.last_step.copy_(state["last_step"])
    adam.scale1.copy_(state["scale1"])
    adam.scale2.copy_(state["scale2"])
    adam._scaled = bool((adam.scale1 != 1.0).any() or (adam.scale2 != 1.0).any())
    adam.step_count = int(state["step"])
    adam._betas = tuple(state["betas"])
    adam.decay = DecayLedger(adam.num_blocks, adam.lr_scales)
    adam._legacy_gaps = None
    if "decay" in state:
        adam.decay.load_state_dict(state["decay"])
    else:  # what each block owed was kept as a count of steps: priced at the next step's rate, as it was
        gaps = adam.step_count - state["decayed_step"]
        adam._legacy_gaps = gaps if bool(gaps.any()) else None


def upgrade_row_adam_state(state: dict[str, Any], block_rows: int, betas: tuple[float, float]) -> dict[str, Any]:
    """``state`` in the block Adam's layout.

    State written by the row-sparse embedding's former ``HostRowAdam`` (one matrix, true moments, a last step per
    row) is the one-row blocks it is; state from before ``settle_decay`` existed applied every block's decay through its
    last step. State without a decay ledger keeps its ``decayed_step``: the row Adam prices what each block owed then at
    its next step.

    Args:
        state: what was checkpointed.
        block_rows: the loading optimizer's rows per block.
        betas: the loading optimizer's betas (state that kept none).

    Raises:
        ValueError: for state of another layout: per-row step counts (the lazy row Adam the block Adam replaced) or
            another block size.
    """
    if torch.is_tensor(state.get("exp_avg")):
        ones = torch.ones(state["last_step"].shape, dtype=torch.float64)
        state = {**state, "exp_avg": [state["exp_avg"]], "exp_avg_sq": [state["exp_avg_sq"]], "scale1": ones,
                 "scale2": ones, "block_rows": 1, "betas": betas}
    if "steps" in state and "last_step" not in state:
        raise ValueError("This MEFT checkpoint holds per-row Adam step counts, written by lightning_offload's "
                         "earlier lazy row Adam; its state does not carry over to the block Adam (one step count, "
                         "moments caught up over gaps). Resume it with the release that wrote it, or load only "
                         "the model's weights (its state_dict) and start the optimizer afresh.")
    if int(state["block_rows"]) != block_rows:
        raise ValueError(f"This MEFT checkpoint steps blocks of {state['block_rows']} rows, the strategy "
                         f"{block_rows}: resume with meft_offload(row_block={state['block_rows']}).")
    if "decayed_step" not in state:
        state = {**state, "decayed_step": state["last_step"]}
    return state
