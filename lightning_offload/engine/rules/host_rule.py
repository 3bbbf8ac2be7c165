"""The host-optimizer seam: a :class:`HostRule` says how the engine steps tensors for one family of user
optimizers, and the registry finds the rule of the optimizer a user hands over.

The engine's slots never name an optimizer: a projected weight's ``Z``, a dense parameter's fp32 master and a
parameter kept on the device are each stepped by ``rule.optimizer_over(tensor, hparams)``, with the user's group
hyper-parameters ``rule.hparams_of(group)`` copied in before each step; a refit carries the state into the new
subspace by ``rule.first_moments`` (mapped linearly) and ``rule.second_moments`` (mapped element-squared); a
checkpoint records ``rule.name``. Kinds whose arithmetic is the engine's own (row-sparse embeddings and MEFT's rows,
the row Adam; the scaled rule, whose channel scales read Adam's direction) say whether a rule has them
(``rows``, ``scaled``); the scaled rule's refusals are here too, where the engine, the faces and a plan check them. A
new host optimizer is one module that builds its :class:`HostRule` and calls :func:`register_host_rule` (as
:mod:`~lightning_offload.engine.rules.lion` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer


@dataclass(frozen=True)
class HostRule:
    """How the engine steps the tensors of one family of user optimizers.

    Attributes:
        name: what a checkpoint records (a checkpoint resumes only under the same rule).
        optimizers: the user's optimizer classes it takes over (exactly these: a subclass may step differently).
        hparams: the keys of a user's param group copied into the stepping optimizer before each step.
        first_moments: state entries linear in the gradient (a refit maps them by the coordinate maps).
        second_moments: state entries of squared gradients (a refit maps them element-squared, mass kept).
        build: ``(tensor, hparams, decoupled) -> Optimizer`` stepping one tensor, on the host or the device, with
            decoupled weight decay or not (where the rule has both).
        decoupled: ``(optimizer, group) -> bool``: whether the group's weight decay multiplies the weight by
            ``1 − lr·λ`` (AdamW's) rather than adding ``λW`` to the gradient (Adam's L2).
        moments: fp32 moments it keeps per stepped element by default (what a plan counts; Adam: 2, Lion: 1).
        step_bytes: bytes of the step counter it keeps per tensor (a fused Adam's is a 4-byte tensor).
        check: ``(optimizer) -> None``: refuse a configuration of the user's optimizer the rule cannot step.
        rows: whether the engine's row Adam steps it (``embeddings="sparse"``, MEFT's adapter rows).
        scaled: whether ``update="scaled"`` can take its direction (the scaled rule's scales read Adam's).
        one_step_size: whether every element's step has one size (Lion's sign): a projected weight's expanded update
            then takes the host update's per-element RMS, which the expansion does not keep
            (:meth:`~lightning_offload.lsp.linear.ProjectedWeight.apply_update`).
        step_together: ``(optimizers) -> None``: step several of its optimizers that share a group's hyper-parameters
            at once, with each one's own results (the device Adam's vectors); ``None``: one after another.
    """

    name: str
    optimizers: tuple[type[Optimizer], ...]
    hparams: tuple[str, ...]
    first_moments: tuple[str, ...]
    second_moments: tuple[str, ...]
    build: Callable[[Tensor, dict[str, Any], bool], Optimizer]
    decoupled: Callable[[Optimizer, dict[str, Any]], bool]
    moments: int
    step_bytes: int
    check: Callable[[Optimizer], None] = lambda optimizer: None
    rows: bool = False
    scaled: bool = False
    one_step_size: bool = False
    step_together: Callable[[Sequence[Optimizer]], None] | None = None

    def hparams_of(self, group: dict[str, Any]) -> dict[str, Any]:
        """The hyper-parameters of a user group that the stepping optimizer copies before each step."""
        return {key: group[key] for key in self.hparams if key in group}

    def optimizer_over(self, tensor: Tensor, hparams: dict[str, Any], decoupled: bool = False) -> Optimizer:
        """An optimizer stepping ``tensor`` alone (one per tensor, so each steps as soon as its gradient lands), its
        weight decay decoupled or not (``False`` where the tensor's decay is applied elsewhere: ``Z`` has none)."""
        return self.build(tensor, hparams, decoupled)

    def refuse_rows(self, setting: str, instead: str) -> None:
        """Refuse a row-stepped kind under a rule the row Adam does not implement.

        Args:
            setting: what steps rows (``"embeddings='sparse'"``, :data:`MEFT_ROWS`).
            instead: what to use instead, besides Adam/AdamW.

        Raises:
            ValueError: naming ``setting`` and ``instead``, unless the rule has rows.
        """
        if not self.rows:
            raise ValueError(f"{setting} steps rows with the engine's row Adam, which has no {self.name} rule: "
                             f"the user's optimizer would silently become Adam there. Use Adam/AdamW, or {instead}.")


#: What ``meft_offload`` steps by rows, and what to train with instead (for :meth:`HostRule.refuse_rows`).
MEFT_ROWS = ("meft_offload's adapter rows", "lsp_offload or zero_offload")


def scaled_across_ranks_error() -> ValueError:
    """The refusal of the scaled rule under data parallelism."""
    return ValueError("update='scaled' trains on one process: its projected gradients are not reduced between ranks "
                      "yet. Use update='projected' with data parallelism (lsp_offload_ddp), or train on one device.")


def refuse_rule_without_scales(rule: HostRule) -> None:
    """Refuse the scaled rule under a host rule whose direction it cannot scale (wherever it is checked: the engine's
    set-up, a plan).

    Raises:
        ValueError: naming the user's optimizer and what to use instead, unless the rule has the scaled form.
    """
    if not rule.scaled:
        raise ValueError(f"update='scaled' takes its direction and scales from Adam's moments; the user's optimizer "
                         f"steps by {rule.name}. Use update='projected' (the default), or Adam/AdamW.")


_RULES: list[HostRule] = []


def register_host_rule(rule: HostRule) -> HostRule:
    """Make the engine take over ``rule.optimizers`` with ``rule`` (a later rule for the same class replaces it)."""
    taken = set(rule.optimizers)
    _RULES[:] = [known for known in _RULES if not taken & set(known.optimizers)] + [rule]
    return rule


def host_rule_for(optimizer: Optimizer) -> HostRule:
    """The rule that steps ``optimizer``'s tensors (checked against what the rule can step).

    Raises:
        TypeError: for an optimizer no rule takes over, naming the ones that have one.
    """
    for rule in _RULES:
        if type(optimizer) in rule.optimizers:
            rule.check(optimizer)
            return rule
    known = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for rule in _RULES for cls in rule.optimizers)
    raise TypeError(
        f"The offload takes over {known}, but was given {type(optimizer).__module__}.{type(optimizer).__qualname__} "
        f"(returned by configure_optimizers, or passed to offload() or fabric.setup()). Use torch.optim.AdamW(...) "
        f"(any param groups, lr, betas, eps, weight_decay) — its state will live on the host.")


def host_rule_of(optimizer_class: type[Optimizer]) -> HostRule:
    """The rule that steps ``optimizer_class``'s tensors (a class :func:`optimizer_class` returned)."""
    return next(rule for rule in _RULES if optimizer_class in rule.optimizers)


def optimizer_class(optimizer: type[Optimizer] | Optimizer | str | None) -> type[Optimizer]:
    """The user's optimizer class a plan is for: a class a rule takes, an optimizer of one, or the class's name in any
    case (``"adamw"``, ``"Lion"``); ``None`` is ``torch.optim.AdamW``.

    Raises:
        TypeError: for a class or name no rule takes, naming the ones that have one.
    """
    classes = [cls for rule in _RULES for cls in rule.optimizers]
    if optimizer is None:
        optimizer = "AdamW"
    if isinstance(optimizer, Optimizer):
        optimizer = type(getattr(optimizer, "_optimizer", optimizer))  # the user's own (a LightningOptimizer's)
    if isinstance(optimizer, str):
        found = next((cls for cls in classes if cls.__name__.lower() == optimizer.lower()), None)
    else:
        found = optimizer if optimizer in classes else None
    if found is None:
        raise TypeError(f"optimizer={optimizer!r} is not one the offload takes over; use one of "
                        f"{[cls.__name__ for cls in classes]} (a class or its name).")
    return found

