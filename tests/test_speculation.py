"""Host Adam started during backward (speculation) gives the same bits as starting it after the norm is known.

Speculation (engine/step/speculation.py) is on by default only on a GPU; these tests turn it on explicitly on the CPU.

Each tensor's host step starts as soon as its gradient has landed, assuming the step is not clipped by norm, not
skipped, and clipped by value as the step before was. The runs below break every assumption on some steps and keep
it on others: clipping that fires on some steps only (norm and value), a non-finite step, accumulation, bf16.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from tiny_modules import TinyCausalLM, params_of, tiny_hf_model, token_data, trainer

CLIPPED_STEPS = (1, 2, 3)  # optimizer steps on which the module clips (none on 0, 4, 5)
NONFINITE_STEP = 4


class IntermittentClipping(TinyCausalLM):
    """Clips on some optimizer steps only (norm: a limit below the norm, so it fires), and one step's loss is nan."""

    def __init__(self, model, algorithm: str, accumulate: int) -> None:
        super().__init__(model)
        self.algorithm = algorithm
        self.accumulate = accumulate

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx // self.accumulate == NONFINITE_STEP:
            return loss * float("nan")
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.trainer.global_step in CLIPPED_STEPS:
            limit = 0.05 if self.algorithm == "norm" else 0.01
            self.clip_gradients(optimizer, gradient_clip_val=limit, gradient_clip_algorithm=self.algorithm)


def _strategy(kind: str, speculative: bool):
    if kind == "zero":
        return ZeroOffloadStrategy(speculative=speculative, link_dtype="bf16")
    return LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="random", speculative=speculative,
                              link_dtype="bf16")


def _run(kind: str, algorithm: str, precision: str, accumulate: int, speculative: bool):
    torch.manual_seed(0)
    module = IntermittentClipping(tiny_hf_model("llama"), algorithm, accumulate)
    if precision == "bf16-true":
        module = module.to(torch.bfloat16)
    strategy = _strategy(kind, speculative)
    with pytest.warns(UserWarning, match="Skipped an optimizer step"):
        trainer(strategy, max_steps=6, precision=precision, accumulate_grad_batches=accumulate).fit(
            module, token_data(n=48, batch_size=4 // accumulate))
    return module, strategy.offload_optimizer


@pytest.mark.parametrize("kind", ["lsp", "zero"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("precision, accumulate", [("32-true", 1), ("bf16-true", 2)])
def test_speculative_steps_equal_steps_started_after_backward(kind, algorithm, precision, accumulate):
    plain, plain_optimizer = _run(kind, algorithm, precision, accumulate, speculative=False)
    fast, optimizer = _run(kind, algorithm, precision, accumulate, speculative=True)
    a, b = params_of(plain), params_of(fast)
    initial = params_of(tiny_hf_model("llama"))
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"
    assert any(not torch.equal(a[name], initial[name.removeprefix("model.")]) for name in a)
    assert plain.losses == fast.losses
    steps = dict(optimizer.telemetry.completed)
    # Every path was taken: steps confirmed as speculated, steps rolled back and redone, and a step skipped (its
    # speculative work undone) — and none of it in the run that does not speculate.
    assert sum(m["offload/speculative_steps"] for m in steps.values()) > 0
    assert sum(m["offload/rolled_back_steps"] for m in steps.values()) > 0
    assert optimizer.telemetry.skipped_steps == plain_optimizer.telemetry.skipped_steps == 1
    assert all(m["offload/speculative_steps"] == 0 for _, m in plain_optimizer.telemetry.completed)


class SlowEmbeddingBackward(TinyCausalLM):
    """Backward spends 50 ms at its very end (the embedding's output gradient), after every block's gradient."""

    def training_step(self, batch, batch_idx):
        def slow_backward(module, args, output):
            output.register_hook(lambda grad: time.sleep(0.05))  # returns None: the output stays as it is

        handle = self.model.get_input_embeddings().register_forward_hook(slow_backward)
        try:
            return super().training_step(batch, batch_idx)
        finally:
            handle.remove()


def test_speculation_starts_host_work_before_backward_ends():
    strategy = ZeroOffloadStrategy(speculative=True)
    trainer(strategy, max_steps=4).fit(SlowEmbeddingBackward(tiny_hf_model("llama")), token_data())
    shares = [m["offload/host_share_before_backward_end"] for _, m in strategy.offload_optimizer.telemetry.completed]
    assert all(share > 0 for share in shares), shares
    plain = ZeroOffloadStrategy(speculative=False)
    trainer(plain, max_steps=4).fit(SlowEmbeddingBackward(tiny_hf_model("llama")), token_data())
    assert all(m["offload/host_share_before_backward_end"] == 0 for _, m in plain.offload_optimizer.telemetry.completed)


class FailingAfterBackward(TinyCausalLM):
    def on_before_optimizer_step(self, optimizer):
        if self.trainer.global_step == 2:
            raise RuntimeError("planted after backward")


def test_a_step_that_fails_after_backward_leaves_the_host_state_as_before_it():
    module = FailingAfterBackward(tiny_hf_model("llama"))
    strategy = ZeroOffloadStrategy(speculative=True)
    with pytest.raises(RuntimeError, match="planted after backward"):
        trainer(strategy, max_steps=4).fit(module, token_data())
    optimizer = strategy.offload_optimizer
    reference = TinyCausalLM(tiny_hf_model("llama"))
    plain = ZeroOffloadStrategy(speculative=False)
    trainer(plain, max_steps=2).fit(reference, token_data())
    # Two steps were taken in both; the third's speculative host steps were undone: same masters and moments.
    for slot, other in zip(optimizer.slots, plain.offload_optimizer.slots):
        assert torch.equal(slot.host_param, other.host_param), slot.name
        state, other_state = slot.host_optimizer.state[slot.host_param], other.host_optimizer.state[other.host_param]
        assert all(torch.equal(state[key], other_state[key]) for key in other_state), slot.name
