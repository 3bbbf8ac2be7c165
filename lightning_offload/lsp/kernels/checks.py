"""A kernel's check before it is offered: its three products against :mod:`~lightning_offload.lsp.kernels.reference`
on random projectors, and its stochastic rounding against the definition.

Shapes cover what the kernels' tiles leave over (token counts, widths and compressed sizes that are not multiples of
16), both index widths, fp32 and bf16 inputs and weights, and one thread and two. The tolerance is fp32 summation
order: a result may differ from the dense product by the rounding of a sum of ``n`` terms, and by no more.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_offload.lsp.kernels import reference

# (T, n, d, r): tokens or rows of the other operand, the dimension compressed, the compressed size, nonzeros a column.
_SHAPES = ((37, 53, 19, 3), (16, 128, 32, 8), (5, 40, 40, 1), (70, 33, 64, 16))


def random_projector(n: int, dim_out: int, r: int, generator: torch.Generator,
                     index_dtype: torch.dtype = torch.int16) -> tuple[Tensor, Tensor]:
    """Indices (``n × r``, distinct and ascending in each row) and values (``n × r`` fp32) of a random projector."""
    indices = torch.rand(n, dim_out, generator=generator, dtype=torch.float32).topk(r, dim=1).indices.sort(dim=1).values
    return indices.to(index_dtype), torch.randn(n, r, generator=generator, dtype=torch.float32)


def close(got: Tensor, want: Tensor, terms: int) -> bool:
    """Whether ``got`` equals ``want`` within the rounding of fp32 sums of ``terms`` products (relative to the
    magnitudes summed, which the reference's absolute values bound)."""
    scale = want.abs().amax().item() + 1e-30
    return got.shape == want.shape and bool(((got - want).abs() <= 8 * terms * 2**-24 * scale).all())


def check_kernels(kernels: Any) -> str:
    """Runs ``kernels`` (an object with ``compress_tokens``, ``expand_columns`` and ``update_rows_`` taking
    ``indices, values, dim_out`` and CPU tensors, as :class:`~lightning_offload.lsp.kernels.native.NativeProjection`)
    against the reference; ``""`` when every result is within rounding, else what differed."""
    generator = torch.Generator().manual_seed(0)
    for tokens, n, dim_out, r in _SHAPES:
        for index_dtype in (torch.int16, torch.int32):
            indices, values = random_projector(n, dim_out, r, generator, index_dtype)
            for dtype in (torch.float32, torch.bfloat16):
                for threads in (1, 2):
                    problem = _check_one(kernels, indices, values, dim_out, tokens, dtype, threads, generator)
                    if problem:
                        return f"{problem} (T={tokens}, n={n}, d={dim_out}, r={r}, {index_dtype}, {dtype}, " \
                               f"{threads} thread(s))"
    return _check_rounding(kernels, generator)


def _check_one(kernels: Any, indices: Tensor, values: Tensor, dim_out: int, tokens: int, dtype: torch.dtype,
               threads: int, generator: torch.Generator) -> str:
    n = indices.shape[0]
    # A strided view of wider rows: the forward's input is often a slice of a larger activation.
    x = torch.randn(tokens, n + 3, generator=generator, dtype=torch.float32).to(dtype)[:, :n]
    if not close(kernels.compress_tokens(indices, values, dim_out, x, threads=threads),
                 reference.compress_tokens(indices, values, dim_out, x), n * indices.shape[1]):
        return "compress_tokens differs"
    matrix = torch.randn(tokens, dim_out, generator=generator, dtype=torch.float32)
    if not close(kernels.expand_columns(indices, values, dim_out, matrix.t().contiguous(), threads=threads),
                 reference.expand_columns(indices, values, dim_out, matrix), indices.shape[1]):
        return "expand_columns differs"
    # The update: rows of the weight are P's columns (n of them), the half has dim_out rows.
    weight = torch.randn(n, tokens, generator=generator, dtype=torch.float32).to(dtype)
    half = torch.randn(dim_out, tokens, generator=generator, dtype=torch.float32) * 1e-2
    want = reference.updated_rows(weight, indices, values, half, 0.99)
    kernels.update_rows_(weight, indices, values, half, 0.99, None, threads=threads)
    if dtype == torch.float32 and not close(weight, want, indices.shape[1] + 2):
        return "update_rows differs"
    if dtype == torch.bfloat16 and not bool(bf16_neighbours(weight, want).all()):
        return "update_rows rounds to a value that is not a bf16 neighbour of the exact one"
    return ""


def bf16_neighbours(rounded: Tensor, exact: Tensor) -> Tensor:
    """Where bf16 ``rounded`` is one of the two bf16 values next to fp32 ``exact`` (or equals it)."""
    nearest = exact.to(torch.bfloat16)
    towards = torch.where(nearest.float() < exact, float("inf"), -float("inf"))
    other = torch.nextafter(nearest, towards.to(torch.bfloat16))
    return (rounded == nearest) | (rounded == other)


def _check_rounding(kernels: Any, generator: torch.Generator) -> str:
    """bf16 stochastic rounding: each result one of the fp32 value's two bf16 neighbours, the same bits from the
    same seed, other bits from another, and infinities kept."""
    indices, values = random_projector(64, 16, 4, generator)
    half = torch.randn(16, 48, generator=generator, dtype=torch.float32) * 1e-3
    start = torch.randn(64, 48, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    exact = reference.updated_rows(start, indices, values, half, 1.0)
    results = []
    for seed in (7, 7, 8):
        weight = start.clone()
        kernels.update_rows_(weight, indices, values, half, 1.0, seed, threads=1 + seed % 2)
        results.append(weight)
    if not bool(bf16_neighbours(results[0], exact).all()):
        return "stochastic rounding gave a value that is not a neighbour of the exact one"
    if not torch.equal(results[0], results[1]) or torch.equal(results[0], results[2]):
        return "stochastic rounding is not a function of its seed"
    infinite = torch.full((4, 48), float("inf"), dtype=torch.float32).to(torch.bfloat16)
    kernels.update_rows_(infinite, indices[:4], values[:4], half, 1.0, 3, threads=1)
    if not bool(torch.isinf(infinite).all()):
        return "stochastic rounding changed an infinity"
    return ""
