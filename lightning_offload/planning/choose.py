"""``choose(model, ...)``: the strategy, rank, placements, batch size and gradient checkpointing that fit the device
(and a time budget, if given) with the best predicted throughput, and why each alternative was rejected.

A candidate is rejected by the first of these that decides it, and its line says which, with the figures: it cannot be
set up; it does not fit the device or the host (by how much); its step is over the time budget; it is slower than
the chosen one (by how much); or it ties (its throughput within :data:`TIE` of the fastest) and loses the tie-break,
which goes to the candidate tried first: by the order of ``strategies``, then ``ranks``, then ``placements``, then
the smaller batch, then the order of ``checkpointing`` (the defaults: plain training, the larger rank, a sparse
embedding with a host head, less memory, no recomputation first). A tie's line names the first of those on which it
differs from the chosen one.

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
#: Predicted throughputs within this share of the fastest count as equal: the candidate tried first wins (the order
#: of the module docstring; with the defaults, plain training, the larger rank and no checkpointing come first).
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
            # In the order of placements (a tie goes to the one tried first), each once.
            dense = dict.fromkeys(("host" if e == "sparse" else e, h) for e, h in placements if h != "projected")
            combos += [(strategy, {**settings, "embeddings": emb, "head": head}) for emb, head in dense]
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
        ranks: ``lsp_offload``'s ranks tried; at equal speed (within :data:`TIE`) the one listed first wins.
            Default: ``(0.25, 0.125)`` (the larger first).
        placements: ``(embeddings, head)`` pairs tried (``zero_offload`` takes those without projection), the first
            listed winning a tie. Default:
            ``(('sparse', 'host'), ('sparse', 'projected'), ('host', 'host'), ('device', 'device'))``.
        batch_sizes: batch sizes tried (the smaller wins a tie).
            Default: ``(1, 2, 4, 8, 16, 32)``.
        checkpointing: gradient checkpointing off, on, or both, the first listed winning a tie.
            Default: ``(False, True)``.
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
    combos = _grid(strategies, ranks, placements, settings)
    order = _TieOrder(strategies, ranks, placements, checkpointing)
    candidates = []
    for (strategy, combo), batch, ckpt in itertools.product(combos, sorted(batch_sizes), checkpointing):
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
    tied = [c for c in fitting if c.plan.tokens_per_second >= fastest * (1 - TIE)]
    best = min(tied, key=order.key)  # the tie-break: the one first in the order
    ranked = [c if c is best or c.rejected else Candidate(
        c.strategy, c.settings, c.batch_size, c.gradient_checkpointing, c.plan, _lost(c, best, c in tied, fastest,
                                                                                      order))
        for c in candidates]
    return Choice(best, ranked)


def _misfit(found: Plan, time_budget: float | None) -> str:
    """Why a plan is rejected before speeds are compared, with by how much (empty: it fits)."""
    reasons = []
    if not found.fits_device:
        usable = found.device_usable_bytes
        kept = f" less {found.headroom:.0%} headroom" if found.headroom else ""
        reasons.append(f"does not fit the device: {gib(found.device_bytes)} against {gib(usable)} usable "
                       f"({gib(found.device_memory)}{kept}), {gib(found.device_bytes - usable)} over")
    if not found.fits_host:
        needed = found.host_needed_bytes
        reasons.append(f"does not fit the host: {gib(needed)} against {gib(found.host_memory)}, "
                       f"{gib(needed - found.host_memory)} over")
    if time_budget is not None and found.step_seconds > time_budget:
        reasons.append(f"over the time budget: step {found.step_seconds:.3f} s against {time_budget:.3f} s, "
                       f"{found.step_seconds / time_budget - 1:.0%} over")
    return "; ".join(reasons)


def _share(speed: float, than: float) -> str:
    """``speed`` against ``than`` as "x% faster" / "x% slower" / "as fast"."""
    change = speed / than - 1
    if abs(change) < 0.0005:
        return "as fast as"
    return f"{abs(change):.1%} {'faster' if change > 0 else 'slower'} than"


def _lost(candidate: Candidate, best: Candidate, tied: bool, fastest: float, order: _TieOrder) -> str:
    """Why a fitting candidate lost to ``best``: slower, or tied and tried after it (naming on what)."""
    speed, chosen = candidate.plan.tokens_per_second, best.plan.tokens_per_second
    if not tied:  # below the tie band: slower than the chosen one too (the chosen one is within it)
        return (f"fits, but slower: {speed:,.0f} tokens/s against the chosen one's {chosen:,.0f} "
                f"({1 - speed / chosen:.1%} slower)")
    return (f"fits, ties: {speed:,.0f} tokens/s, {_share(speed, chosen)} the chosen one's {chosen:,.0f}, within "
            f"{TIE:.0%} of the fastest ({fastest:,.0f}); lost the tie-break on {order.difference(best, candidate)}")


class _TieOrder:
    """The order a tie is broken in (the candidate tried first wins): ``strategies``, ``ranks``, ``placements`` as
    given, the smaller batch, ``checkpointing`` as given; and, for two candidates, the first of those they differ on."""

    def __init__(self, strategies: Sequence[str], ranks: Sequence[float], placements: Sequence[tuple[str, str]],
                 checkpointing: Sequence[bool]) -> None:
        self.strategies, self.ranks, self.checkpointing = list(strategies), list(ranks), list(checkpointing)
        # zero_offload's placements are the pairs without projection, a sparse embedding as "host": in this order.
        self.placements = list(dict.fromkeys([*placements, *(("host" if e == "sparse" else e, h)
                                                              for e, h in placements)]))

    def key(self, candidate: Candidate) -> tuple[int, int, int, int, int]:
        """The candidate's place in the order (smaller: tried first)."""
        settings = candidate.settings
        rank = self.ranks.index(settings["rank"]) if "rank" in settings else -1
        placement = self.placements.index((settings["embeddings"], settings["head"])) if "head" in settings else -1
        return (self.strategies.index(candidate.strategy), rank, placement, candidate.batch_size,
                self.checkpointing.index(candidate.gradient_checkpointing))

    def difference(self, first: Candidate, later: Candidate) -> str:
        """The first criterion of the order on which ``first`` comes before ``later``, in words."""
        a, b = self.key(first), self.key(later)
        if a == b:
            return "nothing: the same combination, given twice (the first one wins)"
        if a[0] != b[0]:
            why = " (plain training: nothing offloaded)" if first.strategy == "auto" else ""
            return f"strategy: {first.strategy!r} comes before {later.strategy!r} in strategies{why}"
        if a[1] != b[1]:
            mine, theirs = first.settings["rank"], later.settings["rank"]
            why = " (the larger rank: less compressed)" if type(mine) is type(theirs) and mine > theirs else ""
            return f"rank: {mine!r} comes before {theirs!r} in ranks{why}"
        if a[2] != b[2]:
            shown = lambda c: f"(embeddings={c.settings['embeddings']!r}, head={c.settings['head']!r})"  # noqa: E731
            return f"placement: {shown(first)} comes before {shown(later)} in placements"
        if a[3] != b[3]:
            return f"batch size: {first.batch_size} is smaller than {later.batch_size} (less memory)"
        why = " (no recomputation)" if not first.gradient_checkpointing else ""
        return (f"checkpointing: {'on' if first.gradient_checkpointing else 'off'} comes before "
                f"{'on' if later.gradient_checkpointing else 'off'} in checkpointing{why}")
