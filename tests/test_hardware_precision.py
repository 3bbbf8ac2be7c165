"""The default precision follows the hardware: bf16-mixed only where bf16 is computed natively, said in one line."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

import pytest
import torch

from hydra import compose, initialize_config_dir

from lightning_offload.cli.precision import PRECISION_ENV, resolve_precision
from lightning_offload.cli.train import CONFIG_DIR, compose_config
from lightning_offload.setup import hardware_precision as hp


def test_the_probe_measures_a_positive_ratio() -> None:
    ratio = hp.bf16_matmul_slowdown(size=(16, 32, 32), rounds=1)
    assert ratio > 0 and ratio == ratio  # finite and not NaN


def test_a_burst_of_other_work_does_not_move_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that advances by each product's cost: bf16 native at 0.3x fp32, and a burst of other work making the
    # 5th to 8th products 20x slower (the bf16 warm-up and timed products of a probe that ran fp32 first, then bf16),
    # as a busy machine did (it read 1.8x and trained in fp32).
    clock, products = [0.0], []

    def product(a: torch.Tensor, b: torch.Tensor) -> None:
        products.append(a.dtype)
        burst = 20.0 if 5 <= len(products) <= 8 else 1.0
        clock[0] += (0.3e-3 if a.dtype == torch.bfloat16 else 1e-3) * burst

    monkeypatch.setattr(hp.torch, "mm", product)
    monkeypatch.setattr(hp.time, "perf_counter", lambda: clock[0])
    assert hp.bf16_matmul_slowdown() == pytest.approx(0.3)
    assert products.count(torch.bfloat16) == products.count(torch.float32) == 10  # a warm-up and 9 rounds each


@pytest.mark.parametrize("ratio, expected", [(0.5, "bf16-mixed"), (1.0, "bf16-mixed"), (2.8, "32-true"),
                                             (210.0, "32-true")])
def test_a_cpu_trains_in_bf16_only_when_bf16_is_no_slower(monkeypatch: pytest.MonkeyPatch, ratio: float,
                                                          expected: str) -> None:
    monkeypatch.setattr(hp, "bf16_matmul_slowdown", lambda: ratio)
    choice = hp.hardware_precision("cpu")
    assert choice.precision == expected and choice.bf16_to_fp32_time == ratio
    assert f"{ratio:.1f}" in choice.reason or f"{ratio:.2f}" in choice.reason


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's ISA cap is an x86 setting")
def test_a_cpu_without_native_bf16_kernels_gets_fp32() -> None:
    """Not a mock: oneDNN capped at AVX2 runs bf16 matmuls in its reference kernel, as on an AVX2-only CPU (where a
    SmolLM2 head-shaped product took 93 s in bf16 against 0.44 s in fp32)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    code = ("from lightning_offload.setup.hardware_precision import hardware_precision as h; "
            "c = h('cpu'); print(c.precision, c.bf16_to_fp32_time)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    precision, ratio = done.stdout.split()
    # The ratio is a timing on a shared machine: 1.9–2.9 in this emulation, so it is held to what decides, not to a
    # figure of its own (a fixed 2.0 failed under load while the decision was right).
    assert precision == "32-true" and float(ratio) > hp.NATIVE_BF16_MAX_RATIO


def test_auto_is_resolved_once_said_in_one_line_and_inherited_by_launched_ranks(
        tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(PRECISION_ENV, "")  # recorded, so the value resolve_precision sets is removed afterwards
    monkeypatch.setattr(hp, "bf16_matmul_slowdown", lambda: 30.0)
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["trainer=cpu"])
    assert cfg.trainer.precision == "auto"  # the default config leaves it to the hardware
    with caplog.at_level(logging.INFO, logger="lightning_offload.cli.precision"):
        assert resolve_precision(cfg) == "32-true"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Precision:")]
    assert said == ["Precision: 32-true (trainer.precision=auto: a bf16 matmul on this CPU took 30.0× the time of "
                    "fp32 (no native bf16: emulated or a reference kernel); set trainer.precision to choose another)."]
    assert cfg.trainer.precision == "32-true" and os.environ[PRECISION_ENV] == "cpu=32-true"
    # A rank Lightning launches runs the same command in a child process: it takes the parent's choice unprobed.
    monkeypatch.setattr(hp, "bf16_matmul_slowdown", lambda: pytest.fail("a launched rank must not probe again"))
    assert compose_config(["trainer=cpu"], tmp_path).trainer.precision == "32-true"
    # Another accelerator in the same process is not a launched rank of this run: it decides for itself.
    monkeypatch.setattr(hp, "bf16_matmul_slowdown", lambda: 0.5)
    if not torch.cuda.is_available():  # "auto" is the CPU here, probed again (now native)
        assert compose_config(["trainer=cpu", "trainer.accelerator=auto"], tmp_path).trainer.precision == "bf16-mixed"


def test_an_explicit_precision_is_kept(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hp, "bf16_matmul_slowdown", lambda: pytest.fail("no probe for an explicit precision"))
    cfg = compose_config(["trainer=cpu", "trainer.precision=bf16-true"], tmp_path)
    assert resolve_precision(cfg) == "bf16-true"


@pytest.mark.skipif(torch.cuda.is_available(), reason="16-mixed runs as fp16 on a GPU")
def test_16_mixed_on_a_cpu_warns_and_is_recorded_as_what_runs(tmp_path) -> None:
    with pytest.warns(UserWarning, match=r"16-mixed on a CPU: fp16 autocast does not run there, so Lightning trains "
                                         r"in bf16-mixed instead; this run is recorded as bf16-mixed"):
        cfg = compose_config(["trainer=cpu", "trainer.precision=16-mixed"], tmp_path)
    assert cfg.trainer.precision == "bf16-mixed"
