"""The Triton kernels of :mod:`lightning_offload.lsp.kernels.triton_projection` against dense torch references.

On a machine without CUDA they run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), so shapes stay
tiny; with CUDA they run compiled on the GPU. References are dense and in float64 on the CPU, so the bound each
product is held to is the fp32 rounding of a sum in some order: ``1e-5`` of the sum of its terms' magnitudes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

_CUDA = torch.cuda.is_available()
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")


def _set_interpret(value: str | None) -> None:
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value


# Triton 3.9 picks interpreted or compiled when a function is jit-decorated, and decorates its own helpers
# (tl.randint, used by one check below) when triton is imported: so the variable is set before that import. The kernels
# under test are decorated on first call, so the fixture below setting it again for this module's tests is what they
# need; it is taken back in between so that other modules' tests run as they would without this one.
if not _CUDA:
    _set_interpret("1")
try:
    triton = pytest.importorskip("triton")
    import triton.language as tl
finally:
    _set_interpret(_INTERPRET_BEFORE)

from lightning_offload.lsp.kernels import triton_projection as tp  # noqa: E402

DEVICE = torch.device("cuda" if _CUDA else "cpu")
#: A sum of k fp32 terms, in any order, is off the exact sum by at most about k · 2⁻²⁴ times the sum of the terms'
#: magnitudes. The sums here have a few dozen terms at most, so 1e-5 of that magnitude bounds any order's rounding,
#: while a wrong product misses it by orders of magnitude.
RTOL = 1e-5
BF16_MAX = torch.finfo(torch.bfloat16).max


@pytest.fixture(autouse=True, scope="module")
def _interpreter() -> Iterator[None]:
    """This module's tests run interpreted on a machine without CUDA, compiled on one with it."""
    if not _CUDA:
        _set_interpret("1")
    yield
    _set_interpret(_INTERPRET_BEFORE)


# ---------------------------------------------------------------------------------------------------- helpers


def _projector(n: int, d: int, r: int, index_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random indices (distinct and ascending per column) and normal values, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.rand(n, d, generator=gen).topk(r, dim=1).indices.sort(dim=1).values.to(index_dtype)
    return indices, torch.randn(n, r, generator=gen)


def _dense(indices: torch.Tensor, values: torch.Tensor, d: int) -> torch.Tensor:
    """``P`` densely, float64: ``P[indices[j, s], j] = values[j, s]``."""
    n = indices.shape[0]
    dense = torch.zeros(d, n, dtype=torch.float64)
    dense[indices.long(), torch.arange(n).unsqueeze(1).expand_as(indices)] = values.double()
    return dense


def _assert_within(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """``out`` (fp32, any device) equals float64 ``ref`` up to ``RTOL`` of ``magnitude``, elementwise."""
    assert out.dtype == torch.float32 and out.shape == ref.shape and out.is_contiguous()
    error = (out.cpu().double() - ref).abs()
    bound = RTOL * magnitude
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (
        f"{int((error > bound).sum())} of {error.numel()} elements off; worst {error.flatten()[worst]:.3g} against a "
        f"bound of {bound.flatten()[worst]:.3g}")


def _bits(bf16: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's 16-bit patterns, as int32 in [0, 2¹⁶), on the CPU."""
    return bf16.cpu().view(torch.int16).int() & 0xFFFF


def _philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 as Random123 specifies it (Salmon et al., SC'11), in Python integers."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_ in range(10):
        if round_:  # the key is bumped between rounds
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
    return c0, c1, c2, c3


def _stream(seed: int, offset: int) -> int:
    """The uint32 ``tl.randint(seed, offset)`` draws: counter (offset's halves, 0, 0), key (seed's halves)."""
    return _philox4x32_10((offset & 0xFFFFFFFF, offset >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))[0]


def _reference_stochastic(new: torch.Tensor, seed: int) -> torch.Tensor:
    """The bf16 bits the kernel must store for fp32 ``new`` (rows × cols, contiguous): the element's flat index is the
    random stream's counter; carries into inf/NaN and NaN inputs round to nearest."""
    flat = new.cpu().contiguous().flatten()
    bits = (flat.view(torch.int32).long() & 0xFFFFFFFF).tolist()
    nearest = _bits(flat.to(torch.bfloat16)).tolist()
    out = []
    for index, (pattern, value, fallback) in enumerate(zip(bits, flat.tolist(), nearest, strict=True)):
        rounded = ((pattern + (_stream(seed, index) & 0xFFFF)) & 0xFFFFFFFF) >> 16
        out.append(fallback if (rounded & 0x7F80) == 0x7F80 or math.isnan(value) else rounded)
    return torch.tensor(out, dtype=torch.int32).view(new.shape)


def _exact_update_case(rows: int, cols: int, d: int, r: int, index_dtype: torch.dtype, seed: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """An update whose fp32 ``new`` is exact in any summation order (with or without fused multiply-adds): weights
    are multiples of 2⁻⁸ below 1, decay 0.75, values ±¼ or ±½, ``half`` multiples of 2⁻¹² up to 1 — so ``new`` is a
    multiple of 2⁻¹⁴ below 9, 18 significant bits. Returns weight (bf16), indices, values, half, decay, new (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randint(-255, 256, (rows, cols), generator=gen) / 256).to(torch.bfloat16)
    indices = torch.rand(rows, d, generator=gen).topk(r, dim=1).indices.sort(dim=1).values.to(index_dtype)
    values = torch.tensor([-0.5, -0.25, 0.25, 0.5])[torch.randint(0, 4, (rows, r), generator=gen)]
    half = torch.randint(-4096, 4097, (d, cols), generator=gen) / 4096
    decay = 0.75
    exact = weight.double() * decay + _dense(indices, values, d).t() @ half.double()
    new = exact.float()
    assert torch.equal(new.double(), exact)  # the premise: fp32 holds new exactly
    return weight, indices, values, half, decay, new


def _on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE, copy=True) for t in tensors]  # a copy on the CPU too: targets are written


# -------------------------------------------------------------------------------------------------- available


def test_available_here() -> None:
    assert tp.available()


def test_the_module_imports_without_triton() -> None:
    code = ("import sys\nsys.modules['triton'] = None  # makes `import triton` raise ImportError\n"
            "from lightning_offload.lsp.kernels import triton_projection\nprint(triton_projection.available())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- compress_tokens

#: (T, n, d, r): single elements; tails in every dimension; several d-, T- and n-blocks (64, 64, 32); r = 1 and 16;
#: a d of thousands.
COMPRESS_SHAPES = [(1, 1, 1, 1), (17, 50, 37, 1), (40, 96, 48, 16), (70, 33, 130, 5), (4, 20, 2000, 2)]


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "n", "d", "r"), COMPRESS_SHAPES)
def test_compress_tokens_matches_dense(tokens: int, n: int, d: int, r: int, x_dtype: torch.dtype,
                                       index_dtype: torch.dtype) -> None:
    indices, values = _projector(n, d, r, index_dtype, seed=tokens + n + d + r)
    x = torch.randn(tokens, n, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    out = tp.compress_tokens(*_on(indices, values), d, x.to(DEVICE))
    dense = _dense(indices, values, d)
    assert out.device.type == DEVICE.type
    _assert_within(out, dense @ x.double().t(), dense.abs() @ x.double().abs().t())


def test_compress_tokens_reads_rows_longer_than_n() -> None:
    indices, values = _projector(45, 20, 3, torch.int32, seed=5)
    wide = torch.randn(30, 64, generator=torch.Generator().manual_seed(2))
    x = wide[3:, 7:52]  # a view: row stride 64, offset start
    out = tp.compress_tokens(*_on(indices, values), 20, wide.to(DEVICE)[3:, 7:52])
    dense = _dense(indices, values, 20)
    _assert_within(out, dense @ x.double().t(), dense.abs() @ x.double().abs().t())


def test_compress_tokens_without_tokens() -> None:
    indices, values = _projector(12, 6, 2, torch.int16, seed=0)
    out = tp.compress_tokens(*_on(indices, values), 6, torch.empty(0, 12, device=DEVICE))
    assert out.shape == (6, 0) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- expand_columns

#: (k, d, n, r): single elements; tails; several k- and n-blocks (16, 128); r = 1 and 16; a d of thousands.
EXPAND_SHAPES = [(1, 1, 1, 1), (40, 48, 96, 16), (7, 130, 200, 3), (16, 5, 33, 1), (3, 3000, 40, 8)]


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize(("k", "d", "n", "r"), EXPAND_SHAPES)
def test_expand_columns_matches_dense(k: int, d: int, n: int, r: int, index_dtype: torch.dtype) -> None:
    indices, values = _projector(n, d, r, index_dtype, seed=k + d + n + r)
    m = torch.randn(k, d, generator=torch.Generator().manual_seed(3))
    out = tp.expand_columns(*_on(indices, values), d, m.to(DEVICE))
    dense = _dense(indices, values, d)
    _assert_within(out, m.double() @ dense, m.double().abs() @ dense.abs())


def test_expand_columns_widens_bf16_and_reads_strided_m() -> None:
    indices, values = _projector(70, 24, 4, torch.int16, seed=9)
    m = torch.randn(24, 9, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).t()  # 9 × 24, column-major
    out = tp.expand_columns(*_on(indices, values), 24, m.to(DEVICE))
    dense = _dense(indices, values, 24)
    _assert_within(out, m.double() @ dense, m.double().abs() @ dense.abs())


# ------------------------------------------------------------------------------------------ update_rows_: fp32

#: (rows, cols, d, r): single elements; tails; several row- and column-blocks (16, 128); r = 1 and 16; a d of
#: thousands.
UPDATE_SHAPES = [(1, 1, 1, 1), (40, 80, 48, 16), (37, 200, 20, 1), (16, 17, 130, 4), (20, 24, 3000, 8)]


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize(("rows", "cols", "d", "r"), UPDATE_SHAPES)
def test_update_rows_fp32_matches_dense(rows: int, cols: int, d: int, r: int, index_dtype: torch.dtype) -> None:
    indices, values = _projector(rows, d, r, index_dtype, seed=rows + cols + d + r)
    gen = torch.Generator().manual_seed(6)
    weight, half = torch.randn(rows, cols, generator=gen), torch.randn(d, cols, generator=gen)
    decay = 0.93
    dense = _dense(indices, values, d)
    ref = weight.double() * decay + dense.t() @ half.double()
    magnitude = weight.double().abs() * decay + dense.abs().t() @ half.double().abs()
    target = weight.to(DEVICE, copy=True)
    address = target.data_ptr()
    returned = tp.update_rows_(target, *_on(indices, values, half), decay, 123)
    assert returned is target and target.data_ptr() == address  # in place
    _assert_within(target, ref, magnitude)


def test_update_rows_fp32_ignores_the_seed() -> None:
    indices, values = _projector(20, 10, 3, torch.int32, seed=2)
    half = torch.randn(10, 30, generator=torch.Generator().manual_seed(8), device="cpu").to(DEVICE)
    weight = torch.randn(20, 30, generator=torch.Generator().manual_seed(9))
    with_seed, without = weight.to(DEVICE, copy=True), weight.to(DEVICE, copy=True)
    tp.update_rows_(with_seed, *_on(indices, values), half, 0.5, 77)
    tp.update_rows_(without, *_on(indices, values), half, 0.5, None)
    assert torch.equal(with_seed, without)
    assert not torch.equal(with_seed.cpu(), weight)


# ------------------------------------------------------------------------------------------ update_rows_: bf16


def test_philox_reference_meets_random123_known_answers() -> None:
    # Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key, expected output.
    assert _philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 0xFFFFFFFF
    assert _philox4x32_10((ones,) * 4, (ones, ones)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert _philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def _randint_kernel(out_ptr, seed, base, N: tl.constexpr):
    offsets = base + tl.arange(0, N).to(tl.int64)
    tl.store(out_ptr + tl.arange(0, N), tl.randint(seed, offsets).to(tl.int32, bitcast=True))


@pytest.mark.parametrize(("seed", "base"), [(0, 0), (12345, 3), (2**62 - 11, 2**32 - 5)])
def test_philox_reference_is_tl_randint(seed: int, base: int) -> None:
    """The stream the kernel writes out is tl.randint's (so the reference below, and the docstring, hold)."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415  (only this check needs it)

    if not _CUDA and not isinstance(tl.randint, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET was set: its tl.randint is not interpretable")
    out = torch.empty(16, dtype=torch.int32, device=DEVICE)
    triton.jit(_randint_kernel)[(1,)](out, seed, base, N=16)
    assert (out.cpu().long() & 0xFFFFFFFF).tolist() == [_stream(seed, base + i) for i in range(16)]


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize(("rows", "cols", "d", "r", "seed"), [(1, 1, 1, 1, 3), (40, 200, 48, 16, 2**62 - 1),
                                                              (19, 37, 7, 2, 2**40 + 5)])
def test_update_rows_bf16_rounds_to_a_neighbour_with_philox_bits(rows: int, cols: int, d: int, r: int, seed: int,
                                                                  index_dtype: torch.dtype) -> None:
    weight, indices, values, half, decay, new = _exact_update_case(rows, cols, d, r, index_dtype, seed=rows)
    target = weight.to(DEVICE, copy=True)
    tp.update_rows_(target, *_on(indices, values, half), decay, seed)
    got = _bits(target)
    # (a) each result is new's bf16 neighbour below or above (in magnitude: truncated, or truncated plus one ulp).
    truncated = (new.view(torch.int32) >> 16) & 0xFFFF
    exact = (new.view(torch.int32) & 0xFFFF) == 0
    assert bool(((got == truncated) | (~exact & (got == truncated + 1))).all())
    # The bits are Philox's at (seed, flat index), whatever the tiling.
    assert torch.equal(got, _reference_stochastic(new, seed))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_rows_bf16_is_unbiased(sign: float) -> None:
    # new = ±(1 + f · 2⁻⁷): a fraction f of the way from 1 to its next bf16 (2⁻⁷ above); it must round away from 1
    # with frequency f. Each row has one f over 2048 columns: 4σ of a binomial frequency bounds the deviation.
    fractions = torch.tensor([0.0, 1 / 16, 0.25, 0.5, 0.75, 15 / 16])
    rows, cols = len(fractions), 2048
    weight = torch.full((rows, cols), sign, dtype=torch.bfloat16)
    indices = torch.zeros(rows, 1, dtype=torch.int16)
    half = torch.full((1, cols), sign * 2.0**-7)
    target = weight.to(DEVICE, copy=True)
    tp.update_rows_(target, *_on(indices, fractions.unsqueeze(1), half), 1.0, 2024)
    result = target.cpu().float()
    assert bool(((result == sign) | (result == sign * (1 + 2.0**-7))).all())
    frequency = (result != sign).double().mean(dim=1)
    bound = 4 * (fractions.double() * (1 - fractions.double()) / cols).sqrt()
    assert bool(((frequency - fractions.double()).abs() <= bound).all()), (frequency, fractions)
    mean = result.double().mean(dim=1)
    exact = sign * (1 + fractions.double() * 2.0**-7)
    assert bool(((mean - exact).abs() <= bound * 2.0**-7).all())


def test_update_rows_bf16_averages_to_new_over_seeds() -> None:
    weight, indices, values, half, decay, new = _exact_update_case(5, 24, 6, 2, torch.int32, seed=11)
    seeds = 64
    total = torch.zeros_like(new, dtype=torch.float64)
    for seed in range(seeds):
        target = weight.to(DEVICE, copy=True)
        tp.update_rows_(target, *_on(indices, values, half), decay, 1000 + seed)
        total += target.cpu().double()
    mean = total / seeds
    # Per element: the result is low + ulp · Bernoulli(p), p the discarded fraction; 4σ of the mean of 64 draws.
    low = (new.view(torch.int32) & -(1 << 16)).view(torch.float32).double()
    high = ((new.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32).double()
    p = (new.double() - low) / (high - low)
    bound = 4 * (high - low).abs() * (p * (1 - p) / seeds).sqrt()
    assert bool(((mean - new.double()).abs() <= bound).all())
    assert bool((p > 0).any())  # the case does round


def test_update_rows_bf16_seeds() -> None:
    weight, indices, values, half, decay, _ = _exact_update_case(33, 50, 9, 3, torch.int16, seed=4)

    def run(seed: int) -> torch.Tensor:
        target = weight.to(DEVICE, copy=True)
        tp.update_rows_(target, *_on(indices, values, half), decay, seed)
        return _bits(target)

    first = run(7)
    assert torch.equal(first, run(7))  # reproducible
    assert not torch.equal(first, run(8))  # another seed, other bits
    assert not torch.equal(first, run(7 + 2**32))  # the seed's upper half counts too


def test_update_rows_bf16_keeps_non_finite_classes() -> None:
    # Columns: inf, -inf, NaN, and the largest bf16 ± a quarter of its ulp (2¹¹⁸): plain stochastic rounding would
    # carry a quarter of those into ±inf; the kernel rounds them to nearest instead, back to ±max.
    row = torch.tensor([math.inf, -math.inf, math.nan, BF16_MAX, -BF16_MAX], dtype=torch.bfloat16)
    weight = row.repeat(64, 1)
    half = torch.tensor([[1.0, 1.0, 1.0, 2.0**118, -(2.0**118)]])
    indices, values = torch.zeros(64, 1, dtype=torch.int32), torch.ones(64, 1)
    for seed in (5, None):
        target = weight.to(DEVICE, copy=True)
        tp.update_rows_(target, *_on(indices, values, half), 1.0, seed)
        out = target.cpu().float()
        assert bool((out[:, 0] == math.inf).all()) and bool((out[:, 1] == -math.inf).all())
        assert bool(out[:, 2].isnan().all())
        assert bool((out[:, 3] == BF16_MAX).all()) and bool((out[:, 4] == -BF16_MAX).all())


def test_update_rows_bf16_without_seed_rounds_to_nearest() -> None:
    weight, indices, values, half, decay, new = _exact_update_case(40, 150, 12, 4, torch.int32, seed=6)
    target = weight.to(DEVICE, copy=True)
    tp.update_rows_(target, *_on(indices, values, half), decay, None)
    assert torch.equal(_bits(target), _bits(new.to(torch.bfloat16)))
    # Exact ties go to the even neighbour: 1 + 2⁻⁸ → 1, 1 + 3·2⁻⁸ → 1 + 2⁻⁶, −(1 + 2⁻⁸) → −1, 2 + 2⁻⁷ → 2.
    weight = torch.tensor([[1.0, 1.0 + 2.0**-7, -1.0, 2.0]], dtype=torch.bfloat16).to(DEVICE)
    half = torch.tensor([[2.0**-8, 2.0**-8, -(2.0**-8), 2.0**-7]], device=DEVICE)
    tp.update_rows_(weight, *_on(torch.zeros(1, 1, dtype=torch.int16), torch.ones(1, 1)), half, 1.0, None)
    assert weight.cpu().float().tolist() == [[1.0, 1.0 + 2.0**-6, -1.0, 2.0]]


# ---------------------------------------------------------------------------------------------- bad arguments


def _bad_calls() -> list[tuple[str, Callable[[], object]]]:
    indices, values = _on(*_projector(10, 6, 2, torch.int16, seed=0))
    x, m = torch.randn(4, 10, device=DEVICE), torch.randn(3, 6, device=DEVICE)
    weight, half = torch.randn(10, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    return [
        ("x must be T × n with n=10", lambda: tp.compress_tokens(indices, values, 6, x[:, :9])),
        ("x must have 2 dimensions", lambda: tp.compress_tokens(indices, values, 6, x[0])),
        ("x must be float32 or bfloat16, got float16", lambda: tp.compress_tokens(indices, values, 6, x.half())),
        ("indices must be int16 or int32, got int64", lambda: tp.compress_tokens(indices.long(), values, 6, x)),
        ("values must have indices' shape", lambda: tp.compress_tokens(indices, values[:, :1], 6, x)),
        ("values must be float32, got float64", lambda: tp.compress_tokens(indices, values.double(), 6, x)),
        ("dim_out must be a positive int, got 0", lambda: tp.compress_tokens(indices, values, 0, x)),
        (r"r=2 entries per column; need 1 ≤ r ≤ min\(dim_out=1", lambda: tp.compress_tokens(indices, values, 1, x)),
        ("m must be k × dim_out with dim_out=6", lambda: tp.expand_columns(indices, values, 6, m[:, :5])),
        ("m must be float32 or bfloat16, got int64", lambda: tp.expand_columns(indices, values, 6, m.long())),
        ("weight must be contiguous", lambda: tp.update_rows_(torch.randn(8, 10, device=DEVICE).t(), indices,
                                                              values, half, 1.0, None)),
        ("weight must be float32 or bfloat16, got float16", lambda: tp.update_rows_(weight.half(), indices, values,
                                                                                    half, 1.0, 1)),
        ("indices must have weight's 9 rows", lambda: tp.update_rows_(weight[:9], indices, values, half, 1.0, 1)),
        ("half must be dim_out × cols with cols=8", lambda: tp.update_rows_(weight, indices, values, half[:, :7], 1.0,
                                                                            1)),
        ("half must be float32, got bfloat16", lambda: tp.update_rows_(weight, indices, values, half.bfloat16(), 1.0,
                                                                       1)),
        ("half must have at least one row", lambda: tp.update_rows_(weight, indices, values, half[:0], 1.0, 1)),
        (r"seed must be None or an int in \[0, 2\*\*64\), got -1", lambda: tp.update_rows_(
            weight.bfloat16(), indices, values, half, 1.0, -1)),
        ("decay must be a float, got None", lambda: tp.update_rows_(weight, indices, values, half, None, 1)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_raise_value_error(case: int) -> None:
    message, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    indices, values = _projector(10, 6, 2, torch.int16, seed=0)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tp.expand_columns(indices, values, 6, torch.randn(3, 6))
