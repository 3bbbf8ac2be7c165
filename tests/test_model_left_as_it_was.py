"""The user's model after a fit: nothing the strategy added is left on it, and task heads were never projected."""

from __future__ import annotations

import gc
import re
import weakref
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from tiny_modules import TinyCausalLM, tiny_hf_model, token_data, trainer


def _module_footprint(model: nn.Module) -> dict[str, Any]:
    """Everything a strategy could leave on modules and parameters: instance attributes and every kind of hook."""
    footprint: dict[str, Any] = {}
    for name, module in model.named_modules():
        footprint[name] = (
            sorted(module.__dict__),
            len(module._forward_pre_hooks), len(module._forward_hooks), len(module._backward_hooks),
            len(module._backward_pre_hooks),
        )
    for name, param in model.named_parameters():
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        footprint[f"param:{name}"] = (len(hooks) if hooks else 0, param._backward_hooks is not None)
    return footprint


@pytest.mark.parametrize("make_strategy", [
    lambda: LSPOffloadStrategy(rank=0.5, density=2, min_dim=16),
    lambda: LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, pipelined=False),
    lambda: ZeroOffloadStrategy(),
], ids=["lsp", "lsp-sync", "zero"])
def test_after_fit_no_module_carries_what_the_strategy_added(make_strategy):
    # Lightning itself leaves attributes on the LightningModule (its trainer, fx names): a plain fit is the baseline.
    plain = TinyCausalLM(tiny_hf_model("llama"))
    trainer("auto", max_steps=3).fit(plain, token_data())
    module = TinyCausalLM(tiny_hf_model("llama"))
    before = _module_footprint(module.model)
    trainer(make_strategy(), max_steps=3).fit(module, token_data())
    assert _module_footprint(module.model) == before
    assert _module_footprint(module) == _module_footprint(plain)
    assert not any("forward" in m.__dict__ for m in module.modules())


class _FailingLM(TinyCausalLM):
    """Raises in the third training step, after the strategy has rebound forwards and stepped twice."""

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("planted failure")
        return super().training_step(batch, batch_idx)


def test_after_a_failed_fit_no_module_carries_what_the_strategy_added():
    module = _FailingLM(tiny_hf_model("gpt2"))
    before = _module_footprint(module.model)
    with pytest.raises(RuntimeError, match="planted failure"):
        trainer(LSPOffloadStrategy(rank=0.5, density=2, min_dim=16), max_steps=5).fit(module, token_data())
    assert _module_footprint(module.model) == before
    assert not any("forward" in m.__dict__ or "_lsp_state" in m.__dict__ for m in module.modules())


def test_a_forward_the_user_set_on_the_instance_is_kept():
    module = TinyCausalLM(tiny_hf_model("llama"))
    q_proj = module.model.model.layers[0].self_attn.q_proj
    calls = []

    def counting_forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return nn.Linear.forward(q_proj, x)

    q_proj.forward = counting_forward
    trainer(LSPOffloadStrategy(rank=0.5, density=2, min_dim=16), max_steps=2).fit(module, token_data())
    assert q_proj.__dict__["forward"] is counting_forward
    calls.clear()
    module.model(input_ids=next(iter(token_data()))[0])
    assert calls == [1]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_model_taken_out_of_a_fit_is_freed_as_soon_as_it_is_dropped(kind):
    module = TinyCausalLM(tiny_hf_model(kind))
    fit = trainer(LSPOffloadStrategy(rank=0.5, density=2, min_dim=16), max_steps=3)
    fit.fit(module, token_data())
    strategy = fit.strategy
    assert strategy.projected_layers
    weight = next(iter(strategy.projected_layers.values())).weight
    model = module.model
    del fit, module, strategy
    gc.collect()  # Lightning's own cycles (trainer ↔ module ↔ strategy) go here; the model must need no collector
    reference = weakref.ref(weight)
    del weight
    assert reference() is not None
    gc.disable()
    try:
        del model
        assert reference() is None, "a projected weight outlived its model: something holds a reference cycle"
    finally:
        gc.enable()


# --------------------------------------------------------------------------------------------------- task heads
class _ClassifierModule(pl.LightningModule):
    """A Hugging Face task model (logits from ``model(**inputs)``) trained with AdamW on random labels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        key = "pixel_values" if inputs.is_floating_point() else "input_ids"
        return self.model(**{key: inputs}, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _bert_classifier() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, num_labels=32,
    ))


def _llama_classifier() -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=32, pad_token_id=0,
    ))


def _vit_classifier() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=32,
    ))


def _classification_data(images: bool) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(8, 3, 16, 16, generator=generator) if images else torch.randint(1, 64, (8, 12),
                                                                                         generator=generator)
    labels = torch.randint(0, 32, (8,), generator=generator)
    return DataLoader(TensorDataset(inputs, labels), batch_size=4)


HEADS = {
    "bert": (_bert_classifier, {"model.classifier", "model.bert.pooler.dense"}),
    "llama": (_llama_classifier, {"model.score"}),
    "vit": (_vit_classifier, {"model.classifier"}),
}


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_task_heads_stay_dense_by_default(kind):
    build, heads = HEADS[kind]
    module = _ClassifierModule(build())
    head_weights = {name: module.get_submodule(name).weight.detach().clone() for name in heads}
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="random")
    trainer(strategy, max_steps=2).fit(module, _classification_data(kind == "vit"))
    projected = set(strategy.projected_layers)
    assert projected, "the blocks' layers must still be projected"
    assert not projected & heads
    # Dense, so trained by the host Adam, not frozen.
    assert all(not torch.equal(head_weights[n], module.get_submodule(n).weight) for n in heads)


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_an_explicit_target_still_projects_a_head(kind):
    build, heads = HEADS[kind]
    module = _ClassifierModule(build())
    patterns = [f"^{re.escape(name)}$" for name in heads]
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="random", target_modules=patterns)
    trainer(strategy, max_steps=1).fit(module, _classification_data(kind == "vit"))
    assert set(strategy.projected_layers) == heads
