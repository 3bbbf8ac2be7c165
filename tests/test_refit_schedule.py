"""One refit schedule for every face (issue 66): the same ``refit_every`` refits at the same optimizer steps under
Lightning's Trainer (``ProjectorRefit``), Fabric, a plain loop and Hugging Face's ``Trainer`` (``OffloadCallback``),
each accumulating two micro-batches per step, because all of them ask one rule
(:func:`lightning_offload.setup.refit_schedule.refit_due`). ``every_n_steps``, the Trainer's former name for the knob,
is a deprecated alias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_offload import FabricOffload, LSPOffloadStrategy, ProjectorFitting, ProjectorRefit, offload
from lightning_offload.setup.refit_schedule import refit_due
from tiny_modules import TinyCausalLM, TokenDicts, tiny_hf_model, token_data, trainer

REFIT_EVERY, STEPS, MICRO_BATCHES = 2, 5, 2
#: Fits before steps 0 (the initial one), 2 and 4.
EXPECTED = [0, 2, 4]
PROJECTION = dict(rank=0.5, density=2, min_dim=16, projectors="learned")
FIT = dict(threshold=10.0, num_samples=1, norm_samples=1, max_iters=2)  # checks measure; none refits
LR = 3e-3


def _lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _batches() -> list[Any]:
    return list(token_data(n=4 * STEPS * MICRO_BATCHES, batch_size=4))


def _loop(model: torch.nn.Module, optimizer: Any, backward: Any) -> list[int]:
    """A loop of one's own: the first fit, then a refit check before each step; the steps fits were taken at."""
    batches = _batches()
    optimizer.fit_projectors(batches, _lm_loss)
    for step in range(STEPS):
        if optimizer.refit_due:
            optimizer.fit_projectors(batches, _lm_loss)
        for batch in batches[MICRO_BATCHES * step:MICRO_BATCHES * (step + 1)]:
            backward(_lm_loss(model, batch) / MICRO_BATCHES)
        optimizer.step()
        optimizer.zero_grad()
    steps = [record.step for record in optimizer.fits]
    optimizer.close()
    return steps


def _trainer_steps() -> list[int]:
    refit = ProjectorRefit(refit_every=REFIT_EVERY, **FIT)
    run = trainer(LSPOffloadStrategy(**PROJECTION), max_steps=STEPS, accumulate_grad_batches=MICRO_BATCHES,
                  callbacks=[refit])
    run.fit(TinyCausalLM(tiny_hf_model("llama"), lr=LR), token_data(n=4 * STEPS * MICRO_BATCHES, batch_size=4))
    return [record.step for record in refit.history]


def _fabric_steps() -> list[int]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricOffload(
        **PROJECTION, refit_every=REFIT_EVERY, fitting=ProjectorFitting(**FIT), accumulation_steps=MICRO_BATCHES))
    model = tiny_hf_model("llama")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return _loop(model, optimizer, fabric.backward)


def _plain_loop_steps() -> list[int]:
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **PROJECTION, refit_every=REFIT_EVERY,
                        fitting=ProjectorFitting(**FIT), accumulation_steps=MICRO_BATCHES)
    return _loop(model, optimizer, lambda loss: loss.backward())


def _hf_trainer_steps(tmp_path: Path) -> list[int]:
    transformers = pytest.importorskip("transformers")
    from lightning_offload.faces.hf import OffloadCallback

    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **PROJECTION, refit_every=REFIT_EVERY,
                        fitting=ProjectorFitting(**FIT), accumulation_steps=MICRO_BATCHES)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=MICRO_BATCHES, max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no",
        seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(n=4 * STEPS * MICRO_BATCHES),
                         optimizers=(optimizer, None), callbacks=[OffloadCallback(optimizer)]).train()
    steps = [record.step for record in optimizer.fits]
    optimizer.close()
    return steps


def test_the_same_schedule_refits_at_the_same_steps_in_every_face(tmp_path: Path) -> None:
    steps = {"Trainer": _trainer_steps(), "Fabric": _fabric_steps(), "plain loop": _plain_loop_steps(),
             "HF Trainer": _hf_trainer_steps(tmp_path)}
    assert steps == dict.fromkeys(steps, EXPECTED)


def test_the_rule_counts_from_the_latest_fit_or_check() -> None:
    assert [step for step in range(12) if refit_due(step, 0, 4)] == [4, 5, 6, 7, 8, 9, 10, 11]  # due until checked
    last, checked = 0, []
    for step in range(12):  # a face checks before each step, and a check restarts the count
        if refit_due(step, last, 4):
            last = step
            checked.append(step)
    assert checked == [4, 8]
    assert not refit_due(7, -1, 4) and not refit_due(7, 3, 0)  # no fit yet; refits off


def test_every_n_steps_is_a_deprecated_alias_of_refit_every() -> None:
    with pytest.warns(DeprecationWarning, match=r"every_n_steps=\.\.\.\) is deprecated.*refit_every"):
        refit = ProjectorRefit(every_n_steps=7)
    assert refit.refit_every == 7 and "refit_every=7" in repr(refit)
    with pytest.warns(DeprecationWarning, match="read refit_every"):
        assert refit.every_n_steps == 7
    with pytest.raises(ValueError, match=r"refit_every=-1 must be an int ≥ 0"):
        ProjectorRefit(refit_every=-1)


def test_a_checkpoint_of_the_former_schedule_resumes_at_the_same_steps() -> None:
    # Saved before the one rule: last_checked_step (-1 before the first check), checks on multiples of every_n_steps.
    refit = ProjectorRefit(refit_every=4)
    for saved, next_check in ((-1, 4), (8, 12)):
        refit.load_state_dict({"initial_fit_done": True, "last_checked_step": saved, "refits_per_layer": {},
                               "fits_done": 1})
        assert [step for step in range(16) if refit_due(step, refit._last_fit_step, 4)][0] == next_check
