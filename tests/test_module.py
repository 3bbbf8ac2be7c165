"""CausalLMModule: optimizer groups, warmup, token-weighted validation, and a short real training run."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_offload.data import BibleLMDataModule
from lightning_offload.models import ByteTokenizer, tiny_gpt2, tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule, LinearWarmup, evaluate_loss, param_groups


def plain_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2])
def test_param_groups_cover_each_trainable_param_once(factory) -> None:
    model = factory()
    # Freeze one parameter: it must be left out of both groups.
    frozen = model.transformer.wpe.weight if factory is tiny_gpt2 else model.model.norm.weight
    frozen.requires_grad_(False)
    module = CausalLMModule(model, weight_decay=0.1)
    opt = module.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 2
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in plain["params"])
    assert plain["params"], "biases/norm scales expected"
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))  # tied embeddings appear once
    trainable = {id(p) for p in model.parameters() if p.requires_grad}  # parameters() dedups ties
    assert set(ids) == trainable and id(frozen) not in trainable


def test_optimizer_options_and_warmup() -> None:
    module = CausalLMModule(tiny_llama(), lr=1e-3, optimizer="adam", warmup_steps=4, betas=(0.8, 0.9), eps=1e-6)
    assert "model" not in module.hparams and module.hparams.lr == 1e-3
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]
    assert type(opt) is torch.optim.Adam and opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6
    assert sched["interval"] == "step"
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched["scheduler"].step()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert sched["scheduler"].state_dict()["lr_lambdas"][0] == {"warmup_steps": 4}  # checkpointable
    assert LinearWarmup(1)(0) == 1.0
    with pytest.raises(ValueError):
        CausalLMModule(tiny_llama(), optimizer="sgd")


def test_val_loss_is_token_weighted() -> None:
    torch.manual_seed(0)
    ids = torch.randint(1, 256, (6, 16))
    labels = ids.clone()
    labels[:4, :12] = -100  # the first two batches have few targets, the last many
    batches = [
        {"input_ids": ids[s], "attention_mask": torch.ones_like(ids[s]), "labels": labels[s]}
        for s in (slice(0, 2), slice(2, 4), slice(4, 6))
    ]
    model = tiny_llama(seed=1)
    module = CausalLMModule(model)
    trainer = plain_trainer()
    (metrics,) = trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    expected = evaluate_loss(model, batches)
    batch_mean = sum(model(**b).loss.item() for b in batches) / len(batches)
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(expected - batch_mean) > 1e-4  # the weighting actually matters here
    assert metrics["val/ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_trains_tiny_llama_on_bible_bytes(tmp_path) -> None:
    dm = BibleLMDataModule(
        ByteTokenizer(), block_size=64, batch_size=8, max_train_blocks=160, max_val_blocks=16, cache_dir=tmp_path
    )
    dm.setup()
    model = tiny_llama(seed=0)
    before = evaluate_loss(model, dm.val_dataloader())
    module = CausalLMModule(model, lr=3e-3, weight_decay=0.01, warmup_steps=5)
    # 160 blocks / 8 = 20 steps per epoch, so validation runs after steps 20 and 40 (the last one).
    trainer = plain_trainer(max_steps=40, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    after = evaluate_loss(model, dm.val_dataloader())
    assert math.isfinite(after) and after < before - 1.0  # ~5.6 (uniform over bytes) -> ~3
    assert trainer.global_step == 40
    metrics = trainer.callback_metrics
    assert {"train/loss", "val/loss", "val/ppl"} <= set(metrics)
    assert float(metrics["val/loss"]) == pytest.approx(after, rel=1e-4)
    assert model.training  # evaluate_loss restores the mode


def test_the_chunked_loss_trains_and_validates_as_the_model_s_own_loss() -> None:
    # loss="chunked" (the default) against loss="model": the same steps, the same validation metrics.
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (6, 24))
    labels = ids.clone()
    labels[:2, :10] = -100  # prompts, as bible_qa's
    batches = [{"input_ids": ids[s], "attention_mask": torch.ones_like(ids[s]), "labels": labels[s]}
               for s in (slice(0, 2), slice(2, 4), slice(4, 6))]
    results = {}
    start = {n: p.detach().clone() for n, p in tiny_llama(seed=3, tie_word_embeddings=False).named_parameters()}
    for loss in ("model", "chunked"):
        model = tiny_llama(seed=3, tie_word_embeddings=False)
        # Plain SGD: Adam's normalisation would take the chunks' fp32 rounding in an element whose gradient is near 0
        # (an embedding row seen once) to a sizeable share of a step, by an amount that differs between CPUs.
        module = CausalLMModule(model, exact_match=True, loss=loss,
                                optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=1.0))
        trainer = plain_trainer(max_steps=3, num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(batches, batch_size=None))
        (metrics,) = trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
        results[loss] = (metrics, {n: p.detach().clone() for n, p in model.named_parameters()})
    (want_metrics, want), (got_metrics, got) = results["model"], results["chunked"]
    assert got_metrics.keys() == want_metrics.keys() and "val/exact_match" in got_metrics
    for key in want_metrics:
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5), key
    for name in want:
        # Chunks sum the hidden states' gradient in another order: fp32 rounding (≤ 1.2e-7 measured), where every
        # tensor moved by 1e-3 or more in the three steps.
        assert (want[name] - start[name]).abs().max() > 1e-4, f"{name} did not train"
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match="'chunked'"):
        CausalLMModule(tiny_llama(), loss="fused")
    with pytest.raises(TypeError, match="loss='model'"):
        CausalLMModule(torch.nn.Linear(2, 2))
