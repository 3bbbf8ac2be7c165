"""The command line's optimizer settings: validated as one value, and the schedules they describe."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_offload.tasks.schedule import OptimSettings, SettingsError, WarmupDecay


def _lrs(settings: OptimSettings, total: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=settings.lr)
    scheduler = settings.scheduler(optimizer, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return lrs


def test_cosine_warms_up_then_decays_to_its_floor() -> None:
    lrs = _lrs(OptimSettings(lr=1.0, warmup_steps=2, decay="cosine", min_lr_ratio=0.1), total=10)
    assert lrs[:2] == pytest.approx([0.5, 1.0])
    # Step 2 + k of the 8 decay steps: 0.1 + 0.9 · (1 + cos(π k / 8)) / 2.
    assert lrs[2:] == pytest.approx([0.1 + 0.45 * (1 + math.cos(math.pi * k / 8)) for k in range(8)])
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # strictly decreasing once the decay starts


def test_linear_decay_with_a_warmup_ratio_reaches_the_floor_after_the_last_step() -> None:
    settings = OptimSettings(lr=2.0, warmup_ratio=0.25, decay="linear", min_lr_ratio=0.0)
    lrs = _lrs(settings, total=8)
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 2 * 5 / 6, 2 * 4 / 6, 2 * 3 / 6, 2 * 2 / 6, 2 * 1 / 6])
    assert WarmupDecay(2, 8, "linear", 0.0)(8) == 0.0 and WarmupDecay(2, 8, "linear", 0.0)(50) == 0.0


def test_constant_without_warmup_needs_no_scheduler() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert OptimSettings().scheduler(optimizer, 100) is None


def test_a_warmup_as_long_as_the_run_is_said() -> None:
    with pytest.warns(UserWarning, match=r"warm-up \(50 steps\) is as long as the run \(40 optimizer steps\)"):
        _lrs(OptimSettings(lr=1e-3, warmup_steps=50), total=40)


def test_a_decay_without_a_run_length_is_refused() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(SettingsError, match=r"need the run's length: set trainer.max_steps"):
        OptimSettings(decay="cosine").scheduler(optimizer, None)


@pytest.mark.parametrize("values, message", [
    ({"lr": 0.0}, "optim.lr=0.0 must be a finite number > 0"),
    ({"lr": True}, "optim.lr=True must be a finite number > 0"),
    ({"eps": -1e-8}, "optim.eps=-1e-08 must be a finite number > 0"),
    ({"betas": [0.9]}, "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ({"betas": [0.9, 1.0]}, "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    ({"warmup_ratio": 1.0}, "optim.warmup_ratio=1.0 must be in [0, 1)"),
    ({"min_lr_ratio": 1.5}, "optim.min_lr_ratio=1.5 must be in [0, 1]"),
    ({"decay": "exp"}, "optim.decay='exp' is not one of ('constant', 'linear', 'cosine')"),
    ({"warmup_steps": 2.5}, "optim.warmup_steps=2.5 must be an int ≥ 0"),
    ({"momentum": 0.9}, "optim.momentum is not an optimizer setting"),
])
def test_bad_values_are_refused_by_name(values: dict, message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        OptimSettings.from_mapping({"lr": 1e-4, **values})
    assert message in str(caught.value)


def test_betas_from_a_config_list_become_a_tuple() -> None:
    assert OptimSettings.from_mapping({"betas": [0.8, 0.95]}).betas == (0.8, 0.95)
