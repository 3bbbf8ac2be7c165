"""The engine's checkpoint: what :meth:`~lightning_offload.engine.optimizer.OffloadOptimizer.state_dict` writes and
what loading it checks and restores (format 2, unchanged by the split into slot kinds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_offload.engine.checkpoint_kinds import WEIGHTS_ONLY, optimizer_state_kind, torch_state_under_offload
from lightning_offload.engine.figures.telemetry import OffloadTelemetry
from lightning_offload.engine.slots.row_blocks_slot import RowBlocksSlot
from lightning_offload.engine.slots.row_slot import RowSlot
from lightning_offload.engine.slots.scaled_slot import ScaledSlot
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.engine.step.data_parallel import RankShards
from lightning_offload.engine.step.device_adam import DeviceAdam
from lightning_offload.lsp.projector import SparseProjector

STATE_FORMAT = 2


def engine_state(slots: Sequence[Slot], param_groups: list[dict[str, Any]], device_adam: DeviceAdam | None,
                 telemetry: OffloadTelemetry, ranks: RankShards | None) -> dict[str, Any]:
    """Everything needed to resume exactly: group hyper-parameters, host moments and step counts, projector
    indices and values (with the clipping norm's ``ρ`` and its probes' averages, as plain numbers), fp32 masters of
    low-precision dense parameters, rounding generators, counters.

    Call after every pending update was applied.
    """
    host_adam = {slot.name: slot.host_state() for slot in slots if slot.owned}
    # fp32 params equal their masters (restored with the model); lower-precision ones don't.
    dense_masters = {slot.name: slot.master_state() for slot in slots if slot.owned and slot.master_in_checkpoint()}
    if ranks is not None:
        # The host state is sharded: rank 0 (which writes the checkpoint) gathers every rank's share, so the
        # checkpoint is the same as one process's and resumes on any number of ranks.
        shares = ranks.gather_to_zero((host_adam, dense_masters))
        if shares is not None:
            for adam_share, master_share in shares:
                host_adam.update(adam_share)
                dense_masters.update(master_share)
        else:
            host_adam, dense_masters = {}, {}  # the other ranks' checkpoints are not written
    return {
        "format": STATE_FORMAT,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups],
        "slots": [slot.name for slot in slots],
        "host_adam": [host_adam.get(slot.name) for slot in slots],
        "device_adam": device_adam.state_dict() if device_adam is not None else None,
        "projectors": {
            slot.name: {"out": slot.layer.proj_out.state_dict(), "in": slot.layer.proj_in.state_dict(),
                        "norm_ratio": slot.layer.norm_ratio, "norm_probe": slot.layer.norm_probe.state_dict()}
            for slot in slots if slot.layer is not None
        },
        "dense_masters": dense_masters,
        "rounding_generators": {slot.name: slot.generator.get_state() for slot in slots if slot.layer is not None},
        "telemetry": telemetry.state_dict(),
    }


def check_engine_state(state: dict[str, Any], slots: Sequence[Slot], device_adam: DeviceAdam | None) -> None:
    """Refuse a checkpoint this engine cannot resume from, saying what to do instead.

    Raises:
        ValueError: for ``torch.optim`` state, another format, other tensors, a rank's share, or another placement.
    """
    if optimizer_state_kind(state) == "torch":
        raise ValueError(torch_state_under_offload())
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            "This optimizer state was not written by this version of lightning_offload's OffloadOptimizer; "
            "resume with the version and strategy that wrote the checkpoint. " + WEIGHTS_ONLY
        )
    names = [slot.name for slot in slots]
    if state["slots"] != names:
        raise ValueError(
            f"Checkpoint has offloaded tensors {state['slots'][:3]}… ({len(state['slots'])}), but this run has "
            f"{names[:3]}… ({len(names)}): resume with the same model, strategy settings (rank, density, patterns) "
            f"and optimizer groups."
        )
    if None in state["host_adam"]:
        raise ValueError("This optimizer state lacks the host Adam state of some tensors: it is a non-zero "
                         "rank's share of a data-parallel checkpoint. Resume from the checkpoint rank 0 wrote.")
    for slot, adam_state in zip(slots, state["host_adam"]):
        if isinstance(slot, RowBlocksSlot):
            continue  # its row Adam checks its own state's layout
        saved_scaled, scaled = "scaled" in adam_state, isinstance(slot, ScaledSlot)
        if saved_scaled != scaled:
            rules = ("scaled", "projected") if saved_scaled else ("projected", "scaled")
            raise ValueError(f"The checkpoint stepped {slot.name} with update={rules[0]!r}, this run with "
                             f"update={rules[1]!r}: their host states differ. Resume with update={rules[0]!r}. "
                             + WEIGHTS_ONLY)
        saved_rows = "last_step" in adam_state  # a row Adam's state, not a torch optimizer's
        rows = isinstance(slot, RowSlot)
        if saved_rows != rows:
            raise ValueError(
                f"The checkpoint stepped {slot.name} {'row-sparsely' if saved_rows else 'densely'}, this run "
                f"{'row-sparsely' if rows else 'densely'}: resume with embeddings={'sparse' if saved_rows else 'host'!r} "
                f"(checkpoints written before embeddings= existed stepped every embedding densely: embeddings='host')."
            )
    if (state.get("device_adam") is None) != (device_adam is None):
        raise ValueError("Checkpoint and this run disagree on which parameters a device Adam steps: resume with "
                         "the same embeddings= and head= settings.")


def load_engine_state(state: dict[str, Any], slots: Sequence[Slot], param_groups: list[dict[str, Any]],
                      device_adam: DeviceAdam | None, telemetry: OffloadTelemetry, device: torch.device) -> None:
    """Restore :func:`engine_state` output (checked by :func:`check_engine_state`; every pending update applied and
    every copy from the host buffers finished). Call after the model weights are restored: fp32 masters are
    refreshed from them."""
    for group, saved in zip(param_groups, state["param_groups"]):
        group.update(saved)
    for slot, adam_state in zip(slots, state["host_adam"]):
        if slot.owned:  # a tensor another rank steps keeps no host state here
            slot.load_host_state(adam_state)
        if slot.layer is not None:
            saved = state["projectors"][slot.name]
            slot.layer.set_projectors(SparseProjector.from_state_dict(saved["out"], device),
                                      SparseProjector.from_state_dict(saved["in"], device))
            slot.layer.norm_ratio = float(saved.get("norm_ratio", 1.0))
            # The probes' averages and draw count (lsp/norm_probe.py); absent from checkpoints written before them.
            slot.layer.norm_probe.load_state_dict(saved.get("norm_probe"), device)
            slot.generator.set_state(state["rounding_generators"][slot.name])
        elif slot.owned and slot.keeps_master:
            slot.load_master(state["dense_masters"].get(slot.name))
    if device_adam is not None:
        device_adam.load_state_dict(state["device_adam"])
    telemetry.load_state_dict(state["telemetry"])
