"""The engine's one row Adam (``BlockRowAdam``): its two paths (in place by blocks, gathered rows) are one optimizer,
the decay idle rows owe is AdamW's under any schedule and can be read before it is paid, and state written by the
embedding's former row Adam resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings

SETTINGS = RowAdamSettings(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _schedule(generator: torch.Generator, steps: int, height: int) -> list[torch.Tensor]:
    """Sorted unique row sets, each missing some rows, so rows are caught up over gaps of different lengths."""
    return [torch.randperm(height, generator=generator)[:height // 2].sort().values for _ in range(steps)]


def test_in_place_and_gathered_steps_are_one_optimizer() -> None:
    """A matrix of one-row blocks stepped in place (scaled moments) at some steps and gathered at others equals one
    stepped gathered throughout, to fp32 rounding: the gathered path takes over the in-place path's scales."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(16, 3, generator=generator)
    mixed, gathered = BlockRowAdam([start.clone()], 1), BlockRowAdam([start.clone()], 1)
    scaled = 0  # rows whose moments the in-place path left scaled, each taken over by a gathered step
    for i, rows in enumerate(_schedule(generator, 10, 16)):
        grad = torch.randn(rows.numel(), 3, generator=generator)
        gathered.step_rows(rows, grad.clone(), SETTINGS)
        if i % 2:
            mixed.step_rows(rows, grad.clone(), SETTINGS)
        else:
            full = torch.zeros(16, 3).index_copy_(0, rows, grad)
            mixed.step(rows, [full], SETTINGS)
            scaled += int((mixed.scale2 != 1).sum())
    assert scaled > 0
    torch.testing.assert_close(mixed.params[0], gathered.params[0], rtol=1e-6, atol=1e-7)
    for index in range(2):
        torch.testing.assert_close(mixed.moments()[index], gathered.moments()[index], rtol=1e-5, atol=1e-9)


# Warm-up from 0, a peak, a decay through 0 and a restart: no two steps owe decay at the same rate.
SCHEDULE = [0.0, 5e-3, 1e-2, 8e-3, 3e-3, 0.0, 0.0, 4e-3, 1e-2]


@pytest.mark.parametrize("gathered", [False, True], ids=["in-place blocks", "gathered rows"])
def test_decay_owed_under_a_schedule_through_lr_zero_equals_adamw(gathered: bool) -> None:
    """Blocks idle through a warm-up, a decay to lr 0 and a restart owe AdamW's product of ``1 − lr_t·λ`` over the
    steps they missed: read at any step (without paying it), and paid when next stepped (at lr 0 too)."""
    generator = torch.Generator().manual_seed(1)
    rows, block_rows = (6, 1) if gathered else (8, 2)
    matrices = 1 if gathered else 2
    scales = [1.0] if gathered else [1.0, 0.5]
    starts = [torch.randn(rows, 3, generator=generator) for _ in range(matrices)]
    adam = BlockRowAdam([s.clone() for s in starts], block_rows, lr_scales=scales)
    dense = [torch.nn.Parameter(s.clone()) for s in starts]
    groups = [{"params": [param], "lr_scale": scale} for param, scale in zip(dense, scales)]
    reference = torch.optim.AdamW(groups, betas=SETTINGS.betas, eps=SETTINGS.eps, weight_decay=SETTINGS.weight_decay)
    for step, lr in enumerate(SCHEDULE):
        # Rows 0-1 every step; the rest from step 6 on (lr 0, with decay owed), never idle after (no momentum drift).
        touched = torch.arange(2) if step < 6 else torch.arange(rows)
        grads = [torch.zeros(rows, 3) for _ in range(matrices)]
        for grad in grads:
            grad[touched] = torch.randn(touched.numel(), 3, generator=generator)
        for group, param, grad in zip(reference.param_groups, dense, grads):
            group["lr"] = lr * group["lr_scale"]
            param.grad = grad.clone()
        reference.step()
        settings = RowAdamSettings(lr=lr, betas=SETTINGS.betas, eps=SETTINGS.eps, weight_decay=SETTINGS.weight_decay)
        if gathered:
            adam.step_rows(touched, grads[0][touched].clone(), settings)
        else:
            adam.step(adam.blocks_of(torch.isin(torch.arange(rows), touched)), [g.clone() for g in grads], settings)
        before = [matrix.clone() for matrix in adam.params]
        owing, values = adam.decayed_rows()
        assert all(torch.equal(a, b) for a, b in zip(before, adam.params))  # a read pays nothing
        for value, param in zip(values, dense):
            torch.testing.assert_close(value, param.detach()[owing], rtol=1e-6, atol=1e-7)
        if 1 <= step < 6:
            assert owing.tolist() == list(range(2, rows))  # idle rows owe decay, at lr 0 too
    for matrix, param in zip(adam.params, dense):
        torch.testing.assert_close(matrix, param.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(adam.params[0][2:], starts[0][2:])


def test_a_saved_row_adam_resumes_bit_for_bit() -> None:
    """An embedding's row Adam saved mid-run and loaded into a fresh one continues exactly as an uninterrupted one."""
    generator = torch.Generator().manual_seed(2)
    schedule = _schedule(generator, 8, 12)
    grads = [torch.randn(rows.numel(), 5, generator=generator) for rows in schedule]
    start = torch.randn(12, 5, generator=generator)
    straight = BlockRowAdam([start.clone()], 1)
    for rows, grad in zip(schedule, grads):
        straight.step_rows(rows, grad.clone(), SETTINGS)
    first = BlockRowAdam([start.clone()], 1)
    for rows, grad in zip(schedule[:4], grads[:4]):
        first.step_rows(rows, grad.clone(), SETTINGS)
    state = first.state_dict()
    resumed = BlockRowAdam([first.params[0].clone()], 1)
    resumed.load_state_dict(state)
    for rows, grad in zip(schedule[4:], grads[4:]):
        resumed.step_rows(rows, grad.clone(), SETTINGS)
    assert torch.equal(resumed.params[0], straight.params[0])
    assert torch.equal(resumed.exp_avg[0], straight.exp_avg[0])
    assert torch.equal(resumed.exp_avg_sq[0], straight.exp_avg_sq[0])


def test_gathered_steps_refuse_blocks_of_several_rows() -> None:
    adam = BlockRowAdam([torch.zeros(8, 2)], 4)
    try:
        adam.step_rows(torch.tensor([1]), torch.ones(1, 2), SETTINGS)
    except ValueError as error:
        assert "blocks of 4 rows" in str(error) and "step()" in str(error)
    else:
        raise AssertionError("step_rows accepted blocks of 4 rows")
