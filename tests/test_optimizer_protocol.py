"""The ``torch.optim.Optimizer`` protocol users and libraries call on the optimizer they train with, against torch's own
AdamW on a separate model: ``add_param_group`` mid-run (on the offload optimizer or on the user's own, whose groups it
shares), the step hooks (the instance's, the user's optimizer's, the global ones) and the state-dict hooks."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

from lightning_offload import offload, signed_permutation_projector
from tiny_modules import params_of, tiny_hf_model, token_data

LR = 3e-3
SETTINGS = {
    "zero": dict(strategy="zero_offload"),
    "lossless_lsp": dict(strategy="lsp_offload", rank=1.0, density=1, min_dim=16, projectors="random",
                         projector_factory=signed_permutation_projector, embeddings="host"),
}
STEPS, ADDED_AT = 5, 2


def _later_layer(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.model.layers[1].parameters())


def _train_adding_a_group(model: torch.nn.Module, offload_settings: dict | None, add_on: str) -> None:
    """The backbone-unfreezing habit in a loop: the last layer frozen at first, then unfrozen and added as a group of
    its own with its own learning rate and weight decay."""
    for p in _later_layer(model):
        p.requires_grad_(False)
    user = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    optimizer = user if offload_settings is None else offload(model, user, **offload_settings)
    for step, (ids,) in enumerate(token_data(n=4 * STEPS, batch_size=4)):
        if step == ADDED_AT:
            for p in _later_layer(model):
                p.requires_grad_(True)
            target = user if add_on == "user" else optimizer
            target.add_param_group({"params": _later_layer(model), "lr": LR / 3, "weight_decay": 0.1})
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if optimizer is not user:
        optimizer.close()


@pytest.mark.parametrize("add_on", ["offload", "user"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_a_param_group_added_mid_run_trains_as_under_torch(settings: str, add_on: str) -> None:
    reference = tiny_hf_model("llama")
    _train_adding_a_group(reference, None, add_on)
    model = tiny_hf_model("llama")
    _train_adding_a_group(model, SETTINGS[settings], add_on)
    got, want, initial = params_of(model), params_of(reference), params_of(tiny_hf_model("llama"))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    added = "model.layers.1.mlp.up_proj.weight"
    assert not torch.equal(got[added], initial[added])


def _count_hooks(optimizer: torch.optim.Optimizer, user: torch.optim.Optimizer, calls: Counter) -> list[Any]:
    """Every hook torch offers, counted; the state-dict post-hook adds a key, the load pre-hook removes it."""
    def count(name: str, returned: Any = None):
        def hook(*args: Any) -> Any:
            calls[name] += 1
            return returned(*args) if returned is not None else None
        return hook

    handles = [
        user.register_step_pre_hook(count("user_step_pre")),
        user.register_step_post_hook(count("user_step_post")),
        optimizer.register_step_pre_hook(count("step_pre")),
        optimizer.register_step_post_hook(count("step_post")),
        torch_optimizer.register_optimizer_step_pre_hook(count("global_step_pre")),
        torch_optimizer.register_optimizer_step_post_hook(count("global_step_post")),
        optimizer.register_state_dict_pre_hook(count("state_dict_pre")),
        optimizer.register_state_dict_post_hook(count("state_dict_post", lambda o, state: {**state, "mine": 1})),
        optimizer.register_load_state_dict_pre_hook(count("load_pre", lambda o, state: {
            k: v for k, v in state.items() if k != "mine"})),
        optimizer.register_load_state_dict_post_hook(count("load_post")),
    ]
    return handles


@pytest.mark.parametrize("settings", SETTINGS)
def test_every_optimizer_hook_runs_as_torch_runs_it(settings: str) -> None:
    counted = []
    for offload_settings in (None, SETTINGS[settings]):
        model = tiny_hf_model("llama")
        user = torch.optim.AdamW(model.parameters(), lr=LR)
        optimizer = user if offload_settings is None else offload(model, user, **offload_settings)
        calls: Counter = Counter()
        handles = _count_hooks(optimizer, user, calls)
        try:
            for (ids,) in token_data(n=12, batch_size=4):
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            state = optimizer.state_dict()
            assert state["mine"] == 1  # what the post-hook returned is the state dict
            optimizer.load_state_dict(state)  # the pre-hook took "mine" out again: loaded as it was saved
        finally:
            for handle in handles:
                handle.remove()
        if optimizer is not user:
            optimizer.close()
        counted.append(calls)
    assert counted[1] == counted[0]
    assert counted[0]["global_step_pre"] == 3 and counted[0]["state_dict_post"] == 1
