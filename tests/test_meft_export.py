"""MEFT adapters leaving the model: unload gives the base bit for bit; saved adapters load into a fresh base with
identical logits; save_pretrained of an injected model refuses and says what to call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_meft import SMALL, batches, loader, trainer

from lightning_offload import (
    MEFTConfig,
    MEFTOffloadStrategy,
    inject_meft,
    load_meft_adapters,
    meft_adapters,
    save_meft_adapters,
    unload_meft,
)
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule


def _trained(tmp_path: Path) -> torch.nn.Module:
    model = tiny_llama()
    inject_meft(model, MEFTConfig(**SMALL))
    trainer(tmp_path, 3, MEFTOffloadStrategy(device="cpu")).fit(CausalLMModule(model, lr=1e-2),
                                                                 train_dataloaders=loader(batches(3, seed=5)))
    assert any(bool(a.host.values.abs().sum() > 0) for a in meft_adapters(model))  # the adapters trained
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    batch = batches(1, seed=11)[0]
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def test_unload_gives_the_base_back_bit_for_bit(tmp_path: Path) -> None:
    base = tiny_llama()
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    trainable = {n: p.requires_grad for n, p in base.named_parameters()}
    mlp_type = type(base.model.layers[0].mlp)
    inject_meft(base, MEFTConfig(**SMALL))
    trainer(tmp_path, 3, MEFTOffloadStrategy(device="cpu")).fit(CausalLMModule(base, lr=1e-2),
                                                                train_dataloaders=loader(batches(3, seed=5)))
    assert unload_meft(base) is base
    state = base.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    assert {n: p.requires_grad for n, p in base.named_parameters()} == trainable
    assert type(base.model.layers[0].mlp) is mlp_type and not meft_adapters(base)
    assert torch.equal(_logits(base), _logits(tiny_llama()))  # no hook or adapter left behind


def test_saved_adapters_load_into_a_fresh_base_with_identical_logits(tmp_path: Path) -> None:
    trained = _trained(tmp_path)
    save_meft_adapters(trained, tmp_path / "adapters.pt")
    assert not (tmp_path / "adapters.pt.partial").exists()
    fresh = load_meft_adapters(tiny_llama(), tmp_path / "adapters.pt")
    assert torch.equal(_logits(fresh), _logits(trained))
    assert not torch.equal(_logits(fresh), _logits(tiny_llama()))  # the adapters change the model


def test_save_pretrained_of_an_injected_model_refuses_and_the_unloaded_base_saves(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    trained = _trained(tmp_path)
    with pytest.raises(ValueError, match=r"save_meft_adapters\(model, 'adapters.pt'\).*unload_meft\(model\)"
                                         r"\.save_pretrained\(path\)"):
        trained.save_pretrained(tmp_path / "hf")
    save_meft_adapters(trained, tmp_path / "adapters.pt")
    expected = _logits(trained)
    unload_meft(trained).save_pretrained(tmp_path / "hf")
    reloaded = load_meft_adapters(LlamaForCausalLM.from_pretrained(tmp_path / "hf"), tmp_path / "adapters.pt")
    assert torch.equal(_logits(reloaded), expected)


def test_an_adapters_file_for_other_ffns_is_refused(tmp_path: Path) -> None:
    trained = _trained(tmp_path)
    save_meft_adapters(trained, tmp_path / "adapters.pt")
    other = tiny_llama(layers=3)
    inject_meft(other, MEFTConfig(**SMALL))
    with pytest.raises(ValueError, match="sit beside"):
        load_meft_adapters(other, tmp_path / "adapters.pt")
