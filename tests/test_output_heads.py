"""The output head found in every model a user brings (lsp/output_heads.py), and the set-up saying what it projects.

A head projected by mistake trains worse and silently: PEFT's ``modules_to_save`` copy of ``lm_head`` and Lightning's
demo ``Transformer``'s ``decoder`` were projected under the defaults and ``head=`` changed nothing for them. Here each
is found, kept out of projection by default and placed by ``head=``; a PEFT model whose only large trainable layer is
its saved head then trains as torch's AdamW does, bit for bit; an explicit placement that finds nothing is a warning;
the set-up's log line and ``projected_names``/``projected_layers`` name what is projected.
"""

from __future__ import annotations

import copy
import logging
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn

import lightning_offload
from lightning_offload.lsp.output_heads import output_heads
from lightning_offload.lsp.targets import name_patterns
from lightning_offload.models.tiny import tiny_llama
from tiny_modules import TinyCausalLM, token_data, trainer

peft = pytest.importorskip("peft")


def _peft_model_saving_the_head() -> nn.Module:
    """A LoRA model of a small LLaMA (hidden 128: its head passes min_dim) whose ``lm_head`` is trained in full
    through ``modules_to_save``, as PEFT's docs recommend for new tokens."""
    base = tiny_llama(vocab_size=256, hidden=128, layers=2, intermediate=256, tie_word_embeddings=False)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    return peft.get_peft_model(base, config)


SAVED_HEAD = "base_model.model.lm_head.modules_to_save.default"


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 12), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------------------ PEFT's saved head
def test_the_trainable_copy_peft_saves_is_a_head_and_not_projected_by_default():
    model = _peft_model_saving_the_head()
    found = {head.name for head in output_heads(model).values()}
    assert SAVED_HEAD in found
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(_trainable(model), lr=1e-3))
    assert SAVED_HEAD not in optimizer.projected_names
    optimizer.close()


def test_a_peft_model_whose_only_large_layer_is_its_saved_head_trains_as_torch_adamw():
    # Nothing else is projectable (LoRA's factors are rank 4; the base is frozen), so with the head found every
    # parameter takes an exact host or device Adam: the run is torch's AdamW bit for bit (fp32). With the head
    # projected, as before, the losses parted at the second step.
    model = _peft_model_saving_the_head()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "found no layer to project": true, and the point here
        optimizer = lightning_offload.offload(model, torch.optim.AdamW(_trainable(model), lr=1e-2))
    losses = _train(model, optimizer)
    # torch's fused AdamW: the arithmetic the host Adam runs (the for-loop one rounds differently in the last bits).
    expected = _train(reference, torch.optim.AdamW(_trainable(reference), lr=1e-2, fused=True))
    assert losses == expected
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours, theirs), name
    optimizer.close()


@pytest.mark.parametrize("head", ["frozen", "projected", "device"])
def test_head_places_peft_s_saved_head(head):
    model = _peft_model_saving_the_head()
    saved = dict(model.named_modules())[SAVED_HEAD].weight
    before = saved.detach().clone()
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(_trainable(model), lr=1e-2), head=head)
    assert (SAVED_HEAD in optimizer.projected_names) == (head == "projected")
    _train(model, optimizer, steps=2)
    assert torch.equal(saved, before) == (head == "frozen")
    optimizer.close()
    assert saved.requires_grad  # a frozen head gets requires_grad back when the engine is closed


# --------------------------------------------------------------------------------------- Lightning's demo Transformer
def _demo_transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=500, ninp=160, nhead=2, nhid=160, nlayers=1, dropout=0.0)


def _demo_steps(model: Transformer, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        inputs = torch.randint(0, 500, (2, 8), generator=generator)
        target = torch.randint(0, 500, (2, 8), generator=generator)
        loss = nn.functional.nll_loss(model(inputs, target), target.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_the_demo_transformer_s_decoder_is_found_by_its_vocabulary_and_kept_out(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _demo_transformer()
    (head,) = output_heads(model).values()
    assert head.name == "decoder" and "embedding 'embedding'" in head.found_by
    with caplog.at_level(logging.INFO, logger="lightning_offload"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MultiheadAttention reads out_proj.weight directly: warned, and true
        optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert "decoder" not in optimizer.projected_names
    assert "transformer.encoder.layers.0.linear1" in optimizer.projected_names
    said = next(r.getMessage() for r in caplog.records if " projects " in r.getMessage())
    assert "transformer.encoder.layers.*.linear1" in said
    assert "Not projected: output head (maps 160 features to the 500 rows of embedding 'embedding'): decoder" in said
    optimizer.close()


@pytest.mark.parametrize("head", ["frozen", "projected"])
def test_head_places_the_demo_transformer_s_decoder(head):
    model = _demo_transformer()
    before = model.decoder.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2), head=head)
    assert ("decoder" in optimizer.projected_names) == (head == "projected")
    _demo_steps(model, optimizer)
    assert torch.equal(model.decoder.weight, before) == (head == "frozen")
    optimizer.close()


# ----------------------------------------------------------------------------------------------- by shape, any model
class PlainLM(nn.Module):
    """A hand-written LM whose vocabulary equals its width (every attention-like layer has the head's shape) and whose
    learned positions have the FFN's up-projection shape."""

    def __init__(self, vocabulary: int = 128, width: int = 128, positions: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"mix": nn.Linear(width, width), "up": nn.Linear(width, positions),
                           "down": nn.Linear(positions, width)}) for _ in range(layers))
        self.out = nn.Linear(width, vocabulary, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = h + block["mix"](h)
            h = h + block["down"](torch.relu(block["up"](h)))
        return self.out(h)


def test_a_plain_lm_s_head_is_found_among_layers_of_its_shape_and_no_ffn_is_taken_for_one():
    heads = {head.name for head in output_heads(PlainLM()).values()}
    assert heads == {"out"}


def test_a_layer_holding_an_embedding_s_weight_is_a_head():
    model = PlainLM()
    model.out.weight = model.tokens.weight  # tied, as GPT-2 and SmolLM2 are
    assert {head.name for head in output_heads(model).values()} == {"out"}


def test_a_model_with_no_head_has_none():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    assert output_heads(model) == {}


# ------------------------------------------------------------------------------ a placement that applies to nothing
def test_an_explicit_head_or_embeddings_that_finds_nothing_is_a_warning():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    with pytest.warns(UserWarning, match=r"head='frozen' found no trainable output head .* no effect"):
        lightning_offload.offload(model, torch.optim.AdamW(model.parameters()), head="frozen").close()
    with pytest.warns(UserWarning, match=r"embeddings='host' has no effect: the model has no trainable nn.Embedding"):
        lightning_offload.offload(model, torch.optim.AdamW(model.parameters()), embeddings="host").close()
    tied = tiny_llama(vocab_size=256, hidden=128, tie_word_embeddings=True)
    with pytest.warns(UserWarning, match=r"embeddings='sparse' has no effect: the model's trainable embedding "
                                         r"model.embed_tokens is tied to the output head and takes head=None"):
        lightning_offload.offload(tied, torch.optim.AdamW(tied.parameters()), embeddings="sparse").close()


def test_the_defaults_warn_of_nothing_on_a_model_without_a_head():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lightning_offload.offload(model, torch.optim.AdamW(model.parameters())).close()


# --------------------------------------------------------------------------------------------- what is projected, said
def test_the_names_of_the_projected_layers_in_every_face():
    model = tiny_llama(vocab_size=256, hidden=128, layers=2, intermediate=256, tie_word_embeddings=False)
    expected = [name for name, module in model.named_modules()
                if isinstance(module, nn.Linear) and name != "lm_head"]
    loop_model = copy.deepcopy(model)
    optimizer = lightning_offload.offload(loop_model, torch.optim.AdamW(loop_model.parameters()))
    assert optimizer.projected_names == expected
    optimizer.close()

    module = TinyCausalLM(copy.deepcopy(model))
    strategy = lightning_offload.LSPOffloadStrategy()
    trainer(strategy, max_steps=1).fit(module, token_data(n=8))
    assert list(strategy.projected_layers) == [f"model.{name}" for name in expected]

    fabric = L.Fabric(strategy="lsp_offload", accelerator="cpu", devices=1)
    fabric_model = copy.deepcopy(model)
    fabric.setup(fabric_model, torch.optim.AdamW(fabric_model.parameters()))
    assert list(fabric.strategy.projected_layers) == expected


def test_name_patterns_group_a_stack_s_layers():
    names = ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj", "lm_head"]
    assert name_patterns(names) == {"model.layers.*.mlp.up_proj": 2, "lm_head": 1}
