"""The row Adam's checkpointed state read back
(:meth:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam.load_state_dict`), or refused with the way to
resume."""

from __future__ import annotations

from typing import Any

from lightning_offload.engine.rows.row_decay import DecayLedger

#: What :meth:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam.state_dict` writes.
STATE_KEYS = frozenset({"exp_avg", "exp_avg_sq", "scale1", "scale2", "step", "last_step", "decay", "block_rows",
                        "betas"})


def load_row_adam_state(adam: Any, state: dict[str, Any]) -> None:
    """Restore ``adam`` (a :class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`) in place from its
    ``state_dict()``.

    Raises:
        ValueError: For state of another layout (another block size, or not the block Adam's) or shape.
    """
    missing = STATE_KEYS - set(state)
    if missing:
        raise ValueError(f"This row Adam state lacks {sorted(missing)}: it was not written by this version's block "
                         f"Adam. Resume with the version that wrote it, or load only the model's weights (its "
                         f"state_dict) and start the optimizer afresh.")
    if int(state["block_rows"]) != adam.block_rows:
        raise ValueError(f"This MEFT checkpoint steps blocks of {state['block_rows']} rows, the strategy "
                         f"{adam.block_rows}: resume with meft_offload(row_block={state['block_rows']}).")
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
    adam.decay.load_state_dict(state["decay"])
