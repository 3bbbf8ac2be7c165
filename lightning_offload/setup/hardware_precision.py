"""The training precision the hardware computes fastest: bf16 where the device has bf16 arithmetic, fp32 elsewhere.

A CPU without bf16 instructions (AVX512-BF16 or AMX) runs a bf16 matmul in an emulated kernel at best (2.8× slower
than fp32 on an AVX-512 CPU) and in a reference kernel at worst: on an AVX2-only x86 CPU one SmolLM2 output-head
product took 93 s in bf16 against 0.44 s in fp32. Which of these a machine gets depends on the CPU and on the kernels
torch was built with, and a capability flag does not always tell (oneDNN can be capped below what the CPU reports), so
the CPU's case is decided by measuring: one small matmul in each dtype.

Use it for a Trainer of your own::

    choice = lightning_offload.hardware_precision()
    trainer = L.Trainer(strategy="lsp_offload", precision=choice.precision)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

#: A bf16 matmul at most this many times an fp32 one's time counts as native: native bf16 kernels run about twice
#: as fast as fp32 (0.5 measured on an AVX512-BF16 CPU), emulated ones 2.8× slower or far worse.
NATIVE_BF16_MAX_RATIO = 1.0


@dataclass(frozen=True)
class PrecisionChoice:
    """A Trainer ``precision`` and why it was chosen.

    Attributes:
        precision: ``"bf16-mixed"`` or ``"32-true"``.
        reason: one sentence for the log: the device and what decided.
        bf16_to_fp32_time: the CPU probe's bf16/fp32 matmul time ratio (``None`` on a GPU).
    """

    precision: str
    reason: str
    bf16_to_fp32_time: float | None = None


def bf16_matmul_slowdown(size: tuple[int, int, int] = (128, 512, 512), rounds: int = 9) -> float:
    """The fastest bf16 CPU matmul's time over the fastest fp32 one's (< 1: bf16 is faster).

    The dtypes alternate, one product each per round, and each keeps its fastest time: a burst of other work on the
    machine slows the products it overlaps, never the fastest of each, unless it lasts the whole probe. (A median of
    three products per dtype, one dtype after the other, read 1.8× in one of five runs on an idle AVX-512 CPU whose
    bf16 is native, 0.21–0.31× in the others: that run trained in fp32.) Takes a few milliseconds where bf16 is
    native, about a second in torch's reference kernel.

    Args:
        size: ``(m, k, n)`` of the ``m × k`` by ``k × n`` product.
        rounds: timed products per dtype, after one untimed warm-up each.
    """
    m, k, n = size
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    operands = {dtype: (left.to(dtype), right.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    fastest = {}
    for dtype, (a, b) in operands.items():
        torch.mm(a, b)  # warm-up: the first call picks and may build the kernel
        fastest[dtype] = math.inf
    for _ in range(rounds):
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.mm(a, b)
            fastest[dtype] = min(fastest[dtype], time.perf_counter() - start)
    return fastest[torch.bfloat16] / max(fastest[torch.float32], 1e-9)


def uses_cuda(accelerator: str) -> bool:
    """Whether a Trainer with this ``accelerator`` trains on a CUDA device."""
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()


def hardware_precision(accelerator: str = "auto") -> PrecisionChoice:
    """The precision to train in on this machine: ``bf16-mixed`` where the device computes bf16 natively, else
    ``32-true``.

    A CUDA device counts as native when torch says it supports bf16 (Ampere and newer); ``16-mixed`` is never chosen,
    since fp16 loss scaling sees only ``param.grad``, which offloaded weights do not have. A CPU is probed with
    :func:`bf16_matmul_slowdown`.

    Args:
        accelerator: the Trainer's ``accelerator`` (``"auto"``, ``"cpu"``, ``"gpu"``, ``"cuda"``).

    Returns:
        The choice with a one-sentence reason for the log.
    """
    if uses_cuda(accelerator):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16-mixed", f"{torch.cuda.get_device_name()} computes bf16 natively")
        return PrecisionChoice("32-true", "this CUDA device has no bf16 arithmetic (and offloaded weights cannot use "
                                          "16-mixed's loss scaling)")
    ratio = bf16_matmul_slowdown()
    if ratio <= NATIVE_BF16_MAX_RATIO:
        return PrecisionChoice("bf16-mixed", f"a bf16 matmul on this CPU took {ratio:.2f}× the time of fp32 (native "
                                             f"bf16)", ratio)
    return PrecisionChoice("32-true", f"a bf16 matmul on this CPU took {ratio:.1f}× the time of fp32 (no native bf16: "
                                      f"emulated or a reference kernel)", ratio)
