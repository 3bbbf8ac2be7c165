"""The clipping norm stays true while training goes on: each projected layer's ``ρ = ‖S‖/‖G‖`` is re-measured from
the probes of every step's backward while clipping is in use, and of every 4th step without clipping, where
``optimizer.grad_norm()`` is what users log (``lightning_offload/lsp/norm_probe.py``).

Without the probes ``ρ`` keeps the value of the fit (or 1 for random draws) while training changes how much of each
gradient the subspace holds: on the tiny LLaMA below the estimate read 0.77–0.90× (random, lr 1e-2) and 0.75–0.84×
(learned, lr 3e-3) of the true global norm after 150 steps, over data orders 0–3; with them, 0.95–1.05×
(docs/benchmarks/2026-12-03.md, "The clipping norm after training")."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch
from torch import nn

from lightning_offload import ProjectorFitting, offload
from lightning_offload.lsp import norm_probe
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector
from tiny_modules import params_of, tiny_hf_model, token_data


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _projectors(out_features: int, in_features: int, seed: int = 0) -> tuple[SparseProjector, SparseProjector]:
    generator = torch.Generator().manual_seed(seed)
    return (SparseProjector.random(out_features, out_features // 4, 2, generator=generator),
            SparseProjector.random(in_features, in_features // 4, 2, generator=generator))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_the_probes_sketch_the_full_gradient_summed_over_micro_batches(kind: str) -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    # In fp64, so that Δᵀ(X z) and (Δᵀ X) z, which sum in different orders, agree to the fp32 the sketch is kept in.
    module = (nn.Linear(48, 40) if kind == "linear" else Conv1D(40, 48)).double()  # o = 40, i = 48 either way
    plain = (nn.Linear(48, 40) if kind == "linear" else Conv1D(40, 48)).double()
    plain.load_state_dict(module.state_dict())
    layer = ProjectedWeight("layer", module, *_projectors(40, 48))
    layer.norm_probe.active = True
    for _ in range(2):  # two micro-batches of one step: the same probes, G z accumulated as S is
        x = torch.randn(3, 5, 48, dtype=torch.float64)
        module(x).square().sum().backward()
        plain(x).square().sum().backward()
    grad = plain.weight.grad if kind == "linear" else plain.weight.grad.t()  # o × i
    probes = layer.norm_probe.probe(48, torch.device("cpu"), torch.float64)
    assert probes.shape == (48, norm_probe.PROBES) and set(probes.unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(layer.norm_probe.sketch, (grad @ probes).float())
    layer.zero_grad()
    assert layer.norm_probe.sketch is None  # a released (or skipped) step's sketch goes with its S


def test_the_probes_measure_the_squared_norm_without_bias() -> None:
    # E‖G z‖²/m = ‖G‖² over fresh draws, for a gradient of rank 1 (the noisiest case), which a fixed projector does
    # not keep: fresh probes are independent of the gradient.
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(40, 1, generator=generator) @ torch.randn(1, 48, generator=generator)
    probe = norm_probe.NormProbe("layer")
    estimates = []
    for _ in range(400):
        estimates.append(float((grad @ probe.probe(48, torch.device("cpu"), torch.float32)).square().sum())
                         / norm_probe.PROBES)
        probe.add(torch.zeros(40, norm_probe.PROBES))
        probe.next_step(True)
    assert probe.draws == 400
    assert abs(statistics.mean(estimates) / float(grad.square().sum()) - 1) < 0.05


def test_signed_permutations_are_never_probed() -> None:
    generator = torch.Generator().manual_seed(0)
    permutations = (SparseProjector.signed_permutation(40, generator),
                    SparseProjector.signed_permutation(48, generator))
    assert all(norm_probe.is_isometry(p) for p in permutations)
    layer = ProjectedWeight("layer", nn.Linear(48, 40), *permutations)
    layer.norm_probe.next_step(True)
    assert not layer.norm_probe.active
    # A random draw at the same shapes (density 1: one nonzero per column, rows hit unevenly) is measured.
    draw = SparseProjector.random(48, 48, 1, generator=generator)
    assert not norm_probe.is_isometry(draw)
    layer.set_projectors(permutations[0], draw)
    layer.norm_probe.next_step(True)
    assert layer.norm_probe.active


# ------------------------------------------------------------------------------------------------ after training
# 150 steps at rates where ρ moves well past 10% (a random draw's at 1e-2; learned projectors' already at 3e-3), then
# the median over 32 fresh batches (one batch's estimate ranges about ±25%).
STEPS, FRESH = 150, 32
RATES = {"random": 1e-2, "learned": 3e-3}
FITTING = ProjectorFitting(num_samples=2, max_iters=8)  # a short fit; its ρ is still pooled over 8 held-out batches


def _train(projectors: str, steps: int, max_grad_norm: float | None = 1.0, seed: int = 0,
           resume_from: dict[str, Any] | None = None, stop_at: int | None = None) -> tuple[nn.Module, Any, list]:
    """A tiny LLaMA trained at a high rate, clipped by norm (at every step with a small ``max_grad_norm``)."""
    torch.manual_seed(0)
    batches = list(token_data(n=4 * (steps + FRESH + 8), batch_size=4, seed=seed))
    model = tiny_hf_model("llama")
    # accumulation_steps=None: gradients of fresh batches can be taken after training without a step.
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=RATES[projectors]), rank=0.25, density=2,
                        min_dim=16, projectors=projectors, max_grad_norm=max_grad_norm, embeddings="host",
                        accumulation_steps=None, fitting=FITTING)
    start = 0
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        optimizer.load_state_dict(resume_from["optimizer"])
        start = optimizer.steps_taken
    elif projectors == "learned":
        optimizer.fit_projectors(batches[steps:], lm_loss)
    for step in range(start, steps if stop_at is None else stop_at):
        lm_loss(model, batches[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.settle()
    return model, optimizer, batches


def _estimate_over_true(model: nn.Module, optimizer: Any, batches: list) -> float:
    """Median over fresh batches of the engine's global norm over plain torch's on a copy of the model."""
    plain = tiny_hf_model("llama")
    plain.load_state_dict(model.state_dict())
    ratios = []
    for batch in batches[-FRESH:]:
        lm_loss(model, batch).backward()
        estimate = float(optimizer.grad_norm())
        optimizer.zero_grad()
        plain.zero_grad()
        lm_loss(plain, batch).backward()
        ratios.append(estimate / float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()
                                                                       if p.grad is not None])))
    return statistics.median(ratios)


# Unclipped, grad_norm() is what users log and pick max_grad_norm from, and only every UNCLIPPED_EVERY-th step is
# measured: at these rates, which unclipped are rougher, one data order's median reads 0.82-1.12 (random: 1.04, 0.82,
# 0.99; learned: 1.12, 1.00, 0.98 over orders 0-2; 0.73-0.86 without the probes), so the median over three orders is
# what is held to 10% (the small LLaMA of scripts/benchmark_clip_norm.py reads 0.95-1.01 from one order).
DATA_ORDERS = {1.0: (0,), None: (0, 1, 2)}


def _estimates_over_true(projectors: str, max_grad_norm: float | None) -> tuple[float, list[bool]]:
    """The median over :data:`DATA_ORDERS` of :func:`_estimate_over_true` after :data:`STEPS` steps, and whether
    every projected layer's averages had replaced its ``ρ``."""
    ratios, measured = [], []
    for seed in DATA_ORDERS[max_grad_norm]:
        model, optimizer, batches = _train(projectors, STEPS, max_grad_norm, seed=seed)
        ratios.append(_estimate_over_true(model, optimizer, batches))
        measured += [layer.norm_probe.ready() for layer in optimizer.projected_layers]
        optimizer.close()
    return statistics.median(ratios), measured


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("projectors", ["random", "learned"])
def test_the_clipping_norm_is_within_ten_percent_after_training(projectors: str, max_grad_norm: float | None) -> None:
    ratio, measured = _estimates_over_true(projectors, max_grad_norm)
    assert all(measured)
    assert 0.9 <= ratio <= 1.1, ratio


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("projectors", ["random", "learned"])
def test_without_the_probes_the_estimate_drifts_past_ten_percent(projectors: str, max_grad_norm: float | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # What the probes correct: the same training with ρ left as the fit (or the draw) set it.
    monkeypatch.setattr(norm_probe, "PROBES", 0)
    ratio, _ = _estimates_over_true(projectors, max_grad_norm)
    assert ratio < 0.9, ratio


def test_a_resume_while_the_probes_average_equals_the_uninterrupted_run() -> None:
    # Clipped at every step (a small limit), so each step's update depends on ρ. The probes' averages first replace
    # ρ after WINDOW_STEPS measured steps (steps 1–16), after the resume at 10, and keep replacing it: a resume that
    # lost the averages, the draw count or the probes' on/off flag would give other ρ from step 16 on.
    steps, stop_at, clip = 30, 10, 0.05
    straight, straight_optimizer, _ = _train("random", steps, clip)
    ratios = [layer.norm_ratio for layer in straight_optimizer.projected_layers]
    straight_optimizer.close()
    halfway_model, halfway, _ = _train("random", steps, clip, stop_at=stop_at)
    state = {"model": {k: v.clone() for k, v in halfway_model.state_dict().items()},
             "optimizer": halfway.state_dict()}
    halfway.close()
    saved = next(iter(state["optimizer"]["projectors"].values()))["norm_probe"]
    assert saved["active"] and saved["draws"] == saved["window_steps"] == stop_at - 1 < norm_probe.WINDOW_STEPS
    resumed, resumed_optimizer, _ = _train("random", steps, clip, resume_from=state)
    assert [layer.norm_ratio for layer in resumed_optimizer.projected_layers] == ratios
    assert all(ratio != 1.0 for ratio in ratios)
    resumed_optimizer.close()
    for name, value in params_of(straight).items():
        assert torch.equal(params_of(resumed)[name], value), name


@pytest.mark.parametrize("clipping", ["none", "value"])
def test_runs_that_do_not_clip_by_norm_probe_every_fourth_step_and_keep_their_results(
        clipping: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def run() -> tuple[dict[str, torch.Tensor], list[int]]:
        torch.manual_seed(0)
        model = tiny_hf_model("llama")
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank=0.25, density=2, min_dim=16)
        for batch in token_data(n=4 * (norm_probe.WINDOW_STEPS + 2), batch_size=4):
            lm_loss(model, batch).backward()
            if clipping == "value":
                optimizer.clip_grad_value_(0.01)
            optimizer.step()
            optimizer.zero_grad()
        optimizer.settle()
        draws = [layer.norm_probe.window_steps for layer in optimizer.projected_layers]
        optimizer.close()
        return params_of(model), draws

    probed, draws = run()
    monkeypatch.setattr(norm_probe, "PROBES", 0)  # the measurement off: what runs did before it existed
    unprobed, unmeasured = run()
    steps = norm_probe.WINDOW_STEPS + 2
    assert draws == [steps // norm_probe.UNCLIPPED_EVERY] * len(draws) and unmeasured == [0] * len(draws)
    for name, value in unprobed.items():
        assert torch.equal(probed[name], value), name


def test_steps_before_the_probes_first_replace_rho_equal_unprobed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # The probes only read the backward: until a window closes, a clipped run is the unprobed run bit for bit (so
    # the 4-step golden runs keep their recorded results).
    probed, optimizer, _ = _train("random", norm_probe.WINDOW_STEPS, max_grad_norm=0.05)
    assert all(layer.norm_probe.window_steps == norm_probe.WINDOW_STEPS - 1 and layer.norm_ratio == 1.0
               for layer in optimizer.projected_layers)
    optimizer.close()
    monkeypatch.setattr(norm_probe, "PROBES", 0)
    unprobed, optimizer, _ = _train("random", norm_probe.WINDOW_STEPS, max_grad_norm=0.05)
    optimizer.close()
    for name, value in params_of(unprobed).items():
        assert torch.equal(params_of(probed)[name], value), name
