"""The benchmark harness every script of ``scripts/`` shares: seeding, timing, alternation, medians, ratios, the
machine line, the Markdown table, JSON output and the command-line arguments the scripts have in common.

Scripts run as ``python scripts/<name>.py``, so ``scripts/`` is on ``sys.path`` and they ``from harness import …``.
The figures in docs/benchmarks.md are read as ratios between configurations measured side by side on a shared, noisy
machine; everything here exists so that every script measures the same way: configurations interleaved round by
round (noise hits each alike), warm-up steps left out, the median of a run's steady steps and then the median over
rounds, the spread shown as min–max, and every ratio taken against a baseline measured in the same rounds.

torch is imported inside the functions that need it: ``gpu_bench.py``'s parent process and the pure table/median
helpers stay importable (and cheap) without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")

#: The clock of every timing unless a script passes its own (``time.thread_time`` to leave out other processes).
Clock = Callable[[], float]


def seed_everything(seed: int) -> Any:
    """Seed Python's and torch's generators; return a fresh ``torch.Generator`` seeded alike.

    Args:
        seed: The seed.

    Returns:
        A CPU ``torch.Generator`` at ``seed``, for the data a script draws (so its draws do not depend on what the
        model's initialisation consumed from the global generator).
    """
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def synchronize() -> None:
    """Wait for the GPU's queued work, where a GPU is in use; a no-op on the CPU.

    A CUDA launch returns before the kernel ran: without this, a timing would measure the launch, not the work.
    """
    torch = sys.modules.get("torch")  # a script that never imported torch has no GPU work to wait for
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_call(call: Callable[[], Value], clock: Clock = time.perf_counter) -> tuple[Value, float]:
    """Run ``call`` once and time it, the GPU synchronised before and after.

    Args:
        call: What to time.
        clock: The clock (wall time by default).

    Returns:
        ``call``'s result and its seconds.
    """
    synchronize()
    start = clock()
    result = call()
    synchronize()
    return result, clock() - start


def time_steps(step: Callable[[int], object], steps: int, warmup: int = 0,
               clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of each of ``step(0) … step(steps − 1)`` after the first ``warmup`` (run, not returned).

    Args:
        step: One step, given its index.
        steps: How many steps to run, warm-up included.
        warmup: Leading steps left out: they allocate state, size workspaces and pick kernels.
        clock: The clock.

    Returns:
        The steady steps' seconds (all of them if ``warmup`` would leave none).
    """
    seconds = [time_call(lambda: step(index), clock)[1] for index in range(steps)]
    return steady(seconds, warmup)


def steady(values: Sequence[Value], warmup: int) -> list[Value]:
    """``values`` without the first ``warmup``; all of them when that would leave none (a smoke run's few steps)."""
    return list(values[warmup:]) or list(values)


@dataclass(frozen=True)
class Spread:
    """A median and the range it came from."""

    median: float
    low: float
    high: float

    def cell(self, scale: float = 1.0, digits: int = 2) -> str:
        """``median (low–high)``, each times ``scale``, for a table cell."""
        return (f"{self.median * scale:.{digits}f} ({self.low * scale:.{digits}f}–"
                f"{self.high * scale:.{digits}f})")


def spread(values: Iterable[float]) -> Spread:
    """The median, minimum and maximum of ``values``."""
    values = list(values)
    return Spread(statistics.median(values), min(values), max(values))


def median_over_runs(runs: Iterable[Sequence[float]], warmup: int = 0) -> Spread:
    """Each run's median over its steady steps, then the median (and range) of those over the runs.

    Two levels, because one slow step (a page fault, another process) should move neither a run's figure nor, if
    one whole run was disturbed, the final one.

    Args:
        runs: Per run, its per-step seconds (warm-up included).
        warmup: Leading steps of each run left out.
    """
    return spread(statistics.median(steady(run, warmup)) for run in runs)


def ratios(medians: Mapping[Key, float], baseline: Key) -> dict[Key, float]:
    """Each figure over the ``baseline``'s (measured in the same rounds, so drift cancels)."""
    if baseline not in medians:
        raise KeyError(f"the baseline {baseline!r} was not measured; measured: {list(medians)}")
    return {key: value / medians[baseline] for key, value in medians.items()}


def alternation_order(configs: Sequence[Key], repeats: int) -> list[tuple[int, Key]]:
    """The order configurations run in: round by round, each configuration once per round.

    Interleaved rather than one configuration's repeats after another's: the machine's speed drifts (other work,
    heat), and interleaving spreads the drift over every configuration alike.
    """
    return [(round_index, config) for round_index in range(repeats) for config in configs]


def alternate(configs: Sequence[Key], repeats: int, measure: Callable[[Key, int], Value],
              report: Callable[[Key, int, Value], None] | None = None) -> dict[Key, list[Value]]:
    """Measure each configuration ``repeats`` times, interleaved (:func:`alternation_order`).

    Args:
        configs: The configurations, in the order each round runs them.
        repeats: Rounds.
        measure: One measurement of a configuration in a round.
        report: Called after each measurement (a progress line, a partial save).

    Returns:
        Per configuration, its measurements in round order.
    """
    results: dict[Key, list[Value]] = {config: [] for config in configs}
    for round_index, config in alternation_order(configs, repeats):
        result = measure(config, round_index)
        results[config].append(result)
        if report is not None:
            report(config, round_index, result)
    return results


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table in docs/benchmarks.md's form: ``| a | b |``, a ``|---|---|`` rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under a header of {len(header)}: {row}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def machine_info(cpuinfo: str | None = None, date: datetime.date | None = None) -> dict[str, Any]:
    """What the figures were measured on.

    Args:
        cpuinfo: ``/proc/cpuinfo``'s text (read when not given; empty off Linux).
        date: The measurement's date (today when not given).

    Returns:
        ``cpu``, ``avx512f``, ``avx2``, ``cores``, ``threads`` (torch's), ``torch``, ``gpu`` (None without one) and
        ``date``.
    """
    import torch

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
                  if line.startswith("flags")), set())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "avx512f": "avx512f" in flags, "avx2": "avx2" in flags, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "gpu": gpu,
            "date": (date or datetime.date.today()).isoformat()}


def machine_line(info: Mapping[str, Any] | None = None) -> str:
    """One line naming the machine: CPU, its vector extensions, cores, torch, GPU, date.

    Whether the CPU has AVX-512 decides how fast bf16 runs on it (docs/benchmarks.md: the main job), so it is named
    on every output, beside the core count a shared machine's figures depend on.
    """
    info = machine_info() if info is None else info
    flags = ", ".join(f"{flag} {'yes' if info[flag] else 'no'}" for flag in ("avx512f", "avx2"))
    return (f"machine: {info['cpu']} ({flags}), {info['cores']} cores, {info['threads']} torch threads, "
            f"torch {info['torch']}, GPU: {info['gpu'] or 'none'}, {info['date']}")


def print_machine_line() -> dict[str, Any]:
    """Print the machine line (every script's first line of output); return what it names, for the JSON."""
    info = machine_info()
    print(machine_line(info), flush=True)
    return info


def write_json(path: str | os.PathLike[str] | None, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` and the machine it ran on to ``path`` (nothing when ``path`` is None).

    Written to a temporary file and moved into place: a run killed mid-write never leaves half a results file.
    """
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"machine": machine_info(), **payload}, indent=1, default=str))
    os.replace(partial, path)


def add_standard_arguments(parser: argparse.ArgumentParser, *, repeats: int | None = None, warmup: int | None = None,
                           seed: int | None = None, json_out: bool = True, trees: bool = False,
                           repeats_aliases: Sequence[str] = (), json_aliases: Sequence[str] = (),
                           repeats_help: str = "rounds: every configuration runs once per round, interleaved") -> None:
    """Add the arguments the scripts share, with each script's own defaults.

    Args:
        parser: The script's parser.
        repeats: ``--repeats``'s default (rounds of alternation); None: not added.
        warmup: ``--warmup``'s default (leading steps not timed); None: not added.
        seed: ``--seed``'s default; None: not added.
        json_out: Add ``--json OUT`` (every result, and the machine, as JSON).
        trees: Add ``--trees DIR DIR`` and ``--tree-rounds`` (:func:`alternate_trees`).
        repeats_aliases: Earlier names of ``--repeats`` the docs' commands use (``--rounds``).
        json_aliases: Earlier names of ``--json`` (``--out``).
        repeats_help: ``--repeats``'s help, where a script's rounds are something more particular.
    """
    if repeats is not None:
        parser.add_argument("--repeats", *repeats_aliases, dest="repeats", type=int, default=repeats,
                            help=repeats_help)
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup, help="leading steps of each run not timed")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed)
    if json_out:
        parser.add_argument("--json", *json_aliases, dest="json", default=None,
                            help="write every result and the machine line's figures here as JSON")
    if trees:
        parser.add_argument("--trees", nargs="+", default=None, metavar="DIR",
                            help="run this command against each source tree (PYTHONPATH), alternated round by round")
        parser.add_argument("--tree-rounds", type=int, default=3, help="with --trees: rounds")


def alternate_trees(script: str, argv: Sequence[str], trees: Sequence[str], rounds: int) -> dict[str, list[Any]]:
    """Run ``script`` with ``argv`` once per tree per round, alternated, each with ``PYTHONPATH`` set to the tree.

    Comparing two commits of the engine on a drifting machine needs the same interleaving as comparing two
    configurations: run one after the other, the drift would read as a difference between the trees. Each run's
    output (after its machine line) is printed under a label; its ``--json`` results are collected.

    Args:
        script: The script's path (its own copy runs in every tree; the trees differ in the package imported).
        argv: The command line without ``--trees``/``--tree-rounds``/``--json``.
        trees: Source trees' roots.
        rounds: Rounds.

    Returns:
        Per tree, each round's JSON results (None where the run wrote none).
    """
    results: dict[str, list[Any]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index, tree in alternation_order(list(trees), rounds):
            out = Path(scratch) / f"{len(results[tree])}_{abs(hash(tree))}.json"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run([sys.executable, script, *argv, "--json", str(out)], env=env, text=True,
                                  capture_output=True)
            body = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("machine: "))
            print(f"\n[round {round_index + 1}/{rounds}] {tree}\n{body}", flush=True)
            if done.returncode != 0:
                print(done.stderr[-3000:], flush=True)
            results[tree].append(json.loads(out.read_text()) if out.exists() else None)
    return results


def begin_run(args: argparse.Namespace, script: str, argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Begin a script's run: print the machine line; with ``--trees``, run the trees alternated and say so.

    Args:
        args: The parsed command line.
        script: The script's ``__file__``.
        argv: The command line as given (``sys.argv[1:]`` when None).

    Returns:
        The machine's figures, or None when the trees were run (the caller returns: the work is done).
    """
    info = print_machine_line()
    trees = getattr(args, "trees", None)
    if not trees:
        return info
    argv = list(sys.argv[1:] if argv is None else argv)
    results = alternate_trees(script, _without_options(argv, ("--trees", "--tree-rounds", "--json")), trees,
                              args.tree_rounds)
    write_json(getattr(args, "json", None), {"trees": results})
    return None


def _without_options(argv: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` without ``options`` and their values (``--opt value …`` or ``--opt=value``)."""
    kept: list[str] = []
    skipping = False
    for word in argv:
        if word.split("=", 1)[0] in options:
            skipping = "=" not in word
            continue
        if skipping and not word.startswith("--"):
            continue
        skipping = False
        kept.append(word)
    return kept
