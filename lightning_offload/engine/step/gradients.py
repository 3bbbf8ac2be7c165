"""The engine's hooks on the model: each tensor's final gradient is handed on as soon as backward has produced it
(sent to the host, or first reduced to its owner rank), and each module's forward waits for its tensors' updates."""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.phases import DISABLED, PhaseClock
from lightning_offload.engine.lanes.ranks import RankShards, ReducedTensor
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.engine.step.gradient_edits import GradientEdits
from lightning_offload.engine.step.module_reads import conceal, expose
from lightning_offload.lsp.model_attachments import EngineHook


#: Source files whose frames a warning about the user's code looks past.
_INTERNAL = re.compile(r"[\\/](lightning_offload|torch|lightning|transformers)[\\/]")


def final_twice_error(name: str) -> RuntimeError:
    """The error for a gradient declared final twice before one step: it crossed (or was reduced) after the
    micro-batch a loop declared the last, and changed after."""
    return RuntimeError(
        f"The gradient of {name} was final twice before one optimizer step: it crossed to the host (or between "
        f"ranks) after the micro-batch the loop declared the last, and changed after. With lightning_offload.offload "
        f"or Fabric's offload strategies, set accumulation_steps to the loop's micro-batches per optimizer step "
        f"(Hugging Face: gradient_accumulation_steps), or None to send gradients at the step.")


class GradientRouting:
    """Hooks that route gradients to the slots and updates back to the modules.

    Args:
        slots: the engine's slots.
        model: the module holding the parameters (``None``: every update is applied inside the step).
        ranks: the ranks of data parallelism, or ``None``.
        device_params: parameters a device Adam steps (reduced between ranks like the rest).
        tied: ids of projected weights also used outside their module: their updates are applied inside the step.
        send: called with a slot whose final gradient should cross now.
        finish: called with a slot whose update a module's forward is about to need.
        pending: whether a slot's launched update is not applied yet (the orchestrator's records say).
        edits: told of every gradient backward leaves in a ``param.grad`` (``None``: nothing watches them).
        phases: the engine's phase clock (its hooks are charged to ``hooks``).
    """

    def __init__(self, slots: Sequence[Slot], model: torch.nn.Module | None, ranks: RankShards | None,
                 device_params: Sequence[Tensor], tied: set[int], send: Callable[[Slot], None],
                 finish: Callable[[Slot], None], pending: Callable[[Slot], bool], edits: GradientEdits | None = None,
                 phases: PhaseClock = DISABLED) -> None:
        self.ranks = ranks
        self._phases = phases
        self._send = send
        self._finish = finish
        self._pending = pending
        self._edits = edits
        # On during the closure's backward (the last micro-batch's): gradients are final and may be sent at once.
        self.collecting = False
        # Whether gradients cross only at the step (a loop with accumulation_steps=None): any backward may be the last,
        # so each one's gradient norms are measured (the step compares them with what it finds).
        self.measure_every_backward = False
        #: Whether a module's forward ran under torch.compile: its pre-hook was traced, and so cannot wait for the host.
        #: From then on the step applies every update before it returns (:meth:`Orchestrator.decide_and_launch`).
        self.compiled_forward = False
        self._hooks: list[Any] = []
        self._slots_by_module: dict[int, list[Slot]] = {}
        self._modules: list[torch.nn.Module] = []  # those with slots, in model order
        self._layers = [slot.layer for slot in slots if slot.layer is not None]
        slots = [slot for slot in slots if slot.routed]
        for slot in slots:
            if slot.layer is not None:
                slot.layer.on_grad_ready = lambda layer, slot=slot: self._timed(self._gradient_ready, slot)
                # A projected weight used outside its module's forward (``F.linear(h, layer.weight)`` elsewhere, a
                # tied use) gets a dense .grad from that use: it is compressed into S here rather than ignored.
                handle = slot.param.register_post_accumulate_grad_hook(
                    lambda param, slot=slot: self._timed(self._dense_gradient_of_projected, slot))
                slot.layer.hooks.engine_ids.add(handle.id)  # not a user's hook (lsp/weight_hooks.py)
                self._hooks.append(handle)
            else:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(
                    lambda param, slot=slot: self._timed(self._gradient_ready, slot)))
        #: Slots whose pending update is applied inside the step (no forward pre-hook can serve them).
        self.eager = list(slots) if model is None else self._attach_forward_hooks(model, slots)
        served = {id(slot) for slot in self.eager}
        self.eager += [slot for slot in slots if id(slot.param) in tied and id(slot) not in served]
        self._late_reduced: set[int] = set()
        if ranks is not None:
            self._build_reductions(slots, device_params, tied)

    def _attach_forward_hooks(self, model: torch.nn.Module, slots: Sequence[Slot]) -> list[Slot]:
        """Forward pre-hooks on every module holding an offloaded tensor; returns the slots no hook can serve."""
        by_param = {id(slot.param): slot for slot in slots}
        served: set[int] = set()
        for module in model.modules():
            if module is model:
                continue  # the root's forward need not run in training_step (Lightning calls training_step)
            owned = [by_param[id(p)] for p in module._parameters.values() if p is not None and id(p) in by_param]
            if owned:
                self._slots_by_module[id(module)] = owned
                self._modules.append(module)
                # First among the module's pre-hooks: a user's own (a max-norm renormalisation writing w.data) then
                # sees the updated weights, as it sees them after torch's step.
                # An EngineHook: a copy of the model (an EMA's deepcopy, torch.save) holds an inert hook, not the
                # engine.
                self._hooks.append(module.register_forward_pre_hook(EngineHook(self._forward_pre_hook), prepend=True))
                served.update(id(slot) for slot in owned)
        return [slot for slot in slots if id(slot) not in served]

    def _build_reductions(self, slots: Sequence[Slot], device_params: Sequence[Tensor], tied: set[int]) -> None:
        """Hand the ranks every gradient to reduce, in forward order. Gradients that are final only at the step
        (a device Adam's, a projected weight with a tied use elsewhere) come first, so their buckets are the last
        ones of backward and never hold back the launch of the others."""
        tensors = [ReducedTensor(param, lambda param=param: param.grad, param.numel(), None) for param in device_params]
        late = [slot for slot in slots if id(slot.param) in tied]
        for slot in late + [slot for slot in slots if id(slot.param) not in tied]:
            tensors.append(ReducedTensor(slot, slot.gradient, slot.gradient_numel(), slot.owner))
        self._late_reduced = {id(slot) for slot in late}
        self.ranks.on_reduced = self._reduced
        self.ranks.build(tensors)

    def _reduced(self, key: Any) -> None:
        """An owned tensor's gradient, reduced over the ranks, is in place: send it to the host."""
        if isinstance(key, Slot):
            self._send(key)

    def _timed(self, hook: Callable[..., None], *args: Any) -> None:
        """Run one of the engine's hooks, charged to the phase clock's ``hooks`` (what it calls, to its own phases)."""
        with self._phases.phase("hooks"):
            hook(*args)

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Traced, untimed (the phase clock is a context manager the compiler cannot enter). The step applies the
            # updates from now on, so the trace finds nothing pending and compiles to nothing; whatever a module does
            # owe (the first compiled forward after eager steps) is still applied here, at a graph break.
            self.compiled_forward = True
            self._before_forward(module, args)
        else:
            self._timed(self._before_forward, module, args)

    def check_user_hooks(self) -> None:
        """Say each user's gradient hook on a projected weight (:mod:`~lightning_offload.lsp.weight_hooks`): the
        layer's forward says it in eager mode; a compiled forward leaves it to the step, which calls this."""
        # The warning points at the first caller outside this package, torch and Lightning: the loop's step() call,
        # or trainer.fit(...).
        level, frame = 2, sys._getframe()
        while frame.f_back is not None and _INTERNAL.search(frame.f_code.co_filename):
            frame, level = frame.f_back, level + 1
        for layer in self._layers:
            layer.hooks.check(layer.name, layer.weight, stacklevel=level)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        owed = conceal(module)  # its own dict back first: applying the update reads the weights through it
        training = torch.is_grad_enabled()
        for slot in self._slots_by_module.get(id(module), ()):
            if self._pending(slot):
                self._finish(slot)
            if training:
                slot.unsettle()  # training sees the weights as if nothing had read them (their next step pays decay)
            elif owed:
                slot.settle()  # an evaluation forward computes with AdamW's weights: the decay idle rows owe shown

    def expose(self) -> None:
        """After a step or a settle: reads of the weights through a module that owes anything settle it first
        (:mod:`~lightning_offload.engine.step.module_reads`); a module that owes nothing has its plain dict (a compiled
        forward finds the same type every step, and nothing to trace). Nothing once the model was handed back."""
        for module in self._modules if self._hooks else ():
            if any(self._pending(slot) or slot.owes_settle() for slot in self._slots_by_module[id(module)]):
                expose(module, self._settle_module)
            else:
                conceal(module)

    def _settle_module(self, module: torch.nn.Module) -> None:
        """Apply what ``module``'s weights owe: its pending updates, and the decay its idle rows owe."""
        for slot in self._slots_by_module[id(module)]:
            if self._pending(slot):
                self._finish(slot)
            slot.settle()

    def _dense_gradient_of_projected(self, slot: Slot) -> None:
        layer = slot.layer
        if layer.sampling or slot.param.grad is None:
            return  # a projector fit is sampling full gradients: they are its to consume
        if self.ranks is not None and id(slot) not in self._late_reduced and self.collecting:
            raise ValueError(
                f"The projected weight {slot.name}.weight is used outside its module's forward, which data "
                f"parallelism cannot reduce: its compressed gradient may already be on its way to another rank. Call "
                f"the module instead of using its weight directly, or exclude it with exclude_modules=[...]."
            )
        if all(eager is not slot for eager in self.eager):
            # Its pending update cannot wait for the module's next forward (a forward pre-hook): the outside use may
            # come first and would read the old weight. It is applied inside the step instead.
            self.eager.append(slot)
            warnings.warn(
                f"The projected weight {slot.name}.weight is used outside its module's forward, so autograd gives it "
                f"a full gradient there. It is compressed into the layer's S (exact: projection is linear), which "
                f"costs one full-size gradient on the device per such backward, and its update is applied inside "
                f"each step rather than overlapped with the next forward. Call the module instead of using its "
                f"weight directly, or exclude it with exclude_modules=[...], to avoid this.",
                stacklevel=2,
            )
        grad, slot.param.grad = slot.param.grad, None
        layer.accumulate_dense(grad)

    def _gradient_ready(self, slot: Slot) -> None:
        # Called from autograd during backward: on the last micro-batch, start this gradient's trip at once (with
        # data parallelism, first its reduction to the owner rank, which sends it on once that completes).
        if self._edits is not None and slot.gradient_is_param_grad:
            self._edits.backward_wrote(slot, measure=self.collecting or self.measure_every_backward)
        if not self.collecting:
            return
        if self.ranks is None:
            self._send(slot)
        elif id(slot) not in self._late_reduced:
            if self.ranks.is_ready(slot):
                raise final_twice_error(slot.name)
            self.ranks.ready(slot)

    def add_late(self, slot: Slot) -> None:
        """Route a slot that joined after set-up (late_params.py): its gradient crosses as backward leaves it, and its
        update is applied inside the step (no forward pre-hook of its module was set up for it)."""
        self._hooks.append(slot.param.register_post_accumulate_grad_hook(
            lambda param, slot=slot: self._timed(self._gradient_ready, slot)))
        self.eager.append(slot)

    def remove(self) -> None:
        """Remove every hook, and give every module its own parameter dict back (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._modules:
            conceal(module)
        for layer in self._layers:
            layer.on_grad_ready = None
