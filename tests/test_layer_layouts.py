"""Layer layouts (``lsp/layouts``): a projectable layer kind is one layout plus its registration.

Two layer kinds the package does not know, each registered here by one ``register_layout`` call and nothing else: a
plain module storing its weight ``in × out`` and an ``nn.Linear`` subclass storing it transposed (which the package's
own Linear layout would otherwise claim). Each trains under ``lsp_offload`` with lossless projectors exactly as torch's
AdamW on a separate model, trains as the same model made of ``nn.Linear`` layers under lossy projectors and under the
scaled rule, hands the gradient sampling its ``o × i`` gradient and is planned as a projected weight of its own layout.
The import paths of before the layouts keep working.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_offload import offload, random_projector, signed_permutation_projector
from lightning_offload.lsp.layouts import BUILT_IN, HF_CONV1D, LINEAR, LayerLayout, is_projectable, layout_of, \
    register_layout, registered_layouts, unregister_layout, weight_shape
from lightning_offload.lsp.linear import ProjectedWeight, is_hf_conv1d
from lightning_offload.lsp.output_heads import is_projectable as is_projectable_of_before
from lightning_offload.lsp.sampling import sample_gradients
from lightning_offload.planning.inventory import inventory
from lightning_offload.planning.plan import settings_for

LR, DECAY, STEPS = 1e-2, 0.1, 4
# The README's exact recipe; its embeddings="host" is left out: these models have no embedding to place.
LOSSLESS = dict(rank=1.0, density=1, min_dim=8, projectors="random", projector_factory=signed_permutation_projector)
LOSSY = dict(rank=0.5, density=2, min_dim=8, projectors="random")


class InputMajorLinear(nn.Module):
    """``y = x W + b`` with ``W`` stored ``in × out``: a layer class the package knows nothing of."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) / in_features ** 0.5)
        self.bias = nn.Parameter(torch.randn(out_features) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class TransposedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is stored transposed (``in × out``): the Linear layout would misread it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.weight = nn.Parameter(self.weight.detach().t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return flat.reshape(*x.shape[:-1], self.weight.shape[1])


INPUT_MAJOR = LayerLayout("InputMajorLinear", lambda module: isinstance(module, InputMajorLinear), transposed=True)
TRANSPOSED = LayerLayout("TransposedLinear", lambda module: isinstance(module, TransposedLinear), transposed=True)
TOYS = {"InputMajorLinear": InputMajorLinear, "TransposedLinear": TransposedLinear}


@pytest.fixture
def registered() -> Iterator[None]:
    """The two toy layouts registered for one test (the registry is the process's)."""
    register_layout(INPUT_MAJOR)
    register_layout(TRANSPOSED)
    try:
        yield
    finally:
        unregister_layout(TRANSPOSED)
        unregister_layout(INPUT_MAJOR)


def toy_model(layer: type[nn.Module], seed: int = 0) -> nn.Sequential:
    """Two toy layers (non-square, so an ``o``/``i`` mix-up cannot pass) and a plain Linear, all projected."""
    torch.manual_seed(seed)
    return nn.Sequential(layer(16, 24), nn.GELU(), layer(24, 12), nn.GELU(), nn.Linear(12, 8))


def as_linear(model: nn.Sequential) -> nn.Sequential:
    """The same function made of ``nn.Linear`` layers (each toy weight stored back as ``out × in``)."""
    plain = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 12), nn.GELU(), nn.Linear(12, 8))
    with torch.no_grad():
        for index in (0, 2, 4):
            toy, linear = model[index], plain[index]
            linear.weight.copy_(toy.weight if index == 4 else toy.weight.t())
            linear.bias.copy_(toy.bias)
    return plain


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 16, generator=generator), torch.randint(0, 8, (6,), generator=generator))
            for _ in range(steps)]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def math_weights(model: nn.Sequential) -> list[torch.Tensor]:
    """Each layer's ``o × i`` weight (its layout's view) and bias."""
    found = []
    for index in (0, 2, 4):
        layer = model[index]
        layout = layout_of(layer)
        found += [layout.math_view(layer.weight.detach()).clone(), layer.bias.detach().clone()]
    return found


def offloaded_run(model: nn.Module, **settings: object) -> list[str]:
    """Train ``model`` for :data:`STEPS` steps under ``lsp_offload``; returns the layouts of the projected layers."""
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), **settings)
    projected = []
    try:
        for step, batch in enumerate(batches()):
            loss_of(model, batch).backward()
            if step == 0:
                projected = [module._lsp_state.layout.name for module in model
                             if getattr(module, "_lsp_state", None) is not None]
                # A projected weight's gradient is made compressed: autograd never fills its .grad.
                assert all(module.weight.grad is None for module in model if hasattr(module, "_lsp_state"))
            optimizer.step()
            optimizer.zero_grad()
    finally:
        optimizer.close()
    return projected


@pytest.mark.parametrize("toy", list(TOYS))
def test_a_registered_layout_trains_with_lossless_projectors_as_adamw(toy: str, registered: None) -> None:
    reference = toy_model(TOYS[toy])
    model = copy.deepcopy(reference)
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=DECAY)
    for batch in batches():
        loss_of(reference, batch).backward()
        adamw.step()
        adamw.zero_grad()
    projected = offloaded_run(model, **LOSSLESS)
    assert projected == [toy, toy, "nn.Linear"]
    for got, want in zip(math_weights(model), math_weights(reference), strict=True):
        torch.testing.assert_close(got, want)
    assert not any(hasattr(module, "_lsp_state") for module in model)  # closing gave every module back


@pytest.mark.parametrize("update", ["projected", "scaled"])
@pytest.mark.parametrize("toy", list(TOYS))
def test_a_registered_layout_trains_as_the_same_model_of_linears(toy: str, update: str, registered: None) -> None:
    # Lossy projectors (and the scaled rule) are drawn per side of the o × i weight, so a layer that stores it
    # transposed gets the same projectors, gradients and updates as the nn.Linear holding the same weight.
    model = toy_model(TOYS[toy])
    plain = as_linear(model)
    # The scaled rule takes no sparse projectors' settings.
    settings = dict(LOSSY, update=update) if update == "projected" else dict(rank=0.5, min_dim=8, update=update)
    assert offloaded_run(model, **settings) == ([toy, toy, "nn.Linear"] if update == "projected" else [])
    offloaded_run(plain, **settings)
    changed = False
    for got, want, before in zip(math_weights(model), math_weights(plain), math_weights(toy_model(TOYS[toy])),
                                 strict=True):
        torch.testing.assert_close(got, want)
        changed |= not torch.equal(got, before)
    assert changed


def test_sampling_hands_a_registered_layout_s_gradient_in_the_o_by_i_layout(registered: None) -> None:
    model = toy_model(InputMajorLinear)
    reference = copy.deepcopy(model)
    loss_of(reference, batches(1)[0]).backward()
    generator = torch.Generator().manual_seed(0)
    layer = model[2]
    state = ProjectedWeight("2", layer, random_projector(12, 6, 2, generator, torch.device("cpu")),
                            random_projector(24, 12, 2, generator, torch.device("cpu")))
    seen = []
    try:
        with sample_gradients(model, [state], lambda _, grad: seen.append(grad.clone())):
            loss_of(model, batches(1)[0]).backward()
    finally:
        state.detach()
    (grad,) = seen
    assert grad.shape == (12, 24) and state.layout is INPUT_MAJOR
    torch.testing.assert_close(grad, reference[2].weight.grad.t())


def test_the_planner_counts_a_registered_layout_s_layers_as_projected(registered: None) -> None:
    model = toy_model(InputMajorLinear)
    found = inventory(model, settings_for("lsp_offload", dict(LOSSY)), None)
    projected = {entry.name: entry for entry in found.of("projected")}
    assert set(projected) == {"0.weight", "2.weight", "4.weight"}
    assert [projected[name].layout for name in ("0.weight", "2.weight", "4.weight")] == \
        [INPUT_MAJOR, INPUT_MAJOR, LINEAR]
    # Sized on the o × i weight, whatever its storage (stored 16 × 24: o = 24, i = 16).
    assert projected["0.weight"].shape == (16, 24) and projected["0.weight"].projector_sizes == (24, 16)
    assert projected["0.weight"].compressed == (12, 8)


def test_an_unregistered_layer_is_not_projectable_and_says_how_to_register() -> None:
    toy = InputMajorLinear(4, 6)
    assert layout_of(toy) is None and not is_projectable(toy)
    # Unregistered, an nn.Linear subclass is read as a Linear: its own layout must be registered to be read right.
    assert layout_of(TransposedLinear(4, 6)) is LINEAR
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(TypeError, match="register_layout"):
        ProjectedWeight("toy", toy, random_projector(6, 3, 1, generator, torch.device("cpu")),
                        random_projector(4, 2, 1, generator, torch.device("cpu")))
    with pytest.raises(TypeError, match="InputMajorLinear.*register_layout"):
        weight_shape(toy)


def test_registration_is_asked_first_and_is_undone(registered: None) -> None:
    assert layout_of(TransposedLinear(4, 6)) is TRANSPOSED and layout_of(nn.Linear(4, 6)) is LINEAR
    assert weight_shape(TransposedLinear(4, 6)) == (6, 4)
    assert registered_layouts()[:2] == (TRANSPOSED, INPUT_MAJOR)
    with pytest.raises(ValueError, match="'InputMajorLinear' is registered already"):
        register_layout(LayerLayout("InputMajorLinear", lambda module: False, transposed=False))
    with pytest.raises(ValueError, match="package's own"):
        unregister_layout(LINEAR)
    with pytest.raises(ValueError, match="not registered"):
        unregister_layout(LayerLayout("Nowhere", lambda module: False, transposed=False))


def test_the_built_in_layouts_and_the_names_of_before() -> None:
    transformers = pytest.importorskip("transformers")
    conv = transformers.pytorch_utils.Conv1D(6, 4)  # nf=6 outputs, nx=4 inputs: weight stored 4 × 6
    linear = nn.Linear(4, 6)
    assert BUILT_IN == (LINEAR, HF_CONV1D)
    assert layout_of(conv) is HF_CONV1D and layout_of(linear) is LINEAR and layout_of(nn.LayerNorm(4)) is None
    assert weight_shape(conv) == weight_shape(linear) == ProjectedWeight.weight_shape(conv) == (6, 4)
    assert is_hf_conv1d(conv) and not is_hf_conv1d(linear)
    assert is_projectable_of_before(conv) and is_projectable_of_before(linear) and not is_projectable_of_before(
        nn.Embedding(4, 6))
    x = torch.randn(3, 4)
    # Each layout's forward is its layer's product (the projected forward computes it so).
    torch.testing.assert_close(HF_CONV1D.forward(x, conv.weight, conv.bias), conv(x))
    torch.testing.assert_close(LINEAR.forward(x, linear.weight, linear.bias), linear(x))
    generator = torch.Generator().manual_seed(0)
    state = ProjectedWeight("conv", conv, random_projector(6, 3, 1, generator, torch.device("cpu")),
                            random_projector(4, 2, 1, generator, torch.device("cpu")))
    try:
        assert state.transposed and state.layout is HF_CONV1D
    finally:
        state.detach()
