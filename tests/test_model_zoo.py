"""Today's model families, tiny but with their real vocabularies and head arrangements: Llama-3 (GQA, 128K vocabulary,
tied as 3.2-1B and untied as 3.1-8B), Qwen2.5 (152K, untied, attention biases) and Gemma-2 (256K, tied, soft-capped
logits and attention). Each trains under ``lsp_offload`` with the package's task (the chunked loss), its checkpoint
loads into the plain model, lossless projectors equal torch's AdamW on a separate model, and the chunked loss equals
the model's own with its gradients."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_offload import LSPOffloadStrategy, causal_lm_loss, offload, signed_permutation_projector
from lightning_offload.tasks.causal_lm import CausalLMModule
from tiny_modules import check_checkpoint_loads_into_plain, params_of

transformers = pytest.importorskip("transformers")

ZOO = {
    "llama3_tied": (128256, "llama", dict(tie_word_embeddings=True)),
    "llama3_untied": (128256, "llama", dict(tie_word_embeddings=False)),
    "qwen2.5": (151936, "qwen2", dict(tie_word_embeddings=False)),
    "gemma2": (256000, "gemma2", dict(head_dim=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                      query_pre_attn_scalar=8)),
}


def _zoo_model(name: str, seed: int = 0) -> torch.nn.Module:
    vocab, family, extra = ZOO[name]
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **extra)
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}
    config_class, model_class = classes[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**common))
    if name == "qwen2.5":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's attention biases are there
    return model


def _batches(vocab: int, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    # Ids spread over the whole vocabulary, the high ones included (a 256K head is all there is to test here).
    ids = torch.randint(0, vocab, (steps, 2, 16), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]


@pytest.mark.parametrize("name", list(ZOO))
def test_trains_under_lsp_offload_and_its_checkpoint_loads_into_the_plain_model(name: str, tmp_path: Path) -> None:
    model = _zoo_model(name)
    module = CausalLMModule(model, lr=1e-2)
    keys = list(module.state_dict())
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="random")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    batches = _batches(ZOO[name][0])
    before = causal_lm_loss(_zoo_model(name), batches[0]).item()
    trainer.fit(module, DataLoader(batches, batch_size=None))
    assert strategy.projected_layers, "the blocks' Linears were projected"
    with torch.no_grad():
        after = causal_lm_loss(model, batches[0]).item()
    assert after < before  # three steps at 1e-2 on the same batches lower their loss
    check_checkpoint_loads_into_plain(trainer, tmp_path / "model.ckpt", keys, CausalLMModule(_zoo_model(name, seed=1)),
                                      model, batches[0]["input_ids"])


@pytest.mark.parametrize("name", list(ZOO))
def test_lossless_projectors_equal_adamw_on_a_separate_model(name: str) -> None:
    batches = _batches(ZOO[name][0])
    reference = _zoo_model(name)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in batches:
        reference(**batch).loss.backward()
        adamw.step()
        adamw.zero_grad()
    model = _zoo_model(name)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2), strategy="lsp_offload", rank=1.0,
                        density=1, min_dim=16, projectors="random", projector_factory=signed_permutation_projector,
                        embeddings="host")
    for batch in batches:
        model(**batch).loss.backward()  # the offload against AdamW alone (the chunked loss is compared below)
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.steps_taken == len(batches)
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", list(ZOO))
def test_the_chunked_loss_and_its_gradients_equal_the_model_s_own(name: str) -> None:
    model = _zoo_model(name).eval()
    batch = _batches(ZOO[name][0])[0]
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, :6] = -100
    grads = []
    for loss_of in (lambda: model(**batch).loss, lambda: causal_lm_loss(model, batch, chunk_tokens=7)):
        model.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_loss, want), (got_loss, got) = grads
    torch.testing.assert_close(got_loss, want_loss)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, k=key: f"{k}: {m}")
