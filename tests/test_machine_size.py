"""The main job sized to the machine: a shorter run on a slow CPU, said in the log and the summary; the user's
settings, presets and ``main_job.size_to_machine=false`` always win."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from lightning_offload.cli import machine_size as ms
from lightning_offload.cli.train import CONFIG_DIR, compose_config
from lightning_offload.reporting.run_record import read_summary

AVX2_2_CORES = ms.Machine(cuda=False, cpu_capability="AVX2", cores=2)
THE_CONFIGS = {"trainer.max_steps": 40, "data.block_size": 128, "data.max_val_blocks": 64}


@pytest.fixture(autouse=True)
def _fresh_hydra() -> None:
    GlobalHydra.instance().clear()


def composed(overrides: Sequence[str] = ()) -> DictConfig:
    """The real config, composed without resolving anything (no precision probe)."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("machine, full", [
    (ms.Machine(cuda=True, cpu_capability="AVX2", cores=2), True),  # a GPU: nothing changes
    (ms.Machine(cuda=False, cpu_capability="AVX512", cores=2), True),  # this project's CPU
    (AVX2_2_CORES, False),  # the CPU the main job took 10 min on
    (ms.Machine(cuda=False, cpu_capability="DEFAULT", cores=4), False),  # no vector kernels at all
    (ms.Machine(cuda=False, cpu_capability="AVX2", cores=8), True),
    (ms.Machine(cuda=False, cpu_capability="AVX512", cores=1), False),
])
def test_the_rule_reads_the_device_the_vector_width_and_the_cores(machine: ms.Machine, full: bool) -> None:
    assert machine.runs_full_main_job is full
    size = ms.choose_size(composed(), machine)
    assert size.sized is not full
    assert size.settings == ({} if full else dict(ms.SMALL_CPU_RUN))


def test_a_slow_cpu_trains_fewer_steps_on_shorter_blocks_and_evaluates_fewer() -> None:
    cfg = composed()
    size = ms.choose_size(cfg, AVX2_2_CORES)
    assert size.replaced == THE_CONFIGS and size.kept == ()
    assert size.settings == {"trainer.max_steps": 30, "data.block_size": 64, "data.max_val_blocks": 32}
    assert cfg.trainer.max_steps == 40  # choosing changes nothing; applying does
    ms.apply_size(cfg, size)
    assert (cfg.trainer.max_steps, cfg.data.block_size, cfg.data.max_val_blocks) == (30, 64, 32)
    assert ms.describe(size, cfg) == ("30 steps of 4×64 tokens, evaluations on 32 held-out blocks, sized to a CPU "
                                      "with AVX2 (no AVX-512), 2 cores")
    assert size.record(cfg)["sized_to_machine"] is True


@pytest.mark.parametrize("overrides", [["trainer.max_steps=100"], ["++trainer.max_steps=100"]])
def test_a_setting_on_the_command_line_keeps_its_value(overrides: list[str]) -> None:
    cfg = composed(overrides)
    size = ms.choose_size(cfg, AVX2_2_CORES, overrides)
    ms.apply_size(cfg, size)
    assert (cfg.trainer.max_steps, cfg.data.block_size, cfg.data.max_val_blocks) == (100, 64, 32)
    assert size.kept == ("trainer.max_steps",)
    assert "(trainer.max_steps=100 as set on the command line)" in ms.describe(size, cfg)


def test_every_key_set_leaves_the_run_as_set() -> None:
    overrides = ["trainer.max_steps=40", "data.block_size=128", "data.max_val_blocks=64"]
    size = ms.choose_size(composed(overrides), AVX2_2_CORES, overrides)
    assert not size.sized and size.settings == {}
    assert size.kept == ("trainer.max_steps", "data.block_size", "data.max_val_blocks")


@pytest.mark.parametrize("overrides, choices, reason", [
    (["main_job.size_to_machine=false"], {}, "main_job.size_to_machine=false"),
    (["experiment=lm_policies"], {"experiment": "lm_policies"}, "experiment=lm_policies sets its own length"),
    (["debug=limit"], {"debug": "limit"}, "debug=limit sets its own length"),
])
def test_the_sizing_can_be_turned_off_and_presets_keep_their_length(overrides: list[str], choices: dict[str, str],
                                                                     reason: str) -> None:
    cfg = composed(overrides)
    before = (cfg.trainer.max_steps, cfg.data.block_size)
    size = ms.choose_size(cfg, AVX2_2_CORES, overrides, choices)
    ms.apply_size(cfg, size)
    assert not size.sized and size.reason == reason and (cfg.trainer.max_steps, cfg.data.block_size) == before


def test_data_without_blocks_is_sized_in_steps_only() -> None:
    size = ms.choose_size(composed(["data=bible_genre"]), AVX2_2_CORES, ["data=bible_genre"])
    assert size.settings == {"trainer.max_steps": 30}


def test_the_command_lines_overrides_are_read_from_hydra_and_the_choice_said_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ms.Machine, "this", classmethod(lambda cls, accelerator: AVX2_2_CORES))
    cfg = compose_config(["trainer=cpu", "data.max_val_blocks=16", "trainer.precision=32-true"], tmp_path)
    with caplog.at_level(logging.INFO, logger=ms.__name__):
        size = ms.size_to_machine(cfg)
    assert size.kept == ("data.max_val_blocks",)
    assert (cfg.trainer.max_steps, cfg.data.block_size, cfg.data.max_val_blocks) == (30, 64, 16)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Run size:")]
    assert said == ["Run size: 30 steps of 4×64 tokens, evaluations on 16 held-out blocks (data.max_val_blocks=16 as "
                    "set on the command line), sized to a CPU with AVX2 (no AVX-512), 2 cores, where the full main "
                    "job takes over 8 minutes; main_job.size_to_machine=false runs 40 steps of 4×128 tokens, "
                    "evaluations on 16 held-out blocks."]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ATEN_CPU_CAPABILITY is an x86 setting")
def test_the_machine_is_read_from_torchs_cpu_capability() -> None:
    code = ("from lightning_offload.cli.machine_size import Machine; m = Machine.this('cpu'); "
            "print(m.cpu_capability, m.cores, m.has_avx512)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    capability, cores, has_avx512 = done.stdout.split()
    assert capability == "AVX2" and int(cores) >= 1 and has_avx512 == "False"


def test_the_command_says_the_size_in_its_log_and_summary(tmp_path: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    # The command as `lightning-offload-train` runs it, on a machine the rule sizes (whatever this one is).
    run_dir = tmp_path / "run"
    code = ("import sys; from lightning_offload.cli import machine_size as ms; "
            "ms.Machine.this = classmethod(lambda cls, accelerator: ms.Machine(False, 'AVX2', 2)); "
            "from lightning_offload.cli.train import main; main()")
    args = ["model=tiny_llama", "trainer=cpu", "trainer.max_steps=4", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=2", "trainer.precision=32-true", "logger=csv", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "LIGHTNING_OFFLOAD_CACHE": str(tmp_path_factory.getbasetemp() / "cache"),
           "HYDRA_FULL_ERROR": "0"}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = ("Run size: 4 steps of 4×64 tokens, evaluations on 32 held-out blocks (trainer.max_steps=4 as set on the "
            "command line), sized to a CPU with AVX2 (no AVX-512), 2 cores, where the full main job takes over 8 "
            "minutes; main_job.size_to_machine=false runs 4 steps of 4×128 tokens, evaluations on 64 held-out blocks.")
    assert line in (run_dir / "train.log").read_text()
    assert ("run size            4 steps of 4×64 tokens, evaluations on 32 held-out blocks (trainer.max_steps=4 as "
            "set on the command line), sized to a CPU with AVX2 (no AVX-512), 2 cores") in done.stdout
    summary = read_summary(run_dir)
    assert summary["steps"] == 4  # the user's
    assert summary["run_size"]["sized_to_machine"] is True
    assert summary["run_size"]["settings"] == {"data.block_size": 64, "data.max_val_blocks": 32}
    assert summary["run_size"]["replaced"] == {"data.block_size": 128, "data.max_val_blocks": 64}
    # The run trained on what was said: the loggers' record of the config has the sized values.
    (hparams,) = run_dir.rglob("hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert (logged["data"]["block_size"], logged["data"]["max_val_blocks"]) == (64, 32)
