"""Learned projectors: the fit, the moment rotation, the sampling pass and the ProjectorRefit schedule."""

from __future__ import annotations

import csv
import math
import statistics
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_offload import (
    LSPOffloadStrategy,
    ProjectedWeight,
    ProjectorRefit,
    SparseProjector,
    ZeroOffloadStrategy,
)
import lightning_offload.engine.fitting.projector_fitting as projector_fitting
from lightning_offload.lsp.fit import (
    FitSettings,
    LayerFit,
    cross_gram,
    fit_initial_values,
    gram,
    reconstruction_error,
)
from lightning_offload.lsp.norm_ratio import NormRatioPool
from lightning_offload.engine.rules.adam import ADAM
from lightning_offload.lsp.rotation import coordinate_map, rotate_moments
from lightning_offload.lsp.sampling import sample_gradients
from tiny_modules import TinyCausalLM, TinyClassifier, classification_data, tiny_hf_model, token_data, trainer


def _dense_error(proj_out, proj_in, grad):
    a, b = proj_out.to_dense(), proj_in.to_dense()
    return float((a.T @ a @ grad @ b.T @ b - grad).norm() / grad.norm())


def _pair(o, i, d_o, d_i, r, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (SparseProjector.random(o, d_o, r, generator=generator),
            SparseProjector.random(i, d_i, r, generator=generator))


# ------------------------------------------------------------------------------------------------------- the fit
def test_reconstruction_error_equals_the_dense_formula():
    proj_out, proj_in = _pair(48, 40, 12, 10, 3)
    grad = torch.randn(48, 6) @ torch.randn(6, 40)
    assert reconstruction_error(proj_out, proj_in, grad) == pytest.approx(_dense_error(proj_out, proj_in, grad),
                                                                          rel=1e-4)


def test_fit_gradient_of_the_values_matches_dense_autograd():
    proj_out, proj_in = _pair(48, 40, 12, 10, 3, seed=1)
    grad = torch.randn(48, 40)
    fit = LayerFit(proj_out, proj_in, FitSettings(max_iters=1, target_error=0.0, l2=0.0))
    fit.fit(grad, 1)  # one Adam step: its first update is -lr·sign(gradient of the values)
    a = proj_out.values.clone().requires_grad_()
    b = proj_in.values.clone().requires_grad_()

    def dense(indices, values, d):
        return torch.zeros(d, indices.shape[0]).index_put(
            (indices.long(), torch.arange(indices.shape[0]).unsqueeze(1).expand_as(indices)), values)

    da, db = dense(proj_out.indices, a, 12), dense(proj_in.indices, b, 10)
    ((da.T @ da @ grad @ db.T @ db - grad).norm() / grad.norm()).square().backward()
    lr = fit.settings.lr
    torch.testing.assert_close(fit.a.detach(), proj_out.values - lr * a.grad.sign(), atol=1e-5, rtol=0)
    torch.testing.assert_close(fit.b.detach(), proj_in.values - lr * b.grad.sign(), atol=1e-5, rtol=0)


def _tiny_llama_gradients(batches):
    """Full gradients of the tiny LLaMA's q_proj and up_proj on several batches (plain autograd)."""
    model = tiny_hf_model("llama")
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    samples = {name: [] for name in names}
    for (ids,) in batches:
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        for name in names:
            samples[name].append(model.get_submodule(name).weight.grad.clone())
    return samples


def test_a_fit_lowers_the_error_on_held_out_gradients_well_below_random():
    batches = list(token_data(n=40, batch_size=8, seed=5))
    samples = _tiny_llama_gradients(batches)
    for name, grads in samples.items():
        train, held_out = grads[:4], grads[4]
        o, i = held_out.shape
        proj_out, proj_in = _pair(o, i, o // 4, i // 4, 2, seed=3)
        random_error = reconstruction_error(proj_out, proj_in, held_out)
        scaled_error = reconstruction_error(fit_initial_values(proj_out), fit_initial_values(proj_in), held_out)
        fit = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in), FitSettings(max_iters=200))
        for grad in train:
            fit.fit(grad, 50)
        fitted_error = reconstruction_error(*fit.projectors(), held_out)
        assert fitted_error < 0.5 * random_error, name
        # Also below the norm-scaled random start, a random subspace (error ≈ 1). The margin is small here: the
        # gradients of a randomly initialised tiny model are nearly isotropic (SmolLM2's are not: docs/benchmarks.md).
        assert fitted_error < scaled_error - 0.05, (name, fitted_error, scaled_error)
        # Indices never change during a fit; values do.
        assert torch.equal(fit.projectors()[0].indices, proj_out.indices)


def test_a_fit_stops_at_the_target_error_and_within_its_budget():
    proj_out, proj_in = _pair(32, 32, 16, 16, 2)
    grad = torch.randn(32, 2) @ torch.randn(2, 32)
    budget = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in), FitSettings(max_iters=5,
                                                                                               target_error=0.0))
    budget.fit(grad, 100)
    assert budget.iterations == 5
    target = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in), FitSettings(max_iters=500,
                                                                                               target_error=0.6))
    _, after = target.fit(grad, 500)
    assert after <= 0.6 and target.converged and target.iterations < 500


def test_a_non_finite_gradient_is_skipped_by_the_fit():
    proj_out, proj_in = _pair(16, 16, 8, 8, 2)
    fit = LayerFit(proj_out, proj_in, FitSettings())
    grad = torch.randn(16, 16)
    grad[3, 3] = float("nan")
    before, after = fit.fit(grad, 5)
    assert before != before and after != after  # nan
    assert fit.samples_seen == 0 and torch.equal(fit.a.detach(), proj_out.values)


class _LiveBytes(TorchDispatchMode):
    """Tracks bytes of tensor storages created inside the block that are still alive, and their peak."""

    def __init__(self, exclude):
        super().__init__()
        self.live = self.peak = 0
        self.seen = {t.untyped_storage().data_ptr() for t in exclude}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.seen or size == 0:
                continue
            self.seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key, size):
        self.live -= size
        self.seen.discard(key)


@pytest.mark.parametrize("shape", [(768, 192), (192, 768), (384, 384)])
def test_fit_memory_stays_within_the_stated_bound(shape):
    o, i = shape
    d_o, d_i = o // 4, i // 4
    proj_out, proj_in = _pair(o, i, d_o, d_i, 4)
    grad = torch.randn(o, 8) @ torch.randn(8, i)
    fit = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in), FitSettings(target_error=0.0))
    fit.fit(grad, 1)  # Adam's state exists from here on: it is the fit's, not a working set
    tracker = _LiveBytes(exclude=[grad])
    with tracker:
        fit.fit(grad, 3)
    bound = 4 * (8 * max(d_o * i, o * d_i) + 4 * (d_o**2 + d_i**2))
    assert tracker.peak <= bound
    assert tracker.peak <= 2 * grad.numel() * 4  # at rank 0.25: under two more copies of the layer's gradient


# -------------------------------------------------------------------------------------------------- rotation
def _random_state(d_o, d_i):
    m = torch.randn(d_o, d_i)
    return {"step": torch.tensor(7.0), "exp_avg": m, "exp_avg_sq": m.square() + torch.rand(d_o, d_i)}


def test_rotation_with_unchanged_projectors_is_the_identity():
    proj_out, proj_in = _pair(64, 48, 16, 12, 3)
    state = _random_state(16, 12)
    expected = {k: v.clone() for k, v in state.items()}
    rotate_moments(state, coordinate_map(proj_out, proj_out), coordinate_map(proj_in, proj_in), ADAM.first_moments,
                   ADAM.second_moments)
    torch.testing.assert_close(state["exp_avg"], expected["exp_avg"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state["exp_avg_sq"], expected["exp_avg_sq"], atol=1e-4, rtol=1e-4)
    assert float(state["step"]) == 7.0


def test_rotation_projects_the_first_moment_orthogonally_onto_the_new_subspace():
    old_out, old_in = _pair(64, 48, 16, 12, 3, seed=0)
    new_out, new_in = _pair(64, 48, 16, 12, 3, seed=1)
    state = _random_state(16, 12)
    m_old = state["exp_avg"].clone()
    rotate_moments(state, coordinate_map(old_out, new_out), coordinate_map(old_in, new_in), ADAM.first_moments,
                   ADAM.second_moments)
    a_old, b_old, a_new, b_new = (p.to_dense().double() for p in (old_out, old_in, new_out, new_in))
    target = a_old.T @ m_old.double() @ b_old  # the moment as a weight-space matrix
    residual = a_new.T @ state["exp_avg"].double() @ b_new - target
    # Orthogonal to every matrix the new subspace can express (A'ᵀ Z B'), i.e. A' residual B'ᵀ = 0 ...
    assert float((a_new @ residual @ b_new.T).abs().max()) < 1e-4 * float(target.abs().max())
    # ... so it is the best approximation: no Z' does better (checked against random perturbations).
    best = float(residual.norm())
    for _ in range(5):
        other = state["exp_avg"].double() + 0.01 * torch.randn(16, 12, dtype=torch.float64)
        assert float((a_new.T @ other @ b_new - target).norm()) > best
    assert bool((state["exp_avg_sq"] >= 0).all())


# ------------------------------------------------------------------------------------------------- sampling
def test_sampling_hands_over_one_full_gradient_at_a_time_and_accumulates_nothing():
    module = TinyClassifier()
    layers = []
    for name in ("body.0", "body.3"):
        linear = module.get_submodule(name)
        o, i = linear.weight.shape
        layers.append(ProjectedWeight(name, linear, *_pair(o, i, o // 2, i // 2, 2)))
    flags = {name: p.requires_grad for name, p in module.named_parameters()}
    seen = []

    def consume(layer, grad):
        # Every other projected weight's gradient is already freed (or not yet computed) when one is handed over.
        assert all(other.weight.grad is None for other in layers)
        seen.append((layer.name, tuple(grad.shape), grad.dtype))
        torch.testing.assert_close(grad, expected[layer.name])

    x, y = next(iter(classification_data()))
    reference = TinyClassifier()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = {name: reference.get_submodule(name).weight.grad for name in ("body.0", "body.3")}
    with sample_gradients(module, layers, consume):
        torch.nn.functional.cross_entropy(module(x), y).backward()
    assert sorted(seen) == [("body.0", (32, 16), torch.float32), ("body.3", (24, 32), torch.float32)]
    assert all(p.grad is None for p in module.parameters())  # nothing else received a gradient
    assert {name: p.requires_grad for name, p in module.named_parameters()} == flags
    assert all(not layer.has_grad for layer in layers)  # S untouched


def test_the_norm_ratio_pool_averages_each_gradients_kept_share():
    proj_out, proj_in = _pair(24, 16, 6, 4, 2)
    a, b = proj_out.to_dense(), proj_in.to_dense()
    generator = torch.Generator().manual_seed(1)
    small = torch.randn(24, 16, generator=generator)
    large = 100 * torch.randn(24, 1, generator=generator) @ torch.randn(1, 16, generator=generator)  # rank one
    pool = NormRatioPool()
    for grad in (small, large, torch.zeros(24, 16), torch.full((24, 16), float("nan"))):
        pool.add("w", proj_out, proj_in, grad)  # the zero and the nan gradient carry nothing and are left out

    def kept(grad):
        return float((a @ grad @ b.T).square().sum() / grad.square().sum())

    # Each gradient counts once whatever its size (a ratio of sums would be the large one's alone).
    assert pool.ratio("w") == pytest.approx(((kept(small) + kept(large)) / 2) ** 0.5, rel=1e-5)
    assert math.isnan(pool.ratio("never added"))
    # Lossless projectors keep every norm: their ρ is exactly 1, so their clipping arithmetic stays that of Adam.
    lossless = NormRatioPool()
    lossless.add("w", SparseProjector.signed_permutation(24), SparseProjector.signed_permutation(16), small)
    assert lossless.ratio("w") == 1.0


def test_the_refit_measures_the_norm_ratio_on_batches_the_fit_did_not_use():
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, seed=0)
    refit = ProjectorRefit(num_samples=2, norm_samples=3)
    seen: dict[str, dict[str, float]] = {}

    class Measure(pl.Callback):
        # Runs after the refit's on_train_start (listed after it), at the same weights: the loader is unshuffled,
        # so the fit drew batches 0–1 and the measurement 2–4.
        def on_train_start(self, trainer, pl_module):
            layers = list(trainer.strategy.offload_optimizer.projected_layers)
            batches = list(token_data(n=32, batch_size=4))
            for part, indices in (("fitted on", range(0, 2)), ("held out", range(2, 5))):
                pool = NormRatioPool()
                with sample_gradients(pl_module, layers,
                                      lambda layer, grad: pool.add(layer.name, layer.proj_out, layer.proj_in, grad)):
                    for index in indices:
                        pl_module.training_step(batches[index], index).backward()
                seen[part] = {layer.name: pool.ratio(layer.name) for layer in layers}
            seen["installed"] = {layer.name: layer.norm_ratio for layer in layers}

    _lm_fit(strategy, callbacks=[refit, Measure()], max_steps=1)
    (record,) = refit.history
    assert record.norm_ratios == seen["installed"] and not record.norm_ratio_from_fit
    for name, ratio in seen["installed"].items():
        assert ratio == pytest.approx(seen["held out"][name], rel=1e-5)
    # On the gradients it was fitted to a fit keeps more of the norm than on others: the bias a held-out ρ avoids.
    assert statistics.fmean(seen["fitted on"].values()) > statistics.fmean(seen["held out"].values())


def test_a_refit_with_no_batch_left_to_measure_on_says_so():
    refit = ProjectorRefit(num_samples=2, norm_samples=2)
    module = TinyCausalLM(tiny_hf_model("llama"), lr=3e-3)
    run = trainer(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16), max_steps=1,
                  callbacks=[refit])
    with pytest.warns(UserWarning, match="no batch left after the fit's 2"):
        run.fit(module, token_data(n=8, batch_size=4))  # two batches: both go to the fit
    (record,) = refit.history
    assert sorted(record.norm_ratio_from_fit) == sorted(record.refit) and record.refit


# -------------------------------------------------------------------------------------------- the callback
def _lm_fit(strategy, callbacks=(), max_steps=4, **kwargs):
    module = TinyCausalLM(tiny_hf_model("llama"), lr=3e-3)
    run = trainer(strategy, max_steps=max_steps, callbacks=list(callbacks), **kwargs)
    run.fit(module, token_data(n=32, batch_size=4))
    return module, run


def test_learned_projectors_are_fitted_before_the_first_update():
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, seed=0)
    drawn = {}

    class Spy(ProjectorRefit):
        def _run(self, trainer, pl_module, initial):
            optimizer = trainer.strategy.offload_optimizer
            drawn.update({layer.name: layer.proj_in.values.clone() for layer in optimizer.projected_layers})
            drawn["steps_before_fit"] = optimizer.telemetry.steps
            super()._run(trainer, pl_module, initial)

    _, run = _lm_fit(strategy, callbacks=[Spy()])
    (refit,) = [cb for cb in run.callbacks if isinstance(cb, ProjectorRefit)]
    assert drawn["steps_before_fit"] == 0
    (record,) = refit.history
    assert record.initial and record.step == 0
    assert sorted(record.refit) == sorted(strategy.projected_layers)
    for name, layer in strategy.projected_layers.items():
        assert not torch.equal(layer.proj_in.values, drawn[name])  # fitted values replaced the draw
        # The reference is the norm-scaled random start (≈ √(1 − d_o·d_i/(o·i)) ≈ 0.97 here), not the ±1/√r draw (≈ 5).
        assert 0.8 < record.errors[name] < 1.1
    # Held out, a fit on four batches of a random tiny model gains little per layer, but it gains on average.
    assert statistics.fmean(record.fitted_errors.values()) < statistics.fmean(record.errors.values())

    # The same callback in a second fit (new projectors drawn) fits them again.
    _lm_fit(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, seed=0), callbacks=[refit])
    assert [r.initial for r in refit.history] == [True, True]

    # Without a callback the strategy adds one with the default schedule; with projectors="random", the default, it
    # does not, and the projectors stay the seeded draw.
    _, learned_run = _lm_fit(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16))
    (added,) = [cb for cb in learned_run.callbacks if isinstance(cb, ProjectorRefit)]
    assert added.refit_every == 500 and added.history[0].initial
    default = LSPOffloadStrategy(rank=0.25, density=2, min_dim=16, seed=0)
    _, default_run = _lm_fit(default)
    assert default.settings.projectors == "random"
    assert not any(isinstance(cb, ProjectorRefit) for cb in default_run.callbacks)
    for layer in default.projected_layers.values():  # the draw's ±1/√r values (r = density = 2), never fitted
        for projector in (layer.proj_out, layer.proj_in):
            assert torch.equal(projector.values.abs(), torch.full_like(projector.values, 2 ** -0.5))


def test_layers_under_the_threshold_are_skipped_and_others_refit_with_moments_on_the_host():
    indices = []

    class Spy(ProjectorRefit):
        def _run(self, trainer, pl_module, initial):
            super()._run(trainer, pl_module, initial)
            indices.append({layer.name: (layer.proj_out.indices.clone(), layer.proj_in.indices.clone())
                            for layer in trainer.strategy.offload_optimizer.projected_layers})

    def run(threshold):
        indices.clear()
        refit = Spy(refit_every=2, threshold=threshold, num_samples=2, max_iters=8)
        strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, seed=1)
        _lm_fit(strategy, callbacks=[refit], max_steps=3)
        return refit, strategy

    probe, _ = run(threshold=0.0)  # refits every layer at step 2: shows the errors measured there
    errors = probe.history[1].errors
    assert probe.history[1].step == 2 and sorted(probe.history[1].refit) == sorted(errors)
    threshold = sorted(errors.values())[len(errors) // 2]
    refit, strategy = run(threshold=threshold)
    record = refit.history[1]
    assert record.errors == pytest.approx(errors)  # the same run up to this point: same measurement
    above = sorted(name for name, error in errors.items() if error > threshold)
    assert sorted(record.refit) == above and 0 < len(above) < len(errors)
    assert refit.refits_per_layer == {name: 2 if name in above else 1 for name in errors}
    after_initial, after_refit = indices
    for name, (old_out, old_in) in after_initial.items():
        new_out, new_in = after_refit[name]
        redrawn = not torch.equal(old_out, new_out) and not torch.equal(old_in, new_in)
        assert redrawn == (name in above), name  # refit layers get fresh indices, skipped ones keep theirs
    optimizer = strategy.offload_optimizer
    assert optimizer.device_state_bytes() == 0
    for slot in optimizer.slots:
        for value in slot.state_tensors():
            assert value.device.type == "cpu"


def test_refit_metrics_reach_the_loggers(tmp_path):
    refit = ProjectorRefit(refit_every=2, threshold=0.0, num_samples=1, max_iters=2)
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, log_telemetry=False)
    _lm_fit(strategy, callbacks=[refit], max_steps=3, logger=CSVLogger(tmp_path, name="run"))
    (metrics_file,) = tmp_path.glob("run/*/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    logged = [row for row in rows if row.get("projector_refit/error_mean")]
    assert [int(row["step"]) for row in logged] == [0, 2]
    first = logged[0]
    assert float(first["projector_refit/error_min"]) <= float(first["projector_refit/error_mean"]) <= float(
        first["projector_refit/error_max"])
    assert float(first["projector_refit/layers_refit"]) == len(strategy.projected_layers)
    assert float(logged[1]["projector_refit/fits_done"]) == 2.0


def test_refit_errors_are_clear():
    with pytest.raises(ValueError, match="ProjectorRefit fits the projectors of strategy='lsp_offload'"):
        trainer(ZeroOffloadStrategy(), callbacks=[ProjectorRefit()]).fit(TinyClassifier(), classification_data())
    # Random projectors (the default) are never fitted: a ProjectorRefit beside them would silently change their kind.
    module = TinyClassifier()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"projectors='random' \(the default\), which are never fitted\. Use "
                                         r"LSPOffloadStrategy\(projectors='learned'\)"):
        trainer(LSPOffloadStrategy(min_dim=16, rank=0.5, density=2), callbacks=[ProjectorRefit()]).fit(
            module, classification_data())
    assert all(torch.equal(before[n], p) for n, p in module.named_parameters())  # refused before any step

    class Manual(TinyClassifier):
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    with pytest.raises(ValueError, match="loss_fn=lambda module, batch"):
        trainer(LSPOffloadStrategy(projectors="learned", min_dim=16, rank=0.5, density=2)).fit(
            Manual(), classification_data())
    with pytest.raises(ValueError, match="refit_every=-1"):
        ProjectorRefit(refit_every=-1)
    with pytest.raises(ValueError, match="projectors must be one of"):
        LSPOffloadStrategy(projectors="pca")


# ------------------------------------------------------------------------------------------- reproducibility
@pytest.fixture
def two_threads():
    # The drift came from more than one thread: run these at two at least, whatever the machine's default.
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    yield
    torch.set_num_threads(previous)


def test_gram_products_match_the_dense_ones():
    a = SparseProjector.random(1536, 384, 8, generator=torch.Generator().manual_seed(1))
    b = SparseProjector.random(1536, 200, 3, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(cross_gram(a, b), a.to_dense() @ b.to_dense().t())
    torch.testing.assert_close(gram(a.values, a.indices, a.dim_out), a.to_dense() @ a.to_dense().t())


def test_a_layer_fit_is_bit_identical_across_runs_with_threads(two_threads):
    # SmolLM2's MLP shape: big enough that CPU kernels split the work between threads.
    grad = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0))

    def fitted():
        out = fit_initial_values(SparseProjector.random(1536, 384, 8, generator=torch.Generator().manual_seed(1)))
        inp = fit_initial_values(SparseProjector.random(576, 144, 8, generator=torch.Generator().manual_seed(2)))
        fit = LayerFit(out, inp, FitSettings(max_iters=12, target_error=0.0))
        fit.fit(grad, 12)
        return fit.projectors()

    first, second = fitted(), fitted()
    for p, q in zip(first, second):
        assert torch.equal(p.values, q.values)  # exact: a resume check compares bits


@pytest.mark.parametrize("fit_threads", [None, 2], ids=["default-threads", "two-fit-threads"])
def test_the_learned_fit_gives_identical_projectors_in_two_runs(two_threads, fit_threads):
    def fitted():
        strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, seed=0)
        torch.manual_seed(0)
        _lm_fit(strategy, callbacks=[ProjectorRefit(num_samples=2, max_iters=8, fit_threads=fit_threads)], max_steps=1)
        return {name: (layer.proj_out.values.clone(), layer.proj_in.values.clone())
                for name, layer in strategy.projected_layers.items()}

    first, second = fitted(), fitted()
    assert first.keys() == second.keys()
    for name in first:
        assert all(torch.equal(p, q) for p, q in zip(first[name], second[name])), name


def test_fit_threads_are_restored_and_validated(two_threads):
    before = torch.get_num_threads()
    _lm_fit(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16),
            callbacks=[ProjectorRefit(fit_threads=1)],
            max_steps=1)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="fit_threads=0 must be an int ≥ 1, or None"):
        ProjectorRefit(fit_threads=0)


def test_a_fit_on_an_accelerator_holds_one_layers_fit_state_there_at_a_time(monkeypatch):
    # On an accelerator each layer's fit state is parked on the host after its sample. Here the device is the CPU,
    # so the park decision is forced and the moves are recorded: every layer's state leaves right after its sample.
    from lightning_offload.lsp import fit as fit_module

    active, peak, parks = set(), [0], []
    real_fit, real_to = fit_module.LayerFit.fit, fit_module.LayerFit.to

    def fit(self, grad, iterations):
        active.add(id(self))
        peak[0] = max(peak[0], len(active))
        return real_fit(self, grad, iterations)

    def to(self, device):
        if torch.device(device) == torch.device("cpu") and id(self) in active:
            active.discard(id(self))
            parks.append(id(self))
        return real_to(self, device)

    monkeypatch.setattr(fit_module.LayerFit, "fit", fit)
    monkeypatch.setattr(fit_module.LayerFit, "to", to)
    monkeypatch.setattr(projector_fitting, "_park_device", lambda grad: torch.device("cpu"))
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16, seed=0)
    _lm_fit(strategy, callbacks=[ProjectorRefit(num_samples=3, max_iters=6)], max_steps=1)
    layers = len(strategy.projected_layers)
    assert layers > 1 and peak[0] == 1
    (record,) = [cb for cb in strategy.lightning_module.trainer.callbacks if isinstance(cb, ProjectorRefit)][0].history
    # The record counts what was on the training device at once (here the CPU, where parked states also are).
    assert record.device_fit_state_bytes > 0
    assert len(parks) == 3 * layers and len(set(parks)) == layers


def test_a_layer_fit_moved_between_samples_continues_exactly():
    proj_out, proj_in = _pair(96, 64, 24, 16, 3)
    grads = [torch.randn(96, 4, generator=torch.Generator().manual_seed(s)) @ torch.randn(4, 64) for s in range(3)]
    settings = FitSettings(max_iters=12, target_error=0.0)
    staying = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in), settings)
    moving = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in), settings)
    for grad in grads:
        staying.fit(grad, 4)
        moving.fit(grad, 4)
        moving.pattern_a = moving.pattern_b = None  # as after a move: the structures are rebuilt where the sample is
        moving.to("cpu")
    assert torch.equal(staying.a, moving.a) and torch.equal(staying.b, moving.b)
    # Values with two Adam moments each (fp32), int16 indices, and Adam's two scalar step counts.
    assert moving.nbytes() == (96 + 64) * 3 * (4 * 3 + 2) + 2 * 4
