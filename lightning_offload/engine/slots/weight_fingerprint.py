"""Noticing writes into a parameter that move no version counter: ``p.data.clamp_(...)``, ``w.data.copy_(...)`` in a
max-norm hook, ``lm_head.weight.data.mul_(0.9)``.

``torch.optim`` steps from whatever the parameter holds, so such writes are kept; the engine steps a host master and
writes the result back, so it must notice them to keep them too. The engine writes parameters through ``.data`` as well,
which is why the counter cannot tell (it moves for a plain in-place write, which ``Slot.weights_written`` sees). A
*fingerprint* can: the sum of the parameter's bit patterns modulo 2³² (the elements viewed as integers, summed in
wrapping int32 arithmetic), taken on the device right after each of the engine's writes and again at the next step.
Integer addition is exact and associative, so equal contents give equal fingerprints on any device in any summation
order, and any change of one element changes it; only changes that cancel modulo 2³² over several elements (a
permutation of the values) go unseen. One pass over the parameter at memory speed (an int32 sum runs as fast as an
fp32 one), twice a step; the step reads all the fingerprints with one device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensor: Tensor, out: Tensor | None = None) -> Tensor:
    """The sum of ``tensor``'s bit patterns modulo 2³² (2⁶⁴ for 8-byte elements), a 0-dim integer on its device.

    Args:
        tensor: the values to fingerprint.
        out: a 0-dim buffer of :func:`fingerprint_dtype` on ``tensor``'s device to write the sum into (the host worker
            passes one, so that its steady-state jobs allocate nothing); a new tensor where ``None``.
    """
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    if size == 2 and flat.numel() % 2 == 0 and flat.storage_offset() % 2 == 0:
        # Pairs of 16-bit elements as one int32 word: a change of either half changes the word, and summing words
        # avoids widening each element (which runs ~20x slower than the int32 sum).
        words = flat.view(torch.int32)
    else:
        words = flat.view(_INT_OF_SIZE[size])
    dtype = fingerprint_dtype(tensor)
    if out is None:
        return words.sum(dtype=dtype)
    return torch.sum(words, dim=0, dtype=dtype, out=out)


def fingerprint_dtype(tensor: Tensor) -> torch.dtype:
    """The integer dtype of :func:`fingerprint`'s result for ``tensor``."""
    return torch.int64 if tensor.element_size() == 8 else torch.int32


def changed_since(tensors: Sequence[Tensor], fingerprints: Sequence[Tensor]) -> list[bool]:
    """Whether each tensor's fingerprint differs from the one given (a host or a device scalar), read with one
    synchronisation: the host ones cross to the device in one copy, the answers come back in one."""
    if not tensors:
        return []
    device = tensors[0].device
    now = torch.stack([fingerprint(tensor).to(torch.int64) for tensor in tensors])
    on_host = [i for i, given in enumerate(fingerprints) if given.device != device]
    before = torch.empty(len(tensors), dtype=torch.int64, device=device)
    if on_host:
        host = torch.stack([fingerprints[i].to(torch.int64) for i in on_host])
        before[torch.tensor(on_host, device=device)] = host.to(device)
    on_device = [i for i, given in enumerate(fingerprints) if given.device == device]
    if on_device:
        before[torch.tensor(on_device, device=device)] = torch.stack([fingerprints[i].to(torch.int64)
                                                                      for i in on_device])
    return (now != before).tolist()
