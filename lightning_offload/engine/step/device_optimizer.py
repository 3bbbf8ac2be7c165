"""The user's optimizer on the device for the parameters an offload strategy is told to keep there
(``embeddings="device"`` or ``head="device"``): their state costs device memory, but their step costs neither link
bytes nor host time."""

from __future__ import annotations

from collections.abc import Sequence, Set as AbstractSet
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.rules.host_rule import HostRule
from lightning_offload.engine.slots.slot import Clip, clip_
from lightning_offload.engine.slots.weight_fingerprint import fingerprint
from lightning_offload.inner_optimizers import step_unhooked


class DeviceOptimizer:
    """The host rule's optimizer (a fused ``torch.optim.Adam`` for Adam/AdamW) on the device over some of the user's
    parameters, with the user's groups.

    A parameter stored narrower than fp32 (``bf16-true``) gets an fp32 master on the device, as the host path keeps
    one on the host, and is rounded to nearest from it after each step; fp32 parameters are stepped in place. A write
    into such a parameter between steps (``p.data.mul_(0.5)``, an EMA copied back, loaded weights) is kept, as
    ``torch.optim`` keeps it: its fingerprint (:mod:`~lightning_offload.engine.slots.weight_fingerprint`) moved since
    the engine's write, so the master is taken from it before the step.

    Args:
        params: ``(parameter, user param group, decoupled weight decay?)`` for each kept parameter.
        rule: how the user's optimizer steps a tensor (:mod:`~lightning_offload.engine.rules`).
        names: the parameters' names in the model, in ``params``' order. Default: none.
    """

    def __init__(self, params: Sequence[tuple[Tensor, dict[str, Any], bool]], rule: HostRule,
                 names: Sequence[str] = ()) -> None:
        self.rule = rule
        #: The parameters' names in the model, in :attr:`entries`' order (what a checkpoint's conversion matches).
        self.names = list(names)
        self.entries: list[tuple[Tensor, Tensor | None, dict[str, Any], Optimizer]] = []
        for param, group, decoupled in params:
            master = param.detach().float() if param.dtype != torch.float32 else None
            stepped = master if master is not None else param
            # One optimizer per tensor (a fused Adam is one launch on a GPU), with the user's hyper-parameters copied
            # in at each step.
            self.entries.append((param, master, group, rule.optimizer_over(stepped, {}, decoupled)))
        #: Each master-keeping parameter's fingerprint at the engine's last write into it, by identity.
        self.fingerprints: dict[int, Tensor] = {}
        self._fingerprint_written()

    @property
    def params(self) -> list[Tensor]:
        """The parameters stepped here."""
        return [param for param, _, _, _ in self.entries]

    @property
    def watched(self) -> list[Tensor]:
        """The parameters kept beside an fp32 master, whose writes between steps :meth:`step` must see."""
        return [param for param, master, _, _ in self.entries if master is not None]

    def watched_fingerprints(self) -> list[Tensor]:
        """The fingerprints of :attr:`watched` at the engine's last write, in its order."""
        return [self.fingerprints[id(param)] for param in self.watched]

    @torch.no_grad()
    def step(self, clip: Clip, written: AbstractSet[int] = frozenset()) -> None:
        """Clip each gradient as the step decided (the same clipping the host jobs apply), then step every parameter
        that has one, with its group's hyper-parameters as they are now.

        Args:
            clip: the step's clipping.
            written: identities of :attr:`watched` parameters written since the engine's last write (their
                fingerprints moved): their masters step from what they hold now.
        """
        by_group: dict[int, list[Optimizer]] = {}
        for param, master, group, optimizer in self.entries:
            if master is not None and id(param) in written:
                master.copy_(param)
            grad = param.grad
            if grad is None:
                continue
            optimizer.param_groups[0].update(self.rule.hparams_of(group))
            if master is not None:
                # Clipped in fp32, as the host jobs clip a gradient that crossed: the same bits on either side.
                master.grad = grad.float()
            clip_(master.grad if master is not None else grad, clip)
            by_group.setdefault(id(group), []).append(optimizer)
        for optimizers in by_group.values():
            # The user's optimizer hooks are for their step (inner_optimizers.py): these steps run without them.
            if self.rule.step_together is not None:
                self.rule.step_together(optimizers)  # one fused call for a group's vectors, each one's own bits
            else:
                for optimizer in optimizers:
                    step_unhooked(optimizer)
        for param, master, _, _ in self.entries:
            if master is not None and master.grad is not None:
                master.grad = None
                param.copy_(master)
        self._fingerprint_written()

    def _fingerprint_written(self) -> None:
        """Fingerprint every master-keeping parameter as the engine left it (on the device: no synchronisation)."""
        for param in self.watched:
            self.fingerprints[id(param)] = fingerprint(param)

    def state_bytes(self) -> int:
        """Device bytes of the optimizer's state and fp32 masters."""
        total = 0
        for _, master, _, optimizer in self.entries:
            if master is not None:
                total += master.numel() * master.element_size()
            for state in optimizer.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total

    def state_dict(self) -> dict[str, Any]:
        """Each tensor's optimizer state and fp32 master (moved to the CPU: a checkpoint is host data)."""
        return {
            "adam": [_to_cpu(optimizer.state_dict()) for _, _, _, optimizer in self.entries],  # key kept: format 2
            "masters": [master.cpu() if master is not None else None for _, master, _, _ in self.entries],
            "names": self.names,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` onto the device (call after the model weights are restored)."""
        for (param, master, _, optimizer), saved, saved_master in zip(self.entries, state["adam"], state["masters"]):
            optimizer.load_state_dict(saved)  # torch moves the state to the parameter's device
            if master is not None:
                master.copy_(saved_master if saved_master is not None else param.detach())
        self._fingerprint_written()  # the restored weights are the engine's: its masters hold them


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value
