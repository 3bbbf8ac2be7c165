"""The planner's named GPU profiles assume an achieved matmul rate, not the peak: the model FLOPs utilisation of the
one GPU run measured (one H200, 2026-11-30: the LLaMA 1.3B shape, bf16-true, 4×512 tokens, native fused AdamW, 0.101 s
a step) applied to each chip's dense bf16 peak. So the h200 profile predicts that run's step, and no profile predicts
a step faster than its achievable rate allows (the RTX 4090's Llama-3.1-8B step had reached ~100% of its rate)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_offload.planning import calibration
from lightning_offload.planning.calibration import ACHIEVED_MFU, PEAK_FLOPS, PROFILES
from lightning_offload.planning.plan import plan

#: The H200 run of 2026-11-30 (docs/benchmarks.md, "GPU: the last measurement"): native fused AdamW, seconds a step.
MEASURED_NATIVE_STEP = 0.101
H200_PEAK = 989e12  # dense bf16, NVIDIA's data sheet
TOKENS, SEQ = 4 * 512, 512


def _meta(config: LlamaConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _llama_1b3() -> torch.nn.Module:
    # As scripts/gpu_bench_run.py built it: untied head, as many key/value heads as heads.
    return _meta(LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False))


def _llama_8b() -> torch.nn.Module:
    return _meta(LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False))


def _linear_elements(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _native(model: torch.nn.Module, hardware: str) -> object:
    # The run as measured: no checkpointing, the model's own loss.
    return plan(model, "auto", batch_size=4, seq_len=SEQ, device_memory="141GB", precision="bf16-true",
                hardware=hardware, loss="model")


def test_the_assumed_mfu_is_the_one_the_h200_run_achieved() -> None:
    model = _llama_1b3()
    # Counted here from the model: forward, input gradients and weight gradients, 2·T FLOPs per weight element each;
    # attention 4·T·s·h per block forward and twice that backward.
    linear = _linear_elements(model)
    assert linear == 1_279_787_008
    flops = 3 * 2 * TOKENS * linear + 3 * 4 * TOKENS * SEQ * 2048 * 24
    assert calibration.NATIVE_1B3_FLOPS == pytest.approx(flops, rel=1e-4)
    assert _native(model, "h200").step.flops == pytest.approx(flops, rel=1e-12)  # the cost model counts the same
    assert ACHIEVED_MFU == pytest.approx(flops / MEASURED_NATIVE_STEP / H200_PEAK, rel=1e-4)
    assert 0.15 < ACHIEVED_MFU < 0.18  # 16.4%: far from the ~70-100% the profiles had assumed
    for name, profile in PROFILES.items():
        assert profile.matmul_flops == pytest.approx(ACHIEVED_MFU * PEAK_FLOPS[name])
        assert f"{ACHIEVED_MFU:.1%} of its {PEAK_FLOPS[name] / 1e12:.3g} TFLOP/s bf16 peak" in profile.name  # said


def test_the_h200_profile_predicts_the_measured_native_step_within_25_percent() -> None:
    predicted = _native(_llama_1b3(), "h200").step_seconds
    # Over it by the device AdamW's pass the cost model adds (~9 ms), which the measured rate already includes.
    assert abs(predicted / MEASURED_NATIVE_STEP - 1) <= 0.25, predicted


@pytest.mark.parametrize("strategy", ["lsp_offload", "auto"])
def test_no_profile_predicts_a_step_faster_than_its_achievable_rate(strategy: str) -> None:
    model = _llama_8b()
    found = plan(model, strategy, batch_size=4, seq_len=SEQ, device_memory="24GiB", host_memory="32GiB",
                 precision="bf16-true", gradient_checkpointing=True, hardware="rtx4090")
    achievable = ACHIEVED_MFU * 165.2e12  # the RTX 4090's dense bf16 peak (FP32 accumulation)
    # The forward, its recomputation and the input gradients run under any strategy: 3 × 2·T FLOPs per weight element.
    least = 3 * 2 * TOKENS * _linear_elements(model)
    assert found.step.flops >= least
    assert found.step.device >= found.step.flops / achievable * (1 - 1e-9)
    assert found.step_seconds >= least / achievable
    assert found.step.flops / found.step_seconds <= achievable * (1 + 1e-9)
    for name in ("h200", "laptop-4gb"):
        other = plan(_llama_1b3(), strategy, batch_size=4, seq_len=SEQ, device_memory="141GB", precision="bf16-true",
                     gradient_checkpointing=True, hardware=name)
        assert other.step.flops / other.step_seconds <= ACHIEVED_MFU * PEAK_FLOPS[name] * (1 + 1e-9)
