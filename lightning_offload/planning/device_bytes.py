"""Device bytes of a run besides its activations: the weights, the gradients as the engine keeps them, the optimizer
state a plain run or a device placement keeps, and what the offload machinery keeps between steps (under the names of
``offload/device_persistent_bytes/*``).

Sizes follow the engine's structures: projectors (``lsp/projector.py``: int16/int32 indices, fp32 values, an int32
permutation and the CSR row pointers; on the CPU also the CSR forms it keeps between products), the update ring
(``engine/lanes/link.py``: ``update_buffers`` buffers of the largest compressed update), the scaled rule's ``P``
(``lsp/channel_scales.py``) and the device Adam (``engine/step/device_optimizer.py``: fp32 moments and fp32 masters of
narrower parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_offload.engine.lanes.link import default_update_buffers
from lightning_offload.engine.rules.host_rule import HostRule
from lightning_offload.planning.inventory import Entry, Inventory

#: Device bytes per projector nonzero on an accelerator: fp32 value and int32 permutation (the index is sized apart).
NONZERO_BYTES_ACCELERATOR = 4 + 4
#: On the CPU (whose "device" memory is the host's), the CSR form of ``P`` kept between products adds its column
#: numbers and values (docs/design.md, "Device memory per projected layer"), and the transposed form the same again.
NONZERO_BYTES_CPU = NONZERO_BYTES_ACCELERATOR + 8 + 8
#: Under the native, dense and Triton kernels (lsp/kernels/): the fp32 value alone (nothing else is kept).
NONZERO_BYTES_OTHER_KERNELS = 4


@dataclass(frozen=True)
class DeviceParts:
    """Device bytes by part (activations apart).

    Attributes:
        weights: every parameter as it trains.
        gradients: the gradients that exist on the device at once at their peak (a plain run's every ``.grad``; an
            offload's dense gradients and compressed ``S`` before they leave, the scaled rule's held ``G``).
        optimizer_state: a plain run's Adam moments, or the device Adam's of device placements (with fp32 masters).
        persistent: the offload machinery's bytes between steps, by ``offload/device_persistent_bytes/*`` category.
    """

    weights: int
    gradients: int
    optimizer_state: int
    persistent: dict[str, int]

    @property
    def total(self) -> int:
        """Everything but activations."""
        return self.weights + self.gradients + self.optimizer_state + sum(self.persistent.values())


def projector_bytes(entry: Entry, density: int, accelerator: bool, csr: bool = True) -> int:
    """Device bytes of a projected weight's two projectors: indices and values, and where their products run on
    torch's CSR kernels (``csr``) the CSR structure (permutation, row pointers) and, on the CPU, its kept forms."""
    total = 0
    for size, dim in zip(entry.projector_sizes, entry.compressed):
        nonzeros = size * density
        index = 2 if dim <= 32768 else 4
        if not csr:  # the other kernels read the indices and values in place
            total += nonzeros * (index + NONZERO_BYTES_OTHER_KERNELS)
            continue
        per = NONZERO_BYTES_ACCELERATOR if accelerator else NONZERO_BYTES_CPU
        total += nonzeros * (index + per) + (dim + 1) * 4
        if not accelerator:  # the transposed CSR form's row pointers
            total += (size + 1) * 4
    return total


def device_parts(found: Inventory, plain: bool, density: int, accelerator: bool, update_buffers: int | None,
                 link_itemsize: int, rule: HostRule, csr: bool = True, asynchronous: bool | None = None,
                 device_memory: int = 0) -> DeviceParts:
    """The device bytes of ``found``'s run, activations apart.

    Args:
        found: the run's inventory.
        plain: plain training (every tensor stepped by the user's optimizer on the device; moments in the parameter's
            dtype, as torch's).
        density: the projectors' nonzeros per column.
        accelerator: the device is a GPU (no CPU caches, an update ring by default).
        update_buffers: the ring's buffers (``None``: the engine's default,
            :func:`~lightning_offload.engine.lanes.link.default_update_buffers` where the link copies asynchronously,
            none on the CPU).
        link_itemsize: bytes per element on the link (the ring's dtype).
        rule: the user's optimizer's rule (how many moments it keeps, and its step counter).
        csr: the projections run on torch's CSR kernels (which keep CSR forms of the projectors).
        asynchronous: the link copies asynchronously (a GPU's, the simulated one). Default: ``None`` (``accelerator``).
        device_memory: the device's memory in bytes, which the default ring takes a share of (0: unknown).
    """
    if plain:
        gradients = sum(e.numel * e.itemsize for e in found.entries)
        return DeviceParts(found.weight_bytes, gradients, rule.moments * gradients, {})
    projected, scaled, device = found.of("projected"), found.of("scaled"), found.of("device")
    # Dense and row gradients are .grad until sent; S is fp32 until sent; the scaled rule holds G until its scales
    # return (offload/device_held_gradient_bytes), so all of them can coexist at the end of backward.
    gradients = sum(e.numel * e.itemsize for e in found.of("dense", "rows", "device", "scaled"))
    gradients += sum(e.host_numel * 4 for e in projected)
    largest = max((e.host_numel for e in projected), default=0)
    asynchronous = accelerator if asynchronous is None else asynchronous
    buffers = update_buffers if update_buffers is not None else \
        default_update_buffers(len(projected), largest * link_itemsize, device_memory) if asynchronous else 0
    persistent = {
        "projectors": sum(projector_bytes(e, density, accelerator, csr) for e in projected),
        "update_ring": buffers * largest * link_itemsize if projected else 0,
        "scaled_projections": sum(e.compressed[1] * min(e.projector_sizes) * 4 for e in scaled),
        # fp32 moments, plus an fp32 master where the parameter is narrower, and each tensor's step.
        "device_optimizer": sum(e.numel * (4 * rule.moments + (4 if e.itemsize != 4 else 0)) + rule.step_bytes
                                for e in device),
    }
    return DeviceParts(found.weight_bytes, gradients, 0, persistent)
