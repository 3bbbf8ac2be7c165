"""MEFT's host row step, piece by piece: a step's only gradient of a matrix is stepped where it landed, accumulated
gradients still sum, the block Adam steps per-block gradients as it steps full-size accumulators (bit for bit), the
per-block scales are the tensor formula's, small row work runs on one thread, the preparation of a step's blocks is
host work on rows in the telemetry, and the benchmark's clock counts nested calls once."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from lightning_offload.engine.lanes.link import Link
from lightning_offload.engine.lanes.worker import HostWorker
from lightning_offload.engine.rows import row_gradients
from lightning_offload.engine.rows.block_row_adam import RENORMALIZE_BELOW, BlockRowAdam, RowAdamSettings
from lightning_offload.engine.rows.host_threads import _openmp, one_thread
from lightning_offload.engine.rows.row_adam_kernel import decayed_scales, new_first_scales
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.engine.rows.row_landing import KeptLayout, RowLanding
from lightning_offload.meft.figures import _expert_usage_each, expert_usage
from scripts_loader import load_script

ROWS, WIDTH, BLOCK = 32, 3, 4  # 8 blocks


def _landing(generator: torch.Generator) -> tuple[RowLanding, torch.Tensor]:
    """A landing whose accumulator holds a consumed step's sums everywhere (never zeroed), and a copy of them."""
    stale = torch.randn(ROWS, WIDTH, generator=generator)
    return RowLanding(stale.clone(), torch.zeros(ROWS, dtype=torch.bool), BLOCK), stale


def _expected(blocks: list[int], parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each block's gradient: the sum of the gradients of its rows, zero where none came."""
    full = torch.zeros(ROWS, WIDTH)
    for rows, grad in parts:
        full.index_add_(0, rows, grad)
    return [full[b * BLOCK:(b + 1) * BLOCK] for b in blocks]


def test_a_steps_only_gradient_is_stepped_where_it_landed() -> None:
    generator = torch.Generator().manual_seed(0)
    landing, stale = _landing(generator)
    rows = torch.tensor([4, 5, 6, 7, 9, 11, 20, 21, 22, 23])  # blocks 1 and 5 whole, block 2 in part
    grad = torch.randn(rows.numel(), WIDTH, generator=generator)
    assert landing.land(rows, grad, keep=True, want_square=True) == pytest.approx(float((grad * grad).sum()))
    assert torch.equal(landing.accumulator, stale)  # nothing copied as it landed
    blocks = torch.tensor([1, 2, 5])
    got, layout = landing.block_gradients(blocks, blocks.tolist())
    assert layout is not None and layout.per_block == [4, 2, 4]
    for piece, want in zip(got, _expected([1, 2, 5], [(rows, grad)])):
        assert torch.equal(piece, want)  # the idle rows of block 2 read zero, though their old sums were not zeroed
    for whole in (got[0], got[2]):  # whole blocks are views of the landed gradient
        assert whole.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    untouched = torch.cat([torch.arange(0, 4), torch.arange(12, 20), torch.arange(24, 32)])  # blocks not stepped
    assert torch.equal(landing.accumulator[untouched], stale[untouched])
    landing.forget(blocks)
    assert landing.kept is None and not landing.written.any()


def test_the_touched_rows_layout_is_taken_only_when_it_is_the_landed_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    landing, _ = _landing(generator)
    rows = torch.tensor([0, 1, 2, 3, 5])
    grad = torch.randn(rows.numel(), WIDTH, generator=generator)
    landing.land(rows, grad, keep=True, want_square=False)
    blocks = torch.tensor([0, 1])
    # Touched rows beyond the landed ones (a forward whose backward never came): counted from the landed rows.
    got, layout = landing.block_gradients(blocks, [0, 1], KeptLayout(None, [4, 3]))
    assert layout.rows is rows and layout.per_block == [4, 1]
    for piece, want in zip(got, _expected([0, 1], [(rows, grad)])):
        assert torch.equal(piece, want)


def test_accumulated_gradients_are_summed_and_a_staged_one_is_added() -> None:
    generator = torch.Generator().manual_seed(2)
    landing, _ = _landing(generator)
    first, second = torch.tensor([0, 1, 2, 3, 8]), torch.tensor([2, 3, 9, 12])
    g1, g2 = torch.randn(5, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)
    assert landing.land(first, g1, keep=True, want_square=True) is not None
    assert landing.land(second, g2, keep=True, want_square=True) is None  # rows 2 and 3 summed: no norm of sums
    assert landing.kept is None and landing.written[[0, 1, 2, 3, 8, 9, 12]].all()
    blocks = torch.tensor([0, 2, 3])
    got, _ = landing.block_gradients(blocks, blocks.tolist())
    for piece, want in zip(got, _expected([0, 2, 3], [(first, g1), (second, g2)])):
        torch.testing.assert_close(piece, want, rtol=0, atol=0)
    staged, _ = _landing(generator)
    staged.land(first, g1, keep=False, want_square=False)  # a gradient in a staging buffer is copied, not kept
    assert staged.kept is None and torch.equal(staged.accumulator[first], g1)


def _steps(generator: torch.Generator) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Blocks drawn per step (caught up over gaps) with some of their rows left without a gradient."""
    out = []
    for _ in range(8):
        blocks = torch.randperm(ROWS // BLOCK, generator=generator)[:3].sort().values
        grads = [torch.zeros(ROWS, WIDTH) for _ in range(2)]
        for grad in grads:
            for block in blocks.tolist():
                grad[block * BLOCK:block * BLOCK + 3] = torch.randn(3, WIDTH, generator=generator)
        out.append((blocks, grads))
    return out


@pytest.mark.parametrize("clip", [None, ("norm", 0.3), ("value", 0.5)])
def test_per_block_gradients_step_as_full_size_accumulators_bit_for_bit(clip) -> None:
    generator = torch.Generator().manual_seed(3)
    starts = [torch.randn(ROWS, WIDTH, generator=generator) for _ in range(2)]
    full = BlockRowAdam([s.clone() for s in starts], BLOCK, lr_scales=[0.5, 1.0])
    per_block = BlockRowAdam([s.clone() for s in starts], BLOCK, lr_scales=[0.5, 1.0])
    settings = RowAdamSettings(lr=1e-2, weight_decay=0.1)
    for blocks, grads in _steps(generator):
        full.step(blocks, [g.clone() for g in grads], settings, clip)
        pieces = [[g.clone()[b * BLOCK:(b + 1) * BLOCK] for b in blocks.tolist()] for g in grads]
        per_block.step(blocks, pieces, settings, clip)
    for a, b in zip(full.params + full.exp_avg + full.exp_avg_sq, per_block.params + per_block.exp_avg
                    + per_block.exp_avg_sq):
        assert torch.equal(a, b)
    assert torch.equal(full.scale1, per_block.scale1) and torch.equal(full.scale2, per_block.scale2)
    assert (full.scale2 != 1).any()  # blocks were caught up over gaps
    with pytest.raises(ValueError, match="a gradient for each of the 2 blocks"):
        per_block.step(torch.tensor([0, 1]), [[torch.zeros(BLOCK, WIDTH)]] * 2, settings)


def test_decayed_and_new_scales_are_the_tensor_formula_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(4)
    blocks = torch.arange(0, 40, 2)
    last_step = torch.randint(0, 30, (40,), generator=generator)
    scales = torch.rand(2, 40, generator=generator, dtype=torch.float64) + 0.5
    betas, step_count = (0.9, 0.999), 31
    # The formula as tensors (what the block Adam computed before its scales were read in one go).
    last = last_step[blocks]
    gaps = (step_count - 1 - last).double()
    want1 = torch.where(last == 0, 1.0, scales[0][blocks] * betas[0]**gaps)
    want2 = torch.where(last == 0, 1.0, scales[1][blocks] * betas[1]**gaps)
    got1, got2 = decayed_scales(blocks, last_step, scales, step_count, betas)
    assert got1 == want1.tolist() and got2 == want2.tolist()
    assert (last == 0).any() and min(got2) > RENORMALIZE_BELOW
    exact = (want1 == 1.0) & (want2 == 1.0)
    want_new = torch.where(exact, 1.0, betas[0] * want1 + (1.0 - betas[0]) * want2.sqrt())
    assert new_first_scales(got1, got2, betas[0]) == want_new.tolist()


@pytest.mark.skipif(_openmp() is None, reason="torch was built without OpenMP")
def test_small_row_work_runs_on_the_calling_thread_alone() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}
        with one_thread(True):
            seen["inside"] = torch.get_num_threads()
            other = threading.Thread(target=lambda: seen.__setitem__("other", torch.get_num_threads()))
            other.start()
            other.join()
        assert seen == {"inside": 1, "other": 2}  # the calling thread only
        assert torch.get_num_threads() == 2
        with one_thread(False):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_preparing_a_steps_blocks_counts_as_host_work_on_rows(monkeypatch) -> None:
    gradients = RowGradients(HostWorker(inline=True), Link(torch.device("cpu")))

    class Slot:
        def touched_blocks(self) -> torch.Tensor:
            return torch.zeros(0, dtype=torch.int64)

    gradients.add_slot(Slot(), [])
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(row_gradients.time, "perf_counter", lambda: next(clock))
    gradients.step_blocks()
    gradients.step_blocks()  # prepared once per step
    assert gradients.take_busy_seconds() == 1.0


class _Host:
    def __init__(self, counts: torch.Tensor) -> None:
        self.expert_counts = counts


class _Adapter:
    def __init__(self, counts: torch.Tensor) -> None:
        self.host = _Host(counts)


def test_expert_usage_of_all_adapters_at_once_is_each_adapters() -> None:
    generator = torch.Generator().manual_seed(5)
    counts = [torch.randint(0, 50, (16,), generator=generator) * (torch.rand(16, generator=generator) > 0.3)
              for _ in range(3)] + [torch.zeros(16, dtype=torch.int64)]  # one adapter that routed nothing
    together = expert_usage([_Adapter(c) for c in counts])
    each = _expert_usage_each(counts)
    assert together.keys() == each.keys()
    for key in each:
        assert math.isclose(together[key], each[key], rel_tol=1e-12)
    assert expert_usage([_Adapter(torch.zeros(4, dtype=torch.int64))]) == {}


def test_the_benchmark_clock_counts_a_call_inside_another_once() -> None:
    script = load_script("benchmark_meft_row_step")
    clock = script.RowClock()
    ticks = iter(float(t) for t in range(100))
    script.CLOCK[0] = lambda: next(ticks)
    try:
        inner = clock._wrap(lambda: None)
        outer = clock._wrap(lambda: inner())
        outer()  # ticks: the outer call starts at 0, the inner at 1, the outer ends at 2 (counting both would give 4)
        assert clock.take() == 2.0 and clock.take() == 0.0
    finally:
        script.CLOCK[0] = time.perf_counter


def test_the_benchmark_times_each_step_beside_fused_adamw() -> None:
    script = load_script("benchmark_meft_row_step")
    args = script.build_parser().parse_args(["--steps", "3", "--skip", "1", "--batch", "2", "--length", "32",
                                             "--fused-repeats", "1"])
    measured = script.run(args)
    assert len(measured) == 2
    for row_seconds, elements, after, cached, telemetry in measured:
        assert row_seconds > 0 and telemetry > 0 and after > 0 and cached > 0
        assert elements > 0 and elements % (2 * 128 * 128) == 0  # whole blocks of 128 rows, keys and values


def _landed_square_sums(on_device: bool, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float | None]:
    """``landed_square_sum`` after each of ``parts`` lands on one matrix, then after the step's end."""
    gradients = RowGradients(HostWorker(inline=True), Link(torch.device("cpu")), squares_on_device=on_device)
    accumulator, written = torch.zeros(ROWS, WIDTH), torch.zeros(ROWS, dtype=torch.bool)
    gradients.add_slot(object(), [RowLanding(accumulator, written, BLOCK)])
    sums = []
    for rows, grad in parts:
        gradients.accumulate(rows, grad, accumulator, written)
        gradients.flush()
        sums.append(gradients.landed_square_sum())
    gradients.start_step()
    sums.append(gradients.landed_square_sum())
    return sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_squares_taken_on_the_device_give_the_hosts_norm(dtype: torch.dtype) -> None:
    """On a GPU each gradient's squared norm is taken on the device before its copy (the host does not read it a
    second time): the step's norm is the host's, and a row summed twice still sends the norm to the sums."""
    generator = torch.Generator().manual_seed(7)
    first, second, overlapping = torch.tensor([0, 1, 5]), torch.tensor([8, 9]), torch.tensor([1, 12])
    parts = [(rows, torch.randn(rows.numel(), WIDTH, generator=generator).to(dtype))
             for rows in (first, second, overlapping)]
    host, device = _landed_square_sums(False, parts), _landed_square_sums(True, parts)
    want = [sum(float(g.float().square().sum()) for _, g in parts[:n]) for n in (1, 2)]
    assert host[:2] == pytest.approx(want, rel=1e-6) and device[:2] == pytest.approx(want, rel=1e-6)
    assert host[2] is None and device[2] is None  # row 1 summed: the norm is read from the sums
    assert host[3] == 0.0 and device[3] == 0.0  # the next step starts a new sum
