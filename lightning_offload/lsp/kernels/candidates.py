"""The kernels a projected layer's three products can run on, one class each; :mod:`.selection` times them.

Every kernel computes the same three products (:mod:`.reference` defines them) on a
:class:`~lightning_offload.lsp.projector.SparseProjector`:

* ``compress_tokens(P, x)``: ``P · xᵀ`` for token-major ``x`` (``T × n``), the forward's ``B Xᵀ`` and the
  backward's ``A Δᵀ``;
* ``expand_columns(P, m)``: ``m · P``, the update's small side ``U B`` (or ``Uᵀ A`` for a transposed storage such
  as ``Conv1D``'s: the layer's layout picks the sides, ``lsp/layouts``);
* ``update_rows_(W, P, half, decay, generator)``: ``W ← W·decay + Pᵀ·half`` in place, bf16 weights rounded
  stochastically.

The kernels: ``csr`` (torch's sparse CSR products, :class:`SparseProjector`'s own, any device), ``dense`` (the
projector formed densely for each product and freed with it, then a dense matmul: on an accelerator the matmul units
may beat any sparse kernel, and nothing dense is kept), ``native`` (the CPU's C kernels, :mod:`.native`) and
``triton`` (CUDA, :mod:`.triton_projection`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from lightning_offload.lsp.projector import SparseProjector, product_dtype
from lightning_offload.lsp.rounding import copy_stochastic_rounded_

#: Elements of one block of an update's fp32 temporary where a kernel forms it (``csr`` and ``dense``): 1 MiB on the
#: CPU (it stays in cache); 16 MiB on CUDA, where each block costs a few kernel launches.
_UPDATE_BLOCK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 22}


def update_block_rows(row_length: int, device: torch.device) -> int:
    """Rows of a weight updated per block by the kernels that form the update's fp32 rows (at least one)."""
    elements = _UPDATE_BLOCK_ELEMENTS.get(device.type, _UPDATE_BLOCK_ELEMENTS["cuda"])
    return max(1, elements // max(row_length, 1))


def _seed(generator: torch.Generator | None, weight: Tensor) -> int | None:
    """The stochastic rounding's seed of one update, drawn from the layer's generator (so a resumed run, which
    restores the generator, rounds as the uninterrupted one); ``None`` for weights that are not bf16.

    A CUDA generator is advanced on the host (its Philox offset) instead of drawn from: a draw would be a device
    tensor, and reading it back would stall the pipeline at every layer's update.
    """
    if weight.dtype != torch.bfloat16:
        return None
    if generator is not None and generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # Philox offsets advance in fours
        return (generator.initial_seed() * 0x9E3779B97F4A7C15 + offset) & (2**64 - 1)
    return int(torch.randint(0, 2**62, (1,), generator=generator))


class ProjectionKernel(Protocol):
    """One way of computing the three products (see the module docstring)."""

    name: str

    def applies(self, device: torch.device) -> bool:
        """Whether this kernel can run on ``device`` in this process."""
        ...

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether this kernel computes a product whose operand (``x``, the matrix expanded, the weight) is
        ``dtype``."""
        ...

    def working_bytes(self, product: str, projector: SparseProjector, operand: Tensor) -> int:
        """Bytes this kernel allocates for one ``product`` (``"compress_tokens"``, ``"expand_columns"`` or
        ``"update_rows"``) of ``projector`` beyond its operands and its result: what its trial and its use cost."""
        ...

    def compress_tokens(self, projector: SparseProjector, x: Tensor) -> Tensor:
        """``P · xᵀ`` (``d × T``, in :func:`~lightning_offload.lsp.projector.product_dtype` of ``x``)."""
        ...

    def expand_columns(self, projector: SparseProjector, matrix: Tensor) -> Tensor:
        """``matrix · P`` (``k × n`` fp32, contiguous) for ``matrix`` of ``k × d`` fp32."""
        ...

    def update_rows_(self, weight: Tensor, projector: SparseProjector, half: Tensor, decay: float,
                     generator: torch.Generator | None) -> None:
        """``weight ← weight·decay + Pᵀ·half`` in place (``half``: ``d × cols`` fp32)."""
        ...


class CsrKernel:
    """torch's sparse CSR products (:meth:`SparseProjector.compress_rows` / :meth:`~SparseProjector.expand_rows`); the
    update block by block, each block's fp32 rows formed, decayed, added and rounded before the next."""

    name = "csr"

    def applies(self, device: torch.device) -> bool:
        return True

    def working_bytes(self, product: str, projector: SparseProjector, operand: Tensor) -> int:
        # The projector's CSR forms (and their transposes): row pointers, column indices and values per nonzero.
        return 2 * (projector.dim_in * projector.nnz_per_column * 12 + (projector.dim_out + projector.dim_in) * 8)

    def takes(self, dtype: torch.dtype) -> bool:
        return True

    def compress_tokens(self, projector: SparseProjector, x: Tensor) -> Tensor:
        return projector.compress_rows(x.t())

    def expand_columns(self, projector: SparseProjector, matrix: Tensor) -> Tensor:
        return projector.expand_rows(matrix.t()).t().contiguous()

    def update_rows_(self, weight: Tensor, projector: SparseProjector, half: Tensor, decay: float,
                     generator: torch.Generator | None) -> None:
        _update_by_blocks(weight, half, decay, generator, lambda rows: projector.expand_rows(half, rows))


class DenseKernel:
    """The projector formed densely for each product (in the product's dtype) and freed with it; the products are
    dense matmuls. Nothing dense is kept between products: at 8B parameters the projectors would take ~12 GB."""

    name = "dense"

    def applies(self, device: torch.device) -> bool:
        return True

    def working_bytes(self, product: str, projector: SparseProjector, operand: Tensor) -> int:
        # The dense projector, in the product's dtype (compressions) or fp32 (the update's two products).
        itemsize = product_dtype(operand).itemsize if product == "compress_tokens" else 4
        return projector.dim_out * projector.dim_in * itemsize

    def takes(self, dtype: torch.dtype) -> bool:
        return True

    @staticmethod
    def _dense(projector: SparseProjector, dtype: torch.dtype) -> Tensor:
        dense = torch.zeros(projector.dim_out, projector.dim_in, dtype=dtype, device=projector.values.device)
        columns = torch.arange(projector.dim_in, device=dense.device).unsqueeze(1).expand_as(projector.indices)
        dense[projector.indices.long(), columns] = projector.values.detach().to(dtype)
        return dense

    def compress_tokens(self, projector: SparseProjector, x: Tensor) -> Tensor:
        dtype = product_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return self._dense(projector, dtype) @ x.to(dtype).t()

    def expand_columns(self, projector: SparseProjector, matrix: Tensor) -> Tensor:
        return matrix.float() @ self._dense(projector, torch.float32)

    def update_rows_(self, weight: Tensor, projector: SparseProjector, half: Tensor, decay: float,
                     generator: torch.Generator | None) -> None:
        dense_t = self._dense(projector, torch.float32).t()
        _update_by_blocks(weight, half, decay, generator, lambda rows: dense_t[rows] @ half)


def _update_by_blocks(weight: Tensor, half: Tensor, decay: float, generator: torch.Generator | None,
                      delta_of: Callable[[slice], Tensor]) -> None:
    """``weight ← weight·decay + delta`` a block of rows at a time, each block's fp32 ``delta`` from ``delta_of``."""
    rows, row_length = weight.shape
    block = update_block_rows(row_length, weight.device)
    for start in range(0, rows, block):
        rows_here = slice(start, min(start + block, rows))
        delta = delta_of(rows_here)  # fp32, block × row_length
        target = weight[rows_here]
        if weight.dtype == torch.float32:
            if decay != 1.0:
                target.mul_(decay)
            target.add_(delta)
        else:
            # Low-precision weights: the new value in fp32 (reusing delta's memory), rounded stochastically
            # (unbiased), since round-to-nearest would drop updates smaller than half a bf16 ulp of the weight.
            new_value = delta.add_(target, alpha=decay) if decay != 1.0 else delta.add_(target)
            copy_stochastic_rounded_(target, new_value, generator)


class NativeKernel:
    """The CPU's C kernels (:mod:`.native`): each large operand read once, whole vectors, every thread's share fixed."""

    name = "native"

    def applies(self, device: torch.device) -> bool:
        if device.type != "cpu":
            return False
        from lightning_offload.lsp.kernels.native import native_projection  # noqa: PLC0415  (built on first use)

        return native_projection() is not None

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)  # the C code reads fp32 or bf16 operands, nothing else

    def working_bytes(self, product: str, projector: SparseProjector, operand: Tensor) -> int:
        return projector.dim_in * 8  # the compression's counting sort of the indices; nothing else beside the result

    _loaded = None

    def _kernels(self):  # noqa: ANN202  (NativeProjection; imported lazily, kept: a step asks per product and layer)
        if self._loaded is None:
            from lightning_offload.lsp.kernels.native import native_projection  # noqa: PLC0415

            self._loaded = native_projection()
        return self._loaded

    def compress_tokens(self, projector: SparseProjector, x: Tensor) -> Tensor:
        return self._kernels().compress_tokens(projector.indices, projector.values.detach(), projector.dim_out, x)

    def expand_columns(self, projector: SparseProjector, matrix: Tensor) -> Tensor:
        # The kernel reads Mᵀ by rows: for U B that is Uᵀ (a small copy); for Conv1D's Uᵀ A it is U itself.
        matrix_t = matrix.float().t().contiguous()
        return self._kernels().expand_columns(projector.indices, projector.values.detach(), projector.dim_out,
                                              matrix_t)

    def update_rows_(self, weight: Tensor, projector: SparseProjector, half: Tensor, decay: float,
                     generator: torch.Generator | None) -> None:
        self._kernels().update_rows_(weight, projector.indices, projector.values.detach(), half.contiguous(), decay,
                                     _seed(generator, weight))


class TritonKernel:
    """The CUDA kernels written in Triton (:mod:`.triton_projection`); offered where ``triton`` imports and the device
    is CUDA."""

    name = "triton"

    def applies(self, device: torch.device) -> bool:
        if device.type != "cuda" or os.environ.get("LIGHTNING_OFFLOAD_TRITON", "1") == "0":
            return False
        from lightning_offload.lsp.kernels import triton_projection  # noqa: PLC0415  (imports triton)

        return triton_projection.available()

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)  # the kernels' loads and stores are written for these

    def working_bytes(self, product: str, projector: SparseProjector, operand: Tensor) -> int:
        return 0  # each program reads the operands and writes its share of the result

    def compress_tokens(self, projector: SparseProjector, x: Tensor) -> Tensor:
        from lightning_offload.lsp.kernels import triton_projection  # noqa: PLC0415

        out = triton_projection.compress_tokens(projector.indices, projector.values.detach(), projector.dim_out, x)
        return out.to(product_dtype(x))

    def expand_columns(self, projector: SparseProjector, matrix: Tensor) -> Tensor:
        from lightning_offload.lsp.kernels import triton_projection  # noqa: PLC0415

        return triton_projection.expand_columns(projector.indices, projector.values.detach(), projector.dim_out,
                                                matrix.float().contiguous())

    def update_rows_(self, weight: Tensor, projector: SparseProjector, half: Tensor, decay: float,
                     generator: torch.Generator | None) -> None:
        from lightning_offload.lsp.kernels import triton_projection  # noqa: PLC0415

        triton_projection.update_rows_(weight, projector.indices, projector.values.detach(), half.contiguous(),
                                       decay, _seed(generator, weight))


#: Every kernel, in the order a tie between their timings is broken (the first, torch's own, wins a tie).
KERNELS: dict[str, ProjectionKernel] = {kernel.name: kernel for kernel in (CsrKernel(), DenseKernel(), NativeKernel(),
                                                                           TritonKernel())}
