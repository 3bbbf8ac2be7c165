import pytest
import torch

from lightning_offload import stochastic_round_to_bf16


def test_stochastic_rounding_is_unbiased_where_nearest_rounding_drops_the_update():
    # 1 + 2^-10 lies between the bf16 neighbours 1 and 1 + 2^-7: nearest rounding always returns 1.
    value = torch.full((200_000,), 1.0 + 2.0**-10)
    assert torch.all(value.to(torch.bfloat16) == 1.0)
    rounded = stochastic_round_to_bf16(value, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    # P(up) = 1/8; the sample mean's standard error is 2^-7·sqrt(p(1-p)/n) ≈ 5.8e-6.
    assert abs(rounded.mean().item() - value[0].item()) < 4e-5


def test_bf16_representable_values_and_non_finite_values_are_unchanged():
    value = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("-inf"), 3.3895e38])
    value = value.to(torch.bfloat16).float()
    out = stochastic_round_to_bf16(value, torch.Generator().manual_seed(0)).float()
    assert torch.equal(out, value)
    assert torch.isnan(stochastic_round_to_bf16(torch.tensor([float("nan")]))).all()


def test_stochastic_rounding_is_reproducible_with_a_seeded_generator():
    value = torch.randn(1000)
    a = stochastic_round_to_bf16(value, torch.Generator().manual_seed(5))
    b = stochastic_round_to_bf16(value, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_non_fp32_input_is_refused():
    with pytest.raises(TypeError, match="fp32"):
        stochastic_round_to_bf16(torch.ones(2, dtype=torch.float64))
