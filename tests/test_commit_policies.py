"""When a host step commits is one policy object over each slot's step record (engine/step/commit.py): a new policy is a
subclass plugged in by name, and the slots hold no step state of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lightning_offload
from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.engine.step import commit_policies
from lightning_offload.engine.step.commit import CommitAfterNorm
from lightning_offload.engine.step.slot_step import SlotStep
from tiny_modules import TinyCausalLM, params_of, tiny_hf_model, token_data, trainer

STEPS = 4


class LaunchOrder(CommitAfterNorm):
    """A policy of the test's own: commits as CommitAfterNorm does, and checks and records what it is handed."""

    instances: list[LaunchOrder] = []

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.launches: list[tuple[int, str, bool]] = []
        LaunchOrder.instances.append(self)

    def launch(self, record: SlotStep, round_, clip, compute_done, step, settings, timeline, resent) -> None:
        assert record.is_sent(round_) and not record.pending  # its gradient crossed; nothing of it is in flight
        self.launches.append((round_, record.slot.name, resent))
        super().launch(record, round_, clip, compute_done, step, settings, timeline, resent)


def _fit(kind: str):
    torch.manual_seed(0)
    module = TinyCausalLM(tiny_hf_model("llama"))
    strategy = (LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="random") if kind == "lsp"
                else ZeroOffloadStrategy())
    trainer(strategy, max_steps=STEPS, gradient_clip_val=1.0).fit(module, token_data())
    return module, strategy.offload_optimizer


@pytest.mark.parametrize("kind", ["lsp", "zero"])
def test_a_new_commit_policy_plugs_in_by_name_and_trains_the_same_weights(kind, monkeypatch):
    reference, _ = _fit(kind)
    LaunchOrder.instances.clear()
    monkeypatch.setitem(commit_policies.COMMIT_POLICIES, "after_norm", LaunchOrder)
    module, optimizer = _fit(kind)
    (policy,) = LaunchOrder.instances
    assert optimizer.commit is policy
    names = [slot.name for slot in optimizer.slots]
    # Every slot launched once a step, in slot order, each with its gradient sent during backward.
    assert policy.launches == [(round_, name, False) for round_ in range(STEPS) for name in names]
    expected, found = params_of(reference), params_of(module)
    assert all(torch.equal(expected[name], found[name]) for name in expected)


def test_slots_keep_no_step_state() -> None:
    # Sent, pending, the job and the backup are the orchestrator's record of each slot's step (SlotStep), written by
    # the orchestrator and the commit policies only: no slot kind reads or writes them.
    step_state = {"pending", "job", "sent_round", "backup"}
    slots = Path(lightning_offload.__file__).parent / "engine" / "slots"
    found = {path.name: sorted({node.attr for node in ast.walk(ast.parse(path.read_text()))
                                if isinstance(node, ast.Attribute) and node.attr in step_state})
             for path in slots.glob("*.py")}
    assert not {name: attrs for name, attrs in found.items() if attrs}
