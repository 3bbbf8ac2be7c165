"""The offload strategies under Lightning Fabric: registered by name, equal to plain Fabric with AdamW where lossless
(accumulation, ``fabric.clip_gradients``), learned projectors resume bit for bit through ``fabric.save``/``load``,
MEFT adapters train, and what Fabric cannot do here is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_offload import FabricOffload, FabricMEFTOffload, FabricZeroOffload, MEFTConfig, inject_meft
from lightning_offload import signed_permutation_projector
from lightning_offload.lsp.linear import ProjectedWeight
from tiny_modules import params_of, tiny_hf_model, token_data

LR = 3e-3
LOSSLESS = dict(rank=1.0, density=1, min_dim=16, projectors="random", projector_factory=signed_permutation_projector,
                embeddings="host")


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _train(fabric: Fabric, model: torch.nn.Module, optimizer: Any, batches: list, steps: range,
           clip: float = 0.3) -> None:
    for step in steps:
        for batch in batches[2 * step:2 * step + 2]:  # two micro-batches per step
            fabric.backward(lm_loss(model, batch) / 2)
        fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()


def test_the_strategy_names_are_registered_in_fabric() -> None:
    for name, cls in (("lsp_offload", FabricOffload), ("zero_offload", FabricZeroOffload),
                      ("meft_offload", FabricMEFTOffload)):
        strategy = Fabric(accelerator="cpu", devices=1, strategy=name).strategy
        assert isinstance(strategy, cls) and strategy.strategy_name == name  # the name's class, with its preset


@pytest.mark.parametrize("strategy", ["zero_offload", "lossless_lsp_offload"])
def test_fabric_offload_equals_plain_fabric_adamw(strategy: str) -> None:
    batches = list(token_data(n=24, batch_size=4))
    plain = Fabric(accelerator="cpu", devices=1)
    reference = tiny_hf_model("gpt2")
    reference, reference_optimizer = plain.setup(reference, torch.optim.AdamW(reference.parameters(), lr=LR))
    _train(plain, reference, reference_optimizer, batches, range(3))
    chosen = FabricZeroOffload(accumulation_steps=2) if strategy == "zero_offload" else \
        FabricOffload(accumulation_steps=2, **LOSSLESS)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=chosen)
    model = tiny_hf_model("gpt2")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(fabric, model, optimizer, batches, range(3))
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def _learned(path: Path, steps: range, load: bool, save_at: int | None) -> dict[str, torch.Tensor]:
    batches = list(token_data(n=64, batch_size=4))
    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=FabricOffload(rank=0.5, density=2, min_dim=16, projectors="learned", accumulation_steps=2))
    model = tiny_hf_model("llama")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01))
    if load:
        fabric.load(path, {"optimizer": optimizer, "model": model})  # either order works
    else:
        optimizer.fit_projectors(batches, lm_loss)
    for step in steps:
        _train(fabric, model, optimizer, batches, range(step, step + 1), clip=1.0)
        if save_at is not None and step + 1 == save_at:
            fabric.save(path, {"model": model, "optimizer": optimizer})
    optimizer.close()
    return params_of(model)


def test_learned_projectors_resume_bit_for_bit_through_fabric_save_and_load(tmp_path: Path) -> None:
    # The uninterrupted run saves at step 3 too: a save applies the decay untouched embedding rows owe, as a run that
    # saves periodically does (docs/loops.md).
    straight = _learned(tmp_path / "straight.ckpt", range(5), load=False, save_at=3)
    _learned(tmp_path / "run.ckpt", range(3), load=False, save_at=3)
    resumed = _learned(tmp_path / "run.ckpt", range(3, 5), load=True, save_at=None)
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


def test_meft_adapters_train_under_fabric() -> None:
    model = tiny_hf_model("llama")
    inject_meft(model, MEFTConfig(num_neurons=256, top_k=8, num_experts=16, experts_per_token=4, calibration_batches=1))
    fabric = Fabric(accelerator="cpu", devices=1, strategy="meft_offload")
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = fabric.setup(model, torch.optim.AdamW(trainable, lr=1e-2))
    keys = [adapter.host.keys.clone() for adapter in fabric.strategy.attached.adapters]
    losses = []
    for (ids,) in list(token_data(n=32, batch_size=4)):
        loss = lm_loss(model, (ids,))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    optimizer.close()
    assert any(not torch.equal(a.host.keys, k) for a, k in zip(fabric.strategy.attached.adapters, keys))
    assert all(a.rows_slot is None for a in fabric.strategy.attached.adapters)  # handed back at close
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("precision", "message"), [("16-true", "precision='16-true'")])
def test_fp16_is_refused_with_the_fix(precision: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="cpu", devices=1, strategy="lsp_offload", precision=precision)


def test_two_optimizers_are_refused() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero_offload")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="exactly one Adam/AdamW"):
        fabric.setup(model, torch.optim.AdamW([model.weight]), torch.optim.AdamW([model.bias]))
    assert not any(isinstance(m, ProjectedWeight) for m in model.modules())
