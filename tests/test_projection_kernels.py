"""The projection kernels (lsp/kernels/): each against the dense torch product, the native build's check at load, and
the selection that times them on this device and keeps the choice."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_offload.lsp.kernels import build, checks, reference
from lightning_offload.lsp.kernels import native as native_module
from lightning_offload.lsp.kernels import selection as selection_module
from lightning_offload.lsp.kernels.candidates import KERNELS
from lightning_offload.lsp.kernels.native import native_projection
from lightning_offload.lsp.kernels.selection import KernelSelector, kernel_choices
from lightning_offload.lsp.projector import SparseProjector

CPU_KERNELS = ("csr", "dense", "native")


@pytest.fixture
def isolated_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of kernel choices (and built kernels) for one test."""
    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    return tmp_path


def _projector(n: int, d: int, r: int, seed: int, index_dtype: torch.dtype = torch.int16) -> SparseProjector:
    indices, values = checks.random_projector(n, d, r, torch.Generator().manual_seed(seed), index_dtype)
    return SparseProjector(indices, values, d)


def _kernel(name: str):  # noqa: ANN202
    kernel = KERNELS[name]
    if not kernel.applies(torch.device("cpu")):
        pytest.skip(f"the {name} kernel cannot run here (no C compiler?)")
    return kernel


# (tokens, n, d, r): tails of the native kernel's 32-token tiles and 16-feature blocks, r = 1, a wide d.
SHAPES = [(37, 53, 19, 3), (64, 128, 32, 8), (5, 40, 40, 1), (70, 33, 64, 16), (33, 300, 75, 8)]


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_kernel_compresses_tokens_as_the_dense_product(name: str, shape: tuple, dtype: torch.dtype) -> None:
    tokens, n, d, r = shape
    projector = _projector(n, d, r, seed=tokens, index_dtype=torch.int32 if n > 200 else torch.int16)
    # A view of wider rows, as a slice of an activation is: the kernels read the row stride.
    x = torch.randn(tokens, n + 5, generator=torch.Generator().manual_seed(1)).to(dtype)[:, 2:n + 2]
    got = _kernel(name).compress_tokens(projector, x)
    want = reference.compress_tokens(projector.indices, projector.values, d, x)
    assert got.dtype == torch.float32 and got.shape == (d, tokens)
    assert checks.close(got, want, n * r)
    assert not checks.close(got, want * 1.01, n * r)  # the tolerance is rounding, not 1%


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_each_kernel_expands_columns_as_the_dense_product(name: str, shape: tuple) -> None:
    rows, n, d, r = shape
    projector = _projector(n, d, r, seed=rows)
    matrix = torch.randn(rows, d, generator=torch.Generator().manual_seed(2))
    for operand in (matrix, matrix.t().contiguous().t()):  # U itself, and Uᵀ's transposed view (Conv1D's U A)
        got = _kernel(name).expand_columns(projector, operand)
        assert got.shape == (rows, n) and got.is_contiguous()
        assert checks.close(got, reference.expand_columns(projector.indices, projector.values, d, matrix), r)


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("decay", [1.0, 0.97])
def test_each_kernel_updates_fp32_rows_with_decay_as_the_dense_update(name: str, shape: tuple, decay: float) -> None:
    cols, rows, d, r = shape
    projector = _projector(rows, d, r, seed=cols)
    generator = torch.Generator().manual_seed(3)
    weight, half = torch.randn(rows, cols, generator=generator), torch.randn(d, cols, generator=generator) * 1e-2
    want = reference.updated_rows(weight, projector.indices, projector.values, half, decay)
    _kernel(name).update_rows_(weight, projector, half, decay, None)
    assert checks.close(weight, want, r + 2)


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_lossless_projectors_update_exactly_as_decay_then_add(name: str) -> None:
    # Signed permutations (r = 1, values ±1): one exact term per element, then W·decay and + in two roundings, as
    # torch's W.mul_(decay).add_(delta): what keeps lossless lsp_offload equal to AdamW bit for bit.
    projector = SparseProjector.signed_permutation(48, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(4)
    weight, half = torch.randn(48, 40, generator=generator), torch.randn(48, 40, generator=generator) * 1e-3
    want = weight.clone().mul_(0.999).add_(projector.to_dense().t() @ half)
    _kernel(name).update_rows_(weight, projector, half, 0.999, None)
    assert torch.equal(weight, want)


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_bf16_rows_round_stochastically_without_bias(name: str) -> None:
    projector = _projector(64, 16, 4, seed=5)
    start = torch.full((64, 256), 1.0).to(torch.bfloat16)
    # An update a quarter of a bf16 step (2⁻⁷ at 1.0) above 1.0 everywhere: U with P^T half = 2⁻⁹.
    dense = reference.dense_projector(projector.indices, projector.values, 16)
    half = torch.linalg.lstsq(dense.t(), torch.full((64, 256), 2.0**-9)).solution
    exact = reference.updated_rows(start, projector.indices, projector.values, half, 1.0)
    generator = torch.Generator().manual_seed(6)
    weight = start.clone()
    _kernel(name).update_rows_(weight, projector, half, 1.0, generator)
    assert bool(checks.bf16_neighbours(weight, exact).all())
    up = (weight.float() > 1.0).float().mean().item()
    expected = ((exact - 1.0) / 2.0**-7).clamp(0, 1).mean().item()  # ~0.25
    sigma = (expected * (1 - expected) / weight.numel()) ** 0.5
    assert abs(up - expected) < 4 * sigma + 1e-3
    again = start.clone()
    _kernel(name).update_rows_(again, projector, half, 1.0, torch.Generator().manual_seed(6))
    assert torch.equal(again, weight)  # the generator's state replays the rounding


def test_the_native_kernels_are_checked_at_load_and_refused_when_they_differ(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    kernels = native_projection()
    if kernels is None:
        pytest.skip("no native kernels on this machine")
    assert checks.check_kernels(kernels) == ""
    real = kernels.compress_tokens

    def off_by_a_lot(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        out.view(-1)[0] += 1e-3 * (out.abs().max() + 1)
        return out

    monkeypatch.setattr(kernels, "compress_tokens", off_by_a_lot)
    assert checks.check_kernels(kernels).startswith("compress_tokens differs")
    monkeypatch.setattr("lightning_offload.lsp.kernels.checks.check_kernels", lambda _: "compress_tokens differs")
    native_projection.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_offload"):
            assert native_projection() is None
        assert "do not match torch's products on this machine (compress_tokens differs)" in caplog.text
        assert not KERNELS["native"].applies(torch.device("cpu"))
    finally:
        native_projection.cache_clear()


def test_the_native_kernels_load_under_a_bf16_default_dtype() -> None:
    """Lightning's ``bf16-true`` runs the training step with torch's default dtype set to bf16, and the kernels load at
    their first product there: their checks build their operands in fp32 whatever the default (they once built them
    in bf16, failed, and left a bf16-true run on torch's kernels; the row Adam's check overran its buffers)."""
    if native_projection() is None:
        pytest.skip("no native kernels on this machine")
    code = ("import torch; torch.set_default_dtype(torch.bfloat16)\n"
            "from lightning_offload.lsp.kernels.native import native_projection\n"
            "from lightning_offload.engine.rows.native_row_adam import native_row_adam\n"
            "print(native_projection() is not None, native_row_adam() is not None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stderr[-2000:]


def test_an_operand_the_c_code_would_misread_is_refused() -> None:
    kernels = native_projection()
    if kernels is None:
        pytest.skip("no native kernels on this machine")
    indices, values = checks.random_projector(32, 8, 2, torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="matrix_t .*torch.float32; got torch.bfloat16"):
        kernels.expand_columns(indices, values, 8, torch.zeros(8, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="weight as a contiguous CPU tensor"):
        kernels.update_rows_(torch.zeros(4, 32).t(), indices, values, torch.zeros(8, 4), 1.0, None)
    with pytest.raises(TypeError, match="values"):
        kernels.compress_tokens(indices, values.double(), 8, torch.zeros(4, 32))


def test_without_a_compiler_there_is_no_native_kernel_and_it_is_said(
        isolated_choices: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(isolated_choices / "empty"))
    monkeypatch.delenv("CC", raising=False)
    native_projection.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="lightning_offload"):
            assert native_projection() is None
            with pytest.warns(UserWarning, match="kernels='native' cannot run on cpu here"):
                selector = KernelSelector("native", persist=False)
                selector.compress_tokens(_projector(32, 8, 2, 0), torch.randn(4, 32))
        assert selector.summary() == {"compress_tokens n=32 d=8 r=2 T=4 float32 cpu": "csr"}
        assert "not available (no C compiler found" in caplog.text
    finally:
        native_projection.cache_clear()
    assert native_module.SOURCE.is_file()


def test_auto_times_every_kernel_that_applies_and_keeps_the_fastest(
        isolated_choices: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    timed: list[str] = []
    real = selection_module._time_kernels

    def spy(kernels, device, call):  # noqa: ANN001, ANN202
        timed.extend(kernel.name for kernel in kernels)
        return real(kernels, device, call)

    monkeypatch.setattr(selection_module, "_time_kernels", spy)
    projector, x = _projector(256, 64, 8, 0), torch.randn(256, 256)
    selector = KernelSelector("auto")
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        out = selector.compress_tokens(projector, x)
        selector.compress_tokens(projector, x)  # the same product: not timed again
    applicable = [k for k in CPU_KERNELS if KERNELS[k].applies(torch.device("cpu"))]
    assert timed == applicable
    choice = selector.choices["compress_tokens n=256 d=64 r=8 T=256 float32 cpu"]
    assert choice.how == "timed" and set(choice.milliseconds) == set(applicable)
    assert choice.kernel == min(choice.milliseconds, key=choice.milliseconds.get)
    assert f"-> {choice.kernel}" in caplog.text and sum(selector.products.values()) == 1
    assert checks.close(out, reference.compress_tokens(projector.indices, projector.values, 64, x), 256 * 8)
    # Kept on disk for this machine: a new selector (a later run) takes it without timing.
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    timed.clear()
    later = KernelSelector("auto")
    later.compress_tokens(projector, x)
    assert timed == [] and later.choices[next(iter(later.choices))].how == "cached"
    assert later.summary() == selector.summary()
    # With its time (what a plan predicts the product by: planning/projection_time.py).
    key = "compress_tokens n=256 d=64 r=8 T=256 float32 cpu"
    assert later.milliseconds(key) == selector.milliseconds(key) == choice.milliseconds[choice.kernel]
    assert (isolated_choices / "kernels" / "choices.json").is_file()


def test_timing_an_update_changes_neither_the_weight_nor_its_rounding(isolated_choices: Path) -> None:
    projector = _projector(64, 16, 4, seed=7)
    half = torch.randn(16, 48, generator=torch.Generator().manual_seed(8)) * 1e-3
    start = torch.randn(64, 48, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    results = []
    for selector in (KernelSelector("auto"), KernelSelector("auto")):  # timed first, then read from the choices
        weight, generator = start.clone(), torch.Generator().manual_seed(10)
        selector.update_rows_(weight, projector, half, 0.99, generator)
        results.append((weight, generator.get_state(), selector.choices["update_rows rows=64 cols=48 d=16 r=4 "
                                                                        "bfloat16 cpu"]))
    assert [choice.how for _, _, choice in results] == ["timed", "cached"]
    weight, generator = start.clone(), torch.Generator().manual_seed(10)
    KERNELS[results[0][2].kernel].update_rows_(weight, projector, half, 0.99, generator)  # once, with no timing
    for got, state, _ in results:
        assert torch.equal(got, weight) and torch.equal(state, generator.get_state())


def test_a_bad_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kernels='fast' is not a kernel policy; use one of auto, csr, dense"):
        KernelSelector("fast")


def test_kernel_choices_gather_every_projected_layers_products() -> None:
    selector = KernelSelector("csr", persist=False)
    selector.compress_tokens(_projector(32, 8, 2, 0), torch.randn(4, 32))

    class Layer:
        kernels = selector

    assert kernel_choices([Layer(), object()]) == {"compress_tokens n=32 d=8 r=2 T=4 float32 cpu": "csr"}
    assert selector.choices["compress_tokens n=32 d=8 r=2 T=4 float32 cpu"].how == "forced"


def test_a_changed_kernel_is_timed_anew(isolated_choices: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The choices kept on disk belong to the kernels' sources they were timed with: another version times again.
    projector, x = _projector(64, 16, 4, seed=3), torch.randn(32, 64)
    KernelSelector("auto").compress_tokens(projector, x)
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    kept = KernelSelector("auto")
    kept.compress_tokens(projector, x)
    assert [choice.how for choice in kept.choices.values()] == ["cached"]
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    monkeypatch.setattr(selection_module, "_kernel_sources", lambda: "another")
    changed = KernelSelector("auto")
    changed.compress_tokens(projector, x)
    assert [choice.how for choice in changed.choices.values()] == ["timed"]


def test_the_avx2_build_gives_the_avx512_build_s_bits(tmp_path: Path) -> None:
    # A CPU without AVX-512 builds the kernels with 8-float tiles (TILE): the load-time check must pass there too, and
    # every sum adds in the same order, so the results are the same bits as this machine's build.
    kernels = native_projection()
    features = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if kernels is None or " avx2" not in features or " avx512f" not in features:
        pytest.skip("needs native kernels built for AVX-512 and a CPU that also runs AVX2 code")
    library = tmp_path / "projection_avx2.so"
    subprocess.run([build.compiler(), *native_module._FLAGS, "-march=haswell", "-Wno-psabi", str(native_module.SOURCE),
                    "-o", str(library)], check=True, capture_output=True)
    avx2 = native_module.NativeProjection(ctypes.CDLL(str(library)), library)
    assert checks.check_kernels(avx2) == ""
    projector = _projector(300, 75, 8, seed=5, index_dtype=torch.int32)
    x = torch.randn(70, 300, generator=torch.Generator().manual_seed(6))
    half = torch.randn(75, 45, generator=torch.Generator().manual_seed(7))
    assert torch.equal(avx2.compress_tokens(projector.indices, projector.values, 75, x),
                       kernels.compress_tokens(projector.indices, projector.values, 75, x))
    weights = [torch.randn(300, 45, generator=torch.Generator().manual_seed(8)) for _ in range(2)]
    avx2.update_rows_(weights[0], projector.indices, projector.values, half, 0.99, None)
    kernels.update_rows_(weights[1], projector.indices, projector.values, half, 0.99, None)
    assert torch.equal(*weights)
    small = torch.randn(75, 37, generator=torch.Generator().manual_seed(9))
    assert torch.equal(avx2.expand_columns(projector.indices, projector.values, 75, small),
                       kernels.expand_columns(projector.indices, projector.values, 75, small))


def test_a_product_of_a_dtype_a_kernel_does_not_take_is_never_given_to_it(isolated_choices: Path) -> None:
    """The native kernels read fp32 or bf16 operands only: an fp64 product (a model in ``.double()``) is timed among
    the kernels that take it, and forcing native gives that product torch's CSR, said, while fp32 keeps native."""
    projector = _projector(64, 16, 2, 0)
    x = torch.randn(8, 64, dtype=torch.float64)
    for policy in ("auto", "native"):
        selector = KernelSelector(policy, persist=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = selector.compress_tokens(projector, x)
        want = reference.compress_tokens(projector.indices, projector.values, 16, x).double()  # summed in fp32
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        chosen = selector.summary()["compress_tokens n=64 d=16 r=2 T=8 float64 cpu"]
        assert chosen != "native"
        assert (policy == "native") == any("does not take torch.float64" in str(w.message) for w in caught)
        if policy == "native" and KERNELS["native"].applies(torch.device("cpu")):
            selector.compress_tokens(projector, x.float())
            assert selector.summary()["compress_tokens n=64 d=16 r=2 T=8 float32 cpu"] == "native"
