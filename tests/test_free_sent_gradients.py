"""``free_sent_gradients``: a parameter's ``.grad`` dropped once its step is launched (crossed to the host, or queued on
the device for the vectors ``vectors="device"`` keeps there).
On by default under the Trainer and Fabric (their loops zero gradients before the next backward anyway), off for
``offload()`` in a loop of one's own (torch's ``p.grad`` stays readable after ``step()``); either way the training is
the same as plain AdamW's on a separate model, and the planner counts what the device holds."""

from __future__ import annotations

from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch

from lightning_offload import ZeroOffloadStrategy, offload, plan
from tiny_modules import TinyCausalLM, params_of, tiny_hf_model, token_data, trainer


class _GradientsAfterTheStep(pl.Callback):
    """Which trainable parameters still hold a ``.grad`` right after each optimizer step."""

    def __init__(self) -> None:
        self.held: list[set[str]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
        self.held.append({n for n, p in module.named_parameters() if p.requires_grad and p.grad is not None})


def _fit(strategy: Any) -> tuple[TinyCausalLM, _GradientsAfterTheStep]:
    module, seen = TinyCausalLM(tiny_hf_model("llama")), _GradientsAfterTheStep()
    trainer(strategy, max_steps=3, callbacks=[seen]).fit(module, token_data())
    return module, seen


def test_the_trainer_drops_crossed_gradients_and_trains_as_plain_adamw() -> None:
    plain, plain_seen = _fit("auto")
    freed, freed_seen = _fit(ZeroOffloadStrategy())
    kept, kept_seen = _fit(ZeroOffloadStrategy(free_sent_gradients=False))
    names = {n for n, p in plain.named_parameters() if p.requires_grad}
    assert plain_seen.held == [names] * 3  # torch keeps them until the next zero_grad
    assert freed_seen.held == [set()] * 3  # host-stepped, or a vector stepped on the device: none holds one
    assert kept_seen.held == [names] * 3
    want = params_of(plain)
    for got in (params_of(freed), params_of(kept)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def _loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[bool]:
    """Two steps of a plain loop; whether every trainable parameter held a .grad right after each step."""
    held = []
    for (ids,) in list(token_data(n=8))[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        held.append(all(p.grad is not None for p in model.parameters() if p.requires_grad))
        optimizer.zero_grad()
    return held


def test_a_loop_of_one_s_own_keeps_torch_s_gradients_unless_asked() -> None:
    model = tiny_hf_model("llama")
    kept = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), strategy="zero_offload")
    assert _loop(model, kept) == [True, True]
    kept.close()
    model = tiny_hf_model("llama")
    freed = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), strategy="zero_offload",
                    free_sent_gradients=True)
    held = []
    for (ids,) in list(token_data(n=8))[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
        freed.step()
        held.append(any(p.grad is not None for p in model.parameters()))
    freed.close()
    assert held == [False, False]


def test_fabric_drops_them_by_default() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload")
    model = tiny_hf_model("llama")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    (ids,) = next(iter(token_data(n=4)))
    fabric.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    assert all(p.grad is None for p in model.parameters())


def test_the_planner_counts_either() -> None:
    model = tiny_hf_model("llama")
    common = dict(batch_size=2, seq_len=16, device_memory="1GiB", precision="32-true", hardware="h200", device="cpu")
    freed = plan(model, "zero_offload", **common)
    kept = plan(model, "zero_offload", free_sent_gradients=False, **common)
    gradients = sum(p.numel() * 4 for p in model.parameters())
    # Kept, every gradient is there while the next forward saves its activations; dropped, only the first one backward
    # makes (the head's) is there beside them.
    head = model.lm_head.weight.numel() * 4
    assert kept.device_bytes - freed.device_bytes == pytest.approx(gradients - head, rel=0.01)
    with pytest.raises(TypeError, match="free_sent_gradients must be True, False or None"):
        ZeroOffloadStrategy(free_sent_gradients="yes")
