"""The Adam host rule's one-tensor Adam (engine/rules/adam.py): every step bit for bit torch.optim.Adam's (fused) on
the same tensor and gradients, whichever path it takes: its own call into the fused kernel, or torch's step where
that call does not apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_offload.engine.rules.adam import OneTensorAdam
from lightning_offload.inner_optimizers import step_unhooked

CASES = {
    "Adam": dict(lr=1e-2),
    "AdamW, decay": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "Adam, L2, maximize": dict(lr=3e-3, weight_decay=0.05, maximize=True, betas=(0.8, 0.99), eps=1e-6),
    "amsgrad (torch's step)": dict(lr=1e-2, amsgrad=True),
    "tensor lr (torch's step)": dict(lr=torch.tensor(1e-2)),
}


@pytest.mark.parametrize("hparams", CASES.values(), ids=CASES.keys())
def test_each_step_is_torch_s_fused_adam_bit_for_bit(hparams: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(37, 11, generator=generator)
    grads = [torch.randn(37, 11, generator=generator) for _ in range(5)]
    ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    one = OneTensorAdam([{"params": [ours], **hparams}], fused=True)
    reference = torch.optim.Adam([{"params": [theirs], **hparams}], fused=True)
    for index, grad in enumerate(grads):
        if index == 3:  # a schedule writes the group between steps
            for optimizer in (one, reference):
                optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"] * 0.5
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        step_unhooked(one)
        reference.step()
        assert torch.equal(ours, theirs), f"step {index}"
        for key, value in reference.state[theirs].items():
            assert torch.equal(one.state[ours][key], value), f"step {index}: {key}"
    assert not torch.equal(ours, start)


def test_its_own_path_is_taken_after_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Which path a step takes: the first creates the state through torch's step; later ones call the kernel directly.
    tensor = torch.zeros(8, requires_grad=True)
    one = OneTensorAdam([tensor], lr=1e-2, fused=True)
    generic: list[int] = []
    original = torch.optim.Adam.step
    monkeypatch.setattr(torch.optim.Adam, "step", lambda self, closure=None: generic.append(1) or original(self))
    for _ in range(3):
        tensor.grad = torch.ones(8)
        step_unhooked(one)
    assert generic == [1] and float(one.state[tensor]["step"]) == 3.0


@pytest.mark.parametrize("hparams", CASES.values(), ids=CASES.keys())
def test_tensors_stepped_together_are_each_torch_s_fused_adam_bit_for_bit(hparams: dict[str, Any]) -> None:
    """The device Adam steps a group's vectors in one fused call (step_together): each tensor, of its own size, gets
    torch's fused Adam's bits over that tensor alone, the first step (torch's own, creating the state) included."""
    from lightning_offload.engine.rules.adam import step_together

    generator = torch.Generator().manual_seed(1)
    shapes = [(256,), (37,), (1,), (64, 3)]
    starts = [torch.randn(shape, generator=generator) for shape in shapes]
    ours = [start.clone().requires_grad_() for start in starts]
    theirs = [start.clone().requires_grad_() for start in starts]
    mine = [OneTensorAdam([{"params": [p], **hparams}], fused=True) for p in ours]
    reference = [torch.optim.Adam([{"params": [p], **hparams}], fused=True) for p in theirs]
    for index in range(4):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        step_together(mine)
        for optimizer in reference:
            optimizer.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"step {index}"
