"""Copies and saves of a model in training: ``copy.deepcopy(model)``, ``torch.optim.swa_utils.AveragedModel(model)``
(EMA and SWA callbacks) and ``torch.save(model)`` work mid-run under every strategy (MEFT's adapters included) and
face, each copy is a plain model
holding the current weights, and training after them is bit for bit what it is without them."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric

from lightning_offload import (FabricOffload, FabricZeroOffload, LSPOffloadStrategy, MEFTConfig, MEFTOffloadStrategy,
                               ZeroOffloadStrategy, inject_meft, meft_state_dict, offload)
from tiny_modules import TinyCausalLM, params_of, tiny_hf_model, token_data, trainer

STRATEGIES = {
    "lsp": lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16),
    "zero": lambda: ZeroOffloadStrategy(),
}
LOOP_SETTINGS = {"lsp": dict(strategy="lsp_offload", projectors="random", rank=0.5, density=2, min_dim=16),
                 "zero": dict(strategy="zero_offload")}


def _saved_and_loaded(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "averaged_model": lambda model: torch.optim.swa_utils.AveragedModel(model).module,
    "torch_save": _saved_and_loaded,
}


def _check_copy(model: torch.nn.Module, copied: torch.nn.Module, ids: torch.Tensor) -> None:
    """The copy holds the model's current weights, computes what the model computes, and is a plain model: a
    backward gives every trainable weight a full gradient, and nothing of the engine runs in it."""
    want = {name: value.detach().clone() for name, value in model.state_dict().items()}
    got = copied.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    was_training = model.training
    model.eval()
    copied.eval()
    with torch.no_grad():
        torch.testing.assert_close(copied(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    model.train(was_training)
    copied.train()
    copied(input_ids=ids, labels=ids).loss.backward()
    missing = [name for name, p in copied.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []


class _Copier(pl.Callback):
    """After each training batch: copies the (inner Hugging Face) model and checks each copy."""

    def __init__(self, make_copy: Callable[[torch.nn.Module], torch.nn.Module], ids: torch.Tensor) -> None:
        self.make_copy, self.ids, self.copies = make_copy, ids, 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        _check_copy(module.model, self.make_copy(module.model), self.ids)
        self.copies += 1


def _fit(strategy: str, callbacks: list[pl.Callback]) -> dict[str, torch.Tensor]:
    module = TinyCausalLM(tiny_hf_model("llama"))
    trainer(STRATEGIES[strategy](), max_steps=4, callbacks=callbacks).fit(module, token_data(n=16))
    return params_of(module)


@pytest.mark.parametrize("copy_kind", COPIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_copy_mid_run_holds_the_current_weights_and_changes_nothing(strategy: str, copy_kind: str) -> None:
    ids = next(iter(token_data(n=4)))[0]
    copier = _Copier(COPIES[copy_kind], ids)
    with_copies = _fit(strategy, [copier])
    assert copier.copies == 4
    without = _fit(strategy, [])
    for name in without:
        assert torch.equal(with_copies[name], without[name]), name


@pytest.mark.parametrize("setting", LOOP_SETTINGS)
def test_a_plain_loop_s_model_copies_and_saves_mid_run(setting: str) -> None:
    def train(copy_each_step: bool) -> dict[str, torch.Tensor]:
        model = tiny_hf_model("llama")
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3), accumulation_steps=1,
                            **LOOP_SETTINGS[setting])
        for (ids,) in token_data(n=16, batch_size=4):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if copy_each_step:
                for make_copy in COPIES.values():
                    _check_copy(model, make_copy(model), ids)
        optimizer.close()
        return params_of(model)

    with_copies, without = train(True), train(False)
    for name in without:
        assert torch.equal(with_copies[name], without[name]), name


def _meft_fit(callbacks: list[pl.Callback]) -> dict[str, torch.Tensor]:
    model = tiny_hf_model("llama")
    inject_meft(model, MEFTConfig(num_neurons=64, top_k=4, num_experts=8, experts_per_token=2))
    module = TinyCausalLM(model)  # AdamW with weight decay: idle experts owe decay that reads and copies show
    trainer(MEFTOffloadStrategy(), max_steps=4, callbacks=callbacks).fit(module, token_data(n=16))
    return {**params_of(module), **{name: value.clone() for name, value in meft_state_dict(model).items()}}


@pytest.mark.parametrize("copy_kind", COPIES)
def test_a_meft_model_s_copy_mid_run_holds_the_current_adapters_and_changes_nothing(copy_kind: str) -> None:
    # The adapters' rows live on the host under the engine: a copy holds them as a read shows them (the decay idle
    # experts owe shown), routes its own mask, and has no engine; training after it is bit for bit the same.
    ids = next(iter(token_data(n=4)))[0]
    copier = _Copier(COPIES[copy_kind], ids)
    with_copies = _meft_fit([copier])
    assert copier.copies == 4
    without = _meft_fit([])
    assert with_copies.keys() == without.keys()
    for name in without:
        assert torch.equal(with_copies[name], without[name]), name


FABRIC_STRATEGIES = {"lsp": lambda: FabricOffload(projectors="random", rank=0.5, density=2, min_dim=16),
                     "zero": lambda: FabricZeroOffload()}


@pytest.mark.parametrize("strategy", FABRIC_STRATEGIES)
def test_fabric_s_model_copies_and_saves_mid_run(strategy: str) -> None:
    def train(copy_each_step: bool) -> dict[str, torch.Tensor]:
        fabric = Fabric(accelerator="cpu", devices=1, strategy=FABRIC_STRATEGIES[strategy]())
        model = tiny_hf_model("llama")
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        for (ids,) in token_data(n=16, batch_size=4):
            fabric.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
            if copy_each_step:
                for make_copy in COPIES.values():  # the module as Fabric hands it back, and the user's own inside
                    _check_copy(model.module, make_copy(model.module), ids)
                    _check_copy(model.module, make_copy(model).module, ids)
        return params_of(model.module)

    with_copies, without = train(True), train(False)
    for name in without:
        assert torch.equal(with_copies[name], without[name]), name


def test_an_averaged_model_tracks_the_weights_as_it_does_under_adamw() -> None:
    """SWA's running average of a training run under lsp_offload's lossless projectors equals the same average taken
    under torch's AdamW (Adam is elementwise, so signed-permutation projectors reproduce it)."""
    from lightning_offload import signed_permutation_projector

    def averaged(optimizer_of: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
        model = tiny_hf_model("llama")
        optimizer = optimizer_of(model)
        average = torch.optim.swa_utils.AveragedModel(model)
        for (ids,) in token_data(n=16, batch_size=4):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            average.update_parameters(model)
        return params_of(average.module)

    def lossless(model: torch.nn.Module) -> torch.optim.Optimizer:
        return offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3), strategy="lsp_offload", rank=1.0,
                       density=1, min_dim=16, projectors="random", projector_factory=signed_permutation_projector,
                       embeddings="host")

    got = averaged(lossless)
    want = averaged(lambda model: torch.optim.AdamW(model.parameters(), lr=3e-3))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
