"""Benchmark runs go through train(cfg): each compared method is a config of the command line, measured alike."""

from __future__ import annotations

import importlib
import math

import pytest
from scripts_loader import load_script

# scripts/benchmark_run.py, benchmark-only and so beside the scripts rather than in the package, imported as the
# scripts import it: by its bare name, scripts/ being on sys.path (scripts_loader puts it there).
benchmark_run = importlib.import_module("benchmark_run")
METHODS, method_overrides = benchmark_run.METHODS, benchmark_run.method_overrides
recipe_overrides, run_benchmark = benchmark_run.recipe_overrides, benchmark_run.run_benchmark

TINY = dict(steps=3, batch_size=2, block_size=32, eval_blocks=4, precision="32-true", lr=1e-3, model="tiny_llama")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # One run per method on a tiny model (the recipe is the real one, shrunk); min_dim 64 lets it project.
    out = {}
    for method in ("adamw", "frozen", "zero_offload", "lsp_learned", "lsp_random", "lora"):
        extra = ["offload.strategy.min_dim=64"] if method.startswith("lsp") else []
        out[method] = run_benchmark(recipe_overrides(**TINY) + method_overrides(method, lora_rank=2) + extra,
                                    tmp_path_factory.mktemp(method))
    return out


def test_every_method_trains_and_is_measured(runs):
    for method, run in runs.items():
        assert math.isfinite(run.eval_loss_before) and math.isfinite(run.eval_loss_after), method
        assert len(run.step_seconds) == 3 and run.median_step_seconds > 0, method
        assert run.eval_loss_after < run.eval_loss_before, method
    # All start from the same seeded model and data: the loss before training is the same.
    assert len({round(run.eval_loss_before, 6) for run in runs.values()}) == 1


def test_the_measurements_tell_the_methods_apart(runs):
    adamw, frozen, zero = runs["adamw"], runs["frozen"], runs["zero_offload"]
    learned, random = runs["lsp_learned"], runs["lsp_random"]
    assert adamw.bytes_device_to_host_per_step == 0 and adamw.device_state_bytes > 0
    assert frozen.trainable_parameters < adamw.trainable_parameters
    assert zero.bytes_device_to_host_per_step > learned.bytes_device_to_host_per_step > 0
    assert zero.host_state_bytes > 0 and zero.device_state_bytes == 0
    assert learned.projected_layers == random.projected_layers > 0
    assert learned.initial_fit_seconds > 0 and not random.initial_fit_seconds
    assert 0.5 < learned.initial_fit_error < 1.1 and learned.initial_fitted_error < 1.1
    assert "host_seconds" in learned.timeline_seconds_per_step


def test_the_overrides_are_the_command_lines():
    assert method_overrides("lsp_random", rank=0.125, density=4, projected_lr=3e-4) == [
        "offload=lsp", "offload.strategy.projectors=random", "offload.strategy.rank=0.125",
        "offload.strategy.density=4", "offload.strategy.pipelined=true", "offload.strategy.speculative=null",
        "offload.strategy.link_dtype=fp32",
        "offload.projected_lr=0.0003"]
    assert "trainer.val_check_interval=null" in recipe_overrides(steps=10)  # evaluation before and after only
    assert set(METHODS) >= {"adamw", "frozen", "lsp_learned", "lsp_random", "galore", "lora"}
    with pytest.raises(ValueError, match="method='dora' is not one of"):
        method_overrides("dora")


@pytest.mark.parametrize("script, args", [
    ("benchmark_core.py", ["--steps", "2", "--repeats", "1", "--eval-blocks", "8"]),
    ("benchmark_pipeline.py", ["--steps", "2", "--repeats", "1", "--strategies", "zero_offload"]),
])
def test_benchmark_scripts_run_on_a_tiny_model(tmp_path, monkeypatch, capsys, script, args):
    module = load_script(script.removesuffix(".py"))
    monkeypatch.setattr("sys.argv", [script, "--model", "tiny_llama", "--precision", "32-true", *args,
                                     "--out", str(tmp_path / "out.json")])
    module.main()
    out = capsys.readouterr().out
    assert "tiny_llama" in out and "| zero_offload |" in out
    assert (tmp_path / "out.json").stat().st_size > 100


def test_the_step_clock_times_the_pipelined_mode_users_get():
    # A callback that may read the weights after each step turns pipelining off; the benchmarks' own clock reads none,
    # so the figures it takes are those of the default (pipelined) mode.
    from lightning_offload.faces.trainer.weight_readers import weight_readers

    assert weight_readers([benchmark_run.StepClock(), benchmark_run.PhaseReader(warmup=0)]) == []
