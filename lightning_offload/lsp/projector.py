"""Sparse projectors: exactly ``r`` nonzeros per column, stored as indices plus values.

A projector ``P`` maps a dimension of size ``n`` to a compressed dimension of size ``d`` (``P`` is ``d × n``).
Column ``j`` of ``P`` holds ``r`` nonzeros at the distinct rows ``indices[j, :]`` (ascending) with weights
``values[j, :]``. It is never densified: :meth:`SparseProjector.compress_rows` (``M ↦ P M``) and
:meth:`SparseProjector.expand_rows` (``M ↦ Pᵀ M``) are sparse CSR products, ``O(n · r)`` work per column of ``M``,
equal to a dense product up to summation order.

Storage: the indices in :func:`index_dtype`, the values in fp32, and one int32 permutation from ``P``'s row-major
order to the ``(n, r)`` order. ``Pᵀ`` in CSR *is* the ``(n, r)`` layout, so its products read indices and values in
place; ``P`` in CSR reads the values through the permutation. On an accelerator the CSR forms are built per product;
on the CPU, where that memory is the host's, they are kept between products because building them is costly there.
Products run in :func:`product_dtype`.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
from torch import Tensor

# Rows of the random score matrix drawn at once when sampling collision-free indices; bounds the transient
# memory of :meth:`SparseProjector.random` to ``_INDEX_CHUNK × d`` floats whatever the layer size.
_INDEX_CHUNK = 1024


def index_dtype(dim_out: int) -> torch.dtype:
    """The smallest integer type that holds row numbers ``0 … dim_out − 1`` (int16 or int32)."""
    if dim_out <= torch.iinfo(torch.int16).max + 1:
        return torch.int16
    if dim_out <= torch.iinfo(torch.int32).max + 1:
        return torch.int32
    raise ValueError(f"A projector to {dim_out} dims is beyond int32 row numbers; use a rank below 2**31.")


def _csr(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta": the products used here are stable
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


class SparsityPattern:
    """The CSR structure of ``P`` (``d × n``) and ``Pᵀ`` (``n × d``) for fixed indices; values are supplied per call.

    Shared by the training products and the fit, whose value gradients come back in ``P``'s CSR order. Holds
    ``crow`` (``d + 1`` row pointers of ``P``) and ``order`` (for each nonzero of ``P`` in row-major order, its
    position in the flattened ``(n, r)`` values); ``P``'s column numbers are ``order // r``.
    """

    def __init__(self, indices: Tensor, dim_out: int) -> None:
        n, r = indices.shape
        rows = indices.reshape(-1).long()
        # Stable sort by compressed row keeps columns ascending within each row (they are generated ascending).
        self.order = torch.sort(rows, stable=True).indices.to(torch.int32)
        self.crow = torch.cat([rows.new_zeros(1), torch.bincount(rows, minlength=dim_out).cumsum(0)]).to(torch.int32)
        self.indices = indices
        self.shape = (dim_out, n)
        self.nnz_per_column = r

    def nbytes(self) -> int:
        """Device bytes this structure holds."""
        return self.order.numel() * 4 + self.crow.numel() * 4

    def matrix(self, values: Tensor) -> Tensor:
        """``P`` in CSR with the given flattened ``(n, r)`` values (gathered into ``P``'s order for this call)."""
        col = torch.div(self.order, self.nnz_per_column, rounding_mode="floor")
        return _csr(self.crow, col, values.reshape(-1)[self.order], self.shape)

    def transposed(self, values: Tensor, rows: slice | None = None) -> Tensor:
        """``Pᵀ`` in CSR (or its rows ``rows``: a slice of the input dimension), reading ``values`` in place."""
        n, r = self.shape[1], self.nnz_per_column
        start, stop = (0, n) if rows is None else (rows.start or 0, n if rows.stop is None else rows.stop)
        crow = torch.arange(0, (stop - start) * r + 1, r, dtype=torch.int32, device=self.crow.device)
        col = self.indices[start:stop].reshape(-1).to(torch.int32)
        return _csr(crow, col, values.reshape(n, r)[start:stop].reshape(-1), (stop - start, self.shape[0]))


class SparseProjector:
    """A ``d × n`` matrix with exactly ``r`` distinct nonzero rows in every column.

    Each column's indices are stored ascending (values permuted alongside), in :func:`index_dtype`.

    Args:
        indices: ``(n, r)`` integer tensor; row ``j`` lists the distinct compressed coordinates that input
            coordinate ``j`` maps to.
        values: ``(n, r)`` floating tensor of the matching weights.
        dim_out: ``d``, the compressed size.

    Raises:
        ValueError: if shapes disagree, an index is out of range, or a column repeats an index.

    Example::

        P = SparseProjector.random(4096, 1024, nnz_per_column=8, generator=torch.Generator().manual_seed(0))
        S = P.compress_rows(torch.randn(4096, 64))  # P · M: (1024, 64)
        back = P.expand_rows(S)  # Pᵀ · S: (4096, 64)
        same = SparseProjector(P.indices, P.values, dim_out=1024)  # from indices and values
    """

    def __init__(self, indices: Tensor, values: Tensor, dim_out: int) -> None:
        if indices.dim() != 2 or values.shape != indices.shape:
            raise ValueError(
                f"SparseProjector needs indices and values of the same (n, r) shape; got {tuple(indices.shape)} "
                f"and {tuple(values.shape)}."
            )
        if not values.is_floating_point():
            raise ValueError(f"SparseProjector values must be floating point, got {values.dtype}.")
        n, r = indices.shape
        if not 1 <= r <= dim_out:
            raise ValueError(
                f"A projector to {dim_out} dims cannot hold r={r} distinct nonzeros per column; use 1 ≤ r ≤ {dim_out}."
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= dim_out):
            raise ValueError(f"Projector indices must lie in [0, {dim_out}); got [{int(indices.min())}, "
                             f"{int(indices.max())}].")
        if r > 1:
            ordered, position = indices.sort(dim=1)
            if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                raise ValueError("Projector indices collide: every column needs r distinct rows.")
            if not torch.equal(ordered, indices):
                indices, values = ordered, values.gather(1, position)
        self.indices = indices.to(index_dtype(dim_out))
        self.values = values
        self.dim_out = int(dim_out)

    # ----------------------------------------------------------------------------------------------- builders
    @classmethod
    def random(
        cls,
        dim_in: int,
        dim_out: int,
        nnz_per_column: int,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> SparseProjector:
        """Draw a seeded random projector: uniform distinct rows per column, Rademacher values ``±1/√r``.

        With ``±1/√r`` values ``E[PᵀP] = I``, so compressing keeps norms on average (a sparse
        Johnson–Lindenstrauss sketch) and the update expanded back has the scale of ``U``.

        Args:
            dim_in: ``n``, the size of the dimension being compressed.
            dim_out: ``d``, the compressed size.
            nnz_per_column: ``r``, nonzeros per column.
            generator: CPU generator that makes the draw reproducible. Default: ``None`` (torch's global one).
            device: where the projector lives. Default: ``None`` (the CPU).
        """
        if not 1 <= nnz_per_column <= dim_out:
            raise ValueError(
                f"density r={nnz_per_column} is larger than the compressed size {dim_out} allows; "
                f"use 1 ≤ r ≤ {dim_out}."
            )
        chunks = []
        for start in range(0, dim_in, _INDEX_CHUNK):
            rows = min(_INDEX_CHUNK, dim_in - start)
            # The top-r of i.i.d. uniform scores is a uniformly random r-subset: distinct by construction.
            scores = torch.rand(rows, dim_out, generator=generator, dtype=torch.float32)
            chunks.append(scores.topk(nnz_per_column, dim=1).indices)
        indices = torch.cat(chunks)
        signs = torch.randint(0, 2, (dim_in, nnz_per_column), generator=generator).float().mul_(2).sub_(1)
        values = signs / nnz_per_column**0.5
        return cls(indices.to(device), values.to(device), dim_out)

    @classmethod
    def signed_permutation(
        cls, dim: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> SparseProjector:
        """A random signed permutation (``r = 1``, ``d = n``, values ``±1``): an orthogonal, lossless projector.

        Adam is elementwise, so with signed-permutation projectors the compressed path is exactly Adam on the full
        weight — the reference the end-to-end tests compare against.
        """
        perm = torch.randperm(dim, generator=generator).unsqueeze(1)
        signs = torch.randint(0, 2, (dim, 1), generator=generator).float().mul_(2).sub_(1)
        return cls(perm.to(device), signs.to(device), dim)

    # ------------------------------------------------------------------------------------------------ algebra
    @property
    def dim_in(self) -> int:
        """``n``, the size of the dimension this projector compresses."""
        return self.indices.shape[0]

    @property
    def nnz_per_column(self) -> int:
        """``r``, nonzeros per column."""
        return self.indices.shape[1]

    def compress_rows(self, matrix: Tensor) -> Tensor:
        """Return ``P · matrix``: maps ``(n, m)`` to ``(d, m)`` by a sparse (CSR) matrix product.

        Runs in, and returns, :func:`product_dtype`.
        """
        dtype = product_dtype(matrix)
        # Autocast would pick the product's dtype itself; here it is chosen above, per device.
        with torch.autocast(matrix.device.type, enabled=False):
            return torch.sparse.mm(self._matrix(dtype), matrix.to(dtype))

    def _matrix(self, dtype: torch.dtype) -> Tensor:
        """``P`` in CSR for a product in ``dtype``: per product on an accelerator, kept on the CPU until the values or
        indices change (see the module docstring)."""
        values = self.values.detach()
        if values.device.type != "cpu":
            return self.pattern().matrix(values.to(dtype))
        key = (values.data_ptr(), values._version, self.indices.data_ptr(), self.indices._version, dtype)
        if getattr(self, "_cpu_matrix_key", None) != key:
            self._cpu_matrix = self.pattern().matrix(values.to(dtype))
            self._cpu_matrix_key = key
        return self._cpu_matrix

    def expand_rows(self, matrix: Tensor, rows: slice | None = None) -> Tensor:
        """Return ``Pᵀ · matrix`` (``(d, m)`` to ``(n, m)``), or only its ``rows`` (a slice of ``0 … n``).

        Same dtype rule as :meth:`compress_rows`. A slice reads only its rows' indices and values, which is how an
        update is expanded block by block without a weight-sized temporary.
        """
        dtype = product_dtype(matrix)
        with torch.autocast(matrix.device.type, enabled=False):
            return torch.sparse.mm(self._transposed(dtype, rows), matrix.to(dtype))

    def _transposed(self, dtype: torch.dtype, rows: slice | None) -> Tensor:
        """``Pᵀ`` (or its ``rows``) in CSR for a product in ``dtype``; kept per row range on the CPU."""
        values = self.values.detach()
        if values.device.type != "cpu":
            return self.pattern().transposed(values.to(dtype), rows)
        key = (values.data_ptr(), values._version, self.indices.data_ptr(), self.indices._version, dtype)
        if getattr(self, "_cpu_transposed_key", None) != key:
            self._cpu_transposed: dict[tuple[int, int] | None, Tensor] = {}
            self._cpu_transposed_key = key
        span = None if rows is None else (rows.start, rows.stop)
        if span not in self._cpu_transposed:
            self._cpu_transposed[span] = self.pattern().transposed(values.to(dtype), rows)
        return self._cpu_transposed[span]

    def pattern(self) -> SparsityPattern:
        """The CSR structure of this projector's indices (cached until the indices change)."""
        key = (self.indices.data_ptr(), self.indices._version)
        if getattr(self, "_pattern_key", None) != key:
            self._pattern = SparsityPattern(self.indices, self.dim_out)
            self._pattern_key = key
        return self._pattern

    def release_products(self) -> None:
        """Drop the CSR structure and forms kept between products, unneeded when another kernel runs them."""
        for cached in ("_pattern", "_pattern_key", "_cpu_matrix", "_cpu_matrix_key", "_cpu_transposed",
                       "_cpu_transposed_key"):
            self.__dict__.pop(cached, None)

    def nbytes(self) -> int:
        """Device bytes held: indices, values, and the CSR structure and forms kept between products."""
        held = self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()
        pattern = getattr(self, "_pattern", None)
        held += pattern.nbytes() if pattern is not None else 0
        cached = getattr(self, "_cpu_matrix", None)
        if cached is not None:  # its row pointers are the pattern's
            held += cached.col_indices().numel() * 4 + cached.values().numel() * cached.values().element_size()
        for matrix in getattr(self, "_cpu_transposed", {}).values():
            held += (matrix.crow_indices().numel() + matrix.col_indices().numel()) * 4
            held += matrix.values().numel() * matrix.values().element_size()
        return held

    def to_dense(self) -> Tensor:
        """The ``d × n`` matrix; for tests and diagnostics only, never on the training path."""
        dense = torch.zeros(self.dim_out, self.dim_in, dtype=self.values.dtype, device=self.values.device)
        cols = torch.arange(self.dim_in, device=self.indices.device).unsqueeze(1).expand_as(self.indices)
        dense[self.indices.long(), cols] = self.values
        return dense

    def to(self, device: torch.device | str) -> SparseProjector:
        """A copy on ``device``."""
        return SparseProjector(self.indices.to(device), self.values.to(device), self.dim_out)

    # ----------------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Host copies of indices and values plus the compressed size."""
        return {"indices": self.indices.cpu(), "values": self.values.detach().cpu(), "dim_out": self.dim_out}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device | str | None = None) -> SparseProjector:
        """Inverse of :meth:`state_dict`."""
        return cls(state["indices"].to(device), state["values"].to(device), int(state["dim_out"]))


# (device, dtype) → whether this CUDA build's sparse CSR product takes the dtype; probed once per pair.
_SPARSE_DTYPE_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def product_dtype(matrix: Tensor) -> torch.dtype:
    """The dtype a projector product on ``matrix`` runs in.

    fp32 on the CPU (no bf16/fp16 sparse kernels) and for fp32/fp64 input. On CUDA, bf16 and fp16 run in their own
    dtype (cuSPARSE accumulates in fp32) unless a probe product shows the build refuses it: then fp32, warned once.
    """
    return product_dtype_of(matrix.device, matrix.dtype)


def product_dtype_of(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """:func:`product_dtype` of a matrix of ``dtype`` on ``device`` (the probe product runs once per device and
    dtype; a projected layer runs it at set-up, so a compiled forward's shape inference never has to)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return torch.float32
    key = (str(device), dtype)
    if key not in _SPARSE_DTYPE_SUPPORT:
        try:
            probe = _csr(torch.tensor([0, 1], dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device),
                         torch.ones(1, dtype=dtype, device=device), (1, 1))
            torch.sparse.mm(probe, torch.ones(1, 1, dtype=dtype, device=device))
            _SPARSE_DTYPE_SUPPORT[key] = True
        except RuntimeError as error:
            _SPARSE_DTYPE_SUPPORT[key] = False
            warnings.warn(f"Sparse products in {dtype} are not available on {device} ({error}); projections "
                          f"run in fp32 there (slower, and twice the bytes).", stacklevel=3)
    return dtype if _SPARSE_DTYPE_SUPPORT[key] else torch.float32


class ProjectorFactory(Protocol):
    """Builds the projector for one side of one layer; the strategy calls it once per side at set-up."""

    def __call__(
        self, dim_in: int, dim_out: int, nnz_per_column: int, generator: torch.Generator, device: torch.device
    ) -> SparseProjector: ...


def random_projector(
    dim_in: int, dim_out: int, nnz_per_column: int, generator: torch.Generator, device: torch.device
) -> SparseProjector:
    """The default :class:`ProjectorFactory`: :meth:`SparseProjector.random`.

    Args:
        dim_in: ``n``, the size of the dimension being compressed.
        dim_out: ``d``, the compressed size.
        nnz_per_column: ``r``, nonzeros per column (the strategies' ``density``).
        generator: CPU generator that makes the draw reproducible (the strategies seed it with ``seed``).
        device: where the projector lives.

    Example::

        P = random_projector(4096, 1024, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
        strategy = LSPOffloadStrategy(projector_factory=random_projector)  # the default factory
    """
    return SparseProjector.random(dim_in, dim_out, nnz_per_column, generator=generator, device=device)


def signed_permutation_projector(
    dim_in: int, dim_out: int, nnz_per_column: int, generator: torch.Generator, device: torch.device
) -> SparseProjector:
    """A :class:`ProjectorFactory` for lossless projection; needs ``dim_out == dim_in`` and ``r == 1``.

    A reference to test against, not a saving (see :meth:`SparseProjector.signed_permutation`).

    Args:
        dim_in: ``n``, the size of the dimension.
        dim_out: must equal ``dim_in`` (``rank=1.0``).
        nnz_per_column: must be 1 (``density=1``).
        generator: CPU generator that makes the permutation and signs reproducible.
        device: where the projector lives.

    Example::

        strategy = LSPOffloadStrategy(rank=1.0, density=1, projectors="random",
                                      projector_factory=signed_permutation_projector)
        trainer = pl.Trainer(strategy=strategy, max_steps=10)  # equals plain AdamW on the projected weights
    """
    if dim_out != dim_in or nnz_per_column != 1:
        raise ValueError(
            f"signed-permutation projectors need rank equal to the layer dim and density 1; got dim {dim_in}, "
            f"rank {dim_out}, density {nnz_per_column}. Use rank=1.0 and density=1."
        )
    return SparseProjector.signed_permutation(dim_in, generator=generator, device=device)
