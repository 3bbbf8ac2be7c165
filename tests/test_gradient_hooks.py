"""Gradient hooks users and their tools register on parameters (``register_hook``,
``register_post_accumulate_grad_hook``, ``wandb.watch``): on every parameter with a full gradient they are called as
torch calls them, and the run equals torch's AdamW with the same hooks on a separate model; on a projected weight, which
has no full gradient, they are never called (never with ``None``) and a warning names the layer and the ways to get a
full gradient."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_offload import offload, signed_permutation_projector
from lightning_offload import ProjectedWeightHookWarning
from tiny_modules import params_of, tiny_hf_model, token_data

LR = 3e-3
PROJECTED = dict(strategy="lsp_offload", rank=0.5, density=2, min_dim=16)
LOSSLESS = dict(strategy="lsp_offload", rank=1.0, density=1, min_dim=16, projectors="random",
                projector_factory=signed_permutation_projector, embeddings="host")
PROJECTED_WEIGHT = "model.layers.0.mlp.up_proj"


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for (ids,) in list(token_data(n=4 * steps, batch_size=4)):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _shift_norm_gradients(model: torch.nn.Module) -> None:
    """A hook that changes training (Adam is blind to a scale, not to a shift): the final norm's weight's gradient
    shifted."""
    model.model.norm.weight.register_hook(lambda grad: grad + 1e-3)


@pytest.mark.parametrize("settings", [LOSSLESS, dict(strategy="zero_offload")], ids=["lossless_lsp", "zero"])
def test_a_hook_on_a_dense_parameter_equals_adamw_with_the_hook(settings: dict) -> None:
    reference = tiny_hf_model("llama")
    _shift_norm_gradients(reference)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01))
    unhooked = tiny_hf_model("llama")
    _train(unhooked, torch.optim.AdamW(unhooked.parameters(), lr=LR, weight_decay=0.01))
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), **settings)
    _shift_norm_gradients(model)
    _train(model, optimizer)
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.allclose(want["model.norm.weight"], params_of(unhooked)["model.norm.weight"])


def test_hooks_on_a_projected_weight_are_never_called_and_said_once() -> None:
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **PROJECTED)
    weight = model.get_submodule(PROJECTED_WEIGHT).weight
    calls: list[Any] = []
    weight.register_hook(lambda grad: grad * 2)  # a plain hook: would raise TypeError if handed None
    weight.register_hook(lambda grad: calls.append(grad))  # a None-tolerant one
    weight.register_post_accumulate_grad_hook(lambda param: calls.append(param.grad))
    dense_calls: list[torch.Tensor] = []
    model.model.norm.weight.register_post_accumulate_grad_hook(lambda param: dense_calls.append(param.grad))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, optimizer)
    optimizer.close()
    assert calls == []
    assert len(dense_calls) == 3 and all(grad is not None for grad in dense_calls)
    said = [w for w in caught if issubclass(w.category, ProjectedWeightHookWarning)]
    assert len(said) == 1  # once, though the layer ran three forwards
    message = str(said[0].message)
    assert f"3 gradient hook(s) registered on {PROJECTED_WEIGHT}.weight" in message
    assert f"exclude_modules=['{PROJECTED_WEIGHT}']" in message and "zero_offload" in message


def test_a_hook_registered_later_is_said_when_its_layer_next_runs() -> None:
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **PROJECTED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProjectedWeightHookWarning)
        _train(model, optimizer, steps=1)  # no hook of the user's yet: nothing said
    model.get_submodule(PROJECTED_WEIGHT).weight.register_post_accumulate_grad_hook(lambda param: None)
    with pytest.warns(ProjectedWeightHookWarning, match=r"1 gradient hook\(s\)"):
        _train(model, optimizer, steps=1)
    optimizer.close()


def test_wandb_watch_logs_the_gradients_that_exist(tmp_path: Any) -> None:
    """``wandb.watch(model, log="all")`` hooks every parameter: the projected weights' hooks are never called, the
    rest log as under torch, and the run trains."""
    wandb = pytest.importorskip("wandb")
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **PROJECTED)
    run = wandb.init(mode="offline", dir=str(tmp_path), project="hooks")
    try:
        wandb.watch(model, log="all", log_freq=1)
        before = params_of(model)
        with pytest.warns(ProjectedWeightHookWarning):
            _train(model, optimizer)
        optimizer.close()
    finally:
        run.finish()
    after = params_of(model)
    assert not torch.equal(before[f"{PROJECTED_WEIGHT}.weight"], after[f"{PROJECTED_WEIGHT}.weight"])
    assert not torch.equal(before["model.norm.weight"], after["model.norm.weight"])
