"""``choose(model, ...)``: the strategy, rank, placements, batch size and gradient checkpointing that fit the device
(and a time budget, if given) with the best predicted throughput, and why each alternative was rejected.

Every candidate is a :func:`~lightning_offload.planning.plan.plan` on the same calibrated hardware (measured once);
activations are measured once per projection and scaled with the batch (they are linear in it), so a grid of a
hundred candidates costs seconds even for a 6.7B model on the meta device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_offload.planning.calibration import Hardware, hardware as hardware_of
from lightning_offload.planning.plan import PRECISIONS, Plan, parse_bytes, plan
from lightning_offload.planning.report import gib

#: The candidates tried when not given: where embeddings and head train under lsp_offload.
PLACEMENTS = (("sparse", "host"), ("sparse", "projected"), ("host", "host"), ("device", "device"))
#: Predicted throughputs within this share of each other count as equal: the candidate earlier in the grid wins
#: (larger rank, no checkpointing, plain training before offloading).
TIE = 0.05


@dataclass(frozen=True)
class Candidate:
    """One combination tried, its plan (``None`` when it could not be planned) and why it lost."""

    strategy: str
    settings: dict[str, Any]
    batch_size: int
    gradient_checkpointing: bool
    plan: Plan | None
    rejected: str = ""

    def describe(self) -> str:
        """The combination in one line."""
        shown = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return (f"{self.strategy}({shown}) batch {self.batch_size}"
                f"{', checkpointing' if self.gradient_checkpointing else ''}")


@dataclass(frozen=True)
class Choice:
    """The chosen run and every alternative with the reason it was rejected.

    Attributes:
        best: the chosen candidate (``None`` when nothing fits).
        candidates: every candidate tried, the chosen one included (its ``rejected`` empty).
    """

    best: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def plan(self) -> Plan | None:
        """The chosen candidate's plan."""
        return self.best.plan if self.best is not None else None

    def table(self, rejected: int = 12) -> str:
        """The choice and up to ``rejected`` of the rejected candidates (the fastest first), as text."""
        if self.best is None:
            lines = ["Nothing fits. Closest candidates:"]
        else:
            lines = [f"Chosen: {self.best.describe()}", self.best.plan.table(), "", "Rejected:"]
        # Those that fit but lost on speed first, then those that do not fit, the smallest overshoot first.
        others = sorted((c for c in self.candidates if c.rejected), key=lambda c: (
            c.plan is None, not (c.plan and c.plan.fits), -(c.plan.tokens_per_second if c.plan and c.plan.fits else 0),
            c.plan.device_bytes / c.plan.device_memory if c.plan else 0))
        lines += [f"  {c.describe()}: {c.rejected}" for c in others[:rejected]]
        if len(others) > rejected:
            lines.append(f"  … and {len(others) - rejected} more")
        return "\n".join(lines)


def _grid(strategies: Sequence[str], ranks: Sequence[float], placements: Sequence[tuple[str, str]],
          settings: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    combos: list[tuple[str, dict[str, Any]]] = []
    for strategy in strategies:
        if strategy == "auto":
            combos.append((strategy, {}))
        elif strategy == "lsp_offload":
            combos += [(strategy, {**settings, "rank": rank, "embeddings": emb, "head": head})
                       for rank, (emb, head) in itertools.product(ranks, placements)]
        elif strategy == "zero_offload":
            dense = {("host" if e == "sparse" else e, h) for e, h in placements if h != "projected"}
            combos += [(strategy, {**settings, "embeddings": emb, "head": head}) for emb, head in sorted(dense)]
        else:
            raise ValueError(f"choose() compares 'auto', 'lsp_offload' and 'zero_offload'; got {strategy!r} (plan a "
                             f"meft_offload run with plan()).")
    return combos


#: Settings that choose() takes as a grid, by the name plan() takes one value under: each singular name is refused.
GRID_ARGUMENTS = {"batch_size": "batch_sizes=[...]", "gradient_checkpointing": "checkpointing=[...]",
                  "rank": "ranks=[...]", "strategy": "strategies=[...]",
                  "embeddings": "placements=[(embeddings, head)]", "head": "placements=[(embeddings, head)]"}


def choose(model: nn.Module, *, seq_len: int, device_memory: int | float | str, precision: str = "bf16-mixed",
           hardware: str | Hardware | None = None, device: torch.device | str | None = None,
           time_budget: float | None = None, strategies: Sequence[str] = ("auto", "lsp_offload", "zero_offload"),
           ranks: Sequence[float] = (0.25, 0.125), placements: Sequence[tuple[str, str]] = PLACEMENTS,
           batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), checkpointing: Sequence[bool] = (False, True),
           host_memory: int | float | str | None = None,
           optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | str | None = None,
           **settings: Any) -> Choice:
    """The combination that fits ``device_memory`` (and the host) with the best predicted tokens per second.

    Args:
        model: as for :func:`~lightning_offload.planning.plan.plan` (``meta`` works).
        seq_len: tokens per sequence.
        device_memory: the device's memory (bytes or ``"4GiB"``).
        precision: as for ``plan``. Default: ``"bf16-mixed"``.
        hardware: a profile name, a ``Hardware`` value or ``None`` (this machine, calibrated once). Default: ``None``.
        device: the device calibrated when ``hardware`` is ``None``. Default: ``None``.
        time_budget: the longest step acceptable, in seconds. Default: ``None`` (any).
        strategies: the strategies compared. Default: ``('auto', 'lsp_offload', 'zero_offload')``.
        ranks: ``lsp_offload``'s ranks tried (larger first: at equal speed the larger one wins).
            Default: ``(0.25, 0.125)``.
        placements: ``(embeddings, head)`` pairs tried (``zero_offload`` takes those without projection).
            Default: ``(('sparse', 'host'), ('sparse', 'projected'), ('host', 'host'), ('device', 'device'))``.
        batch_sizes: batch sizes tried. Default: ``(1, 2, 4, 8, 16, 32)``.
        checkpointing: gradient checkpointing off, on, or both. Default: ``(False, True)``.
        host_memory: the host's memory. Default: ``None`` (the hardware's).
        optimizer: the user's optimizer, as for ``plan``. Default: ``None`` (``torch.optim.AdamW``).
        settings: further settings every offload candidate takes (``link_dtype="bf16"``).

    Raises:
        ValueError: for a bad size, precision, strategy or setting (as ``plan`` raises them).
        TypeError: for a single value of what ``choose`` tries as a grid (``batch_size=4``: pass ``batch_sizes=[4]``).

    Example::

        import lightning_offload
        choice = lightning_offload.choose(model, seq_len=512, device_memory="4GiB", precision="bf16-true",
                                          hardware="laptop-4gb")
        print(choice.table())  # the chosen plan, then each rejected candidate and why
    """
    parse_bytes(device_memory, "device_memory")
    grid_values = sorted(settings.keys() & GRID_ARGUMENTS.keys())
    if grid_values:
        name = grid_values[0]
        raise TypeError(f"choose() got {name}={settings[name]!r}: choose tries a grid of those; pass "
                        f"{GRID_ARGUMENTS[name]} (a fixed {name} is a grid of one), or call plan() for one setting.")
    if time_budget is not None and not time_budget > 0:
        raise ValueError(f"time_budget={time_budget!r} must be a positive number of seconds per step, or None.")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one a plan knows; use one of {sorted(PRECISIONS)}.")
    hw = hardware_of(hardware, device, PRECISIONS[precision][1])
    candidates = []
    for (strategy, combo), batch, ckpt in itertools.product(_grid(strategies, ranks, placements, settings),
                                                            sorted(batch_sizes), checkpointing):
        try:
            found = plan(model, strategy, batch_size=batch, seq_len=seq_len, device_memory=device_memory,
                         precision=precision, gradient_checkpointing=ckpt, hardware=hw, host_memory=host_memory,
                         optimizer=optimizer, **combo)
        except ValueError as error:  # a rank or placement this model cannot take
            candidates.append(Candidate(strategy, combo, batch, ckpt, None, f"cannot be set up: {error}"))
            continue
        candidates.append(Candidate(strategy, combo, batch, ckpt, found, _misfit(found, time_budget)))
    fitting = [c for c in candidates if not c.rejected]
    if not fitting:
        return Choice(None, candidates)
    fastest = max(c.plan.tokens_per_second for c in fitting)
    best = next(c for c in fitting if c.plan.tokens_per_second >= fastest * (1 - TIE))
    speed = best.plan.tokens_per_second
    ranked = [c if c is best or c.rejected else Candidate(
        c.strategy, c.settings, c.batch_size, c.gradient_checkpointing, c.plan,
        f"fits, but slower: {c.plan.tokens_per_second:,.0f} tokens/s against {speed:,.0f}"
        if c.plan.tokens_per_second < speed else f"fits, within {TIE:.0%} of the chosen one's speed "
        f"({c.plan.tokens_per_second:,.0f} tokens/s); the chosen one comes first (larger rank, no checkpointing, plain "
        f"training first)")
        for c in candidates]
    return Choice(best, ranked)


def _misfit(found: Plan, time_budget: float | None) -> str:
    """Why a plan is rejected before speeds are compared (empty: it fits)."""
    reasons = []
    if not found.fits_device:
        reasons.append(f"device {gib(found.device_bytes)} > {gib(found.device_memory)}")
    if not found.fits_host:
        reasons.append(f"host {gib(found.host_bytes)} > {gib(found.host_memory)}")
    if time_budget is not None and found.step_seconds > time_budget:
        reasons.append(f"step {found.step_seconds:.2f} s > time budget {time_budget:.2f} s")
    return "; ".join(reasons)
