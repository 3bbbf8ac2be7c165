"""Fabric's data-parallel offload strategies on 2 CPU processes (gloo, spawned by Fabric's own launcher): two ranks at
half the batch equal one process of plain AdamW at the whole batch (lossless projectors and ``zero_offload_ddp``,
with accumulation and clipping); learned projectors are the same on both ranks after their fit; each rank keeps its
share of the host state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_offload import FabricOffloadDDP, FabricZeroOffloadDDP, signed_permutation_projector
from tiny_modules import params_of, tiny_hf_model, token_data

LR = 3e-3
LOSSLESS = dict(rank=1.0, density=1, min_dim=16, projectors="random", projector_factory=signed_permutation_projector)
GLOBAL_BATCH = 8


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _global_batches() -> list[torch.Tensor]:
    return [ids for (ids,) in token_data(n=48, batch_size=GLOBAL_BATCH)]  # three steps of two micro-batches


def _train(model: torch.nn.Module, optimizer: Any, batches: list[torch.Tensor], backward: Any, clip: Any) -> None:
    for step in range(3):
        for ids in batches[2 * step:2 * step + 2]:
            backward(lm_loss(model, (ids,)) / 2)
        clip()
        optimizer.step()
        optimizer.zero_grad()


def _reference() -> dict[str, torch.Tensor]:
    """One process, plain AdamW, the whole global batches."""
    reference = tiny_hf_model("llama")
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    _train(reference, adamw, _global_batches(), lambda loss: loss.backward(),
           lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3))
    return params_of(reference)


def _mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """``assert_close``'s message for each tensor that differs (fp32 rounding allowed)."""
    found = []
    for name in want:
        try:
            torch.testing.assert_close(got[name], want[name])
        except AssertionError as error:
            found.append(f"{name}: {error}")
    return found


def _ranks_run(fabric: Fabric, kind: str) -> dict[str, Any]:
    """One rank's run (started by Fabric's launcher in each process): its half of every global batch. Returns small
    figures only: the launcher hands rank 0's result back through a pipe it reads after the processes end."""
    model = tiny_hf_model("llama")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01))
    half = GLOBAL_BATCH // fabric.world_size
    batches = [ids[fabric.global_rank * half:(fabric.global_rank + 1) * half] for ids in _global_batches()]
    def projector_values() -> torch.Tensor:
        layers = optimizer.projected_layers
        return torch.cat([layer.proj_out.values.flatten() for layer in layers]) if layers else torch.zeros(1)

    drawn = projector_values()
    if kind == "learned":
        optimizer.fit_projectors([(ids,) for ids in batches], lm_loss)  # each rank samples its own half
    fitted = projector_values()
    _train(model, optimizer, batches, fabric.backward, lambda: fabric.clip_gradients(model, optimizer, max_norm=0.3))
    owned = sum(1 for slot in optimizer.slots if slot.owned)
    slots = len(optimizer.slots)
    optimizer.close()
    gathered = fabric.all_gather(fitted)
    owned_per_rank = fabric.all_gather(torch.tensor(owned)).tolist()
    # A spawned process ends with os._exit, which skips Fabric's atexit handler that destroys the process group; a
    # gloo group left to static destructors can abort the process at exit ("terminate called without an active
    # exception"), so it is destroyed here.
    fabric.barrier()
    torch.distributed.destroy_process_group()
    return {"mismatches": _mismatches(params_of(model.module), _reference()) if kind != "learned" else [],
            "projectors_equal": bool(torch.equal(gathered[0], gathered[1])),
            "projectors_fitted": not torch.equal(drawn, fitted), "owned": owned_per_rank,
            "slots": slots}


def _launch(strategy: Any, kind: str) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    return fabric.launch(_ranks_run, kind)


@pytest.mark.parametrize("kind", ["lossless", "zero"])
def test_two_ranks_equal_one_process_of_adamw_at_the_whole_batch(kind: str) -> None:
    strategy = FabricOffloadDDP(start_method="spawn", accumulation_steps=2, **LOSSLESS) if kind == "lossless" else \
        FabricZeroOffloadDDP(start_method="spawn", accumulation_steps=2)
    ranks = _launch(strategy, kind)
    assert ranks["mismatches"] == []
    # The host state is sharded: each rank owns some tensors, and together all of them.
    assert all(count > 0 for count in ranks["owned"]) and sum(ranks["owned"]) == ranks["slots"]


def test_learned_projectors_are_rank_0_s_fit_on_every_rank() -> None:
    ranks = _launch(FabricOffloadDDP(start_method="spawn", accumulation_steps=2, rank=0.5, density=2, min_dim=16,
                                     projectors="learned"),
                    "learned")
    # Each rank sampled different batches: equal fits mean both installed rank 0's fit of the ranks' mean gradient.
    assert ranks["projectors_fitted"] and ranks["projectors_equal"]


def test_row_sparse_embeddings_are_refused_across_ranks() -> None:
    with pytest.raises(ValueError, match="embeddings='sparse' is not available with data parallelism"):
        FabricOffloadDDP(embeddings="sparse")
