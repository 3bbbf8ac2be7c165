"""A plan's projected layers' products (planning/projection_time.py): on this machine timed by the kernel selection a
run makes, sharing its kept choices both ways; for a named profile at the memory floor, with no assumed rate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import lightning_offload
from lightning_offload.lsp.kernels import selection as selection_module
from lightning_offload.lsp.projector import random_projector
from lightning_offload.models.tiny import tiny_gpt2, tiny_llama
from lightning_offload.planning import projection_time
from lightning_offload.planning.calibration import PROFILES, Hardware
from lightning_offload.planning.inventory import Entry

#: Speeds of a CPU as calibrated (measured=True: the plan times the products here); the rest do not matter.
THIS_CPU = Hardware("this CPU", "cpu", 1e11, 1e-9, 1e-5, 1e10, 1e10, 1e10, 1e10, 0, 64 * 2**30, 1e-4)
BATCH, SEQ = 2, 16


@pytest.fixture
def isolated_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of kernel choices for one test, and no timings kept in the process."""
    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    projection_time._timed_seconds.cache_clear()
    return tmp_path


def _timed_keys(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the key of every product the selection times from now on (what it does not read from the choices)."""
    keys: list[str] = []
    choose = selection_module.KernelSelector._choose

    def recording(self, key, device, dtype, call, budget):  # noqa: ANN001, ANN202
        choice = choose(self, key, device, dtype, call, budget)
        if choice.how == "timed":
            keys.append(key)
        return choice
    monkeypatch.setattr(selection_module.KernelSelector, "_choose", recording)
    return keys


def _train_one_step(model: torch.nn.Module) -> None:
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = lightning_offload.offload(model, adamw, "lsp_offload", projectors="random", min_dim=32)
    try:
        ids = torch.randint(1, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    finally:
        optimizer.close()


@pytest.mark.parametrize("build", [lambda: tiny_llama(hidden=64, intermediate=176, layers=2, seed=0),
                                   lambda: tiny_gpt2(hidden=64, layers=2, heads=4, intermediate=256, seed=0)],
                         ids=["llama", "gpt2 (Conv1D)"])
def test_a_plan_times_the_products_a_run_then_reads(build, isolated_choices: Path,  # noqa: ANN001
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    timed = _timed_keys(monkeypatch)
    found = lightning_offload.plan(build(), "lsp_offload", batch_size=BATCH, seq_len=SEQ, device_memory="1GiB",
                                   precision="32-true", hardware=THIS_CPU, projectors="random", min_dim=32)
    planned = set(timed)
    assert planned and "projected layers" in found.table() and " 0 projected layers" not in found.table()
    # Every product the plan timed is kept with its time, as a run keeps its own.
    kept = selection_module._stored_choices()
    assert planned <= set(kept) and all(kept[key]["ms"] > 0 for key in planned)
    # A run on the same machine (a new process: nothing held in memory) times nothing: each of its products, the
    # Conv1D's transposed update included, is one the plan timed.
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    timed.clear()
    _train_one_step(build())
    assert timed == []
    assert set(selection_module._stored_choices()) == set(kept)


def test_the_planned_time_is_the_sum_of_the_chosen_kernels_times(isolated_choices: Path) -> None:
    entry = Entry("w", "projected", (96, 64), 4, compressed=(24, 16), projector_sizes=(96, 64))
    seconds = projection_time.projection_seconds([entry, entry], 32, 4, THIS_CPU, torch.float32, "auto")
    kept = selection_module._stored_choices()
    # Two compressions, one expansion and one update for this shape, each at its chosen kernel's kept time; the same
    # layer twice counts twice.
    assert len(kept) == 4
    assert seconds == pytest.approx(2 * sum(choice["ms"] for choice in kept.values()) / 1e3)


def test_a_forced_kernel_is_timed_for_the_plan_alone(isolated_choices: Path) -> None:
    entry = Entry("w", "projected", (64, 64), 4, compressed=(16, 16), projector_sizes=(64, 64))
    seconds = projection_time.projection_seconds([entry], 32, 4, THIS_CPU, torch.float32, "csr")
    assert seconds > 0
    # The run forces it without timing; the plan times it for its prediction and keeps nothing on disk for it.
    assert selection_module._stored_choices() == {}
    forced = selection_module.KernelSelector("csr")
    generator = torch.Generator().manual_seed(0)
    forced.compress_tokens(random_projector(64, 16, 4, generator, torch.device("cpu")),
                           torch.randn(32, 64, generator=generator))
    assert forced.milliseconds(next(iter(forced.choices))) is None


def test_a_profile_is_predicted_at_the_memory_floor_without_timing(isolated_choices: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    timed = _timed_keys(monkeypatch)
    o, i, d_o, d_i, density, tokens = 4096, 1024, 1024, 256, 8, 2048
    entry = Entry("w", "projected", (o, i), 2, compressed=(d_o, d_i), projector_sizes=(o, i))
    profile = PROFILES["rtx4090"]
    seconds = projection_time.projection_seconds([entry], tokens, density, profile, torch.bfloat16, "auto")
    assert timed == [] and not profile.measured
    # Reading each activation once in bf16 and writing its fp32 compression, the update's two small products, and one
    # read and write of the bf16 weight: the products' least traffic, at the profile's bandwidth.
    least = (tokens * (o + i) * 2 + tokens * (d_o + d_i) * 4 + (o + i) * density * 8
             + d_o * d_i * 4 + d_o * i * 4 + i * density * 8 + 2 * o * i * 2 + d_o * i * 4 + o * density * 8)
    assert seconds == pytest.approx(least / profile.device_bandwidth)
    # Twice the bandwidth, half the time: nothing but bytes enters (no sparse rate is assumed).
    faster = dataclasses.replace(profile, device_bandwidth=2 * profile.device_bandwidth)
    assert projection_time.projection_seconds([entry], tokens, density, faster, torch.bfloat16, "auto") == \
        pytest.approx(seconds / 2)
    assert "sparse" not in " ".join(field.name for field in dataclasses.fields(Hardware))
