"""The row Adam's native kernel (``engine/rows/native/row_adam.c``): built on first use with the machine's C compiler,
loaded with ctypes, and used only where it is proven to give torch's results bit for bit.

Torch's fused Adam needs each block's gradient as one contiguous tensor, so a block routing covered in part is first
assembled (rows copied into the accumulator, idle ones zeroed); the native kernel reads each row's gradient where it
landed and steps a row without one from zero, with torch's kernel's arithmetic operation for operation.

So that having a compiler never changes a result, it is checked at load against ``torch._fused_adam(w)_`` on random
blocks over the hyper-parameters the block Adam hands it (every bit equal, or it is not used), and each block's size at
each step: torch's kernel runs a scalar tail, rounded differently, over what each thread's share leaves after whole
vectors, so blocks with a tail (:func:`tail_free`) are stepped by torch. Without a compiler, or with a failed build or
check, the row step uses torch's kernel (the same results, slower) and says so once in the log.
``LIGHTNING_OFFLOAD_NATIVE=0`` turns the kernel off; the built library is kept in the package's cache.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_offload.lsp.kernels.build import load_checked

log = logging.getLogger("lightning_offload")

SOURCE = Path(__file__).parent / "native" / "row_adam.c"

#: Floats per vector of the widest kernel torch dispatches to (AVX-512), whole vectors of the narrower ones too.
VECTOR_FLOATS = 16

# Contraction off: only the spelt fmaf fuse, as in torch's kernel. No errno from sqrtf, so the loop vectorizes.
_FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC"]


@dataclass
class LandedRows:
    """Where one matrix's gradients of a step's blocks lie, for the kernel to read them in place.

    Attributes:
        grad: the step's one landed gradient ``[R, h]`` (fp32, contiguous) of ``rows``, or the accumulator ``[N, h]``.
        rows: ``grad``'s rows (sorted, unique int64; each in a stepped block), or ``None`` for the accumulator.
        written: with the accumulator, bool ``[N]``: the rows holding this step's gradient (any other row of a stepped
            block is stepped from zero); else ``None``.
        mirror: a bf16 ``[N, h]`` host copy of the matrix (its owner's routing copy) whose stepped rows the kernel
            rewrites as it steps them, or ``None``.
    """

    grad: Tensor
    rows: Tensor | None
    written: Tensor | None
    mirror: Tensor | None = None

    def dense(self, num_rows: int) -> Tensor:
        """The gradients as a full-size ``[num_rows, h]`` matrix, zero where none lies (a copy, for reading)."""
        if self.rows is not None:
            return torch.zeros(num_rows, self.grad.shape[1], dtype=self.grad.dtype).index_copy_(0, self.rows, self.grad)
        assert self.written is not None
        return torch.where(self.written.unsqueeze(1), self.grad, 0.0)


def tail_free(block_elements: int, threads: int) -> bool:
    """Whether torch's fused kernel steps a block of ``block_elements`` with ``threads`` threads in whole vectors only
    (its shares are ``⌈elements / threads⌉`` each, every one a multiple of :data:`VECTOR_FLOATS`)."""
    return block_elements % (VECTOR_FLOATS * max(threads, 1)) == 0


class NativeRowAdam:
    """The loaded kernel (:func:`native_row_adam` builds, checks and returns it).

    Args:
        library: the loaded shared library.
        path: where it was loaded from (for the log).
    """

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._step = library.lo_row_adam_blocks
        pointer, int64, double, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        self._step.argtypes = [pointer, pointer, pointer, int64, int64, pointer, int64, pointer, double, int64,
                               flag, flag, flag, ctypes.c_float, pointer, pointer, int64, pointer, pointer, flag]
        self._step.restype = int64

    def step_blocks(self, param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, block_rows: int, blocks: Tensor,
                    hyper: Tensor, beta2: float, step: int, decoupled: bool, maximize: bool, bound: float | None,
                    grad: Tensor, grad_rows: Tensor | None = None, written: Tensor | None = None,
                    mirror: Tensor | None = None, threads: int = 1) -> int:
        """Adam on ``blocks`` of ``param`` and its moments (fp32 ``[N, h]``, contiguous), in place.

        Args:
            param, exp_avg, exp_avg_sq: the matrix and its stored moments.
            block_rows: rows per block.
            blocks: sorted int64 block ids.
            hyper: float64 ``[len(blocks), 5]``: per block the kernel call's ``lr``, ``β₁``, weight decay, ``ε`` and
                gradient divisor (what the torch path passes ``torch._fused_adam(w)_`` for that block).
            beta2, step, decoupled, maximize: the step's.
            bound: value clipping (gradients clamped to ``[−bound, bound]``), or ``None``.
            grad: the step's one landed gradient ``[R, h]`` of the sorted rows ``grad_rows``, or (with ``written``)
                the accumulator ``[N, h]``, a row's gradient valid where ``written`` (bool ``[N]``).
            mirror: a bf16 ``[N, h]`` copy of ``param`` (contiguous) whose stepped rows are rewritten from the new
                weights in the same pass, rounded as torch rounds a copy into bf16; or ``None``.
            threads: how many threads split the blocks (the calling one among them).

        Returns:
            How many of ``grad_rows`` were read (all of them lie in ``blocks``; 0 with ``written``).
        """
        width = param.shape[1]
        # The C code reads raw memory: an operand of another dtype or layout would be a write out of bounds.
        for tensor, dtype in ((param, torch.float32), (exp_avg, torch.float32), (exp_avg_sq, torch.float32),
                              (grad, torch.float32), (blocks, torch.int64), (hyper, torch.float64),
                              (grad_rows, torch.int64), (written, torch.bool), (mirror, torch.bfloat16)):
            if tensor is not None and (tensor.dtype != dtype or not tensor.is_contiguous() or tensor.is_cuda):
                raise TypeError(f"The row Adam's native kernel takes contiguous CPU {dtype} operands; got "
                                f"{tensor.dtype} {tuple(tensor.shape)} (contiguous: {tensor.is_contiguous()}).")
        return self._step(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), width, block_rows,
                          blocks.data_ptr(), blocks.numel(), hyper.data_ptr(), beta2, step, int(decoupled),
                          int(maximize), int(bound is not None), 0.0 if bound is None else bound, grad.data_ptr(),
                          0 if grad_rows is None else grad_rows.data_ptr(),
                          0 if grad_rows is None else grad_rows.numel(),
                          0 if written is None else written.data_ptr(), 0 if mirror is None else mirror.data_ptr(),
                          threads)


def step_landed(adam: Any, matrices: list[int], blocks: Tensor, landed: list[LandedRows], hyper: Tensor,
                settings: Any, clip: tuple[str, float] | None) -> None:
    """The native kernel's step of ``matrices`` of ``adam`` (a
    :class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`, its matrices sharing a learning rate) on
    ``blocks``, each block's hyper-parameters a row of ``hyper``, reading each matrix's gradients from ``landed``.

    Raises:
        RuntimeError: when a kept row lies outside ``blocks`` (its gradient would be lost).
    """
    kernel = native_row_adam()
    assert kernel is not None, "the caller checked the kernel is loaded"
    bound = float(clip[1]) if clip is not None and clip[0] == "value" else None
    blocks = blocks.contiguous()
    threads = torch.get_num_threads()  # the calling thread's team (one inside one_thread: small blocks)
    for index in matrices:
        source = landed[index]
        read = kernel.step_blocks(adam.params[index], adam.exp_avg[index], adam.exp_avg_sq[index], adam.block_rows,
                                  blocks, hyper, settings.betas[1], adam.step_count, settings.decoupled,
                                  settings.maximize, bound, source.grad, source.rows, source.written, source.mirror,
                                  threads)
        if source.rows is not None and read != source.rows.numel():
            raise RuntimeError(f"The native row step read {read} of the {source.rows.numel()} landed rows: rows "
                               f"outside the stepped blocks.")


@lru_cache(maxsize=1)
def native_row_adam() -> NativeRowAdam | None:
    """The kernel, built (or found built) and checked on this machine, or ``None`` (said once in the log, with why)."""
    kernel, outcome, detail = load_checked(SOURCE, "row_adam", _FLAGS, NativeRowAdam, lambda k: _check(k))
    if outcome == "off":
        log.info("The row Adam's native kernel is off (LIGHTNING_OFFLOAD_NATIVE=0): MEFT's rows are stepped by "
                 "torch's fused kernel (the same results, slower).")
    elif outcome == "unavailable":
        log.warning("The row Adam's native kernel is not available (%s): MEFT's rows are stepped by torch's fused "
                    "kernel, with the same results but slower (each block routing covered in part is assembled "
                    "first). Install a C compiler (gcc or clang) for the faster step, or set "
                    "LIGHTNING_OFFLOAD_NATIVE=0 to say so and silence this.", detail)
    elif outcome == "mismatch":
        log.warning("The row Adam's native kernel does not give torch's results on this machine (%s): MEFT's rows "
                    "are stepped by torch's fused kernel (slower). Please report this with your CPU and torch "
                    "version.", detail)
    else:
        log.info("The row Adam's native kernel is in use (%s).", detail)
    return kernel


def _check(kernel: NativeRowAdam) -> str:
    """Steps random blocks with the kernel and with torch's: ``""`` when every bit agrees, else what differed."""
    generator = torch.Generator().manual_seed(0)
    rows, width, block_rows = 12, 32, 4
    cases = [(1e-3, 0.9, 0.999, 0.01, 1e-8, 1.0, True, False, 3), (3e-4, 0.9, 0.95, 0.0, 1e-8, 1.0, True, True, 1),
             (1e-2, 0.8, 0.99, 0.1, 1e-6, 0.37, False, False, 100), (2e-3, 0.3, 0.999, 0.05, 1e-3, 3.3, False, True, 7),
             (5e-4, 0.6, 0.98, 0.2, 1e-8, 1.7, True, False, 40), (0.0, 0.9, 0.999, 0.0, 1e-8, 1.0, True, False, 2)]
    # Weights lr 0 leaves as they are, whose bf16 copies are rounding edge cases: subnormals, ±0, overflow, ±inf, ties.
    edges = torch.tensor([1e-39, -1e-39, 3e-40, 0.0, -0.0, 1e38, 3.4e38, math.inf, -math.inf, 1.00390625, 1.01171875],
                         dtype=torch.float32)
    for lr, beta1, beta2, decay, eps, divisor, decoupled, maximize, step in cases:
        param = torch.randn(rows, width, generator=generator, dtype=torch.float32)
        if lr == 0.0:
            param[0, :edges.numel()] = edges
        exp_avg = torch.randn(rows, width, generator=generator, dtype=torch.float32) * 0.1
        exp_avg_sq = torch.rand(rows, width, generator=generator, dtype=torch.float32) * 0.01
        grad = torch.randn(rows, width, generator=generator, dtype=torch.float32)
        kept = torch.tensor([0, 1, 3, 8, 9, 10, 11])  # block 0 in part, block 2 whole
        expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
        assembled = torch.zeros(rows, width, dtype=torch.float32)
        assembled[kept] = grad[kept]
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        for block in (0, 2):
            piece = slice(block * block_rows, (block + 1) * block_rows)
            fused([expected[0][piece]], [assembled[piece].clone()], [expected[1][piece]], [expected[2][piece]], [],
                  [torch.tensor(float(step), dtype=torch.float32)], lr=lr, beta1=beta1, beta2=beta2,
                  weight_decay=decay, eps=eps, amsgrad=False, maximize=maximize,
                  grad_scale=None if divisor == 1.0 else torch.tensor(divisor, dtype=torch.float32), found_inf=None)
        hyper = torch.tensor([[lr, beta1, decay, eps, divisor]] * 2, dtype=torch.float64)
        mirror = torch.zeros(rows, width, dtype=torch.bfloat16)
        kernel.step_blocks(param, exp_avg, exp_avg_sq, block_rows, torch.tensor([0, 2]), hyper, beta2, step,
                           decoupled, maximize, None, grad[kept].contiguous(), kept, mirror=mirror,
                           threads=1 + step % 2)
        stepped = torch.cat([torch.arange(0, block_rows), torch.arange(2 * block_rows, 3 * block_rows)])
        expected_mirror = torch.zeros(rows, width, dtype=torch.bfloat16)
        expected_mirror[stepped] = expected[0][stepped].to(torch.bfloat16)
        for name, got, want in zip(("weights", "first moments", "second moments", "bf16 copies"),
                                   (param, exp_avg, exp_avg_sq, mirror), [*expected, expected_mirror]):
            if not torch.equal(got, want):
                return f"{name} differ at lr={lr}, beta1={beta1}, decoupled={decoupled}, maximize={maximize}"
    return ""
