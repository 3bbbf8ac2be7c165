"""Checkpointed row Adam state written by earlier releases, read as today's layout
(:meth:`~lightning_offload.engine.block_row_adam.BlockRowAdam.load_state_dict`), or refused with the way to resume."""

from __future__ import annotations

from typing import Any

import torch


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
