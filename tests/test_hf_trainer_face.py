"""The loop face under Hugging Face's ``Trainer``: ``optimizers=(opt, scheduler)`` with ``opt`` from
``lightning_offload.offload`` trains, and where lossless (``zero_offload``, signed-permutation projectors) equals the
``Trainer`` with plain AdamW on a separate model, including gradient accumulation and clipping
(``max_grad_norm`` moved from ``TrainingArguments`` to the offload, as docs/loops.md says)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_offload import offload, signed_permutation_projector
from tiny_modules import TokenDicts, params_of, tiny_hf_model

transformers = pytest.importorskip("transformers")

LOSSLESS = dict(strategy="lsp_offload", rank=1.0, density=1, min_dim=16, projectors="random",
                projector_factory=signed_permutation_projector, embeddings="host")


def _fit(model: torch.nn.Module, tmp_path: Path, max_grad_norm: float,
         optimizer: torch.optim.Optimizer) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=max_grad_norm, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(),
                                   optimizers=(optimizer, scheduler))
    trainer.train()
    return trainer


@pytest.mark.parametrize("setting", ["zero_offload", "lossless_lsp_offload"])
def test_the_trainer_with_the_loop_optimizer_equals_the_trainer_with_adamw(setting: str, tmp_path: Path) -> None:
    reference = tiny_hf_model("llama")
    _fit(reference, tmp_path / "plain", 0.3, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01))
    model = tiny_hf_model("llama")
    settings = dict(strategy="zero_offload") if setting == "zero_offload" else LOSSLESS
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), max_grad_norm=0.3,
                        accumulation_steps=2, **settings)
    trainer = _fit(model, tmp_path / "offload", 0.0, optimizer)
    assert optimizer.steps_taken == 3
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    assert trainer.state.global_step == 3


def test_checkpoints_hold_each_saved_step_s_weights_and_learned_projectors_are_fitted(tmp_path: Path) -> None:
    """Pipelined, a step's updates wait for the next forward; the callback settles them before the Trainer saves, and
    the Trainer's own read through model.state_dict() does too, so checkpoint-2 holds step 2's weights: those of the
    plain AdamW Trainer's checkpoint-2 (lossless projectors)."""
    from lightning_offload.faces.hf import OffloadCallback

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path, callbacks: list,
            only_model: bool = True) -> None:
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=3, per_device_train_batch_size=4, max_grad_norm=0.0, use_cpu=True,
            report_to=[], save_strategy="steps", save_steps=2, save_only_model=only_model, seed=0, data_seed=0,
            disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(), optimizers=(optimizer, None),
                             callbacks=callbacks).train()

    reference = tiny_hf_model("llama")
    run(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3), tmp_path / "plain", [])
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3), **LOSSLESS)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*updates still pending")  # settled before the save: no warning
        run(model, optimizer, tmp_path / "offload", [OffloadCallback(optimizer)], only_model=False)
    optimizer.close()
    # Without the callback too: the Trainer reads the weights through model.state_dict(), which applies what is
    # pending first, so its checkpoint holds the step's weights (and nothing is pending when it saves the optimizer).
    unsettled = tiny_hf_model("llama")
    forgetful = offload(unsettled, torch.optim.AdamW(unsettled.parameters(), lr=3e-3), **LOSSLESS)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*updates still pending")
        run(unsettled, forgetful, tmp_path / "forgetful", [], only_model=False)
    forgetful.close()
    from safetensors.torch import load_file

    want = load_file(tmp_path / "plain" / "checkpoint-2" / "model.safetensors")
    for run_name in ("offload", "forgetful"):
        saved = load_file(tmp_path / run_name / "checkpoint-2" / "model.safetensors")
        for name in want:
            torch.testing.assert_close(saved[name], want[name], msg=lambda m, n=name: f"{run_name} {n}: {m}")

    learned = tiny_hf_model("llama")
    fitted = offload(learned, torch.optim.AdamW(learned.parameters(), lr=3e-3), rank=0.5, min_dim=16,
                     projectors="learned", refit_every=2)
    run(learned, fitted, tmp_path / "learned", [OffloadCallback(fitted)])
    fitted.close()
    assert [record.initial for record in fitted.fits] == [True, False]  # fitted first, checked at step 2


def test_learned_projectors_resume_bit_for_bit_from_a_trainer_checkpoint(tmp_path: Path) -> None:
    """A Trainer run resumed from checkpoint-2 (weights, the loop optimizer's state, scheduler, RNG) ends where the
    run that wrote it ends, bit for bit, with learned projectors fitted and refitted by OffloadCallback."""
    from lightning_offload.faces.hf import OffloadCallback

    def run(out: Path, resume: Path | None) -> dict[str, torch.Tensor]:
        model = tiny_hf_model("llama")
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), rank=0.5,
                            min_dim=16, projectors="learned", refit_every=2, max_grad_norm=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=4, max_grad_norm=0.0, use_cpu=True,
            report_to=[], save_strategy="steps", save_steps=2, seed=0, data_seed=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(),
                                       optimizers=(optimizer, scheduler), callbacks=[OffloadCallback(optimizer)])
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
        optimizer.close()
        return params_of(model)

    straight = run(tmp_path / "straight", None)
    resumed = run(tmp_path / "resumed", tmp_path / "straight" / "checkpoint-2")
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


def test_accumulating_more_micro_batches_than_the_offload_was_told_is_refused_before_the_first_step(
        tmp_path: Path) -> None:
    from lightning_offload.faces.hf import OffloadCallback

    model = tiny_hf_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3))  # accumulation_steps=1, the default
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(), optimizers=(optimizer, None),
                                   callbacks=[OffloadCallback(optimizer)])
    with pytest.raises(ValueError, match=r"TrainingArguments\(gradient_accumulation_steps=2\) and offload\(\.\.\., "
                                         r"accumulation_steps=1\) disagree.*Pass offload\(\.\.\., "
                                         r"accumulation_steps=2\).*or accumulation_steps=None"):
        trainer.train()
    optimizer.close()
    assert forwards == [] and optimizer.steps_taken == 0  # at train begin: no micro-batch ran
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
