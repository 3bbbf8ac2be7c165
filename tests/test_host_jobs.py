"""Host jobs allocate nothing in steady state: every host buffer is preallocated (and the bytes counted are the bytes
that cross)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.engine.step.commit import CommitAfterNorm
from lightning_offload.engine.step.speculation import SpeculativeCommit
from tiny_modules import TinyCausalLM, tiny_hf_model, token_data, trainer


class _Ops(TorchDispatchMode):
    """Records every aten op a host job runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _CoupledL2LM(TinyCausalLM):
    """Adam with coupled L2: the host adds λ·A W Bᵀ to each compressed gradient."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=0.1)


def _allocates(op: str) -> bool:
    # In-place ops end in "_", ``out=`` overloads write into a given buffer; views and slices share storage;
    # profiler markers are not tensor ops.
    parts = op.split(".")
    if parts[0] != "aten":
        return False
    name, overload = parts[1], parts[2] if len(parts) > 2 else ""
    return not name.endswith("_") and not overload.endswith("out") and name not in (
        "detach", "view", "alias", "slice", "unsqueeze", "select")


# Every case but the speculated one says speculative=False: a job per tensor per step on any link (speculation's default
# is on where the link copies asynchronously: a GPU, or the simulated link).
CASES = {
    "zero-fp32": (lambda: ZeroOffloadStrategy(speculative=False), "32-true"),
    "zero-bf16-link-bf16-true": (lambda: ZeroOffloadStrategy(link_dtype="bf16", speculative=False), "bf16-true"),
    # Dense embeddings here (every tensor a dense or projected job); the row-sparse one has its own case below.
    "lsp-bf16-link-bf16-mixed": (lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16,
                                                            link_dtype="bf16", embeddings="host", speculative=False),
                                 "bf16-mixed"),
    "lsp-bf16-true-l2": (lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16,
                                                    embeddings="host", speculative=False), "bf16-true"),
    # Clipping that never fires: every step is speculated (backups, working copies) and confirmed.
    "lsp-fp32-l2-speculated": (lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16,
                                                          speculative=True, embeddings="host"), "32-true"),
    # The row-sparse embedding's workspace is sized at the first step; the same batch at every step touches the
    # same rows (more rows than ever before would grow it once).
    "lsp-sparse-embedding-bf16-true": (lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16,
                                                                  embeddings="sparse", speculative=False), "bf16-true"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_host_jobs_allocate_nothing_after_the_first_step(case, monkeypatch):
    make, precision = CASES[case]
    # Per optimizer step (its telemetry object, held here so that no later step's object can reuse its id), in order.
    jobs: dict[int, tuple[object, list[list[str]]]] = {}
    def recording(policy):
        run_job = policy._host_job

        def recorded(self, record, clip, compute_done, step, *args, **kwargs):
            mode = _Ops()
            with mode:
                run_job(self, record, clip, compute_done, step, *args, **kwargs)
            jobs.setdefault(id(step), (step, []))[1].append(mode.ops)
        return recorded

    for policy in (CommitAfterNorm, SpeculativeCommit):  # each commit policy's host job
        monkeypatch.setattr(policy, "_host_job", recording(policy))
    module = (_CoupledL2LM if "l2" in case else TinyCausalLM)(tiny_hf_model("llama"))
    if precision == "bf16-true":
        module = module.to(torch.bfloat16)
    strategy = make()
    speculated = case.endswith("speculated")
    data = token_data(n=4) if "sparse" in case else token_data()  # one batch, seen at every step
    trainer(strategy, max_steps=4, precision=precision, gradient_clip_val=1e6 if speculated else 1.0).fit(
        module, data)
    per_step = len(strategy.offload_optimizer.slots)
    steps = [ops for _, ops in jobs.values()]
    # One job per tensor per step: speculated and confirmed (clipping never fires), or not speculated.
    assert len(steps) == 4 and all(len(step) == per_step for step in steps)
    confirmed = [m["offload/speculative_steps"] for _, m in strategy.offload_optimizer.telemetry.completed]
    assert confirmed == ([per_step] * 4 if speculated else [0] * 4)
    first, steady = steps[0], [ops for step in steps[1:] for ops in step]
    assert any(_allocates(op) for ops in first for op in ops)  # Adam's moments are created at its first step
    allocations = sorted({op for ops in steady for op in ops if _allocates(op)})
    assert allocations == [], allocations
    if "sparse" in case:
        assert strategy.offload_optimizer.telemetry.last.sparse_rows > 0  # the row job was among those recorded


def test_a_bf16_dense_parameter_crosses_back_as_bf16():
    strategy = ZeroOffloadStrategy()
    module = TinyCausalLM(tiny_hf_model("llama")).to(torch.bfloat16)
    trainer(strategy, max_steps=2, precision="bf16-true").fit(module, token_data())
    dense = [slot for slot in strategy.offload_optimizer.slots if slot.layer is None]
    assert dense and all(slot.host_update.dtype == torch.bfloat16 for slot in dense)
    # What telemetry counts is what crosses: the parameter's 2 bytes per element back to the device.
    counted = strategy.offload_optimizer.telemetry.last.bytes_host_to_device
    assert counted == sum(slot.param.numel() * 2 for slot in dense)
