"""Stochastic rounding of fp32 values into bf16 storage.

A bf16 number is the upper 16 bits of an fp32 number. Adding a uniform random integer in ``[0, 2¹⁶)`` to the
fp32 bit pattern and truncating the low 16 bits rounds up with probability equal to the discarded fraction, so
the rounding is unbiased: ``E[round(x)] = x``. Round-to-nearest would instead drop every update smaller than half
an ulp of the weight — most of a fine-tuning step's updates.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW_BITS = 1 << 16
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as a signed int32


def stochastic_round_to_bf16(value: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round an fp32 tensor to bf16, unbiasedly.

    Args:
        value: fp32 tensor.
        generator: generator on ``value``'s device, for reproducible rounding (and resumable runs).

    Returns:
        A bf16 tensor of the same shape. Non-finite inputs round to nearest (their bit patterns must not be
        perturbed into other classes of number).
    """
    if value.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 expects fp32 input, got {value.dtype}.")
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_BITS, bits.shape, generator=generator, device=bits.device, dtype=torch.int32)
    noise.add_(bits).bitwise_and_(_HIGH_MASK)
    rounded = noise.view(torch.float32)
    # Values at the top of the finite range can carry into inf, and inf/nan inputs must keep their class: those
    # take plain rounding instead. (Integer wrap-around only reaches NaN bit patterns, which isnan catches.)
    keep = torch.isfinite(rounded).logical_and_(~torch.isnan(value))
    return torch.where(keep, rounded, value).to(torch.bfloat16)


def copy_stochastic_rounded_(target: Tensor, value: Tensor, generator: torch.Generator | None = None) -> None:
    """Write fp32 ``value`` into the low-precision tensor ``target`` in place, rounding stochastically for bf16.

    Args:
        target: bf16 (stochastic rounding) or another dtype (round to nearest) tensor to overwrite.
        value: the fp32 new value, same shape.
        generator: generator on the tensors' device.
    """
    if target.dtype == torch.bfloat16:
        target.copy_(stochastic_round_to_bf16(value, generator))
    else:
        target.copy_(value)
