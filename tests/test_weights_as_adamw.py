"""The weights a user reads are AdamW's, whatever the schedule and whatever reads or saves happened:

- the decoupled decay of embedding rows a batch never touched is AdamW's under warm-up and a cosine to lr 0, in the
  Trainer and in a loop saved and resumed halfway (AdamW's ``Π (1 − lr_t·λ)``, not the current rate's power);
- a result does not depend on a callback that reads nothing, a ``settle()`` or a save (no more than 1e-6);
- weights read through the module after a pipelined loop (``state_dict()``, ``named_parameters()``,
  ``save_pretrained``, an evaluation forward between steps) are the last step's, with no extra call.

Every comparison is with torch's AdamW on a separate model.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload import FabricOffload, FabricZeroOffload, LSPOffloadStrategy, offload
from lightning_offload import signed_permutation_projector
from tiny_modules import TinyCausalLM, params_of, tiny_hf_model, token_data, trainer

LR, DECAY, STEPS = 1e-2, 0.1, 12
SEEN = 48  # the data uses tokens below this: embedding rows 48-63 are never touched (AdamW only decays them)
SMALL = dict(rank=0.5, density=2, min_dim=16)
LOSSLESS = dict(rank=1.0, density=1, min_dim=16, projector_factory=signed_permutation_projector, embeddings="host")


def warmup_cosine_to_zero(step: int) -> float:
    """Three warm-up steps from 0, then a cosine to 0 at the last step (the CLI's default floor)."""
    if step < 3:
        return step / 3
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 3) / (STEPS - 4))))


def data(n: int = 4 * STEPS) -> list:
    return [(ids % SEEN,) for (ids,) in token_data(n=n, batch_size=4)]


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def adamw_run(batches: list, steps: int = STEPS) -> torch.nn.Module:
    model = tiny_hf_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_to_zero)
    for batch in batches[:steps]:
        lm_loss(model, batch).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return model


def idle_rows(model: torch.nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()[SEEN:].clone()


class Scheduled(TinyCausalLM):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=DECAY)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_to_zero)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ReadsNothing(pl.Callback):
    """A logging callback's shape: it runs after every step and reads nothing."""

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        pass


def _trainer_run(callbacks: list) -> torch.nn.Module:
    module = Scheduled(tiny_hf_model("llama"), lr=LR)
    loader = DataLoader(TensorDataset(torch.cat([ids for (ids,) in data()])), batch_size=4)
    trainer(LSPOffloadStrategy(**SMALL), max_steps=STEPS, callbacks=callbacks).fit(module, loader)
    return module.model


def test_idle_rows_decay_as_adamw_under_a_schedule_in_the_trainer_and_a_callback_changes_nothing() -> None:
    want = idle_rows(adamw_run(data()))
    assert not torch.allclose(want, idle_rows(tiny_hf_model("llama")))  # AdamW decayed them
    plain = _trainer_run([])
    torch.testing.assert_close(idle_rows(plain), want, rtol=1e-6, atol=1e-8)
    with_callback = _trainer_run([ReadsNothing()])
    got, base = params_of(with_callback), params_of(plain)
    assert max(float((got[name] - base[name]).abs().max()) for name in base) <= 1e-6


def _loop(batches: list, settle_at: int | None = None, resume_at: int | None = None) -> torch.nn.Module:
    """A pipelined loop under the schedule; ``settle_at``: a settle() after that step; ``resume_at``: saved after that
    step and resumed into a fresh model and optimizer."""
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), **SMALL)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_to_zero)
    for step, batch in enumerate(batches[:STEPS]):
        lm_loss(model, batch).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step == settle_at:
            optimizer.settle()
        if step == resume_at:
            saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                   "schedule": schedule.state_dict()})
            optimizer.close()
            model = tiny_hf_model("llama", seed=1)
            model.load_state_dict(saved["model"])
            optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), **SMALL)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_to_zero)
            optimizer.load_state_dict(saved["optimizer"])  # after the scheduler's set-up, which writes the lr
            schedule.load_state_dict(saved["schedule"])
    optimizer.close()
    return model


def test_idle_rows_decay_as_adamw_in_a_loop_saved_and_resumed_and_neither_a_settle_nor_a_resume_changes_it() -> None:
    batches = data()
    want = idle_rows(adamw_run(batches))
    straight = _loop(batches)
    torch.testing.assert_close(idle_rows(straight), want, rtol=1e-6, atol=1e-8)
    base = params_of(straight)
    for run in (_loop(batches, settle_at=5), _loop(batches, resume_at=5)):
        got = params_of(run)
        assert max(float((got[name] - base[name]).abs().max()) for name in base) <= 1e-6


def _fabric_run(save_to: Path | None) -> dict[str, torch.Tensor]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricOffload(**SMALL))
    model = tiny_hf_model("llama")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_to_zero)
    for step, batch in enumerate(data()[:STEPS]):
        fabric.backward(lm_loss(model, batch))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if save_to is not None and step == 4:
            fabric.save(save_to, {"model": model, "optimizer": optimizer})
    weights = params_of(model)
    optimizer.close()
    return weights


def test_a_fabric_save_changes_nothing(tmp_path: Path) -> None:
    base, saved = _fabric_run(None), _fabric_run(tmp_path / "step5.ckpt")
    assert max(float((saved[name] - base[name]).abs().max()) for name in base) <= 1e-6


@pytest.mark.parametrize("strategy", [FabricZeroOffload, lambda: FabricOffload(**LOSSLESS)], ids=["zero", "lossless"])
def test_fabric_weights_read_through_the_model_after_the_loop_are_the_last_steps(strategy: Any) -> None:
    batches = data()[:6]
    reference = tiny_hf_model("llama")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY)
    for batch in batches:
        lm_loss(reference, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy())
    model = tiny_hf_model("llama")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY))
    for batch in batches:
        fabric.backward(lm_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    got, want = model.state_dict(), reference.state_dict()  # no settle() called
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    optimizer.close()


def test_a_loop_s_weights_read_after_it_are_the_last_step_s(tmp_path: Path) -> None:
    """named_parameters() and save_pretrained after a pipelined loop, and an evaluation forward between steps, see
    the last step's weights (lossless projectors: AdamW's exactly)."""
    batches = data()[:6]
    reference = tiny_hf_model("llama")
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY)
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), **LOSSLESS)
    probe = batches[0]
    for step, batch in enumerate(batches):
        for m, o in ((reference, adamw), (model, optimizer)):
            lm_loss(m, batch).backward()
            o.step()
            o.zero_grad()
        if step < len(batches) - 1:  # evaluation between steps (not after the last: its reads come below)
            with torch.no_grad():
                torch.testing.assert_close(lm_loss(model.eval(), probe), lm_loss(reference.eval(), probe))
            model.train(), reference.train()
    read = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.save_pretrained(tmp_path / "saved")
    for name, value in params_of(reference).items():
        torch.testing.assert_close(read[name], value, msg=lambda m, n=name: f"{n}: {m}")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "saved" / "model.safetensors")
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved[name], value, msg=lambda m, n=name: f"{n}: {m}")
    optimizer.close()
    assert all(type(module._parameters) is dict for module in model.modules())  # handed back plain


def test_an_evaluation_forward_sees_the_decay_idle_rows_owe_and_training_after_it_is_unchanged() -> None:
    """Row-sparse embedding: an evaluation forward between steps computes with the idle rows' decay paid (the weights
    model.state_dict() gives), and the training after it is the same, bit for bit, as without the evaluation."""
    batches = data()[:6]
    runs = []
    untouched = idle_rows(tiny_hf_model("llama"))
    for evaluate in (False, True):
        model = tiny_hf_model("llama")
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), **SMALL)
        for step, batch in enumerate(batches):
            lm_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            if evaluate:
                seen = {}
                hook = model.get_input_embeddings().register_forward_hook(
                    lambda module, args, out: seen.update(weight=module.weight.detach().clone()))
                with torch.no_grad():
                    model(input_ids=torch.arange(64).view(1, 64))
                hook.remove()
                shown = model.state_dict()["model.embed_tokens.weight"]
                assert torch.equal(seen["weight"], shown)
                # Never-touched rows: AdamW's are only decayed, (1 − lr·λ) per step so far.
                want = untouched * (1 - LR * DECAY) ** (step + 1)
                torch.testing.assert_close(seen["weight"][SEEN:], want, rtol=1e-6, atol=1e-8)
        optimizer.close()
        runs.append(params_of(model))
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


def test_the_readmes_exact_recipe_equals_adamw_where_rank_one_alone_does_not() -> None:
    """The README's settings table names the settings under which lsp_offload is torch's AdamW: run them as written
    there, against torch's AdamW on a tiny LLaMA whose layers the default min_dim projects."""
    import re

    import lightning_offload
    from lightning_offload.models.tiny import tiny_llama

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (recipe,) = re.findall(r"exact, within fp32 rounding of torch's AdamW: `([^`]+)`", readme)
    exact = eval(f"dict({recipe})", {"lightning_offload": lightning_offload})  # noqa: S307  (the README's own text)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 200, (4, 16), generator=generator) for _ in range(6)]

    def run(settings: dict | None) -> dict[str, torch.Tensor]:
        model = tiny_llama(hidden=128, intermediate=256, layers=2, tie_word_embeddings=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if settings is not None:
            optimizer = offload(model, optimizer, **settings)
            assert len(optimizer.projected_layers) == 14  # every Linear of the blocks: the recipe is tested, not idle
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if settings is not None:
            optimizer.close()
        return params_of(model)

    want = run(None)
    got = run(exact)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    rank_one_alone = run(dict(rank=1.0))
    assert max((rank_one_alone[n] - want[n]).abs().max().item() for n in want) > 1e-3
