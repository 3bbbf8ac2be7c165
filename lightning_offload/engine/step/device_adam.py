"""Adam on the device for the parameters an offload strategy is told to keep there (``embeddings="device"`` or
``head="device"``): their state costs device memory, but their step costs neither link bytes nor host time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.slots.slot import Clip, clip_


class DeviceAdam:
    """``torch.optim.Adam`` (fused) on the device over some of the user's parameters, with the user's groups.

    A parameter stored narrower than fp32 (``bf16-true``) gets an fp32 master on the device, as the host path keeps
    one on the host, and is rounded to nearest from it after each step; fp32 parameters are stepped in place.

    Args:
        params: ``(parameter, user param group, decoupled weight decay?)`` for each kept parameter.
    """

    def __init__(self, params: Sequence[tuple[Tensor, dict[str, Any], bool]]) -> None:
        self.entries: list[tuple[Tensor, Tensor | None, dict[str, Any], torch.optim.Adam]] = []
        for param, group, decoupled in params:
            master = param.detach().float() if param.dtype != torch.float32 else None
            stepped = master if master is not None else param
            # One fused Adam per tensor (one launch on a GPU), with the user's hyper-parameters copied in each step.
            adam = torch.optim.Adam([{"params": [stepped], "decoupled_weight_decay": decoupled}], fused=True)
            self.entries.append((param, master, group, adam))

    @property
    def params(self) -> list[Tensor]:
        """The parameters stepped here."""
        return [param for param, _, _, _ in self.entries]

    @torch.no_grad()
    def step(self, clip: Clip, hparams_of: Any) -> None:
        """Clip each gradient as the step decided, then step every parameter that has one.

        Args:
            clip: the step's clipping (the same the host jobs apply).
            hparams_of: ``group -> dict`` of Adam hyper-parameters to copy into the step.
        """
        for param, _, _, _ in self.entries:
            if param.grad is not None:
                clip_(param.grad, clip)
        for param, master, group, adam in self.entries:
            grad = param.grad
            if grad is None:
                continue
            adam.param_groups[0].update(hparams_of(group))
            if master is not None:
                master.grad = grad.float()
            adam.step()
            if master is not None:
                master.grad = None
                param.copy_(master)

    def state_bytes(self) -> int:
        """Device bytes of Adam state and fp32 masters."""
        total = 0
        for _, master, _, adam in self.entries:
            if master is not None:
                total += master.numel() * master.element_size()
            for state in adam.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total

    def state_dict(self) -> dict[str, Any]:
        """Each tensor's Adam state and fp32 master (moved to the CPU: a checkpoint is host data)."""
        return {
            "adam": [_to_cpu(adam.state_dict()) for _, _, _, adam in self.entries],
            "masters": [master.cpu() if master is not None else None for _, master, _, _ in self.entries],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` onto the device (call after the model weights are restored)."""
        for (param, master, _, adam), saved, saved_master in zip(self.entries, state["adam"], state["masters"]):
            adam.load_state_dict(saved)  # torch moves the state to the parameter's device
            if master is not None:
                master.copy_(saved_master if saved_master is not None else param.detach())


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value
