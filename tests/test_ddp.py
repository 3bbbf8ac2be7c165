"""``lsp_offload_ddp`` and ``zero_offload_ddp`` on 2 CPU processes (gloo), against one process at twice the batch.

The 2-process runs are made by ``tests/ddp_runs.py`` through Lightning's own launcher (one launch for the scenarios
the tests share, one per planted failure, each in a subprocess); their results are compared here with single-process
runs of the same model and data.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_runs import Projectable
from tiny_modules import TinyClassifier, classification_data, lossless_lsp, params_of, trainer

from lightning_offload import (
    LSPOffloadDDPStrategy,
    LSPOffloadStrategy,
    ProjectorRefit,
    ZeroOffloadDDPStrategy,
)
from lightning_offload.engine.lanes.ranks import contiguous_owners
from lightning_offload.lsp import norm_probe

RUNS = Path(__file__).parent / "ddp_runs.py"
# ddp_runs.py: 2 ranks × batch 4, two batches accumulated per step, clipped by norm.
SETTINGS: dict[str, Any] = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)


def _launch(out: Path, scenario: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a clean launch: Lightning's launcher sets these for the rank it starts
    return subprocess.run([sys.executable, str(RUNS), str(out), scenario], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _record(out: Path, run: str, rank: int) -> dict[str, Any]:
    return torch.load(out / f"{run}_rank{rank}.pt", weights_only=False)


def _scenario(factory: pytest.TempPathFactory, scenario: str) -> Path:
    out = factory.mktemp(f"ddp_{scenario.replace(',', '_')}")
    result = _launch(out, scenario)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One launch for the three scenarios (each launch is two fresh interpreters and a process group); their records
    # have distinct names.
    return _scenario(tmp_path_factory, "equivalence,bytes,variants")


@pytest.fixture(scope="module")
def equivalence_runs(scenario_runs: Path) -> Path:
    return scenario_runs


@pytest.fixture(scope="module")
def variant_runs(scenario_runs: Path) -> Path:
    return scenario_runs


@pytest.fixture(scope="module")
def bytes_runs(scenario_runs: Path) -> Path:
    return scenario_runs


def _single_process(kind: str, steps: int, resume: Path | None = None, **settings: Any) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)  # as the ranks run, so the projector fits take the same arithmetic
    if kind == "lossless":
        strategy, callbacks = lossless_lsp(**settings), []
    else:
        strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="learned", embeddings="host")
        callbacks = [ProjectorRefit(refit_every=2, threshold=0.0, num_samples=2, max_iters=6, seed=0)]
    module = TinyClassifier(seed=7 if resume else 0)
    trainer(strategy, max_steps=steps, callbacks=callbacks, **SETTINGS).fit(
        module, classification_data(batch_size=8), ckpt_path=resume)
    return params_of(module)


@pytest.mark.parametrize("kind", ["lossless", "learned"])
def test_two_ranks_equal_one_process_at_twice_the_batch(equivalence_runs, kind):
    rank0, rank1 = _record(equivalence_runs, kind, 0), _record(equivalence_runs, kind, 1)
    for name in rank0["params"]:
        assert torch.equal(rank0["params"][name], rank1["params"][name]), f"ranks disagree on {name}"
    single = _single_process(kind, 8)
    start = params_of(TinyClassifier())
    for name, value in single.items():
        assert not torch.equal(value, start[name]), f"{name} did not train"
        # Summing the ranks' (compressed) gradients instead of the batch's reorders fp32 additions, nothing more.
        torch.testing.assert_close(rank0["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run, settings", [("device_head", {"head": "device"}),
                                           ("speculative", {"speculative": True})])
def test_device_adam_and_speculative_steps_equal_one_process(variant_runs, run, settings):
    rank0, rank1 = _record(variant_runs, run, 0), _record(variant_runs, run, 1)
    single = _single_process("lossless", 4, **settings)
    for name, value in single.items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), f"ranks disagree on {name}"
        torch.testing.assert_close(rank0["params"][name], value, rtol=1e-5, atol=1e-6)


def test_ranks_keep_one_process_s_clipping_norm_ratios(variant_runs, monkeypatch):
    # The probes' G z is all-reduced with the owners' ‖S‖²: every rank holds the ρ of the reduced gradient, which is
    # one process's at twice the batch (up to the order of fp32 additions).
    rank0, rank1 = _record(variant_runs, "norm_probes", 0), _record(variant_runs, "norm_probes", 1)
    assert rank0["norm_ratios"] == rank1["norm_ratios"]
    monkeypatch.setattr(norm_probe, "WINDOW_STEPS", 2)
    torch.set_num_threads(1)
    strategy = LSPOffloadStrategy(rank=0.25, density=2, target_modules=[r"net\.\d"], projectors="random")
    trainer(strategy, max_steps=6, **SETTINGS).fit(Projectable(), classification_data(batch_size=8))
    single = {name: layer.norm_ratio for name, layer in strategy.projected_layers.items()}
    assert single.keys() == rank0["norm_ratios"].keys() and all(ratio != 1.0 for ratio in single.values())
    for name, ratio in single.items():
        assert rank0["norm_ratios"][name] == pytest.approx(ratio, rel=1e-5), name


def test_bf16_between_ranks_halves_the_bytes(variant_runs):
    bf16, fp32 = _record(variant_runs, "bf16", 0), _record(variant_runs, "fp32_link", 0)
    rank1 = _record(variant_runs, "bf16", 1)
    start = params_of(TinyClassifier())
    for name, value in bf16["params"].items():
        assert value.dtype == torch.float32 and torch.equal(value, rank1["params"][name])
        assert not torch.equal(value, start[name])
    # Gradients and compressed updates cross in bf16; dense bf16 parameters cross in their own dtype either way.
    assert bf16["bytes_between_ranks"][-1] < 0.8 * fp32["bytes_between_ranks"][-1]


@pytest.mark.parametrize("kind", ["lossless", "learned"])
def test_resume_on_two_ranks_is_bit_exact(equivalence_runs, kind):
    straight, resumed = _record(equivalence_runs, kind, 0), _record(equivalence_runs, f"{kind}_resumed", 0)
    for name in straight["params"]:
        assert torch.equal(straight["params"][name], resumed["params"][name]), f"{name} differs after resume"
    assert resumed["steps"] == straight["steps"] == 8
    if kind == "learned":
        # The resumed run continued the refit schedule (4, 6) of the straight one (0, 2, 4, 6).
        assert straight["refit_steps"] == [0, 2, 4, 6] and resumed["refit_steps"] == [4, 6]


def test_two_rank_checkpoint_resumes_in_one_process(equivalence_runs):
    (path,) = (equivalence_runs / "lossless").glob("*step=4.ckpt")
    state = torch.load(path, weights_only=False)["optimizer_states"][0]
    assert None not in state["host_adam"], "rank 0 must gather every rank's share of the host state"
    resumed = _single_process("lossless", 8, resume=path)
    two_ranks = _record(equivalence_runs, "lossless", 0)["params"]
    for name, value in resumed.items():
        torch.testing.assert_close(value, two_ranks[name], rtol=1e-5, atol=1e-6)


def test_projectors_identical_across_ranks_after_the_initial_fit_and_refits(equivalence_runs):
    rank0, rank1 = _record(equivalence_runs, "learned", 0), _record(equivalence_runs, "learned", 1)
    assert rank0["initial_projectors"] and set(rank0["initial_projectors"]) == set(rank0["projectors"])
    for name, (out_values, in_values) in rank0["initial_projectors"].items():
        assert torch.equal(out_values, rank1["initial_projectors"][name][0])
        assert torch.equal(in_values, rank1["initial_projectors"][name][1])
        # The refits (last at step 6) installed other projectors, again the same on both ranks.
        assert not torch.equal(out_values, rank0["projectors"][name][0])
    for name, tensors in rank0["projectors"].items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, rank1["projectors"][name])), name


def test_host_state_is_sharded_between_ranks(equivalence_runs):
    rank0, rank1 = _record(equivalence_runs, "lossless", 0), _record(equivalence_runs, "lossless", 1)
    assert rank0["owned"] and rank1["owned"] and not set(rank0["owned"]) & set(rank1["owned"])
    # Every matrix is owned by one rank; the biases are stepped on the device by every rank (vectors="device").
    assert len(rank0["owned"]) + len(rank1["owned"]) == len([p for p in TinyClassifier().parameters() if p.dim() > 1])


def test_compressed_gradients_cut_the_bytes_between_ranks(bytes_runs):
    zero = [_record(bytes_runs, "zero", rank)["bytes_between_ranks"][-1] for rank in (0, 1)]
    lsp = [_record(bytes_runs, "lsp_all", rank)["bytes_between_ranks"][-1] for rank in (0, 1)]
    params = (16 * 64 + 64 * 64 + 64 * 16) * 4
    # zero_offload_ddp: every gradient reduced and every new value broadcast, plus the norm's small all-reduce.
    assert min(zero) >= 2 * params
    assert max(lsp) <= min(zero) / 8, (lsp, zero)
    assert len(_record(bytes_runs, "lsp_all", 0)["projectors"]) == 3  # every layer projected


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failure_on_one_rank_stops_both_processes_with_its_error(tmp_path, rank):
    result = _launch(tmp_path, f"fail_on_rank_{rank}", timeout=180.0)
    assert result.returncode != 0
    assert f"planted failure on rank {rank}" in result.stderr
    assert not list(tmp_path.glob("fail_rank*.pt")), "no rank may finish the run"


def test_contiguous_owners_balance_the_host_elements():
    assert contiguous_owners([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert contiguous_owners([5] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    owners = contiguous_owners([10, 1, 1, 1, 1], 2)
    assert owners == sorted(owners) and owners[0] == 0 and owners[-1] == 1
    assert contiguous_owners([], 3) == []
    with pytest.raises(ValueError, match="world"):
        contiguous_owners([1], 0)


def test_ddp_settings_are_checked():
    with pytest.raises(ValueError, match="embeddings='sparse'.*embeddings='host'"):
        LSPOffloadDDPStrategy(embeddings="sparse")
    with pytest.raises(ValueError, match="bucket_mb"):
        LSPOffloadDDPStrategy(bucket_mb=0)
    with pytest.raises(TypeError, match="rnak"):
        LSPOffloadDDPStrategy(rnak=0.5)
    assert LSPOffloadDDPStrategy().placements.embeddings == "host"
    assert ZeroOffloadDDPStrategy().settings.projection is False
