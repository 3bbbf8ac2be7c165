"""The projection kernels for the CPU (``lsp/kernels/native/projection.c``): built on first use with the machine's C
compiler, loaded with ctypes, and offered only once checked on this machine against torch's products.

What is checked at load, on this machine: each of the three kernels against the dense torch product on random
projectors (int16 and int32 indices, fp32 and bf16 inputs and weights, tails of every tile, one thread and two),
within fp32 summation-order rounding; and the stochastic rounding against its definition (each bf16 result one of
the two neighbours of the fp32 value, and the same bits for the same seed). A kernel that fails is not offered,
and the log says why, once; so is a machine without a compiler. ``LIGHTNING_OFFLOAD_NATIVE=0`` turns every native
kernel of the package off.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from lightning_offload.lsp.kernels.build import load_checked

log = logging.getLogger("lightning_offload")

SOURCE = Path(__file__).parent / "native" / "projection.c"
# Contraction off: the update decays and adds in two roundings, as torch's W.mul_(decay).add_(delta), so that a
# lossless projector's update is AdamW's bit for bit whichever kernel applies it (the sums' rounding differs from
# torch's sparse kernels' only in order).
_FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC"]
#: Threads a product runs on unless told. One: inside a training step torch's own OpenMP threads hold the other
#: cores (they wait spinning after each of torch's parallel regions), so threads started here contend with them: on a
#: 2-core CPU two threads made a step's projections slower than one, though alone they were faster (measured:
#: docs/benchmarks/2026-12-04.md, "The kernels forced").
DEFAULT_THREADS = 1


class NativeProjection:
    """The loaded kernels (:func:`native_projection` builds, checks and returns them).

    Every method takes CPU tensors; a projector is given as its ``indices`` (``n × r``, int16 or int32, contiguous),
    ``values`` (``n × r`` fp32, contiguous) and ``dim_out``.

    Args:
        library: the loaded shared library.
        path: where it was loaded from (for the log).
    """

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        pointer, int64, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._compress = library.lo_compress_tokens
        self._compress.argtypes = [pointer, flag, int64, int64, int64, pointer, flag, pointer, int64, int64, pointer,
                                   flag]
        self._expand = library.lo_expand_columns
        self._expand.argtypes = [pointer, int64, int64, int64, pointer, flag, pointer, int64, pointer, flag]
        self._update = library.lo_update_rows
        self._update.argtypes = [pointer, flag, int64, int64, pointer, flag, pointer, int64, pointer, ctypes.c_float,
                                 flag, ctypes.c_uint64, flag]
        for function in (self._compress, self._expand, self._update):
            function.restype = flag

    def compress_tokens(self, indices: Tensor, values: Tensor, dim_out: int, x: Tensor,
                        threads: int | None = None) -> Tensor:
        """``P · xᵀ`` (``dim_out × T`` fp32) for token-major ``x`` (``T × n``, fp32 or bf16, rows contiguous)."""
        tokens, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        _require_projector(indices, values)
        _require(x, (torch.float32, torch.bfloat16), "x", contiguous=False)
        out = torch.empty(dim_out, tokens, dtype=torch.float32)
        status = self._compress(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), tokens, n,
                                indices.data_ptr(), indices.element_size(), values.data_ptr(), indices.shape[1],
                                dim_out, out.data_ptr(), _threads(threads))
        _raise_on(status, "compress_tokens")
        return out

    def expand_columns(self, indices: Tensor, values: Tensor, dim_out: int, matrix_t: Tensor,
                       threads: int | None = None) -> Tensor:
        """``M · P`` (``k × n`` fp32) from ``Mᵀ`` (``dim_out × k`` fp32, contiguous)."""
        k = matrix_t.shape[1]
        n = indices.shape[0]
        _require_projector(indices, values)
        _require(matrix_t, (torch.float32,), "matrix_t")
        out = torch.empty(k, n, dtype=torch.float32)
        status = self._expand(matrix_t.data_ptr(), k, dim_out, n, indices.data_ptr(), indices.element_size(),
                              values.data_ptr(), indices.shape[1], out.data_ptr(),
                              _threads(threads))
        _raise_on(status, "expand_columns")
        return out

    def update_rows_(self, weight: Tensor, indices: Tensor, values: Tensor, half: Tensor, decay: float,
                     seed: int | None, threads: int | None = None) -> None:
        """``W ← W·decay + Pᵀ·H`` in place, in one pass over ``W`` (``rows × cols``, fp32 or bf16, contiguous; bf16
        rounded stochastically from ``seed``, or to nearest when ``seed`` is ``None``); ``H`` is ``dim_out × cols``
        fp32, contiguous."""
        rows, cols = weight.shape
        _require_projector(indices, values)
        _require(weight, (torch.float32, torch.bfloat16), "weight")
        _require(half, (torch.float32,), "half")
        status = self._update(weight.data_ptr(), int(weight.dtype == torch.bfloat16), rows, cols,
                              indices.data_ptr(), indices.element_size(), values.data_ptr(), indices.shape[1],
                              half.data_ptr(), float(decay), int(seed is not None),
                              0 if seed is None else int(seed) & (2**64 - 1),
                              _threads(threads))
        _raise_on(status, "update_rows")


def _require(tensor: Tensor, dtypes: tuple[torch.dtype, ...], name: str, contiguous: bool = True) -> None:
    """Refuse an operand the C code would read wrongly (another dtype, a non-contiguous layout, another device): it
    reads raw memory, so a wrong operand would be a wrong result or a write out of bounds, not an error."""
    # is_cpu, not device.type: this runs on every product (~360 calls a step at the small shape), each µs counts.
    if tensor.dtype not in dtypes or not tensor.is_cpu or (contiguous and not tensor.is_contiguous()):
        raise TypeError(f"The native projection kernels take {name} as a {'contiguous ' if contiguous else ''}CPU "
                        f"tensor of {', '.join(map(str, dtypes))}; got {tensor.dtype} on {tensor.device} "
                        f"(contiguous: {tensor.is_contiguous()}).")


def _require_projector(indices: Tensor, values: Tensor) -> None:
    if (indices.dtype is torch.int16 or indices.dtype is torch.int32) and values.dtype is torch.float32 \
            and indices.is_cpu and values.is_cpu and indices.is_contiguous() and values.is_contiguous():
        return  # the usual case, in one expression (half the time of the two checks below)
    _require(indices, (torch.int16, torch.int32), "indices")
    _require(values, (torch.float32,), "values")


def _threads(threads: int | None) -> int:
    return max(1, DEFAULT_THREADS if threads is None else threads)


def _raise_on(status: int, name: str) -> None:
    if status != 0:
        raise MemoryError(f"The native projection kernel {name} could not allocate its scratch memory.")


@lru_cache(maxsize=1)
def native_projection() -> NativeProjection | None:
    """The kernels, built (or found built) and checked on this machine, or ``None`` (said once in the log, with why)."""
    from lightning_offload.lsp.kernels.checks import check_kernels  # noqa: PLC0415  (checks import the reference)

    kernels, outcome, detail = load_checked(SOURCE, "projection", _FLAGS, NativeProjection, check_kernels)
    if outcome == "off":
        log.info("The native projection kernels are off (LIGHTNING_OFFLOAD_NATIVE=0): projections run through "
                 "torch's kernels.")
    elif outcome == "unavailable":
        log.warning("The native projection kernels are not available (%s): projections run through torch's "
                    "kernels (the same results within rounding, slower). Install a C compiler (gcc or clang) for "
                    "the faster ones, or set LIGHTNING_OFFLOAD_NATIVE=0 to say so and silence this.", detail)
    elif outcome == "mismatch":
        log.warning("The native projection kernels do not match torch's products on this machine (%s): "
                    "projections run through torch's kernels. Please report this with your CPU and compiler.",
                    detail)
    else:
        log.info("The native projection kernels are built and checked (%s).", detail)
    return kernels
