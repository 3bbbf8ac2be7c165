"""Every offload path gives the results recorded in tests/golden/ (one record per machine kind, see
tests/golden_runs.py).

On a machine kind a record was made on (the same CPU kernels and torch), a run must reproduce it bit for bit: the
engine's redesign may not change a result. Against the records of other kinds (or on a kind with none) fp32 rounding
differs from kernel to kernel; there each sketched figure must agree to a relative ``1e-3`` of the tensor (its norm,
times the square root of its element count for the linear figures). Under AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2``) most tensors moved by ~1e-7 of that scale, and the most, 1e-4, moved GPT-2's fused
``c_attn`` bias, whose key part has a zero true gradient (softmax ignores it) so Adam steps it on rounding noise.
Runs with bf16 (weights or the link) get ``1e-2``: bf16 rounds at ``4e-3``. Every record holding a case is checked,
so a run on one kind is held to the other kinds' results too.
"""

from __future__ import annotations

import math

import pytest

import golden_runs

RECORDS = golden_runs.records()
HERE = golden_runs.machine()


def _compare(case: str, got: dict[str, list[float]]) -> None:
    holding = [record for record in RECORDS if case in record["cases"]]
    assert holding, f"{case} is recorded on no machine kind: run python tests/golden_runs.py --record {case}"
    for record in holding:
        _compare_with(case, got, record["cases"][case], exact=record["machine"] == HERE)


def _compare_with(case: str, got: dict[str, list[float]], want: dict[str, list[float]], exact: bool) -> None:
    assert sorted(got) == sorted(want), f"{case}: the checkpoint's tensors changed"
    if exact:
        mismatched = [name for name in want if got[name] != want[name]]
        assert not mismatched, f"{case}: {len(mismatched)} tensors differ from the recorded run, e.g. {mismatched[0]}"
        return
    tolerance = 1e-2 if "bf16" in case else 1e-3
    for name, (count, *figures) in want.items():
        got_count, *got_figures = got[name]
        assert got_count == count, f"{case}: {name} has {got_count:.0f} elements, recorded {count:.0f}"
        squares = figures[1]
        norm = math.sqrt(max(squares, 0.0))
        # A perturbation of relative size ε moves the sum by at most ε‖x‖√n, a dot product with a normal vector by
        # about ε‖x‖ (bounded here by the same ε‖x‖√n), and the sum of squares by about 2ε‖x‖².
        linear = tolerance * norm * math.sqrt(count) + 1e-12
        assert abs(got_figures[1] - squares) <= 2 * tolerance * squares + 1e-12, f"{case}: {name}'s norm moved"
        for index in (0, *range(2, len(figures))):
            moved = abs(got_figures[index] - figures[index])
            assert moved <= linear, f"{case}: {name} moved by {moved:.3g} (allowed {linear:.3g})"


def test_every_record_is_of_its_own_machine_kind() -> None:
    names = [golden_runs.record_name(record["machine"]) for record in RECORDS]
    assert RECORDS, "no golden record in tests/golden/"
    assert sorted(path.name for path in golden_runs.GOLDEN_DIR.glob("*.json")) == sorted(names), (
        "a record's file name does not match the machine kind it holds: record with tests/golden_runs.py --record")
    assert all(record["steps"] == golden_runs.STEPS for record in RECORDS)


@pytest.mark.parametrize("case", list(golden_runs.CASES))
def test_each_offload_path_reproduces_its_recorded_results(case: str) -> None:
    _compare(case, golden_runs.run_case_cached(case))


def test_two_gloo_ranks_reproduce_their_recorded_results() -> None:
    for case, sketches in golden_runs.run_ddp().items():
        _compare(case, sketches)
