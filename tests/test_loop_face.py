"""The offload engine in a plain PyTorch loop (``lightning_offload.offload``).

Lossless projectors and ``zero_offload`` equal plain ``torch.optim.AdamW`` on a separate model (fp32 rounding) over
steps with accumulation, norm clipping and an LR scheduler; learned projectors train, refit when due and resume bit
for bit; a loop whose micro-batches outnumber ``accumulation_steps`` is refused; bad settings are named.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_offload import LoopOffloadOptimizer, offload, signed_permutation_projector
from lightning_offload.lsp.linear import ProjectedWeight
from tiny_modules import params_of, tiny_hf_model, token_data

LR = 3e-3
LOSSLESS = dict(rank=1.0, density=1, min_dim=16, projectors="random", projector_factory=signed_permutation_projector,
                embeddings="host")
SETTINGS: dict[str, dict[str, Any]] = {"zero_offload": dict(strategy="zero_offload"),
                                       "lossless_lsp_offload": dict(strategy="lsp_offload", **LOSSLESS)}


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, accumulation: int,
           clip: float | None) -> list[float]:
    """Steps over ``batches`` in groups of ``accumulation`` micro-batches, with ``clip_grad_norm_`` when ``clip``;
    returns the norms the clipping saw."""
    scheduler = _schedule(optimizer)
    norms = []
    for start in range(0, len(batches), accumulation):
        for batch in batches[start:start + accumulation]:
            (lm_loss(model, batch) / accumulation).backward()
        if clip is not None:
            if isinstance(optimizer, LoopOffloadOptimizer):
                norms.append(float(optimizer.clip_grad_norm_(clip)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("clipping", ["max_grad_norm", "clip_grad_norm_"])
def test_a_loop_equals_plain_adamw_with_accumulation_clipping_and_a_scheduler(kind: str, setting: str,
                                                                               clipping: str) -> None:
    batches = list(token_data(n=24, batch_size=4))  # three steps of two micro-batches
    reference = tiny_hf_model(kind)
    norms = _train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01), batches, 2,
                   clip=0.3)
    assert norms[0] > 0.3  # the clipping fires
    model = tiny_hf_model(kind)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), accumulation_steps=2,
                        max_grad_norm=0.3 if clipping == "max_grad_norm" else None, **SETTINGS[setting])
    _train(model, optimizer, batches, 2, clip=0.3 if clipping == "clip_grad_norm_" else None)
    assert optimizer.steps_taken == 3
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    assert not any(isinstance(m, ProjectedWeight) for m in model.modules())


def test_gradients_cross_during_the_last_micro_batch_backward() -> None:
    """With accumulation_steps, the last micro-batch's backward sends each gradient (before the step is called)."""
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), accumulation_steps=2, **LOSSLESS)
    sent: list[int] = []
    for slot in optimizer.slots:  # each slot's gradient crosses through its send
        slot.send = lambda *args, slot=slot, send=slot.send: (sent.append(id(slot)), send(*args))[1]
    batches = list(token_data(n=8, batch_size=4))
    lm_loss(model, batches[0]).backward()
    assert not sent  # the first micro-batch's gradients are not final
    lm_loss(model, batches[1]).backward()
    assert len(sent) == len(optimizer.slots)  # every one crossed during the last backward
    optimizer.step()
    optimizer.close()


def test_more_micro_batches_than_accumulation_steps_is_refused() -> None:
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), accumulation_steps=1, **LOSSLESS)
    batches = list(token_data(n=8, batch_size=4))
    lm_loss(model, batches[0]).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps"):
        lm_loss(model, batches[1]).backward()
    optimizer.close()


def _learned_run(steps: int, resume_from: dict[str, Any] | None = None) -> tuple[dict, dict, LoopOffloadOptimizer]:
    """Learned projectors on a tiny LLaMA: fitted before the first step, refit checks every 2 steps."""
    batches = list(token_data(n=64, batch_size=4))
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), rank=0.5, density=2,
                        min_dim=16, projectors="learned", refit_every=2, max_grad_norm=1.0)
    start = 0
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        optimizer.load_state_dict(resume_from["optimizer"])
        start = optimizer.steps_taken
    else:
        optimizer.fit_projectors(batches, lm_loss)
    for step in range(start, steps):
        if optimizer.refit_due:
            optimizer.fit_projectors(batches, lm_loss)
        lm_loss(model, batches[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict()}
    return params_of(model), state, optimizer


def test_learned_projectors_train_refit_and_resume_bit_for_bit() -> None:
    straight, _, optimizer = _learned_run(6)
    assert [record.initial for record in optimizer.fits] == [True, False, False]  # the first fit, checks at 2 and 4
    assert all(record.norm_ratios for record in optimizer.fits[:1])
    optimizer.close()
    _, halfway, first = _learned_run(3)
    first.close()
    resumed, _, second = _learned_run(6, resume_from=halfway)
    second.close()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    assert not torch.equal(straight["model.layers.0.self_attn.q_proj.weight"],
                           params_of(tiny_hf_model("llama"))["model.layers.0.self_attn.q_proj.weight"])


def test_unfitted_learned_projectors_are_said_at_the_first_step() -> None:
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), rank=0.5, min_dim=16, projectors="learned")
    lm_loss(model, next(iter(token_data(n=4)))).backward()
    with pytest.warns(UserWarning, match="fit_projectors"):
        optimizer.step()
    optimizer.close()


def test_random_projectors_the_default_are_never_fitted() -> None:
    """Fitting them would make them learned ones behind the setting's back: refused, with the fix."""
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), rank=0.5, min_dim=16)
    drawn = {layer.name: layer.proj_in.values.clone() for layer in optimizer.projected_layers}
    assert not optimizer.needs_first_fit and not optimizer.refit_due
    with pytest.raises(ValueError, match=r"projectors='random' \(the default\), which are never fitted\. Pass "
                                         r"projectors='learned' to offload\(\)"):
        optimizer.fit_projectors(token_data(n=8), lm_loss)
    assert all(torch.equal(layer.proj_in.values, drawn[layer.name]) for layer in optimizer.projected_layers)
    lm_loss(model, next(iter(token_data(n=4)))).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fit_projectors was not called" for projectors that are never fitted
        optimizer.step()
    optimizer.close()


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(strategy="meft"), "strategy='meft' is not a loop offload"),
    (dict(log_telemetry=False), "log_telemetry"),
    (dict(strategy="zero_offload", projection=True), "sets it itself"),
    (dict(strategy="zero_offload", rank=0.5), "rank=0.5"),
    (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0"),
    (dict(accumulation_steps=0), "accumulation_steps=0"),
    (dict(refit_every=-2), "refit_every=-2"),
    (dict(strategy="zero_offload", refit_every=10), "refit_every=10: nothing is projected"),
])
def test_bad_settings_are_named(arguments: dict[str, Any], message: str) -> None:
    model = tiny_hf_model("llama")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        projecting = {} if arguments.get("strategy") == "zero_offload" else {"min_dim": 16}
        offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **projecting, **arguments)
    # Refused before anything was set up: the model is as it was.
    assert not any(isinstance(m, ProjectedWeight) for m in model.modules())
    assert not model._forward_pre_hooks


def test_close_gives_the_model_back() -> None:
    model = tiny_hf_model("llama")
    before = params_of(model)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), rank=0.5, min_dim=16,
                        projectors="random")
    assert any(isinstance(m, ProjectedWeight) for m in model.modules()) or optimizer.projected_layers
    optimizer.close()
    optimizer.close()  # idempotent
    lm_loss(model, next(iter(token_data(n=4)))).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(p.grad is not None for p in model.parameters())  # plain autograd again: every weight has .grad
    assert params_of(model).keys() == before.keys()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_frozen_layer_left_in_the_optimizer_and_a_schedule_through_lr_0_equal_adamw(setting: str) -> None:
    """Users' patterns in a loop: a layer frozen but left in the optimizer stays put, and a schedule that reaches
    lr 0 mid-run (then rises again) steps as torch's AdamW does."""
    batches = list(token_data(n=16, batch_size=4))
    through_zero = [1.0, 0.0, 0.5, 1.0]

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: through_zero[min(step, 3)])
        for batch in batches:
            lm_loss(model, batch).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    def frozen_model() -> torch.nn.Module:
        model = tiny_hf_model("llama")
        model.model.layers[0].requires_grad_(False)
        return model

    reference = frozen_model()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01))
    model = frozen_model()
    start = params_of(model)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), **SETTINGS[setting])
    train(model, optimizer)
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
        if name.startswith("model.layers.0."):
            assert torch.equal(got[name], start[name]), name
