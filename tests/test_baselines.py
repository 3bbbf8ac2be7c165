"""The comparison methods of the projector benchmark: frozen, LoRA (peft) and GaLore (galore-torch); and what an
offload policy adds to a command-line run."""

import logging

import pytest
import torch

from lightning_offload.cli.baselines import (
    add_lora,
    freeze_projectable,
    galore_optimizer,
    layer_param_groups,
    projectable_layers,
)
from lightning_offload import LSPOffloadStrategy
from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule
from tiny_modules import tiny_hf_model, token_data

PROJECTED = {f"model.layers.{b}.{m}" for b in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj")}


def _batch():
    (ids,) = next(iter(token_data(n=4, batch_size=4)))
    return ids


def test_frozen_freezes_exactly_the_projectable_layers():
    model = tiny_hf_model("llama")
    assert set(projectable_layers(model, min_dim=16)) == PROJECTED
    frozen = freeze_projectable(model, min_dim=16)
    assert set(frozen) == PROJECTED
    for name, param in model.named_parameters():
        assert param.requires_grad == (name.removesuffix(".weight") not in PROJECTED), name


def test_lora_starts_equal_to_the_base_model_and_trains_adapters_plus_the_rest():
    base = tiny_hf_model("llama")
    ids = _batch()
    expected = base(input_ids=ids).logits
    model = add_lora(tiny_hf_model("llama"), rank=4, min_dim=16)
    torch.testing.assert_close(model(input_ids=ids).logits, expected)  # B is zero-initialised
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in name for name in trainable) and any("lora_B" in name for name in trainable)
    assert not any(name.endswith("q_proj.base_layer.weight") for name in trainable)
    assert any(name.endswith("embed_tokens.weight") for name in trainable)  # trained as in the frozen run
    assert any(name.endswith("input_layernorm.weight") for name in trainable)


def test_galore_projects_the_projectable_layers_and_trains():
    model = tiny_hf_model("llama")
    optimizer = galore_optimizer(model, lr=1e-2, projected_lr=3e-2, rank=4, min_dim=16)
    low_rank = optimizer.param_groups[0]
    assert low_rank["rank"] == 4 and low_rank["lr"] == 3e-2
    assert {id(p) for p in low_rank["params"]} == {id(m.weight) for m in projectable_layers(model, 16).values()}
    assert all("rank" not in group and group["lr"] == 1e-2 for group in optimizer.param_groups[1:])
    ids = _batch()
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    # The optimizer state of a projected weight is low-rank: rank × max(o, i) per moment.
    weight = model.model.layers[0].mlp.up_proj.weight  # 64 × 32
    assert optimizer.state[weight]["exp_avg"].numel() == 4 * 64


def test_layer_groups_give_the_projectable_layers_their_own_lr():
    model = tiny_hf_model("llama")
    groups = layer_param_groups(model, lr=1e-4, projected_lr=1e-3, weight_decay=0.1, min_dim=16)
    assert groups[0]["lr"] == 1e-3 and groups[1]["lr"] == groups[2]["lr"] == 1e-4
    assert groups[2]["weight_decay"] == 0.0 and all(p.ndim < 2 for p in groups[2]["params"])
    assert sum(len(g["params"]) for g in groups) == len([p for p in model.parameters() if p.requires_grad])


def _module(policy: OffloadPolicy, model: torch.nn.Module, lr: float = 1e-4) -> CausalLMModule:
    # What train() builds for a language-modelling task (lightning_offload.cli.train.build_module), minus the data.
    return CausalLMModule(policy.prepare(model), lr=lr, weight_decay=0.0,
                          optimizer_factory=policy.optimizer_factory(lr, 0.0))


def test_policies_build_each_method():
    wide = tiny_llama(vocab_size=64, hidden=128, intermediate=256, heads=4, kv_heads=2)  # the configs: min_dim 128
    frozen = _module(OffloadPolicy(name="none", strategy="auto", method="frozen", projected_lr=1e-3), wide)
    assert not frozen.model.model.layers[0].mlp.up_proj.weight.requires_grad
    assert frozen.model.model.embed_tokens.weight.requires_grad
    optimizer = frozen.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 1e-4  # nothing at 1e-3
    lora = _module(OffloadPolicy(name="lora", strategy="auto", method="lora", lora_rank=2, projected_lr=1e-3),
                   tiny_llama(vocab_size=64, hidden=128, intermediate=256, heads=4, kv_heads=2))
    (adapters, *_) = lora.configure_optimizers().param_groups
    assert adapters["lr"] == 1e-3 and len(adapters["params"]) == 2 * 2 * 5  # A and B on q, o, gate, up, down × 2
    with pytest.raises(ValueError, match="method='lora' trains the projectable layers itself"):
        OffloadPolicy(name="lsp", strategy=LSPOffloadStrategy(), method="lora")
    with pytest.raises(ValueError, match="method='dora' is not one of"):
        OffloadPolicy(name="none", strategy="auto", method="dora")


def test_one_route_to_the_refit_callback_on_the_command_line(caplog: pytest.LogCaptureFixture) -> None:
    # The policy's refit (conf/offload/lsp.yaml) joins a run whose strategy learns projectors, unless the run's own
    # callbacks hold one: then that one is the run's, said in the log, and the policy adds none.
    from lightning_offload import ProjectorRefit

    policy = OffloadPolicy(name="lsp", strategy=LSPOffloadStrategy(projectors="learned"), refit=ProjectorRefit())
    assert policy.callbacks() == [policy.refit]
    own = ProjectorRefit(refit_every=7)
    with caplog.at_level(logging.INFO, logger="lightning_offload.cli.policies"):
        assert policy.callbacks([own]) == []
    assert "offload.refit" in caplog.text and "is not added" in caplog.text
    random = OffloadPolicy(name="lsp", strategy=LSPOffloadStrategy(), refit=ProjectorRefit())
    assert random.callbacks() == []  # random projectors are never refitted
