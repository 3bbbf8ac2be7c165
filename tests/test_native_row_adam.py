"""The row Adam's native kernel: built where the machine has a C compiler, used only where it gives torch's results bit
for bit, stepping whole blocks from gradients where they landed as torch's kernel steps the assembled blocks (kept
gradients and accumulators, clipping, both decays, maximize, gaps and a schedule to lr 0), in a training run as with it
turned off, the same bits however many threads split a call, and each fallback said in the log."""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_offload import MEFTConfig, MEFTOffloadStrategy, inject_meft, meft_adapters
from lightning_offload.engine.rows import native_row_adam as native
from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings
from lightning_offload.engine.rows.host_threads import SMALL_OP_ELEMENTS, _openmp, one_thread
from lightning_offload.engine.rows.native_row_adam import LandedRows, native_row_adam, tail_free
from lightning_offload.engine.rows.row_landing import RowLanding
from lightning_offload.models import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule
from test_meft import batches, loader, trainer

ROWS, WIDTH, BLOCK = 48, 16, 4  # 12 blocks of 64 elements: whole vectors for up to 4 threads


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """``native_row_adam()`` looked up again (its cache cleared, the build kept under ``tmp_path``),
    and cleared after."""
    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path))
    native_row_adam.cache_clear()
    yield
    native_row_adam.cache_clear()


def test_the_kernel_is_built_and_checked_where_there_is_a_compiler(fresh_kernel: None) -> None:
    assert any(shutil.which(name) for name in ("cc", "gcc", "clang")), "this machine class has gcc"
    kernel = native_row_adam()
    assert kernel is not None and kernel.path.exists()
    assert native._check(kernel) == ""  # bit for bit against torch's fused kernel on this machine


def test_a_kernel_that_differs_from_torch_is_found_and_not_used(fresh_kernel: None, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    kernel = native_row_adam()
    assert kernel is not None
    step = kernel.step_blocks

    def off_by_an_ulp(param, *args, **kwargs):
        read = step(param, *args, **kwargs)
        param.view(-1)[5] = torch.nextafter(param.view(-1)[5], torch.tensor(math.inf))
        return read

    monkeypatch.setattr(kernel, "step_blocks", off_by_an_ulp)
    assert native._check(kernel).startswith("weights differ")
    monkeypatch.setattr(native, "_check", lambda _: "weights differ at lr=0.001")
    native_row_adam.cache_clear()
    with caplog.at_level(logging.WARNING, logger="lightning_offload"):
        assert native_row_adam() is None
    assert "does not give torch's results on this machine (weights differ at lr=0.001)" in caplog.text


def test_without_a_compiler_or_turned_off_the_rows_are_stepped_by_torch_and_it_is_said(
        fresh_kernel: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        assert native_row_adam() is None
        native_row_adam.cache_clear()
        monkeypatch.setenv("LIGHTNING_OFFLOAD_NATIVE", "0")
        assert native_row_adam() is None
    assert "not available (no C compiler found" in caplog.text and "Install a C compiler" in caplog.text
    assert "native kernel is off (LIGHTNING_OFFLOAD_NATIVE=0)" in caplog.text


def test_only_blocks_torch_steps_in_whole_vectors_go_to_the_kernel() -> None:
    assert tail_free(128 * 128, 1) and tail_free(128 * 128, 16)
    assert tail_free(4 * 16, 4) and not tail_free(4 * 16, 8)  # a share of 8 elements: torch's scalar tail
    assert not tail_free(4 * 3, 1)  # 12 elements: no whole vector at all


def _landings(generator: torch.Generator) -> list[RowLanding]:
    """Two landings (keys, values) whose accumulators hold a consumed step's sums (never zeroed)."""
    return [RowLanding(torch.randn(ROWS, WIDTH, generator=generator), torch.zeros(ROWS, dtype=torch.bool), BLOCK)
            for _ in range(2)]


def _land(landings: list[RowLanding], generator: torch.Generator, accumulate: bool) -> torch.Tensor:
    """Lands a step's gradients (two micro-batches when ``accumulate``) in rows of a few blocks, some rows of each
    left without one; returns the step's blocks."""
    blocks = torch.randperm(ROWS // BLOCK, generator=generator)[:4].sort().values
    rows = (blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).reshape(-1)
    rows = rows[torch.rand(rows.numel(), generator=generator) < 0.7]
    for landing in landings:
        parts = [rows[::2], rows[1::3]] if accumulate else [rows]
        for part in parts:
            landing.land(part, torch.randn(part.numel(), WIDTH, generator=generator), keep=True, want_square=False)
    return rows.div(BLOCK, rounding_mode="floor").unique()


@pytest.fixture(params=[1, 4], ids=["1-thread", "4-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count for the test (the kernel splits its blocks between as many); put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("accumulate", [False, True], ids=["kept", "accumulator"])
@pytest.mark.parametrize("clip", [None, ("norm", 0.3), ("value", 0.5)], ids=["none", "norm", "value"])
@pytest.mark.parametrize("decoupled,maximize", [(True, False), (False, True)], ids=["adamw", "adam-l2-maximize"])
def test_landed_rows_step_as_torch_steps_the_assembled_blocks_bit_for_bit(accumulate: bool, clip, decoupled: bool,
                                                                          maximize: bool, threads: int) -> None:
    assert native_row_adam() is not None and tail_free(BLOCK * WIDTH, threads)
    seed = torch.Generator().manual_seed(7)
    starts = [torch.randn(ROWS, WIDTH, generator=seed) for _ in range(2)]
    by_torch = BlockRowAdam([s.clone() for s in starts], BLOCK, lr_scales=[0.5, 1.0])
    by_kernel = BlockRowAdam([s.clone() for s in starts], BLOCK, lr_scales=[0.5, 1.0])
    torch_side, kernel_side = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    torch_landings, kernel_landings = _landings(torch_side), _landings(kernel_side)
    mirror = starts[0].to(torch.bfloat16)
    steps = 10
    for step in range(steps):
        # A schedule reaching lr 0 at the last step; blocks skipped for several steps are caught up (scaled moments).
        settings = RowAdamSettings(lr=1e-2 * (1 - step / (steps - 1)), betas=(0.9, 0.99), weight_decay=0.1,
                                   decoupled=decoupled, maximize=maximize)
        blocks = _land(torch_landings, torch_side, accumulate)
        assert torch.equal(blocks, _land(kernel_landings, kernel_side, accumulate))
        assembled, layout = [], None
        for landing in torch_landings:
            grads, layout = landing.block_gradients(blocks, blocks.tolist(), layout)
            assembled.append(grads)
        landed, layout = [], None
        for landing in kernel_landings:
            where, layout = landing.landed_rows(blocks, layout)
            landed.append(where)
        landed[0].mirror = mirror  # the first matrix's bf16 copy, rewritten where stepped
        assert all((where.rows is None) == accumulate for where in landed)
        gradients_before = [where.grad.clone() for where in landed]
        by_torch.step(blocks, assembled, settings, clip, zero_grads=False)
        by_kernel.step(blocks, landed, settings, clip, zero_grads=False)
        assert all(torch.equal(where.grad, before) for where, before in zip(landed, gradients_before))  # only read
        for landing in torch_landings + kernel_landings:
            landing.forget(blocks)
    for a, b in zip(by_torch.params + by_torch.exp_avg + by_torch.exp_avg_sq,
                    by_kernel.params + by_kernel.exp_avg + by_kernel.exp_avg_sq):
        assert torch.equal(a, b)
    assert torch.equal(by_torch.scale2, by_kernel.scale2) and (by_torch.scale2 != 1).any()  # gaps were caught up
    assert torch.equal(mirror, by_torch.params[0].to(torch.bfloat16))


def test_landed_rows_are_refused_where_the_kernel_cannot_step_them(monkeypatch: pytest.MonkeyPatch) -> None:
    adam = BlockRowAdam([torch.zeros(ROWS, WIDTH)], BLOCK)
    where = LandedRows(torch.zeros(ROWS, WIDTH), None, torch.zeros(ROWS, dtype=torch.bool))
    with pytest.raises(ValueError, match="zero_grads=False"):
        adam.step(torch.tensor([0]), [where], RowAdamSettings(), zero_grads=True)
    kept = LandedRows(torch.ones(1, WIDTH), torch.tensor([BLOCK]), None)  # a row of block 1, block 0 stepped
    with pytest.raises(RuntimeError, match="read 0 of the 1 landed rows"):
        adam.step(torch.tensor([0]), [kept], RowAdamSettings(), zero_grads=False)


def _train(tmp_path: Path, hidden: int, row_block: int | None) -> tuple[list[torch.Tensor], int]:
    """A few steps of meft_offload (gradient norm clipping on) at a hidden size and row block; the adapters' host
    weights and routing copies, and how many row steps the native kernel took."""
    torch.manual_seed(0)
    model = tiny_llama(hidden=hidden, intermediate=2 * hidden, heads=2)
    inject_meft(model, MEFTConfig(num_neurons=256, top_k=8, num_experts=16, experts_per_token=4,
                                  calibration_batches=1))
    calls, refreshed = [], []
    for adapter in meft_adapters(model):  # the routing copy's refreshes after a row step (ranges given)
        def counted(ranges=None, refresh=adapter.refresh_routing_keys) -> None:
            if ranges is not None:
                refreshed.append(ranges)
            refresh(ranges)

        adapter.refresh_routing_keys = counted
    kernel = native_row_adam()
    if kernel is not None:
        step = kernel.step_blocks
        kernel.step_blocks = (  # type: ignore[method-assign]
            lambda *args, **kwargs: calls.append(1) or step(*args, **kwargs))
    try:
        trainer(tmp_path, 5, MEFTOffloadStrategy(device="cpu", row_block=row_block), gradient_clip_val=0.5).fit(
            CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(5, seed=3)))
    finally:
        if kernel is not None:
            del kernel.step_blocks
    adapters = meft_adapters(model)
    for adapter in adapters:  # the routing copy is the keys rounded to bf16, whoever refreshed it
        assert torch.equal(adapter.routing_keys, adapter.host.keys.to(torch.bfloat16))
    # With the kernel, it rewrote the routing copy's stepped rows itself: no refresh after a step.
    assert (len(refreshed) == 0) == bool(calls)
    return [t.clone() for a in adapters for t in (a.host.keys, a.host.values, a.routing_keys)], len(calls)


@pytest.mark.parametrize("hidden,row_block", [(32, None), (12, 1)], ids=["whole-vectors", "torch-tail"])
def test_training_with_the_kernel_equals_training_with_it_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture, hidden: int,
                                                              row_block: int | None) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        with_kernel, native_steps = _train(tmp_path / "on", hidden, row_block)
    # A shape the kernel leaves to torch is said, once for each of the two adapters, however many steps.
    said = "blocks of 12 elements are stepped by torch's fused kernel, not the native one"
    assert caplog.text.count(said) == (2 if row_block == 1 else 0)
    # Blocks of one expert's 16 rows × 32 go to the kernel; of one row × 12, torch's kernel has a tail: torch steps.
    assert native_steps > 0 if row_block is None else native_steps == 0
    monkeypatch.setenv("LIGHTNING_OFFLOAD_NATIVE", "0")
    native_row_adam.cache_clear()
    try:
        without, none = _train(tmp_path / "off", hidden, row_block)
    finally:
        native_row_adam.cache_clear()
    assert none == 0
    for a, b in zip(with_kernel, without):
        assert torch.equal(a, b)


def test_the_kernel_splits_a_large_call_between_the_steps_threads_with_the_same_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = native_row_adam()
    assert kernel is not None
    generator = torch.Generator().manual_seed(11)
    rows, width, block = 64, 16, 4
    blocks = torch.tensor([0, 2, 3, 5, 8, 9, 15])
    kept = torch.cat([torch.arange(b * block, b * block + 3) for b in blocks.tolist()])
    grad = torch.randn(kept.numel(), width, generator=generator)
    hyper = torch.tensor([[1e-2, 0.9, 0.1, 1e-8, 1.0]] * blocks.numel(), dtype=torch.float64)
    starts = [torch.randn(rows, width, generator=generator), torch.zeros(rows, width), torch.zeros(rows, width)]
    results = []
    for threads in (1, 3, 7):  # 7 threads: one block each
        state = [t.clone() for t in starts]
        mirror = torch.zeros(rows, width, dtype=torch.bfloat16)
        read = kernel.step_blocks(*state, block, blocks, hyper, 0.999, 4, True, False, None, grad, kept,
                                  mirror=mirror, threads=threads)
        assert read == kept.numel()  # each share found its first kept row
        results.append([*state, mirror])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    # Inside the engine, a call's threads are the step's: one for small blocks (run inside one_thread), else torch's.
    step, threads_given = kernel.step_blocks, []

    def recording(*args):
        threads_given.append(args[-1])  # step_landed passes the thread count last
        return step(*args)

    monkeypatch.setattr(kernel, "step_blocks", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows_per_block in (4, 4096):  # blocks of 128 elements (small), then of 131,072
            adam = BlockRowAdam([torch.zeros(4 * rows_per_block, 32)], rows_per_block)
            landed = LandedRows(torch.ones(rows_per_block, 32), torch.arange(rows_per_block), None)
            with one_thread(rows_per_block * 32 < SMALL_OP_ELEMENTS):  # as the slot's step runs
                adam.step(torch.tensor([0]), [landed], RowAdamSettings(), zero_grads=False)
    finally:
        torch.set_num_threads(before)
    assert threads_given == [1 if _openmp() is not None else 2, 2]
