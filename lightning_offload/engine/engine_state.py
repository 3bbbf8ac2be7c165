"""The engine's checkpoint: what :meth:`~lightning_offload.engine.optimizer.OffloadOptimizer.state_dict` writes and
what loading it checks and restores (format 2, unchanged by the split into slot kinds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_offload.engine.checkpoint_kinds import WEIGHTS_ONLY, optimizer_state_kind, torch_state_under_offload
from lightning_offload.engine.figures.telemetry import OffloadTelemetry
from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.rules.host_rule import HostRule
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.engine.step.device_optimizer import DeviceOptimizer

STATE_FORMAT = 2


def engine_state(slots: Sequence[Slot], param_groups: list[dict[str, Any]], device_optimizer: DeviceOptimizer | None,
                 telemetry: OffloadTelemetry, ranks: RankShards | None, rule: HostRule) -> dict[str, Any]:
    """Everything needed to resume exactly: group hyper-parameters, host moments and step counts, projector
    indices and values (with the clipping norm's ``ρ`` and its probes' averages, as plain numbers), fp32 masters of
    low-precision dense parameters, rounding generators, counters, and the host rule that wrote the state.

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
    # Sections other kinds of slot write for themselves (a projected weight's projectors and rounding generator).
    parts: dict[str, dict[str, Any]] = {"projectors": {}, "rounding_generators": {}}
    for slot in slots:
        for section, value in slot.checkpoint_part().items():
            parts[section][slot.name] = value
    return {
        "format": STATE_FORMAT,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups],
        "slots": [slot.name for slot in slots],
        "host_adam": [host_adam.get(slot.name) for slot in slots],
        "device_adam": device_optimizer.state_dict() if device_optimizer is not None else None,
        "projectors": parts["projectors"],
        "dense_masters": dense_masters,
        "rounding_generators": parts["rounding_generators"],
        "telemetry": telemetry.state_dict(),
        "host_rule": rule.name,
    }


def check_engine_state(state: dict[str, Any], slots: Sequence[Slot], device_optimizer: DeviceOptimizer | None,
                       rule: HostRule) -> None:
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
            f"{names[:3]}… ({len(names)}): resume with the same model, strategy settings (rank, density, patterns, "
            f"embeddings, head, vectors) and optimizer groups. A checkpoint that holds the norm weights and biases "
            f"among them stepped them on the host: resume it with vectors='host'."
        )
    saved_rule = state["host_rule"]
    if saved_rule != rule.name:
        raise ValueError(f"This optimizer state was written by {saved_rule}, and this run steps by {rule.name}: their "
                         f"states differ. Resume with the optimizer that wrote it. " + WEIGHTS_ONLY)
    if None in state["host_adam"]:
        raise ValueError("This optimizer state lacks the host Adam state of some tensors: it is a non-zero "
                         "rank's share of a data-parallel checkpoint. Resume from the checkpoint rank 0 wrote.")
    for slot, adam_state in zip(slots, state["host_adam"]):
        slot.check_saved_state(adam_state)
    saved_device = state.get("device_adam")
    if (saved_device is None) != (device_optimizer is None) or (
            device_optimizer is not None and len(saved_device["adam"]) != len(device_optimizer.entries)):
        raise ValueError("Checkpoint and this run disagree on which parameters a device Adam steps: resume with "
                         "the same embeddings=, head= and vectors= settings.")


def load_engine_state(state: dict[str, Any], slots: Sequence[Slot], param_groups: list[dict[str, Any]],
                      device_optimizer: DeviceOptimizer | None, telemetry: OffloadTelemetry) -> None:
    """Restore :func:`engine_state` output (checked by :func:`check_engine_state`; every pending update applied and
    every copy from the host buffers finished). Call after the model weights are restored: fp32 masters are
    refreshed from them."""
    for group, saved in zip(param_groups, state["param_groups"]):
        group.update(saved)
    for slot, adam_state in zip(slots, state["host_adam"]):
        if slot.owned:  # a tensor another rank steps keeps no host state here
            slot.load_host_state(adam_state)
        slot.load_checkpoint_part(state)
        if slot.owned and slot.keeps_master:
            slot.load_master(state["dense_masters"].get(slot.name))
    if device_optimizer is not None:
        device_optimizer.load_state_dict(state["device_adam"])
    telemetry.load_state_dict(state["telemetry"])
