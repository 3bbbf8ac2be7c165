"""A sparse projector's three products as Triton kernels (CUDA; the CPU under Triton's interpreter).

A projector ``P`` (``d × n``, ``d = dim_out``) is given by ``indices`` and ``values`` (both ``n × r``): column ``j``
of ``P`` holds ``values[j, s]`` at the distinct rows ``indices[j, s]``. That ``(n, r)`` layout is ``Pᵀ`` in ELL form
(a fixed ``r`` entries per row of ``Pᵀ``), which decides each kernel's shape:

* :func:`expand_columns` (``m · P``) and :func:`update_rows_` (``W·decay + Pᵀ·half``) read a row of ``Pᵀ`` and
  *gather* the ``r`` rows/columns it names: ``O(r)`` work per output element, nothing dense formed.
* :func:`compress_tokens` (``P · xᵀ``) would have to *scatter* from that layout (atomics: a nondeterministic sum).
  Instead each program forms a small dense tile of ``P`` in registers and multiplies it with ``tl.dot``:
  deterministic and nothing dense in memory, at a dense product's work.

Every product accumulates in fp32. Entries of ``indices`` outside ``[0, dim_out)`` are not checked (that needs a host
sync per call) but are memory-safe: they contribute nothing.

``triton.jit`` decides compiled or interpreted when it decorates, and triton's library helpers (``tl.zeros``,
``tl.randint``, …) are decorated at ``import triton``. So the kernels use builtins only and are decorated on first use:
``TRITON_INTERPRET=1`` then need only be set before the first call, whoever imported ``triton`` first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

try:  # guarded: a CPU-only install without triton must still import this module (available() then says False)
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (a broken triton install raises more than ImportError; treat it as absent)
    triton = None
    tl = None

__all__ = ["available", "compress_tokens", "expand_columns", "update_rows_"]

#: The largest ``r`` accepted: the loop over ``r`` is unrolled at compile time, one compiled variant per ``r``.
_MAX_NNZ = 64

#: Ten rounds: the count Philox4x32 is specified (and Crush-tested) with, and what ``tl.randint`` uses.
_PHILOX_ROUNDS = 10

#: Launch options of every kernel; fused multiply-adds set explicitly since triton warns its default will change.
_LAUNCH = {"num_warps": 4, "enable_fp_fusion": True}


# Kernels: plain functions, decorated by _kernel() on first use (see the module docstring); triton builtins only.


def _compress_kernel(idx_ptr, val_ptr, x_ptr, out_ptr, n, tokens, dim_out, tiles_t, stride_xt, stride_xn,
                     R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program: a BLOCK_D × BLOCK_T tile of out = P · xᵀ, streaming over n in chunks of BLOCK_N.
    # A 1-D grid (decomposed here) because CUDA limits a grid's second axis to 65535 programs.
    pid = tl.program_id(0)
    rows = (pid // tiles_t) * BLOCK_D + tl.arange(0, BLOCK_D)
    toks = (pid % tiles_t) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < tokens
    x_rows = x_ptr + toks.to(tl.int64) * stride_xt  # int64: tokens × row stride may pass 2**31 elements
    acc = tl.full((BLOCK_D, BLOCK_T), 0.0, tl.float32)
    for start in range(0, n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        # xᵀ's chunk (BLOCK_N × BLOCK_T); a bf16 x is widened here, exactly.
        xt = tl.load(x_rows[None, :] + cols.to(tl.int64)[:, None] * stride_xn,
                     mask=col_ok[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)
        # P's tile (BLOCK_D × BLOCK_N) in registers: entry (i, j) is values[j, s] where indices[j, s] == i. The r
        # indices of a column are distinct, so at most one s hits each entry and the sum is exact.
        tile = tl.full((BLOCK_D, BLOCK_N), 0.0, tl.float32)
        for s in tl.static_range(R):
            flat = cols.to(tl.int64) * R + s
            idx = tl.load(idx_ptr + flat, mask=col_ok, other=-1).to(tl.int32)  # -1 matches no row
            val = tl.load(val_ptr + flat, mask=col_ok, other=0.0)
            tile += tl.where(rows[:, None] == idx[None, :], val[None, :], 0.0)
        # "ieee": fp32 products and sums, not NVIDIA's default TF32, far outside the fp32 rounding held to.
        acc += tl.dot(tile, xt, input_precision="ieee")
    out = out_ptr + rows.to(tl.int64)[:, None] * tokens + toks[None, :]
    tl.store(out, acc, mask=(rows[:, None] < dim_out) & tok_ok[None, :])


def _expand_kernel(idx_ptr, val_ptr, m_ptr, out_ptr, k, n, dim_out, tiles_n, stride_mk, stride_md,
                   R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program: a BLOCK_K × BLOCK_N tile of out = m · P, gathering r columns of m per output column.
    pid = tl.program_id(0)
    a = (pid // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    j = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ok = a < k
    j_ok = j < n
    m_rows = m_ptr + a.to(tl.int64) * stride_mk
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for s in tl.static_range(R):
        flat = j.to(tl.int64) * R + s
        idx = tl.load(idx_ptr + flat, mask=j_ok, other=0).to(tl.int32)
        val = tl.load(val_ptr + flat, mask=j_ok, other=0.0)
        hit = j_ok & (idx >= 0) & (idx < dim_out)  # an out-of-range index reads nothing rather than stray memory
        g = tl.load(m_rows[:, None] + idx.to(tl.int64)[None, :] * stride_md, mask=a_ok[:, None] & hit[None, :],
                    other=0.0).to(tl.float32)
        acc += g * val[None, :]
    out = out_ptr + a.to(tl.int64)[:, None] * n + j[None, :]
    tl.store(out, acc, mask=a_ok[:, None] & j_ok[None, :])


def _update_kernel(w_ptr, idx_ptr, val_ptr, half_ptr, rows, cols, dim_out, tiles_c, stride_hd, stride_hc, decay,
                   seed_lo, seed_hi, R: tl.constexpr, BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
                   PHILOX_ROUNDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program: a BLOCK_R × BLOCK_C tile of the weight, read once, updated in registers, written once:
    # W ← W·decay + Pᵀ·half, Pᵀ's row ρ gathering the r rows half[indices[ρ, s]] (each a contiguous, coalesced run).
    pid = tl.program_id(0)
    r_ = (pid // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    c_ = (pid % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = r_ < rows
    c_ok = c_ < cols
    delta = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)
    for s in tl.static_range(R):
        flat_p = r_.to(tl.int64) * R + s
        idx = tl.load(idx_ptr + flat_p, mask=r_ok, other=0).to(tl.int32)
        val = tl.load(val_ptr + flat_p, mask=r_ok, other=0.0)
        hit = r_ok & (idx >= 0) & (idx < dim_out)  # an out-of-range index reads nothing rather than stray memory
        h = tl.load(half_ptr + idx.to(tl.int64)[:, None] * stride_hd + c_.to(tl.int64)[None, :] * stride_hc,
                    mask=hit[:, None] & c_ok[None, :], other=0.0)
        delta += val[:, None] * h
    # The element's flat index: its address and the random counter, so rounding depends on (seed, element) alone.
    flat = r_.to(tl.int64)[:, None] * cols + c_[None, :]
    mask = r_ok[:, None] & c_ok[None, :]
    if BF16:
        # The weight arrives as its int16 bit view, so widening is a shift and no float conversion re-rounds it.
        bits16 = tl.load(w_ptr + flat, mask=mask, other=0)
        weight = (bits16.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        weight = tl.load(w_ptr + flat, mask=mask, other=0.0)
    new = weight * decay + delta
    if BF16:
        bits = new.to(tl.uint32, bitcast=True)  # unsigned: the additions below wrap instead of overflowing
        is_num = (bits & 0x7FFFFFFF) <= 0x7F800000  # not NaN, on the bits: immune to any fast-math view of NaN
        # Round to nearest even on the bits; NaN becomes the canonical quiet NaN, as torch's conversion gives.
        nearest = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        nearest = tl.where(is_num, nearest, 0x7FC0)
        if STOCHASTIC:
            # Philox4x32-10, counter (flat_lo, flat_hi, 0, 0), key (seed_lo, seed_hi): tl.randint(seed, flat)'s
            # stream, written out because tl.randint is a library helper (see the module docstring). The constants
            # are Philox's (Salmon et al.), literals because a kernel reads only tl.constexpr module globals.
            c0 = flat.to(tl.uint32)
            c1 = (flat >> 32).to(tl.uint32)
            c2 = c0 * 0
            c3 = c2
            k0, k1 = seed_lo.to(tl.uint32), seed_hi.to(tl.uint32)
            for _ in tl.static_range(PHILOX_ROUNDS):
                c0, c1, c2, c3 = (tl.umulhi(c2, 0xCD9E8D57) ^ c1 ^ k0, c2 * 0xCD9E8D57,
                                  tl.umulhi(c0, 0xD2511F53) ^ c3 ^ k1, c0 * 0xD2511F53)
                k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85
            # Add a uniform integer below the kept bits, then truncate: unbiased, E[result] = new.
            stochastic = (bits + (c0 & 0xFFFF)) >> 16
            # Plain rounding where that would reach inf/NaN, so finite values never become inf by chance.
            finite = (stochastic & 0x7F80) != 0x7F80
            rounded = tl.where(finite & is_num, stochastic, nearest)
        else:
            rounded = nearest
        tl.store(w_ptr + flat, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(w_ptr + flat, new, mask=mask)


# ------------------------------------------------------------------------------------------------- plumbing

_KERNELS: dict[tuple[str, bool], Any] = {}
_SOURCES: dict[str, Callable[..., None]] = {"compress": _compress_kernel, "expand": _expand_kernel,
                                             "update": _update_kernel}
# Seeds change every call: not specialised on, or triton would compile a variant per value class.
_NOT_SPECIALIZED = {"update": ["seed_lo", "seed_hi"]}


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # triton before 3.4 had no knobs


def _kernel(name: str) -> Any:
    """The jitted kernel ``name``, decorated on first use and once per mode (compiled or interpreted)."""
    key = (name, _interpreting())
    if key not in _KERNELS:
        _KERNELS[key] = triton.jit(_SOURCES[name], do_not_specialize=_NOT_SPECIALIZED.get(name, ()))
    return _KERNELS[key]


def available() -> bool:
    """Whether the kernels can run in this process.

    Returns:
        ``True`` when ``triton`` imports and either a CUDA device is present or ``TRITON_INTERPRET`` is ``"1"``
        (Triton's interpreter, which runs the kernels on CPU tensors).
    """
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(size: int, low: int, high: int) -> int:
    """The smallest power of two ≥ ``size``, clamped to ``[low, high]`` (block sizes must be powers of two)."""
    return max(low, min(high, 1 << max(0, size - 1).bit_length()))


def _check(name: str, tensor: Any, dtypes: tuple[torch.dtype, ...]) -> None:
    """``tensor`` is a 2-D tensor of one of ``dtypes``."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have 2 dimensions, got shape {tuple(tensor.shape)}.")
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {str(tensor.dtype).removeprefix('torch.')}.")


def _check_projector(indices: Any, values: Any, dim_out: Any) -> tuple[Tensor, Tensor, int]:
    """Validate a projector's arguments; returns contiguous ``indices`` and ``values`` (the kernels index them flat)
    and ``r``."""
    _check("indices", indices, (torch.int16, torch.int32))
    _check("values", values, (torch.float32,))
    if values.shape != indices.shape:
        raise ValueError(f"values must have indices' shape {tuple(indices.shape)}, got {tuple(values.shape)}.")
    if isinstance(dim_out, bool) or not isinstance(dim_out, int) or dim_out < 1:
        raise ValueError(f"dim_out must be a positive int, got {dim_out!r}.")
    nnz = indices.shape[1]
    if not 1 <= nnz <= min(dim_out, _MAX_NNZ):
        raise ValueError(f"indices has r={nnz} entries per column; need 1 ≤ r ≤ min(dim_out={dim_out}, {_MAX_NNZ}).")
    return indices.contiguous(), values.contiguous(), nnz


def _check_device(**tensors: Tensor) -> None:
    """All tensors on one device, and one the kernels run on: CUDA, or the CPU under the interpreter."""
    if triton is None:
        raise RuntimeError("triton is not installed; the triton projection kernels are unavailable.")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}.")
    device = next(iter(devices.values()))
    if device.type == "cpu" and not _interpreting():
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 (or move them to CUDA).")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the triton projection kernels run on CUDA (or the CPU interpreted), got device {device}.")


# ------------------------------------------------------------------------------------------------ products


def compress_tokens(indices: Tensor, values: Tensor, dim_out: int, x: Tensor) -> Tensor:
    """``P · xᵀ`` for token-major ``x``: the forward's ``B Xᵀ`` and the backward's ``A Δᵀ``.

    Args:
        indices: ``n × r`` int16 or int32, the distinct rows of ``P`` each column has its nonzeros in.
        values: ``n × r`` fp32, those nonzeros.
        dim_out: ``d``, the number of rows of ``P``.
        x: ``T × n`` fp32 or bf16, any strides (rows longer than ``n``, e.g. a slice, are fine; a unit stride
            along ``n`` is what makes the loads coalesce).

    Returns:
        ``d × T`` fp32, contiguous.

    Raises:
        ValueError: on a shape, dtype or device mismatch.
    """
    indices, values, nnz = _check_projector(indices, values, dim_out)
    _check("x", x, (torch.float32, torch.bfloat16))
    n = indices.shape[0]
    if x.shape[1] != n:
        raise ValueError(f"x must be T × n with n={n} (indices' rows), got shape {tuple(x.shape)}.")
    _check_device(indices=indices, values=values, x=x)
    tokens = x.shape[0]
    out = torch.empty((dim_out, tokens), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    # tl.dot needs every tile side ≥ 16; 64 × 64 outputs with 32-wide chunks keep the accumulator in registers.
    block_d = _pow2(dim_out, 16, 64)
    block_t = _pow2(tokens, 16, 64)
    block_n = 32
    tiles_t = triton.cdiv(tokens, block_t)
    grid = (triton.cdiv(dim_out, block_d) * tiles_t,)
    _kernel("compress")[grid](indices, values, x, out, n, tokens, dim_out, tiles_t, x.stride(0), x.stride(1),
                              R=nnz, BLOCK_D=block_d, BLOCK_T=block_t, BLOCK_N=block_n, **_LAUNCH)
    return out


def expand_columns(indices: Tensor, values: Tensor, dim_out: int, m: Tensor) -> Tensor:
    """``m · P``: the update's small side ``U B``; ``out[a, j] = Σ_s values[j, s] · m[a, indices[j, s]]``.

    Args:
        indices: ``n × r`` int16 or int32, the distinct rows of ``P`` each column has its nonzeros in.
        values: ``n × r`` fp32, those nonzeros.
        dim_out: ``d``, the number of rows of ``P``.
        m: ``k × d`` fp32 (or bf16, widened on load), any strides.

    Returns:
        ``k × n`` fp32, contiguous.

    Raises:
        ValueError: on a shape, dtype or device mismatch.
    """
    indices, values, nnz = _check_projector(indices, values, dim_out)
    _check("m", m, (torch.float32, torch.bfloat16))
    if m.shape[1] != dim_out:
        raise ValueError(f"m must be k × dim_out with dim_out={dim_out}, got shape {tuple(m.shape)}.")
    _check_device(indices=indices, values=values, m=m)
    k, n = m.shape[0], indices.shape[0]
    out = torch.empty((k, n), dtype=torch.float32, device=m.device)
    if k == 0 or n == 0:
        return out
    # Wide along n, where loads and output rows are contiguous; 16 rows of m keep the gathered rows cache-sized.
    block_k = _pow2(k, 1, 16)
    block_n = _pow2(n, 16, 128)
    tiles_n = triton.cdiv(n, block_n)
    grid = (triton.cdiv(k, block_k) * tiles_n,)
    _kernel("expand")[grid](indices, values, m, out, k, n, dim_out, tiles_n, m.stride(0), m.stride(1),
                            R=nnz, BLOCK_K=block_k, BLOCK_N=block_n, **_LAUNCH)
    return out


def update_rows_(weight: Tensor, indices: Tensor, values: Tensor, half: Tensor, decay: float,
                 seed: int | None) -> Tensor:
    """``W ← W·decay + Pᵀ·half`` in place, in one pass over ``W``; a bf16 ``W`` is rounded stochastically.

    ``P`` is ``half.shape[0] × rows``; no temporary of the weight's size exists. A bf16 result is rounded unbiasedly
    (:mod:`lightning_offload.lsp.rounding`) with Philox keyed by ``seed`` and counted by element, so the same seed
    gives the same bits on any tiling.

    Args:
        weight: ``rows × cols`` fp32 or bf16, contiguous; overwritten.
        indices: ``rows × r`` int16 or int32, the distinct rows of ``half`` each weight row gathers.
        values: ``rows × r`` fp32, the gathered rows' weights.
        half: ``d × cols`` fp32, any strides (contiguous rows coalesce).
        decay: the factor on the old weight.
        seed: ``None`` (round to nearest) or an int in ``[0, 2**64)``; ignored for fp32 weights.

    Returns:
        ``weight``.

    Raises:
        ValueError: on a shape, dtype, device or seed mismatch.
    """
    _check("weight", weight, (torch.float32, torch.bfloat16))
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (it is written in place), got strides {weight.stride()}.")
    _check("half", half, (torch.float32,))
    if half.shape[0] < 1:
        raise ValueError(f"half must have at least one row (its rows are P's, dim_out), got shape {tuple(half.shape)}.")
    indices, values, nnz = _check_projector(indices, values, half.shape[0])
    rows, cols = weight.shape
    if indices.shape[0] != rows:
        raise ValueError(f"indices must have weight's {rows} rows, got shape {tuple(indices.shape)}.")
    if half.shape[1] != cols:
        raise ValueError(f"half must be dim_out × cols with cols={cols} (weight's), got shape {tuple(half.shape)}.")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise ValueError(f"decay must be a float, got {decay!r}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}.")
    seed_lo, seed_hi = (0, 0) if seed is None else (seed & 0xFFFFFFFF, seed >> 32)  # Philox's two key words
    _check_device(weight=weight, indices=indices, values=values, half=half)
    if weight.numel() == 0:
        return weight
    bf16 = weight.dtype == torch.bfloat16
    # 16 × 128: each gathered half row is a coalesced run, and the delta stays in registers beside Philox's state.
    block_r = _pow2(rows, 1, 16)
    block_c = _pow2(cols, 16, 128)
    tiles_c = triton.cdiv(cols, block_c)
    grid = (triton.cdiv(rows, block_r) * tiles_c,)
    target = weight.view(torch.int16) if bf16 else weight  # bf16 handled on its bits (see the kernel)
    _kernel("update")[grid](target, indices, values, half, rows, cols, half.shape[0], tiles_c, half.stride(0),
                            half.stride(1), float(decay), seed_lo, seed_hi, R=nnz, BF16=bf16,
                            STOCHASTIC=bf16 and seed is not None, PHILOX_ROUNDS=_PHILOX_ROUNDS, BLOCK_R=block_r,
                            BLOCK_C=block_c, **_LAUNCH)
    return weight
