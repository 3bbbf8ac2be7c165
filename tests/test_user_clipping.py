"""A user's own clipping call, the way their loop already clips: ``torch.nn.utils.clip_grad_norm_`` between
``backward()`` and ``step()`` (a plain loop, Fabric, a LightningModule's ``on_before_optimizer_step``), and Hugging
Face's ``TrainingArguments.max_grad_norm``. Each takes effect exactly (equal to clipped AdamW on a separate model) or
is refused at the first step with the offload's own clipping named; never silently ignored.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_offload import (
    FabricZeroOffload, LSPOffloadStrategy, ZeroOffloadStrategy, offload, signed_permutation_projector)
from tiny_modules import TinyCausalLM, TokenDicts, params_of, tiny_hf_model, token_data, trainer

LR = 3e-3
CLIP = 0.1  # fires at every step of these runs (the tiny LLaMA's gradient norm is ~0.3-1)
PROJECTED = dict(strategy="lsp_offload", rank=0.5, density=2, min_dim=16)
LOSSLESS = dict(strategy="lsp_offload", rank=1.0, density=1, min_dim=16, projectors="random",
                projector_factory=signed_permutation_projector, embeddings="host")


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, micro: int,
          clip: float | None) -> list[float]:
    """The PyTorch tutorial's loop, with torch's own clipping call; returns the norms torch reported."""
    norms = []
    for start in range(0, len(batches), micro):
        for batch in batches[start:start + micro]:
            (lm_loss(model, batch) / micro).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _assert_equal(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("accumulation", [1, 2, None])
def test_torch_clip_grad_norm_in_a_loop_under_zero_offload_equals_clipped_adamw(accumulation: int | None) -> None:
    micro = accumulation or 1
    batches = list(token_data(n=24, batch_size=4))
    reference = tiny_hf_model("llama")
    norms = _loop(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01), batches, micro,
                  CLIP)
    assert min(norms) > CLIP  # clipping fires at every step
    unclipped = tiny_hf_model("llama")
    _loop(unclipped, torch.optim.AdamW(unclipped.parameters(), lr=LR, weight_decay=0.01), batches, micro, None)
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), "zero_offload",
                        accumulation_steps=accumulation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_norms = _loop(model, optimizer, batches, micro, CLIP)
    optimizer.close()
    _assert_equal(model, reference)
    assert max(abs(a - b) for a, b in zip(got_norms, norms)) < 1e-5  # torch reported the true norm
    assert not torch.allclose(params_of(model)["lm_head.weight"], params_of(unclipped)["lm_head.weight"])
    said = [w for w in caught if "crossed again" in str(w.message)]
    # Gradients that crossed during backward cross again once edited (said once); at the step they cross once.
    assert len(said) == (0 if accumulation is None else 1)


@pytest.mark.parametrize("accumulation", [1, None])
def test_torch_clip_grad_norm_under_projection_is_refused_at_the_first_step(accumulation: int | None) -> None:
    batches = list(token_data(n=8, batch_size=4))
    model = tiny_hf_model("llama")
    before = params_of(model)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), accumulation_steps=accumulation,
                        **PROJECTED)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_.*max_grad_norm=c.*OffloadCallback"):
        _loop(model, optimizer, batches, 1, CLIP)
    assert optimizer.steps_taken == 0
    optimizer.close()
    after = params_of(model)
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing of the step was applied


def test_torch_clipping_that_multiplied_by_one_under_projection_is_refused() -> None:
    """torch's ``clip_grad_norm_`` multiplies every gradient by exactly 1 when the norm it measured is under the limit;
    under projection that norm lacks the projected weights' gradients, and the true norm is over the limit: the call
    changed no value, yet clipped AdamW would clip. Refused, nothing stepped."""
    (batch,) = list(token_data(n=4, batch_size=4))
    model = tiny_hf_model("llama")
    before = params_of(model)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **PROJECTED)
    lm_loss(model, batch).backward()
    seen_by_torch = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    true_norm = float(optimizer.grad_norm())
    assert seen_by_torch < true_norm
    limit = (seen_by_torch + true_norm) / 2
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)) < limit  # torch: nothing to clip
    with pytest.raises(RuntimeError, match=r"exactly 1.*max_grad_norm=c"):
        optimizer.step()
    assert optimizer.steps_taken == 0
    optimizer.close()
    after = params_of(model)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("strategy", ["lsp_offload", "zero_offload"])
def test_a_norm_read_through_torch(strategy: str) -> None:
    """``clip_grad_norm_(..., inf)`` reads a norm and multiplies by exactly 1. Under projection the norm it reads lacks
    the projected gradients: refused, naming ``optimizer.grad_norm()``. Under ``zero_offload`` it is the true norm: the
    run equals one without the call (the gradients cross again, said once)."""
    batches = list(token_data(n=12, batch_size=4))
    settings = PROJECTED if strategy == "lsp_offload" else dict(strategy=strategy)
    runs = []
    for read_norm in (False, True):
        model = tiny_hf_model("llama")
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **settings)
        if read_norm and strategy == "lsp_offload":
            with pytest.raises(RuntimeError, match=r"grad_norm\(\) reads the global norm"):
                _loop(model, optimizer, batches, 1, float("inf"))
            optimizer.close()
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loop(model, optimizer, batches, 1, float("inf") if read_norm else None)
        optimizer.close()
        assert len([w for w in caught if "crossed again" in str(w.message)]) == int(read_norm)
        runs.append(params_of(model))
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


def test_torch_clip_grad_norm_under_fabric_zero_offload_equals_plain_fabric() -> None:
    batches = list(token_data(n=16, batch_size=4))
    results = []
    for strategy in ("auto", FabricZeroOffload()):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model = tiny_hf_model("gpt2")
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _loop(model, optimizer, batches, 1, CLIP)
        if strategy != "auto":
            optimizer.close()
        results.append(model)
    _assert_equal(results[1], results[0])


class ClipsItself(TinyCausalLM):
    """A LightningModule that clips the way many do: torch's call in ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)


def test_torch_clip_grad_norm_in_a_lightning_module() -> None:
    """Under ``zero_offload`` it equals plain Lightning with AdamW doing the same; under ``lsp_offload`` it is refused
    naming ``gradient_clip_val``."""
    data = token_data(n=24, batch_size=4)
    reference = ClipsItself(tiny_hf_model("llama"))
    trainer("auto", max_steps=4).fit(reference, data)
    module = ClipsItself(tiny_hf_model("llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(ZeroOffloadStrategy(), max_steps=4).fit(module, data)
    _assert_equal(module.model, reference.model)
    projected = ClipsItself(tiny_hf_model("llama"))
    with pytest.raises(RuntimeError, match="gradient_clip_val"):
        trainer(LSPOffloadStrategy(rank=0.5, density=2, min_dim=16), max_steps=4).fit(projected, data)


transformers = pytest.importorskip("transformers")


def _hf_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path, callbacks: list,
              max_grad_norm: float = CLIP) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, max_grad_norm=max_grad_norm, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(), optimizers=(optimizer, None),
                         callbacks=callbacks).train()
    return args


@pytest.mark.parametrize("settings", [dict(strategy="zero_offload"), LOSSLESS], ids=["zero", "lossless_lsp"])
def test_hf_max_grad_norm_becomes_the_offload_s_clipping_under_offload_callback(settings: dict, tmp_path: Path) -> None:
    """The Trainer's default habit, ``max_grad_norm`` in ``TrainingArguments``: with the callback, the run equals the
    Trainer with torch's AdamW (projected gradients clipped too), and the arguments are given back after."""
    from lightning_offload.faces.hf import OffloadCallback

    reference = tiny_hf_model("llama")
    _hf_train(reference, torch.optim.AdamW(reference.parameters(), lr=LR), tmp_path / "plain", [])
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **settings)
    args = _hf_train(model, optimizer, tmp_path / "offload", [OffloadCallback(optimizer)])
    optimizer.close()
    assert args.max_grad_norm == CLIP and optimizer.max_grad_norm is None  # given back after the run
    _assert_equal(model, reference)


def test_hf_max_grad_norm_without_the_callback_is_exact_or_refused(tmp_path: Path) -> None:
    reference = tiny_hf_model("llama")
    _hf_train(reference, torch.optim.AdamW(reference.parameters(), lr=LR), tmp_path / "plain", [])
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), "zero_offload")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_train(model, optimizer, tmp_path / "zero", [])
    optimizer.close()
    _assert_equal(model, reference)
    # Refused whatever the limit: also one far over the true norm, where torch multiplies by exactly 1 (the call
    # cannot know the norm it lacks, so neither can the step).
    for limit in (CLIP, 1e9):
        projected = tiny_hf_model("llama")
        optimizer = offload(projected, torch.optim.AdamW(projected.parameters(), lr=LR), **PROJECTED)
        with pytest.raises(RuntimeError, match="OffloadCallback"):
            _hf_train(projected, optimizer, tmp_path / f"lsp{limit}", [], max_grad_norm=limit)
        assert optimizer.steps_taken == 0
        optimizer.close()
