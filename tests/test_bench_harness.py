"""The benchmark harness every script shares (scripts/harness.py): medians, ratios, alternation order, the table, the
machine line, the shared arguments. Nothing here asserts a speed: the clocks are fakes or unread."""

from __future__ import annotations

import argparse
import datetime
import json

import pytest
import scripts_loader  # noqa: F401  (puts scripts/ on sys.path, as running a script does)

import harness

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9654 96-Core Processor
"""


def test_the_median_over_runs_takes_each_runs_steady_median_first() -> None:
    # Warm-up steps (the 100s) are left out; a run's one slow step does not move its median; the median over runs is
    # the middle run's, the spread the extreme runs'.
    runs = [[100.0, 1.0, 2.0, 3.0], [100.0, 5.0, 5.0, 50.0], [100.0, 4.0, 4.0, 4.0]]
    result = harness.median_over_runs(runs, warmup=1)
    assert result == harness.Spread(median=4.0, low=2.0, high=5.0)
    assert harness.median_over_runs([[7.0, 1.0]], warmup=5).median == 4.0  # too few steps: all kept


def test_a_spread_cell_shows_the_median_and_its_range() -> None:
    assert harness.spread([0.003, 0.001, 0.002]).cell(1e3, 1) == "2.0 (1.0–3.0)"


def test_ratios_are_against_the_named_baseline() -> None:
    assert harness.ratios({"adamw": 2.0, "lsp": 3.0, "zero": 1.0}, "adamw") == {"adamw": 1.0, "lsp": 1.5, "zero": 0.5}
    with pytest.raises(KeyError, match="baseline 'none' was not measured"):
        harness.ratios({"adamw": 2.0}, "none")


def test_alternation_runs_every_configuration_once_per_round() -> None:
    assert harness.alternation_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"),
                                                             (1, "c")]
    calls, reported = [], []
    results = harness.alternate(["a", "b"], 3, lambda config, round_index: calls.append((round_index, config))
                                or f"{config}{round_index}", lambda *args: reported.append(args))
    assert calls == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert results == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    assert reported[1] == ("b", 0, "b0")


def test_timed_steps_leave_the_warm_up_out() -> None:
    ticks = iter(float(t) for t in [0, 10, 10, 11, 11, 13, 13, 16])  # steps of 10, 1, 2 and 3 seconds
    seconds = harness.time_steps(lambda index: None, steps=4, warmup=1, clock=lambda: next(ticks))
    assert seconds == [1.0, 2.0, 3.0]


def test_the_table_has_docs_benchmarks_form() -> None:
    table = harness.markdown_table(["method", "s / step"], [["zero_offload", "0.12"], ["lsp_offload", 0.5]])
    assert table.splitlines() == ["| method | s / step |", "|---|---|", "| zero_offload | 0.12 |",
                                  "| lsp_offload | 0.5 |"]
    with pytest.raises(ValueError, match="a row of 1 cells under a header of 2"):
        harness.markdown_table(["a", "b"], [["only one"]])


def test_the_machine_line_names_the_cpu_its_vector_extensions_torch_and_the_date() -> None:
    info = harness.machine_info(CPUINFO, datetime.date(2026, 12, 4))
    assert info["cpu"] == "AMD EPYC 9654 96-Core Processor" and info["avx512f"] and info["avx2"]
    line = harness.machine_line(info)
    assert line.startswith("machine: AMD EPYC 9654 96-Core Processor (avx512f yes, avx2 yes), ")
    assert f"torch {info['torch']}" in line and line.endswith(", 2026-12-04")
    older = harness.machine_line(harness.machine_info("model name\t: Old\nflags\t\t: sse avx2\n"))
    assert "(avx512f no, avx2 yes)" in older


def test_the_shared_arguments_keep_the_names_the_docs_commands_use(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    harness.add_standard_arguments(parser, repeats=3, warmup=2, seed=0, repeats_aliases=("--rounds",),
                                   json_aliases=("--out",))
    args = parser.parse_args(["--rounds", "5", "--out", str(tmp_path / "r.json")])
    assert (args.repeats, args.warmup, args.seed, args.json) == (5, 2, 0, str(tmp_path / "r.json"))
    harness.write_json(args.json, {"seconds": [1.0]})
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["seconds"] == [1.0] and written["machine"]["cores"] >= 1
    assert not (tmp_path / "r.json.partial").exists()


def test_a_tree_run_drops_only_the_tree_options() -> None:
    argv = ["--steps", "3", "--trees", "/a", "/b", "--tree-rounds=2", "--json", "out.json", "--repeats", "1"]
    assert harness._without_options(argv, ("--trees", "--tree-rounds", "--json")) == ["--steps", "3", "--repeats",
                                                                                       "1"]
