"""The engine's one row Adam (``BlockRowAdam``): its two paths (in place by blocks, gathered rows) are one optimizer,
its owed decay can be settled before the weights are read, and state written by the embedding's former row Adam
resumes bit for bit."""

from __future__ import annotations

import torch

from lightning_offload.engine.block_row_adam import BlockRowAdam, RowAdamSettings

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


def test_settled_decay_equals_adamw_on_untouched_blocks_and_is_not_applied_twice() -> None:
    """Blocks of two rows, the second matrix at half the learning rate: after settle_decay an untouched block equals
    dense AdamW's, and when it is stepped next it is not decayed again."""
    generator = torch.Generator().manual_seed(1)
    starts = [torch.randn(4, 3, generator=generator) for _ in range(2)]
    adam = BlockRowAdam([s.clone() for s in starts], 2, lr_scales=[1.0, 0.5])
    dense = [torch.nn.Parameter(s.clone()) for s in starts]
    reference = torch.optim.AdamW([{"params": [dense[0]]}, {"params": [dense[1]], "lr": SETTINGS.lr * 0.5}],
                                  lr=SETTINGS.lr, betas=SETTINGS.betas, eps=SETTINGS.eps,
                                  weight_decay=SETTINGS.weight_decay)
    for step in range(5):
        blocks = torch.tensor([0] if step < 3 else [0, 1])  # block 1 (rows 2, 3) untouched for three steps
        grads = [torch.zeros(4, 3) for _ in range(2)]
        for grad in grads:
            grad[: 2 * blocks.numel()] = torch.randn(2 * blocks.numel(), 3, generator=generator)
        for param, grad in zip(dense, grads):
            param.grad = grad.clone()
        reference.step()
        adam.step(blocks, [g.clone() for g in grads], SETTINGS)
        if step == 2:
            rows = adam.settle_decay(SETTINGS.lr, SETTINGS.weight_decay)
            assert rows.tolist() == [2, 3]
            for matrix, param in zip(adam.params, dense):
                torch.testing.assert_close(matrix[2:], param.detach()[2:], rtol=1e-6, atol=1e-7)
                assert not torch.equal(matrix[2:], starts[0][2:])
    for matrix, param in zip(adam.params, dense):
        torch.testing.assert_close(matrix, param.detach(), rtol=1e-6, atol=1e-7)


def test_state_of_the_former_embedding_row_adam_resumes_bit_for_bit() -> None:
    """Checkpoints from before the one row Adam hold an embedding's state bare (one moment tensor each, no scales):
    it loads as one-row blocks and the run continues exactly as an uninterrupted one."""
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
    former = {"exp_avg": state["exp_avg"][0].clone(), "exp_avg_sq": state["exp_avg_sq"][0].clone(),
              "step": state["step"], "last_step": state["last_step"].clone(),
              "decayed_step": state["decayed_step"].clone()}
    resumed = BlockRowAdam([first.params[0].clone()], 1)
    resumed.load_state_dict(former)
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
