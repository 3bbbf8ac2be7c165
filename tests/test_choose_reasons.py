"""``choose()``'s reasons: each rejected candidate's line names the criterion that decided it (memory and by how much,
the time budget, slower and by how much, or a tie lost on the first setting the tie-break orders it by), never a
fixed list of criteria that may not apply."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_offload.models.tiny import tiny_llama
from lightning_offload.planning import choose as choose_module
from lightning_offload.planning.calibration import Hardware
from lightning_offload.planning.choose import Candidate, choose

# A GPU whose matmuls are slow and whose host and link are near free: a step is its device time, so candidates that
# differ only in where the embedding trains (not a matmul) predict the same speed and tie.
DEVICE_BOUND = Hardware("device-bound test GPU", "cuda", 1e9, 1e-15, 1e-9, 1e15, 1e15, 1e15, 1e15, 2**30,
                        64 * 2**30, 0.0, measured=False)
# Fixed CPU speeds (no calibration), as tests/test_planning.py uses.
CPU = Hardware("test CPU", "cpu", 1e11, 1e-9, 1e-5, 1e10, 1e10, 1e10, 1e10, 0, 64 * 2**30, 1e-4, measured=False)


def _model() -> torch.nn.Module:
    # Layers of 128 are projected (min_dim); an untied head, so embeddings and head are placed apart.
    return tiny_llama(hidden=128, layers=2, heads=4, intermediate=256, seed=0, tie_word_embeddings=False)


def _rejected(choice: object) -> list[Candidate]:
    return [c for c in choice.candidates if c is not choice.best]


def test_a_tie_between_two_checkpointed_candidates_of_one_rank_names_the_placement() -> None:
    # The issue's case: same rank, both checkpointed; the old line said "larger rank, no checkpointing, plain
    # training first", none of which told them apart.
    choice = choose(_model(), seq_len=64, device_memory="1GiB", precision="32-true", hardware=DEVICE_BOUND,
                    strategies=("lsp_offload",), ranks=(0.25,), batch_sizes=(2,), checkpointing=(True,),
                    placements=(("sparse", "host"), ("host", "host")))
    assert choice.best is not None and choice.best.settings["embeddings"] == "sparse"
    (other,) = _rejected(choice)
    speeds = other.plan.tokens_per_second, choice.plan.tokens_per_second
    assert speeds[0] >= max(speeds) * (1 - choose_module.TIE)  # it did tie
    assert "ties" in other.rejected
    assert "lost the tie-break on placement: (embeddings='sparse', head='host') comes before " \
           "(embeddings='host', head='host') in placements" in other.rejected
    assert "rank" not in other.rejected and "checkpointing" not in other.rejected
    assert "plain training" not in other.rejected


def _first_difference(first: Candidate, later: Candidate) -> str:
    """The tie-break's criteria in their order, worked out here from the candidates' own settings."""
    if first.strategy != later.strategy:
        return "strategy"
    if first.settings.get("rank") != later.settings.get("rank"):
        return "rank"
    if (first.settings.get("embeddings"), first.settings.get("head")) != \
            (later.settings.get("embeddings"), later.settings.get("head")):
        return "placement"
    if first.batch_size != later.batch_size:
        return "batch size"
    return "checkpointing"


def test_every_tie_names_the_first_setting_it_differs_on_and_how_its_speed_compares(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Everything ties (a tie band of 99%): the chosen one is the first in the order, and each other one's line names
    # the first criterion it differs on and whether it is faster or slower than the chosen one, by its real share.
    monkeypatch.setattr(choose_module, "TIE", 0.99)
    choice = choose(_model(), seq_len=64, device_memory="1GiB", precision="32-true", hardware=CPU,
                    strategies=("auto", "lsp_offload", "zero_offload"), ranks=(0.25, 0.125), batch_sizes=(1, 2),
                    placements=(("sparse", "host"), ("sparse", "projected")))
    assert choice.best.strategy == "auto" and choice.best.batch_size == 1 and not choice.best.gradient_checkpointing
    chosen = choice.plan.tokens_per_second
    seen = set()
    for other in _rejected(choice):
        criterion = _first_difference(choice.best, other)
        seen.add(criterion)
        assert f"lost the tie-break on {criterion}:" in other.rejected, other.rejected
        speed = other.plan.tokens_per_second
        share = re.search(r"ties: [\d,]+ tokens/s, ([\d.]+)% (faster|slower) than", other.rejected)
        assert share is not None, other.rejected
        assert share.group(2) == ("faster" if speed > chosen else "slower")
        assert float(share.group(1)) == pytest.approx(abs(speed / chosen - 1) * 100, abs=0.051)
    assert seen == {"strategy", "batch size", "checkpointing"}  # auto differs from the rest by strategy first
    # Among the lsp_offload candidates alone, ranks and placements decide too.
    alone = choose(_model(), seq_len=64, device_memory="1GiB", precision="32-true", hardware=CPU,
                   strategies=("lsp_offload",), ranks=(0.25, 0.125), batch_sizes=(2,), checkpointing=(False,),
                   placements=(("sparse", "host"), ("sparse", "projected")))
    by_setting = {(c.settings["rank"], c.settings["head"]): c.rejected for c in _rejected(alone)}
    assert "on placement: (embeddings='sparse', head='host') comes before (embeddings='sparse', head='projected')" \
        in by_setting[(0.25, "projected")]
    for head in ("host", "projected"):
        assert "on rank: 0.25 comes before 0.125 in ranks (the larger rank: less compressed)" \
            in by_setting[(0.125, head)]


def test_a_slower_candidate_says_by_how_much() -> None:
    choice = choose(_model(), seq_len=64, device_memory="1GiB", precision="32-true", hardware=CPU,
                    strategies=("lsp_offload",), ranks=(0.25,), batch_sizes=(1, 16), checkpointing=(False,),
                    placements=(("sparse", "host"),))
    (other,) = _rejected(choice)
    chosen, speed = choice.plan.tokens_per_second, other.plan.tokens_per_second
    assert speed < chosen * (1 - choose_module.TIE)
    found = re.fullmatch(r"fits, but slower: ([\d,]+) tokens/s against the chosen one's ([\d,]+) \(([\d.]+)% slower\)",
                         other.rejected)
    assert found is not None, other.rejected
    assert int(found.group(1).replace(",", "")) == round(speed)
    assert int(found.group(2).replace(",", "")) == round(chosen)
    assert float(found.group(3)) == pytest.approx((1 - speed / chosen) * 100, abs=0.051)


def test_memory_and_budget_rejections_say_by_how_much_against_what_is_usable() -> None:
    model = _model()
    probe = choose(model, seq_len=64, device_memory="1GiB", precision="32-true", hardware=DEVICE_BOUND,
                   strategies=("lsp_offload",), ranks=(0.25,), batch_sizes=(4,), checkpointing=(False,),
                   placements=(("sparse", "host"),))
    need = probe.plan.device_bytes
    # A device between the plan's peak and the peak over the 5% headroom: under the memory, over what is usable. The
    # old line ("device X > Y") was false there.
    memory = int(need / 0.97)
    tight = choose(model, seq_len=64, device_memory=memory, precision="32-true", hardware=DEVICE_BOUND,
                   strategies=("lsp_offload",), ranks=(0.25,), batch_sizes=(4,), checkpointing=(False,),
                   placements=(("sparse", "host"),))
    assert tight.best is None
    (line,) = [c.rejected for c in tight.candidates]
    usable = memory * 0.95
    assert line == (f"does not fit the device: {need / 2**30:.2f} GiB against {usable / 2**30:.2f} GiB usable "
                    f"({memory / 2**30:.2f} GiB less 5% headroom), {(need - usable) / 2**30:.2f} GiB over")
    host = choose(model, seq_len=64, device_memory="1GiB", host_memory=2**20, precision="32-true",
                  hardware=DEVICE_BOUND, strategies=("lsp_offload",), ranks=(0.25,), batch_sizes=(4,),
                  checkpointing=(False,), placements=(("sparse", "host"),))
    (plan_,) = [c.plan for c in host.candidates]
    (line,) = [c.rejected for c in host.candidates]
    assert line == (f"does not fit the host: {plan_.host_bytes / 2**30:.2f} GiB against 0.00 GiB, "
                    f"{(plan_.host_bytes - 2**20) / 2**30:.2f} GiB over")
    step = probe.plan.step_seconds
    budget = choose(model, seq_len=64, device_memory="1GiB", precision="32-true", hardware=DEVICE_BOUND,
                    strategies=("lsp_offload",), ranks=(0.25,), batch_sizes=(4,), checkpointing=(False,),
                    placements=(("sparse", "host"),), time_budget=step / 2)
    (line,) = [c.rejected for c in budget.candidates]
    assert line == f"over the time budget: step {step:.3f} s against {step / 2:.3f} s, 100% over"
