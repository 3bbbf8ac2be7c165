"""The device time of a plan's projected layers' products: timed on this device by the kernels a run would choose, or
at the memory floor for hardware that is not this machine.

A projected weight ``o × i`` (projectors to ``d_o`` and ``d_i``, ``r`` nonzeros a column) over ``T`` tokens a step runs
four products (``lsp/linear.py``): the forward's ``B Xᵀ`` (``compress_tokens`` of ``T × i``), the backward's
``A Δᵀ`` (of ``T × o``), and the update: ``U B`` (``expand_columns`` of ``d_o × d_i``), then
``W ← W·decay + Aᵀ·(U B)`` in place (``update_rows_``). Their speed depends on the device, the shape and the layout
(the fastest kernel changed with the width on one CPU), so no single rate predicts them:

- **Calibrated hardware** (this machine): each distinct layer's products run through a
  :class:`~lightning_offload.lsp.kernels.selection.KernelSelector` under the run's ``kernels=`` policy, on random
  operands of the layer's shape. That is the selection a run makes at its first step, and it shares the run's
  choices kept per machine: a plan after a run reads that run's timings, a run after a plan starts with the plan's.
- **A named profile** (not measured): the kernels approach the memory floor (each reads its input once), so each
  product is its bytes read and written over the profile's device bandwidth.

The ``S = (A Δᵀ)(B Xᵀ)ᵀ`` GEMM is not here: the cost model counts its FLOPs with the other matmuls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_offload.lsp.kernels.selection import KernelSelector
from lightning_offload.lsp.layouts import LayerLayout
from lightning_offload.lsp.projector import random_projector
from lightning_offload.planning.calibration import Hardware
from lightning_offload.planning.inventory import Entry

#: Bytes of one projector nonzero as the kernels read it (its index and fp32 value).
_NONZERO_BYTES = 8
#: Elements of the largest operand a plan times a product on (64 MiB in fp32): a larger layer (a 152K-vocabulary head:
#: 233M weight elements, 311M gradient elements a step) is timed with its larger side cut, so that planning takes
#: seconds and never needs the memory of the model it plans.
TIMED_ELEMENTS = 2**24


def projection_seconds(projected: list[Entry], tokens: int, density: int, hw: Hardware, compute_dtype: torch.dtype,
                       policy: str) -> float:
    """Device seconds a step spends in the projected weights' four products (see the module docstring).

    Args:
        projected: the inventory's projected weights.
        tokens: tokens a step.
        density: nonzeros per projector column.
        hw: the hardware planned for; timed when it was measured on this machine's device, else the memory floor.
        compute_dtype: the dtype activations and their gradients are projected in.
        policy: the run's ``kernels=`` setting (``"auto"`` or a kernel's name).
    """
    timed = hw.measured and (hw.device == "cpu" or torch.cuda.is_available())
    total = 0.0
    for entry in projected:
        (o, i), (d_o, d_i) = entry.projector_sizes, entry.compressed
        weight_dtype = torch.bfloat16 if entry.itemsize == 2 else torch.float32
        if timed:
            total += _bounded_seconds(o, i, d_o, d_i, density, tokens, compute_dtype, weight_dtype, entry.layout,
                                      hw.device, policy)
        else:
            total += _floor_bytes(o, i, d_o, d_i, density, tokens, compute_dtype.itemsize, entry.itemsize) \
                / hw.device_bandwidth
    return total


def _floor_bytes(o: int, i: int, d_o: int, d_i: int, density: int, tokens: int, activation_bytes: int,
                 weight_bytes: int) -> int:
    """Bytes the four products read and write at the least: each input once, each output once (fp32 results)."""
    compress = sum(tokens * n * activation_bytes + tokens * d * 4 + n * density * _NONZERO_BYTES
                   for n, d in ((i, d_i), (o, d_o)))
    expand = d_o * d_i * 4 + d_o * i * 4 + i * density * _NONZERO_BYTES
    update = 2 * o * i * weight_bytes + d_o * i * 4 + o * density * _NONZERO_BYTES
    return compress + expand + update


def _bounded_seconds(o: int, i: int, d_o: int, d_i: int, density: int, tokens: int, compute_dtype: torch.dtype,
                     weight_dtype: torch.dtype, layout: LayerLayout, device_type: str, policy: str) -> float:
    """One layer's four products as :func:`_timed_seconds` times them, at a size whose operands stay within
    :data:`TIMED_ELEMENTS`: the larger side ``n`` (and its compressed size) is cut by a factor ``f``, and each product
    whose work is linear in that side is counted ``f`` times (the compression of the other side's tokens is not)."""
    cut = max(1, math.ceil(max(o * i, tokens * max(o, i)) / TIMED_ELEMENTS))
    if cut == 1:
        return sum(_timed_seconds(o, i, d_o, d_i, density, tokens, compute_dtype, weight_dtype, layout,
                                  device_type, policy))
    output_cut = o >= i
    if output_cut:
        o, d_o = math.ceil(o / cut), max(density, math.ceil(d_o / cut))
    else:
        i, d_i = math.ceil(i / cut), max(density, math.ceil(d_i / cut))
    forward, backward, expand, apply = _timed_seconds(o, i, d_o, d_i, density, tokens, compute_dtype, weight_dtype,
                                                      layout, device_type, policy)
    # The forward compresses the input side's tokens, the backward the output side's: each is linear in its own side
    # only. The update's two products are linear in either side.
    forward, backward = (forward, backward * cut) if output_cut else (forward * cut, backward)
    return forward + backward + (expand + apply) * cut


@functools.lru_cache(maxsize=256)
def _timed_seconds(o: int, i: int, d_o: int, d_i: int, density: int, tokens: int, compute_dtype: torch.dtype,
                   weight_dtype: torch.dtype, layout: LayerLayout, device_type: str,
                   policy: str) -> tuple[float, float, float, float]:
    """One layer's four products on this device as ``lsp/linear.py`` runs them (the same products, so the same keys
    in the kept choices), each by the kernel the selection chooses, at its best timed call: the seconds of the
    forward's compression, the backward's, the update's expansion and its application. Kept for the process, as the
    selection keeps its choices."""
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    proj_in = random_projector(i, d_i, density, generator, device)
    proj_out = random_projector(o, d_o, density, generator, device)
    x = torch.randn(tokens, i, generator=generator).to(device, compute_dtype)
    delta = torch.randn(tokens, o, generator=generator).to(device, compute_dtype)
    update = torch.randn(d_o, d_i, generator=generator).to(device)
    # The stored weight's rows and the update's small side as the layer's layout gives them (a Conv1D's rows are
    # input features, expanded by B from Uᵀ A, a view of U).
    rows_projector, columns_projector, small_side = layout.update_sides(proj_out, proj_in, update)
    weight = torch.randn(rows_projector.dim_in, columns_projector.dim_in, generator=generator).to(device, weight_dtype)

    def timed(product: Callable[[KernelSelector], Tensor | None]) -> tuple[Tensor | None, float]:
        # A selector per product: two products of one key (a square layer's two compressions) count twice.
        # measure=True: a forced kernel is timed too (a run's own selection never times a forced one).
        selector = KernelSelector(policy, measure=True)
        result = product(selector)
        (key,) = selector.choices
        milliseconds = selector.milliseconds(key)
        if milliseconds is None:
            raise RuntimeError(f"The kernel selection kept no time for {key}: {selector.choices[key]}")
        return result, milliseconds

    _, forward = timed(lambda selector: selector.compress_tokens(proj_in, x))
    _, backward = timed(lambda selector: selector.compress_tokens(proj_out, delta))
    half, expand = timed(lambda selector: selector.expand_columns(columns_projector, small_side))
    rounding = torch.Generator(device=device).manual_seed(0)
    _, apply = timed(lambda selector: selector.update_rows_(weight, rows_projector, half, 1.0, rounding))
    return forward / 1e3, backward / 1e3, expand / 1e3, apply / 1e3
