"""Lion as the engine's second host rule (lightning_offload/engine/rules/lion.py): the optimizer itself against its
definition; under ``zero_offload`` equal to plain Lion on a separate model, through a schedule to lr 0, weight decay,
the user's own ``clip_grad_norm_`` and a save and resume in the middle; under ``lsp_offload`` with lossless projectors
equal to plain Lion too; its one moment carried through a refit; and the kinds that are Adam's arithmetic refusing it
by name (or, for the default row-sparse embeddings, saying they step densely)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from lightning_offload import LSPOffloadStrategy, Lion, offload, signed_permutation_projector
from lightning_offload.lsp.projector import SparseProjector, random_projector
from lightning_offload.lsp.rotation import coordinate_map
from tiny_modules import ProjectedUpdateRMS, TinyCausalLM, tiny_hf_model, token_data, trainer

LR, DECAY, STEPS = 3e-3, 0.1, 10
LOSSLESS = dict(rank=1.0, density=1, min_dim=16, projector_factory=signed_permutation_projector)


def to_zero(step: int) -> float:
    """Two warm-up steps, then a cosine that reaches lr 0 at the last step."""
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 2) / (STEPS - 3))))


def batches() -> list:
    return [ids for (ids,) in token_data(n=4 * STEPS, batch_size=4)]


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def test_lion_steps_by_its_definition() -> None:
    torch.manual_seed(0)
    start, grads = torch.randn(5, 3), [torch.randn(5, 3) for _ in range(3)]
    for maximize in (False, True):
        param = torch.nn.Parameter(start.clone())
        optimizer = Lion([param], lr=0.01, betas=(0.8, 0.95), weight_decay=0.5, maximize=maximize)
        want, moment = start.clone(), torch.zeros(5, 3)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
            g = -grad if maximize else grad
            want = want * (1 - 0.01 * 0.5) - 0.01 * torch.sign(0.8 * moment + 0.2 * g)
            moment = 0.95 * moment + 0.05 * g
            torch.testing.assert_close(param.detach(), want)
            torch.testing.assert_close(optimizer.state[param]["exp_avg"], moment)
    with pytest.raises(ValueError, match="betas"):
        Lion([param], betas=(0.9, 1.0))


def _plain_lion(data: list) -> torch.nn.Module:
    model = tiny_hf_model("llama")
    optimizer = Lion(model.parameters(), lr=LR, weight_decay=DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, to_zero)
    for ids in data:
        loss_of(model, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return model


def _offloaded_lion(data: list, strategy: str, resume_at: int | None = None, **settings: Any) -> torch.nn.Module:
    """The same loop under the offload, with a save after ``resume_at`` steps and a resume into a fresh model,
    optimizer and schedule (the weights read back through ``state_dict`` as a user saves them)."""
    model = tiny_hf_model("llama")
    user = Lion(model.parameters(), lr=LR, weight_decay=DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(user, to_zero)
    optimizer = offload(model, user, strategy, embeddings="host", **settings)
    for step, ids in enumerate(data):
        if step == resume_at:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}
            optimizer.close()
            model = tiny_hf_model("llama", seed=1)  # other weights: the resume must restore every one
            model.load_state_dict(saved["model"])
            user = Lion(model.parameters(), lr=LR, weight_decay=DECAY)
            schedule = torch.optim.lr_scheduler.LambdaLR(user, to_zero)
            optimizer = offload(model, user, strategy, embeddings="host", **settings)
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
        loss_of(model, ids).backward()
        if strategy == "zero_offload":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the user's own habit: exact under zero
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    optimizer.close()
    return model


def _assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    mine, theirs = got.state_dict(), want.state_dict()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("resume_at", [None, STEPS // 2])
def test_zero_offload_with_lion_equals_plain_lion(resume_at: int | None) -> None:
    data = batches()
    _assert_same_weights(_offloaded_lion(data, "zero_offload", resume_at), _plain_lion(data))


def test_lsp_offload_with_lion_and_lossless_projectors_equals_plain_lion() -> None:
    # With signed permutations the compressed step is Lion's own (sign commutes with them), so it must be exact:
    # any Adam left in the host step, or decay applied the wrong way, shows here.
    data = batches()
    model = _offloaded_lion(data, "lsp_offload", resume_at=STEPS // 2, max_grad_norm=0.5, **LOSSLESS)
    _assert_same_weights(model, _plain_lion(data))


def _one_lsp_step() -> Any:
    model = tiny_hf_model("llama")
    optimizer = offload(model, Lion(model.parameters(), lr=LR), "lsp_offload", embeddings="host",
                        rank=0.5, density=2, min_dim=16)
    loss_of(model, batches()[0]).backward()
    optimizer.step()
    return optimizer


class LionModule(TinyCausalLM):
    """A user's LightningModule whose configure_optimizers returns Lion with a schedule to lr 0."""

    def configure_optimizers(self) -> Any:
        optimizer = Lion(self.parameters(), lr=LR, weight_decay=DECAY)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, to_zero)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_the_trainer_s_lsp_offload_with_lion_equals_plain_lightning_with_lion() -> None:
    # The Trainer habit: configure_optimizers returns Lion, gradient_clip_val clips; the offload (lossless projectors,
    # so exact) equals plain Lightning on a separate model.
    runs = []
    for strategy in ("auto", LSPOffloadStrategy(embeddings="host", **LOSSLESS)):
        module = LionModule(tiny_hf_model("llama"))
        trainer(strategy, max_steps=STEPS, gradient_clip_val=0.5).fit(module, token_data(n=4 * STEPS, batch_size=4))
        runs.append(module.model)
    _assert_same_weights(runs[1], runs[0])


class ConstantLion(TinyCausalLM):
    """Lion at one rate, without decay: each step changes every element of a dense weight by exactly ``LR``."""

    def configure_optimizers(self) -> Any:
        return Lion(self.parameters(), lr=LR)


@pytest.mark.parametrize("projectors", ["random", "learned"])
def test_under_projection_lion_steps_each_element_by_lr_on_average(projectors: str) -> None:
    # Dense Lion's step is ±lr per element (RMS exactly lr, where no gradient is exactly 0). Expanded through random
    # projectors it read 1.12–1.15× lr; the expanded step now takes U's per-element RMS (measured on every row of
    # these small weights). U is 0 where a compressed row or column is hit by no coordinate (density 2 at rank 0.5
    # leaves ~2% of them empty: S, its moment and its sign are 0 there), so U's RMS, and the step's, is a little under
    # lr, never over it.
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors=projectors, embeddings="host",
                                  pipelined=False)
    sizes = ProjectedUpdateRMS(strategy)
    trainer(strategy, max_steps=6, callbacks=[sizes]).fit(ConstantLion(tiny_hf_model("llama")),
                                                          token_data(n=24, batch_size=4))
    assert len(sizes.rms) == 6
    for rms in sizes.rms:
        assert 0.97 * LR <= rms <= LR * (1 + 1e-6), rms / LR


def test_the_rms_measured_on_sampled_rows_is_the_whole_update_s_within_a_few_percent() -> None:
    # Past RMS_SAMPLE_ROWS rows of W the RMS is measured on evenly spaced rows: over a wide layer's real shape (2752 ×
    # 1024 at rank 0.25, 8 nonzeros) and the signs of a compressed gradient (U = lr·sign(A G Bᵀ), which follow the
    # projectors as training's do: expanded, 1.14× lr), the whole expanded update's RMS lands within 3% of U's.
    from lightning_offload.lsp.update_size import RMS_SAMPLE_ROWS, match_element_rms_

    generator = torch.Generator().manual_seed(0)
    rows, cols = 2752, 1024
    row_projector = SparseProjector.random(rows, rows // 4, 8, generator=generator)
    col_projector = SparseProjector.random(cols, cols // 4, 8, generator=generator)
    gradient = torch.randn(rows, cols, generator=generator)
    update = LR * torch.sign(col_projector.compress_rows(row_projector.compress_rows(gradient).t()).t())
    half = col_projector.expand_rows(update.t()).t().contiguous()  # U B: d_o × cols
    unscaled = float(row_projector.expand_rows(half).square().mean().sqrt()) / LR
    match_element_rms_(half, row_projector, update)
    rescaled = float(row_projector.expand_rows(half).square().mean().sqrt()) / LR
    assert rows > RMS_SAMPLE_ROWS and abs(unscaled - 1) > 0.05  # there was something to correct
    assert rescaled == pytest.approx(1.0, abs=0.03)


def test_lion_keeps_one_moment_per_tensor_on_the_host() -> None:
    optimizer = _one_lsp_step()
    states = [slot.host_optimizer_state() for slot in optimizer.slots]
    assert states and all(set(state) == {"exp_avg"} for state in states)
    optimizer.close()


def test_a_refit_carries_lion_s_moment_into_the_new_subspace() -> None:
    optimizer = _one_lsp_step()
    layer = optimizer.projected_layers[0]
    slot = next(s for s in optimizer.slots if s.layer is layer)
    moment = slot.host_optimizer_state()["exp_avg"].clone()
    old_out, old_in = layer.proj_out, layer.proj_in
    draw = torch.Generator().manual_seed(7)
    new_out = random_projector(old_out.dim_in, old_out.dim_out, 2, draw, torch.device("cpu"))
    new_in = random_projector(old_in.dim_in, old_in.dim_out, 2, draw, torch.device("cpu"))
    optimizer.replace_projectors(layer, new_out, new_in)
    # What the moment expressed in weight space, projected onto the new subspace (no second moment to rescale).
    want = coordinate_map(old_out, new_out) @ moment @ coordinate_map(old_in, new_in).t()
    torch.testing.assert_close(slot.host_optimizer_state()["exp_avg"], want)
    optimizer.close()


def test_the_kinds_that_are_adam_s_arithmetic_refuse_lion_by_name(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="update='scaled'.*Lion"):
        offload(model, Lion(model.parameters()), "lsp_offload", update="scaled", embeddings="host", min_dim=16)
    # Row-sparse embeddings (the default) step the embedding densely on the host instead, and say so.
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        optimizer = offload(model, Lion(model.parameters()), "lsp_offload", min_dim=16, density=2)
    assert "stepped by Lion" in caplog.text
    assert not any(type(slot).__name__ == "RowSlot" for slot in optimizer.slots)
    optimizer.close()
    # MEFT's rows join the engine through attach_row_blocks (Fabric's and the Trainer's meft_offload): refused there.
    optimizer = offload(model, Lion(model.parameters()), "zero_offload", embeddings="host")
    with pytest.raises(ValueError, match="adapter rows.*Lion.*lsp_offload or zero_offload"):
        optimizer.attach_row_blocks([], lambda: None)
    optimizer.close()


def test_a_checkpoint_resumes_only_under_the_optimizer_that_wrote_it() -> None:
    model = tiny_hf_model("llama")
    lion = offload(model, Lion(model.parameters(), lr=LR), "zero_offload", embeddings="host")
    loss_of(model, batches()[0]).backward()
    lion.step()
    state = lion.state_dict()
    lion.close()
    adamw = offload(model, torch.optim.AdamW(model.parameters()), "zero_offload", embeddings="host")
    with pytest.raises(ValueError, match="written by Lion, and this run steps by Adam"):
        adamw.load_state_dict(state)
    adamw.close()


def test_an_optimizer_no_rule_takes_is_refused_naming_the_ones_that_have_one() -> None:
    model = tiny_hf_model("llama")
    with pytest.raises(TypeError, match=r"torch\.optim\.SGD.*Lion|Lion.*torch\.optim\.sgd\.SGD"):
        offload(model, torch.optim.SGD(model.parameters(), lr=0.1))
