"""The command line's plan mode (``+plan=true`` prints the plan and trains nothing; ``+plan=choose`` the chooser's
answer) and the plan every run logs beside its telemetry, with each prediction's error in its summary."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from lightning_offload.reporting.run_record import read_summary

TINY = ["model=tiny_llama", "trainer=cpu", "trainer.precision=32-true", "data.max_val_blocks=8",
        "trainer.limit_val_batches=2", "+plan_hardware=rtx4090"]  # a profile: no test calibrates this machine


def _train(overrides: list[str], run_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple:
    from test_configs import compose_cfg

    from lightning_offload.cli.train import train

    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path / "cache"))
    GlobalHydra.instance().clear()
    return train(compose_cfg(overrides, run_dir))


def test_plan_mode_prints_the_plan_and_trains_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    # The run's length pinned (a CPU without AVX-512 sizes the main job to 4×64): the plan is of the data config's.
    metrics, objects = _train([*TINY, "logger=none", "+plan=true", "main_job.size_to_machine=false"], run_dir,
                              monkeypatch, tmp_path)
    printed = capsys.readouterr().out
    assert "lsp_offload" in printed and "device memory" in printed and "step time" in printed
    assert metrics["plan/offload/host_state_bytes"] == objects["plan"].host_state_bytes > 0
    assert objects["plan"].batch_size == 4 and objects["plan"].seq_len == 128  # the data config's
    assert not (run_dir / "summary.json").exists()  # nothing trained, nothing summarised


@pytest.mark.parametrize("data", ["bible_genre", "bible_qa"])
def test_every_task_plans_at_its_longest_sequence(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The task sets have no block size ("Key 'block_size' is not in struct" left them without a plan): a plan is made
    # for the longest training example, what a padded batch reaches at most.
    overrides = [o for o in TINY if not o.startswith("data.")]
    _, objects = _train([*overrides, f"data={data}", "logger=none", "+plan=true", "main_job.size_to_machine=false"],
                        tmp_path / "run", monkeypatch, tmp_path)
    datamodule = objects["datamodule"]
    datamodule.setup("fit")
    lengths = [len(example["input_ids"]) for example in datamodule.train_set]
    assert objects["plan"].batch_size == 16 and objects["plan"].seq_len == max(lengths) > 1


def test_plan_choose_prints_the_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _, objects = _train([*TINY, "logger=none", "+plan=choose", "+plan_device_memory=64MiB"], tmp_path / "run",
                        monkeypatch, tmp_path)
    assert objects["choice"].best is not None
    assert "Chosen:" in capsys.readouterr().out


def test_a_bad_plan_value_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"plan='maybe'"):
        _train([*TINY, "logger=none", "+plan=maybe"], tmp_path / "run", monkeypatch, tmp_path)


def test_every_run_logs_its_plan_and_the_prediction_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    _train([*TINY, "logger=csv", "trainer.max_steps=3", "trainer.val_check_interval=3"], run_dir, monkeypatch,
           tmp_path)
    summary = read_summary(run_dir)
    assert summary["plan"]["strategy"] == "lsp_offload"
    errors = summary["plan_errors"]
    # The bytes the plan counts are the engine's (a tiny model's sparse embedding rows: the batch's distinct tokens,
    # fewer than the plan's bound of one per token; those rows are a small share of the whole).
    assert abs(errors["plan_error/host_state_bytes"]) < 0.05
    assert abs(errors["plan_error/link_bytes_to_host_per_step"]) < 0.05
    assert "plan_error/median_step_seconds" in errors
    (metrics_file,) = run_dir.rglob("metrics.csv")
    with metrics_file.open() as f:
        header = next(csv.reader(f))
    assert "plan/offload/host_state_bytes" in header and "plan_error/host_state_bytes" in header


def test_a_cpu_step_time_error_is_said_to_be_against_a_lower_bound(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    from dataclasses import replace

    from lightning_offload.cli.plan_run import record_errors
    from lightning_offload.models.tiny import tiny_llama
    from lightning_offload.planning.plan import plan

    cpu = plan(tiny_llama(hidden=128, intermediate=256), "lsp_offload", batch_size=2, seq_len=16, device_memory="1GiB",
               precision="32-true", hardware="h200", device="cpu")
    summary = {"median_step_seconds": 3 * cpu.step.step, "host_state_bytes": cpu.host_state_bytes}
    with caplog.at_level(logging.INFO):
        record_errors(replace(cpu, step_is_lower_bound=True), dict(summary), [], 1)
        record_errors(replace(cpu, step_is_lower_bound=False), dict(summary), [], 1)
    bound, plain = [r.getMessage() for r in caplog.records if "Prediction errors" in r.getMessage()]
    assert "median_step_seconds +200.0% (predicted as a lower bound" in bound
    assert "lower bound" not in plain


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gpt2", "llama_1b3", "llama_7b", "smollm2_135m", "hf"])
def test_every_model_config_plans(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The shapes of random weights are built on the meta device when the run only plans: a 7B config allocates nothing.
    overrides = [o for o in TINY if not o.startswith("model=")] + [f"model={model}"]
    if model == "hf":  # a local Hugging Face directory: SmolLM2 as the package converts it
        from lightning_offload.models.smollm2 import load_smollm2

        load_smollm2(cache_dir=tmp_path / "smollm2")
        overrides.append(f"model.name_or_path={tmp_path / 'smollm2'}")
    _, objects = _train([*overrides, "logger=none", "+plan=true", "main_job.size_to_machine=false"],
                        tmp_path / "run", monkeypatch, tmp_path)
    found = objects["plan"]
    assert found.device_bytes > 0 and found.projected_layers > 0 and found.step.step > 0
    if model == "llama_7b":
        assert found.device_parts["weights"] > 12 * 2**30  # bf16 weights of 6.7B parameters, none allocated
        assert next(objects["module"].parameters()).device.type == "meta"
