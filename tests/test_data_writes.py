"""Writes into the weights through ``.data``, which move no version counter, kept as ``torch.optim`` keeps them: a clamp
of every parameter after each step (WGAN-style), a max-norm forward pre-hook writing ``w.data.copy_(...)``, and
``lm_head.weight.data.mul_(...)``, each against torch's AdamW doing the same on a separate model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_offload import offload, signed_permutation_projector
from tiny_modules import params_of, tiny_hf_model, token_data

LR = 3e-3
SETTINGS = {
    "zero": dict(strategy="zero_offload"),
    "zero_sync": dict(strategy="zero_offload", pipelined=False),
    "lossless_lsp": dict(strategy="lsp_offload", rank=1.0, density=1, min_dim=16, projectors="random",
                         projector_factory=signed_permutation_projector, embeddings="host"),
}
CLAMP = 0.02  # under most of the tiny LLaMA's initial weights' magnitudes: the clamp changes them at every step


def _clamp_every_parameter(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-CLAMP, CLAMP)


def _shrink_the_head(model: torch.nn.Module) -> None:
    model.lm_head.weight.data.mul_(0.9)


def _max_norm_pre_hook(model: torch.nn.Module) -> None:
    """Rows of the first MLP's down projection renormalised to norm ≤ 0.1 before each forward (a max-norm constraint,
    the way torch.nn.utils.parametrize-less code writes it)."""
    module = model.model.layers[0].mlp.down_proj

    def renormalise(module: torch.nn.Module, args: tuple) -> None:
        w = module.weight
        w.data.copy_(torch.renorm(w.data, p=2, dim=0, maxnorm=0.1))

    module.register_forward_pre_hook(renormalise)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, after_step: Callable | None) -> None:
    for (ids,) in token_data(n=16, batch_size=4):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(model)


HABITS = {"clamp": (_clamp_every_parameter, None), "head": (_shrink_the_head, None),
          "max_norm_hook": (None, _max_norm_pre_hook)}


@pytest.mark.parametrize("habit", HABITS)
@pytest.mark.parametrize("settings", SETTINGS)
def test_a_write_through_data_is_kept_as_torch_keeps_it(settings: str, habit: str) -> None:
    after_step, install = HABITS[habit]
    reference, plain = tiny_hf_model("llama"), tiny_hf_model("llama")
    if install is not None:
        install(reference)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01), after_step)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01), None)
    model = tiny_hf_model("llama")
    if install is not None:
        install(model)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), **SETTINGS[settings])
    _train(model, optimizer, after_step)
    optimizer.close()
    got, want, without = params_of(model), params_of(reference), params_of(plain)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    assert any(not torch.allclose(want[name], without[name]) for name in want)  # the habit changed the training


def test_the_fingerprint_sees_any_one_element_changed() -> None:
    from lightning_offload.engine.slots.weight_fingerprint import fingerprint

    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}
    for dtype, int_dtype in ints.items():
        for shape in ((33, 7), (32, 8)):  # odd and even counts: 16-bit elements are summed in pairs where they can be
            weights = torch.randn(shape).to(dtype)
            before = fingerprint(weights)
            assert torch.equal(fingerprint(weights.clone()), before)
            for index in (0, 100, weights.numel() - 1):
                for bit in (0, torch.iinfo(int_dtype).bits - 2):  # the lowest mantissa bit, the top exponent bit
                    changed = weights.clone()
                    changed.view(-1).view(int_dtype)[index] ^= 1 << bit
                    assert not torch.equal(fingerprint(changed), before), (dtype, shape, index, bit)


@pytest.mark.parametrize("through_data", [True, False], ids=["data", "in_place"])
def test_a_write_after_a_read_of_a_row_sparse_embedding_keeps_what_was_read(through_data: bool) -> None:
    """A read of a row-sparse embedding shows AdamW's weights (idle rows with their owed decay paid); a write made on
    what was read stands: at lr 0 (AdamW moves nothing) the next step leaves exactly the written values."""
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1),
                        strategy="zero_offload", embeddings="sparse")
    batches = [ids for (ids,) in token_data(n=16, batch_size=4)]
    for ids in batches[:3]:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    idle = torch.ones(model.config.vocab_size, dtype=torch.bool)
    idle[batches[2].unique()] = False
    assert idle.any()  # rows the last step did not touch: they owe decay, which the read shows
    weight = model.model.embed_tokens.weight  # a read through the model
    shown = weight.detach().clone()
    if through_data:
        weight.data.mul_(0.9)
    else:
        with torch.no_grad():
            weight.mul_(0.9)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    model(input_ids=batches[3], labels=batches[3]).loss.backward()
    optimizer.step()
    optimizer.close()
    assert torch.equal(model.model.embed_tokens.weight.detach(), shown * 0.9)


@pytest.mark.parametrize("through_data", [True, False], ids=["data", "in_place"])
def test_a_write_into_a_bf16_weight_the_device_adam_steps_stands(through_data: bool) -> None:
    """Under bf16 weights the device Adam keeps an fp32 master beside each weight it steps (vectors, and an embedding
    placed on the device); a write into the weight between steps stands as under torch.optim: at lr 0 (AdamW moves
    nothing) the next step leaves exactly the written values, not the master's."""
    model = tiny_hf_model("llama").to(torch.bfloat16)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1),
                        strategy="zero_offload", embeddings="device", vectors="device")
    batches = [ids for (ids,) in token_data(n=12, batch_size=4)]
    for ids in batches[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    written = {"norm": model.model.layers[0].input_layernorm.weight, "embedding": model.model.embed_tokens.weight}
    for weight in written.values():
        if through_data:
            weight.data.mul_(0.5)
        else:
            with torch.no_grad():
                weight.mul_(0.5)
    wanted = {name: weight.detach().clone() for name, weight in written.items()}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    model(input_ids=batches[2], labels=batches[2]).loss.backward()
    optimizer.step()
    optimizer.close()
    for name, weight in written.items():
        assert torch.equal(weight.detach(), wanted[name]), name
