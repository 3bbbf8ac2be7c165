import pytest
import torch

from lightning_offload import SparseProjector


def test_random_projector_has_r_distinct_rows_per_column_and_unit_columns():
    g = torch.Generator().manual_seed(0)
    p = SparseProjector.random(300, 40, 6, generator=g)
    assert p.indices.shape == (300, 6)
    assert all(len(set(row.tolist())) == 6 for row in p.indices)
    dense = p.to_dense()
    assert ((dense != 0).sum(0) == 6).all()
    torch.testing.assert_close(dense.pow(2).sum(0), torch.ones(300))


def test_compress_and_expand_equal_dense_products():
    g = torch.Generator().manual_seed(1)
    p = SparseProjector.random(50, 12, 3, generator=g)
    dense = p.to_dense()  # 12 × 50
    x = torch.randn(50, 7)
    u = torch.randn(12, 7)
    torch.testing.assert_close(p.compress_rows(x), dense @ x)
    torch.testing.assert_close(p.compress_rows(x.t().contiguous().t()), dense @ x)  # strided input
    torch.testing.assert_close(p.compress_rows(x.bfloat16()), dense @ x.bfloat16().float())
    torch.testing.assert_close(p.expand_rows(u), dense.t() @ u)


def test_compress_follows_in_place_edits_of_the_values():
    p = SparseProjector.random(30, 10, 2, generator=torch.Generator().manual_seed(4))
    x = torch.randn(30, 3)
    p.compress_rows(x)
    p.values.mul_(2.0)  # e.g. a fit editing the values in place
    torch.testing.assert_close(p.compress_rows(x), p.to_dense() @ x)


def test_signed_permutation_is_orthogonal():
    p = SparseProjector.signed_permutation(20, generator=torch.Generator().manual_seed(2))
    dense = p.to_dense()
    torch.testing.assert_close(dense.t() @ dense, torch.eye(20))
    assert set(dense.abs().sum(0).tolist()) == {1.0}


def test_same_seed_same_projector_and_state_dict_round_trip():
    a = SparseProjector.random(64, 16, 4, generator=torch.Generator().manual_seed(3))
    b = SparseProjector.random(64, 16, 4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    c = SparseProjector.from_state_dict(a.state_dict())
    torch.testing.assert_close(c.to_dense(), a.to_dense())


@pytest.mark.parametrize(
    "indices, values, dim_out, message",
    [
        (torch.tensor([[0, 0]]), torch.ones(1, 2), 4, "collide"),
        (torch.tensor([[5]]), torch.ones(1, 1), 4, r"\[0, 4\)"),
        (torch.tensor([[0, 1, 2]]), torch.ones(1, 3), 2, "r=3"),
        (torch.tensor([[0]]), torch.ones(1, 2), 4, "same"),
    ],
)
def test_invalid_projectors_are_refused(indices, values, dim_out, message):
    with pytest.raises(ValueError, match=message):
        SparseProjector(indices, values, dim_out)


def test_density_larger_than_compressed_size_is_refused():
    with pytest.raises(ValueError, match="density r=9"):
        SparseProjector.random(32, 8, 9)


def test_products_stay_fp32_under_autocast():
    # Updates are applied in forward pre-hooks, i.e. inside the autocast region of bf16-mixed training.
    p = SparseProjector.random(30, 10, 2, generator=torch.Generator().manual_seed(5))
    x = torch.randn(30, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compressed = p.compress_rows(x)
        expanded = p.expand_rows(compressed)
    assert compressed.dtype == expanded.dtype == torch.float32
    torch.testing.assert_close(compressed, p.to_dense() @ x)


def test_storage_is_canonical_and_narrow_without_changing_the_matrix():
    indices = torch.tensor([[3, 0], [1, 2], [2, 3]])
    values = torch.tensor([[0.5, -1.0], [2.0, 3.0], [-4.0, 0.25]])
    p = SparseProjector(indices, values, 4)
    assert p.indices.dtype == torch.int16  # 4 rows fit 16-bit row numbers
    assert p.indices.tolist() == [[0, 3], [1, 2], [2, 3]]  # ascending within each column
    dense = torch.zeros(4, 3)
    dense[indices, torch.arange(3).unsqueeze(1).expand_as(indices)] = values
    torch.testing.assert_close(p.to_dense(), dense)
    # Row numbers from 32768 up need 32 bits.
    assert SparseProjector(torch.tensor([[40_000]]), torch.ones(1, 1), 40_001).indices.dtype == torch.int32


def test_only_indices_values_and_one_permutation_are_held():
    p = SparseProjector.random(512, 128, 8, generator=torch.Generator().manual_seed(6))
    p.pattern()
    nnz = 512 * 8
    # int16 indices (2 B), fp32 values (4 B), int32 permutation to P's row order (4 B), P's row pointers.
    assert p.nbytes() == nnz * (2 + 4 + 4) + (128 + 1) * 4
    # On the CPU only, P's column numbers and ordered values are kept between products, and follow value edits.
    x = torch.randn(512, 4)
    p.compress_rows(x)
    assert p.nbytes() == nnz * (2 + 4 + 4 + 4 + 4) + (128 + 1) * 4
    # So is Pᵀ's CSR form per row range expanded (int32 columns, fp32 values, its own row pointers).
    u = torch.randn(128, 4)
    p.expand_rows(u)
    p.expand_rows(u, slice(0, 100))
    assert p.nbytes() == nnz * (2 + 4 + 4 + 4 + 4) + (128 + 1) * 4 + (nnz + 100 * 8) * (4 + 4) + (512 + 1 + 100 + 1) * 4
    p.values.mul_(-0.5)
    torch.testing.assert_close(p.compress_rows(x), p.to_dense() @ x)
    torch.testing.assert_close(p.expand_rows(u), p.to_dense().t() @ u)
    torch.testing.assert_close(p.expand_rows(u, slice(0, 100)), (p.to_dense().t() @ u)[:100])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanding_a_slice_of_rows_equals_those_rows_of_the_full_product(dtype):
    p = SparseProjector.random(70, 20, 4, generator=torch.Generator().manual_seed(7))
    u = torch.randn(20, 9).to(dtype)
    full = p.to_dense().t() @ u.float()
    for rows in (slice(0, 70), slice(0, 13), slice(13, 50), slice(64, 70)):
        torch.testing.assert_close(p.expand_rows(u, rows), full[rows])
    torch.testing.assert_close(p.compress_rows(torch.randn(70, 5, generator=torch.Generator().manual_seed(1))
                                               .to(dtype)),
                               p.to_dense() @ torch.randn(70, 5, generator=torch.Generator().manual_seed(1))
                               .to(dtype).float())


def test_the_compressed_size_rule_is_one_function_the_strategy_uses() -> None:
    from lightning_offload import LSPOffloadStrategy
    from lightning_offload.lsp.targets import compressed_size

    assert [compressed_size(576, 0.25), compressed_size(1536, 0.125), compressed_size(3, 0.1),
            compressed_size(64, 16)] == [144, 192, 1, 16]
    strategy = LSPOffloadStrategy(rank=0.3, density=2)
    assert strategy._compressed_dim("w", "input", 100) == compressed_size(100, 0.3) == 30
