import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lightning_offload import ProjectedWeight, SparseProjector
from lightning_offload.lsp.kernels.selection import KernelSelector

#: The kernels a CPU can run (the native one where this machine has a C compiler; else the selector says so and uses
#: csr, which these tests then check twice).
CPU_KERNELS = ("csr", "dense", "native")


def _projectors(out_features, in_features, d_out=5, d_in=4, r=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (SparseProjector.random(out_features, d_out, r, generator=g),
            SparseProjector.random(in_features, d_in, r, generator=g))


def _math_weight(module):
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("make", [lambda: nn.Linear(12, 10), lambda: Conv1D(10, 12)], ids=["linear", "conv1d"])
def test_backward_yields_exact_compressed_gradient_and_no_weight_grad(make, kernel):
    torch.manual_seed(0)
    plain = make()
    projected = copy.deepcopy(plain)
    keys = list(projected.state_dict())
    a, b = _projectors(10, 12)
    layer = ProjectedWeight("layer", projected, a, b, KernelSelector(kernel, persist=False))
    assert list(projected.state_dict()) == keys

    x = torch.randn(3, 7, 12)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_plain, y_proj = plain(x1), projected(x2)
    torch.testing.assert_close(y_proj, y_plain)
    grad_out = torch.randn_like(y_plain)
    y_plain.backward(grad_out)
    y_proj.backward(grad_out)

    assert projected.weight.grad is None
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(projected.bias.grad, plain.bias.grad)
    full = _math_weight(plain).grad if not isinstance(plain, Conv1D) else plain.weight.grad.t()
    expected = a.to_dense() @ full @ b.to_dense().t()
    torch.testing.assert_close(layer.grad_buffer, expected)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_a_backward_run_inside_an_autocast_region_computes_what_one_outside_computes(kernel):
    # S is the engine's fp32 product of forward's dtypes: an autocast the loss's backward happens to run under (the
    # user's, around forward and backward both) must not round it to bf16.
    def compressed(backward_inside: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        module = nn.Linear(64, 48)
        a, b = _projectors(48, 64, 16, 16, 2)
        layer = ProjectedWeight("layer", module, a, b, KernelSelector(kernel, persist=False))
        x = torch.randn(4, 9, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module(x).float().square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return layer.grad_buffer, x.grad

    (s_inside, x_inside), (s_outside, x_outside) = compressed(True), compressed(False)
    assert s_inside.dtype == torch.float32
    assert torch.equal(s_inside, s_outside) and torch.equal(x_inside, x_outside)


def test_compressed_gradients_accumulate_across_backward_passes():
    torch.manual_seed(1)
    module = nn.Linear(8, 6, bias=False)
    a, b = _projectors(6, 8, 3, 3, 1)
    layer = ProjectedWeight("m", module, a, b)
    x1, x2 = torch.randn(4, 8), torch.randn(5, 8)
    module(x1).sum().backward()
    module(x2).sum().backward()
    g = torch.ones(9, 6).t() @ torch.cat([x1, x2])
    torch.testing.assert_close(layer.grad_buffer, a.to_dense() @ g @ b.to_dense().t())


def test_layer_without_trainable_input_still_produces_its_compressed_gradient():
    module = nn.Linear(8, 6, bias=False)
    layer = ProjectedWeight("m", module, *_projectors(6, 8))
    module(torch.randn(2, 8)).sum().backward()  # input needs no grad, no bias: only the projection needs backward
    assert layer.has_grad and layer.grad_buffer.abs().sum() > 0


@pytest.mark.parametrize("make", [lambda: nn.Linear(12, 10), lambda: Conv1D(10, 12)], ids=["linear", "conv1d"])
def test_apply_update_adds_the_expanded_update_with_decay(make):
    module = make()
    a, b = _projectors(10, 12)
    layer = ProjectedWeight("m", module, a, b)
    before = _math_weight(module).detach().clone()
    u = torch.randn(5, 4)
    layer.apply_update(u, decay=0.9, stochastic_generator=None)
    expected = before * 0.9 + a.to_dense().t() @ u @ b.to_dense()
    torch.testing.assert_close(_math_weight(module).detach(), expected)


def test_bf16_weights_receive_small_updates_on_average():
    torch.manual_seed(2)
    module = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.fill_(1.0)
    layer = ProjectedWeight("m", module, SparseProjector.signed_permutation(64), SparseProjector.signed_permutation(64))
    u = torch.full((64, 64), 1e-3)  # far below half a bf16 ulp of 1.0 (2^-8): nearest rounding keeps 1.0
    expected_total = layer.proj_out.to_dense().t() @ u @ layer.proj_in.to_dense()
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        layer.apply_update(u, 1.0, generator)
    drift = module.weight.float() - 1.0
    # Each element moved by ±0.02 in expectation (signs from the permutations); averages over the ~2048 elements
    # of each sign have a standard error of ~3e-4.
    for sign in (1.0, -1.0):
        mask = torch.sign(expected_total) == sign
        torch.testing.assert_close(drift[mask].mean(), torch.tensor(sign * 0.02), atol=2e-3, rtol=0)


def test_detach_restores_plain_forward():
    module = nn.Linear(4, 3)
    layer = ProjectedWeight("m", module, *_projectors(3, 4, 2, 2, 1))
    layer.detach()
    module(torch.randn(2, 4)).sum().backward()
    assert module.weight.grad is not None


def test_mismatched_projectors_are_refused():
    with pytest.raises(ValueError, match=r"must compress \(10, 12\)"):
        ProjectedWeight("m", nn.Linear(12, 10), *_projectors(12, 10))


@pytest.mark.parametrize("make", [lambda: nn.Linear(12, 10), lambda: Conv1D(10, 12)], ids=["linear", "conv1d"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_forwards_without_a_weight_gradient_compute_no_compressed_input(make, mode, monkeypatch):
    torch.manual_seed(0)
    projected = make()
    layer = ProjectedWeight("layer", projected, *_projectors(10, 12))
    x = torch.randn(3, 7, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer._original_forwards[id(projected)](x)  # the plain module's output, under bf16 autocast
    compressions = []
    real = KernelSelector.compress_tokens
    monkeypatch.setattr(KernelSelector, "compress_tokens",
                        lambda self, p, m: compressions.append(m.t().shape) or real(self, p, m))
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    if mode == "frozen":
        projected.weight.requires_grad_(False)
    with context() if context else torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = projected(x)
    assert compressions == []  # no B Xᵀ: nothing will ever use it
    assert torch.equal(out, expected)
    assert layer.open_backwards == 0 and not layer.has_grad
    # A training forward still keeps B Xᵀ (d_i × tokens).
    projected.weight.requires_grad_(True)
    projected(x).sum().backward()
    assert compressions[0] == (12, 21) and layer.has_grad


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("make", [lambda: nn.Linear(40, 30), lambda: Conv1D(30, 40)], ids=["linear", "conv1d"])
def test_fused_update_in_blocks_equals_the_dense_update_in_fp32(make, kernel, monkeypatch):
    import lightning_offload.lsp.kernels.candidates as candidates

    module = make()
    a, b = _projectors(30, 40, d_out=8, d_in=10, r=3)
    layer = ProjectedWeight("m", module, a, b, KernelSelector(kernel, persist=False))
    layer.update_scale = 1.7  # as a learned fit sets it
    before = _math_weight(module).detach().clone()
    u = torch.randn(8, 10)
    # 7 rows of 40 (or 30) per block where a kernel forms blocks: several blocks and a ragged last one.
    monkeypatch.setitem(candidates._UPDATE_BLOCK_ELEMENTS, "cpu", 7 * module.weight.shape[1])
    layer.apply_update(u, decay=0.95, stochastic_generator=None)
    expected = before * 0.95 + 1.7 * (a.to_dense().t() @ u @ b.to_dense())
    torch.testing.assert_close(_math_weight(module).detach(), expected)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_fused_bf16_update_is_unbiased_and_reproducible_from_the_saved_generator(kernel, monkeypatch):
    import lightning_offload.lsp.kernels.candidates as candidates

    monkeypatch.setitem(candidates._UPDATE_BLOCK_ELEMENTS, "cpu", 5 * 48)
    module = nn.Linear(48, 36, bias=False).to(torch.bfloat16)
    layer = ProjectedWeight("m", module, *_projectors(36, 48, d_out=12, d_in=16, r=3, seed=3),
                            KernelSelector(kernel, persist=False))
    start = module.weight.detach().clone()
    u = torch.randn(12, 16, generator=torch.Generator().manual_seed(4)) * 1e-3  # below half a bf16 ulp mostly
    exact = start.float() * 0.999 + layer.proj_out.to_dense().t() @ u @ layer.proj_in.to_dense()
    generator = torch.Generator().manual_seed(5)
    draws = []
    for _ in range(400):
        with torch.no_grad():
            module.weight.copy_(start)
        layer.apply_update(u, 0.999, generator)
        draws.append(module.weight.float().clone())
    mean = torch.stack(draws).mean(0)
    ulp = start.float().abs().clamp_min(1e-3) * 2.0**-7
    # Each draw is one of the two bf16 neighbours: the mean of 400 has a standard error below ulp/40.
    assert ((mean - exact).abs() <= ulp / 10).float().mean() > 0.99
    assert not torch.equal(draws[0], draws[1])  # the rounding is random, not nearest
    # Reproducible: the generator's state, saved and restored, replays the same rounding.
    state = generator.get_state()
    with torch.no_grad():
        module.weight.copy_(start)
    layer.apply_update(u, 0.999, generator)
    first = module.weight.detach().clone()
    generator.set_state(state)
    with torch.no_grad():
        module.weight.copy_(start)
    layer.apply_update(u, 0.999, generator)
    assert torch.equal(module.weight, first)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("make", [lambda: nn.Linear(24, 20), lambda: Conv1D(20, 24)], ids=["linear", "conv1d"])
def test_bf16_backward_gives_the_compressed_gradient_within_bf16_rounding(make, kernel):
    torch.manual_seed(3)
    module = make().to(torch.bfloat16)
    a, b = _projectors(20, 24, d_out=6, d_in=7, r=2)
    layer = ProjectedWeight("m", module, a, b, KernelSelector(kernel, persist=False))
    x = torch.randn(5, 9, 24).to(torch.bfloat16)
    grad_out = torch.randn(5, 9, 20).to(torch.bfloat16)
    module(x).backward(grad_out)
    # G = Δᵀ X from the bf16 values, in fp32: the projections read bf16 and accumulate in fp32.
    full = grad_out.reshape(-1, 20).float().t() @ x.reshape(-1, 24).float()
    expected = a.to_dense() @ full @ b.to_dense().t()
    assert layer.grad_buffer.dtype == torch.float32
    torch.testing.assert_close(layer.grad_buffer, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
