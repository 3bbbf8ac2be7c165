"""``ProjectorRefit``: learn LSP projectors before training and keep them fresh on a schedule.

The callback fits the projector values of every projected layer to sampled gradients before the first update
(the *initial fit*) and, every ``every_n_steps`` optimizer steps, measures each layer's reconstruction error on
fresh gradients and refits the layers whose error exceeds ``threshold``, carrying their host Adam moments into the
new subspace. ``Trainer(strategy="lsp_offload")`` adds one with the default schedule when none is given.

Gradients are sampled by extra forward/backward passes over ``num_samples`` batches drawn from the training
dataloader with a seeded, forked RNG (the run's own data order and random state are untouched, and a resumed run
draws the same batches). Each pass runs ``training_step`` with logging muted (or ``loss_fn`` when given); the
per-layer full gradient exists for one layer at a time (:mod:`lightning_offload.lsp.sampling`). Like plain
training, these passes keep every projected layer's full input for backward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from tqdm.auto import tqdm
from typing_extensions import override

from lightning_offload.lsp.fit import FitSettings, LayerFit, fit_initial_values, reconstruction_error
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.norm_ratio import NormRatioPool
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.strategies.gradient_sampling import GradientPasses, LossFn, sampling_rng, stop_if_terminated
from lightning_offload.strategies.refit_record import RefitRecord


@runtime_checkable
class ProjectedTraining(Protocol):
    """What the refit needs of the Trainer's strategy (``lsp_offload`` and its DDP form provide it): the projected
    layers' optimizer, and agreement between ranks on what was sampled and fitted. A protocol, so this module does not
    import the strategies (which add this callback)."""

    projection: bool
    offload_optimizer: Any

    def synchronize(self) -> None:
        """Finish the step in flight."""

    def reduce_sampled_gradient(self, grad: Tensor) -> Tensor:
        """The mean over ranks of a sampled gradient (itself on one rank)."""

    def agree(self, value: Any) -> Any:
        """Rank 0's value of a decision, on every rank."""

    def agree_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float,
                         second_moment_scale: float) -> tuple[SparseProjector, SparseProjector, float, float]:
        """Rank 0's fitted projectors, on every rank."""


class ProjectorRefit(Callback):
    """Fit LSP projectors before training and refit stale ones every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: measure (and refit when needed) before every ``every_n_steps``-th optimizer step; 0 turns
            refits off and keeps only the initial fit. Default: ``500``.
        threshold: refit a layer when ``err = ‖AᵀA G BᵀB − G‖/‖G‖`` on a fresh gradient exceeds it. For reference,
            unfitted (norm-scaled) random projectors sit near 1.0 and a fresh fit near 0.6–0.9 on held-out gradients
            of SmolLM2 at ``rank=0.25``. Default: ``0.9``.
        num_samples: gradients (batches) sampled per fit; each is computed, used and freed in turn. Default: ``4``.
        max_iters: Adam iterations per layer per fit, spread evenly over the samples. Default: ``32``.
        norm_samples: further batches, after the fit's, on which the new projectors' ``ρ = ‖S‖/‖G‖`` is measured for
            the clipping norm and the carried ``v`` (see :mod:`lightning_offload.lsp.norm_ratio`): forward and
            backward passes without fitting. Pooled over 8 batches of 4×64 tokens, the global estimate's median read
            0.986–1.006× the true norm on fresh batches, over 4 batches 1.001–1.029×. 0 takes the fit's own one-batch
            figure instead (0.85–1.22×). Default: ``8``.
        target_error: a layer stops fitting once its error on the current sample is at most this. Default: ``0.1``.
        lr: Adam learning rate on the projector values. Default: ``0.05``.
        l2: L2 penalty on the projector values. Default: ``1e-4``.
        initial_fit: fit every projected layer before the first update. Default: ``True``.
        fit_threads: torch threads for the fit's own products on the CPU (the sampling passes keep the run's
            setting). Default: ``None`` (one thread per 256K gradient elements, at most the run's count: these
            products are small, and on a busy or many-core host extra threads mostly wait on each other).
        seed: seeds batch sampling and the indices redrawn at refits. Default: ``0``.
        loss_fn: ``loss_fn(module, batch) -> loss`` for the sampling passes. Default: ``None`` (the module's
            ``training_step`` with logging muted; needs automatic optimization).
        log: send :meth:`RefitRecord.metrics` to the trainer's loggers after each fit. Default: ``True``.

    ``strategy="lsp_offload"`` with ``projectors="learned"`` (its default) adds ``ProjectorRefit(seed=...)`` with
    the strategy's seed when the Trainer has none; pass your own to change the schedule.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import ProjectorRefit

        refit = ProjectorRefit(every_n_steps=200, threshold=0.8, num_samples=2)
        trainer = pl.Trainer(strategy="lsp_offload", precision="bf16-mixed", callbacks=[refit])
        trainer.fit(module)  # refit.history then holds a RefitRecord per fit or check
    """

    #: Reads no weights after a step, or applies pending updates itself first (see strategies/weight_readers.py).
    leaves_weights_alone = True

    def __repr__(self) -> str:
        return (f"ProjectorRefit(every_n_steps={self.every_n_steps}, threshold={self.threshold}, "
                f"num_samples={self.num_samples}, max_iters={self.settings.max_iters})")

    def __init__(
        self,
        every_n_steps: int = 500,
        threshold: float = 0.9,
        num_samples: int = 4,
        max_iters: int = 32,
        norm_samples: int = 8,
        target_error: float = 0.1,
        lr: float = 0.05,
        l2: float = 1e-4,
        initial_fit: bool = True,
        fit_threads: int | None = None,
        seed: int = 0,
        loss_fn: LossFn | None = None,
        log: bool = True,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int ≥ 0 (0 turns refits off).")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r} must be an int ≥ 1.")
        if not isinstance(norm_samples, int) or norm_samples < 0:
            raise ValueError(f"norm_samples={norm_samples!r} must be an int ≥ 0 (0: no measurement passes).")
        if fit_threads is not None and (not isinstance(fit_threads, int) or fit_threads < 1):
            raise ValueError(f"fit_threads={fit_threads!r} must be an int ≥ 1, or None to choose per layer.")
        if not threshold >= 0:
            raise ValueError(f"threshold={threshold!r} must be ≥ 0 (a relative error).")
        self.every_n_steps = every_n_steps
        self.threshold = float(threshold)
        self.num_samples = num_samples
        self.norm_samples = norm_samples
        self.settings = FitSettings(max_iters=max_iters, target_error=target_error, lr=lr, l2=l2)
        self.initial_fit = initial_fit
        self.fit_threads = fit_threads
        self.seed = seed
        self.loss_fn = loss_fn
        self.log = log
        self.history: list[RefitRecord] = []
        self.refits_per_layer: dict[str, int] = {}
        self.fits_done = 0
        self._initial_fit_done = False
        self._last_checked_step = -1

    # -------------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Each fit draws new projectors; a checkpoint being resumed restores this flag after `setup`.
        self._initial_fit_done = False
        self._last_checked_step = -1
        strategy = trainer.strategy
        if not isinstance(strategy, ProjectedTraining) or not strategy.projection:
            raise ValueError(
                f"ProjectorRefit fits the projectors of strategy='lsp_offload', but this Trainer uses "
                f"{type(strategy).__name__}{'' if getattr(strategy, 'projection', True) else ' (projection off)'}. "
                f"Remove the callback or use strategy='lsp_offload'."
            )
        if self.loss_fn is None and not pl_module.automatic_optimization:
            raise ValueError(
                "ProjectorRefit samples gradients by running training_step, which under manual optimization would "
                "also step the optimizer. Pass ProjectorRefit(loss_fn=lambda module, batch: ...) returning the loss, "
                "or use LSPOffloadStrategy(projectors='random')."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.initial_fit and not self._initial_fit_done:
            self._run(trainer, pl_module, initial=True)
            self._initial_fit_done = True

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        # on_train_batch_start fires for every micro-batch; the first one of an optimizer step checks.
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step != self._last_checked_step:
            self._last_checked_step = step
            self._run(trainer, pl_module, initial=False)

    # ------------------------------------------------------------------------------------------------ fitting
    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, initial: bool) -> None:
        strategy = trainer.strategy
        optimizer = strategy.offload_optimizer
        layers: list[ProjectedWeight] = list(optimizer.projected_layers)
        if not layers:
            return
        # Pending updates belong to the current projectors and must land before the weights are sampled.
        strategy.synchronize()
        step = trainer.global_step
        record = RefitRecord(step=step, initial=initial)
        start = time.perf_counter()
        fits: dict[str, LayerFit] = {}
        # ρ of the projectors in use on the check's samples, pooled: every one is held out for them.
        old_pool = NormRatioPool()
        skipped: set[str] = set()
        iters_per_sample = math.ceil(self.settings.max_iters / self.num_samples)
        order = {layer.name: i for i, layer in enumerate(layers)}

        def consume(layer: ProjectedWeight, grad: Tensor) -> None:
            stop_if_terminated(trainer)  # a fit takes minutes on a CPU: a preempted job stops between layers
            progress.update(1)
            # With data parallelism every rank fits to the mean of the ranks' samples, as to one larger batch.
            grad = strategy.reduce_sampled_gradient(grad)
            fit = fits.get(layer.name)
            with _threads(self._threads_for(grad)):
                if fit is None:
                    if not initial:
                        # Rank 0's figure decides, so every rank skips the same layers (and so issues the same
                        # reductions afterwards).
                        error = strategy.agree(reconstruction_error(layer.proj_out, layer.proj_in, grad))
                        if math.isnan(error):
                            return  # a zero or non-finite gradient: wait for a usable sample
                        record.errors[layer.name] = error
                        if error <= self.threshold:
                            skipped.add(layer.name)
                            return
                        proj_out, proj_in = self._redraw(layer, step, order[layer.name])
                    else:
                        proj_out, proj_in = layer.proj_out, layer.proj_in
                    fit = fits[layer.name] = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in),
                                                      self.settings)
                if not initial:
                    # How much of the check's gradients the stale projectors keep: the carried Adam v is rescaled by
                    # how much more the new ones keep, so Adam's step size stays where it was.
                    old_pool.add(layer.name, layer.proj_out, layer.proj_in, grad)
                before, after = fit.fit(grad, iters_per_sample)
                held = sum(f.nbytes() for f in fits.values() if f.device == grad.device)
                record.device_fit_state_bytes = max(record.device_fit_state_bytes, held)
                park = self._park_device(grad)
                if park is not None:
                    # Until this layer's next sample, its fit state waits on the host: the device holds one layer's.
                    fit.to(park)
            if not math.isnan(before):
                if initial and fit.samples_seen == 1:
                    record.errors[layer.name] = before  # the norm-scaled random start, on the first usable gradient
                # The error before fitting on a sample the fit has not seen yet is a held-out error.
                record.fitted_errors[layer.name] = before if fit.samples_seen > 1 else after

        when = "before the first step" if initial else f"at step {step}"
        rank_zero_info(
            f"ProjectorRefit: {'fitting' if initial else 'checking'} the projectors of {len(layers)} layers {when} "
            f"on {self.num_samples} sampled batches (up to {self.settings.max_iters} Adam iterations per layer), "
            f"then measures the new projectors' norm ratio on {self.norm_samples} more."
        )
        # Fits take from seconds to minutes before the training bar moves: a bar of its own, when bars are shown.
        progress = tqdm(total=self.num_samples * len(layers), desc="Projector fit", unit="layer", leave=False,
                        disable=trainer.progress_bar_callback is None or not trainer.is_global_zero)
        fitted: dict[str, tuple[SparseProjector, SparseProjector]] = {}
        measured = NormRatioPool()

        def measure(layer: ProjectedWeight, grad: Tensor) -> None:
            proj_out, proj_in = fitted[layer.name]
            measured.add(layer.name, proj_out, proj_in, strategy.reduce_sampled_gradient(grad))

        try:
            with sampling_rng(trainer, self.seed * 1_000_003 + step):
                passes = GradientPasses(trainer, pl_module, self.num_samples + self.norm_samples, self.loss_fn)

                def active() -> list[ProjectedWeight]:
                    remaining = [layer for layer in layers if layer.name not in skipped]
                    progress.total = progress.n + (self.num_samples - passes.used) * len(remaining)  # skipped: none
                    progress.refresh()
                    return remaining

                if passes.run(self.num_samples, active, consume) == 0:
                    raise ValueError(f"ProjectorRefit drew {passes.drawn} training batch(es) and training_step "
                                     f"returned None (skip) for every one: there are no gradients to fit to. Return "
                                     f"a loss for some batches, pass loss_fn, or use "
                                     f"LSPOffloadStrategy(projectors='random').")
                for name, fit in fits.items():
                    if fit.samples_seen > 0:  # where the gradients are: a fit's state may wait on the host
                        device = layers[order[name]].proj_out.indices.device
                        fitted[name] = tuple(projector.to(device) for projector in fit.projectors())  # type: ignore
                if fitted and self.norm_samples:
                    # ρ of the new projectors on batches the fit never used (see lsp/norm_ratio.py).
                    measuring = [layer for layer in layers if layer.name in fitted]
                    passes.run(self.norm_samples, lambda: measuring, measure)
        finally:
            progress.close()
        for layer in layers:
            if layer.name not in fitted:
                continue
            fit = fits[layer.name]
            ratio = measured.ratio(layer.name)
            if not ratio > 0:
                # No batch was left for the measurement (a small dataloader, or norm_samples=0): the fit's own
                # held-out figure, the last sample before fitting on it, one batch's worth.
                ratio = fit.norm_ratio
                record.norm_ratio_from_fit.append(layer.name)
            old = old_pool.ratio(layer.name)
            scale = (ratio / old) ** 2 if old > 0 else 1.0
            proj_out, proj_in = fitted[layer.name]
            # Every rank must hold the same projectors (the ranks' S are summed): rank 0's fit is installed.
            proj_out, proj_in, ratio, scale = strategy.agree_projectors(proj_out, proj_in, ratio, scale)
            optimizer.replace_projectors(layer, proj_out, proj_in, norm_ratio=ratio, second_moment_scale=scale)
            record.norm_ratios[layer.name] = ratio
            record.refit.append(layer.name)
            self.refits_per_layer[layer.name] = self.refits_per_layer.get(layer.name, 0) + 1
        record.seconds = time.perf_counter() - start
        # The fit has its own figure (projector_refit/seconds); the next step's device time must not include it.
        optimizer.restart_step_clock()
        self.history.append(record)
        rank_zero_info(record.summary_line(len(layers)))
        if record.norm_ratio_from_fit and self.norm_samples:
            rank_zero_warn(
                f"ProjectorRefit: the training dataloader had no batch left after the fit's {self.num_samples} to "
                f"measure the norm ratio of {len(record.norm_ratio_from_fit)} refitted layers on, so their gradient "
                f"clipping norm rests on one batch's figure (0.85–1.22× the true norm at 256 tokens). Give the "
                f"dataloader at least num_samples + norm_samples = {self.num_samples + self.norm_samples} batches, or "
                f"lower num_samples."
            )
        stuck = record.stuck_warning(self.threshold)
        if stuck is not None:
            rank_zero_warn(stuck)
        self.fits_done += 1
        if self.log:
            for logger in trainer.loggers:
                logger.log_metrics({**record.metrics(), "projector_refit/fits_done": float(self.fits_done)}, step=step)

    @staticmethod
    def _park_device(grad: Tensor) -> torch.device | None:
        """Where a layer's fit state waits between its samples: the host, when the gradients are on an accelerator
        (``None``: stay where it is)."""
        return torch.device("cpu") if grad.device.type != "cpu" else None

    def _threads_for(self, grad: Tensor) -> int:
        """Threads for one layer's fit products: ``fit_threads``, or one per 256K gradient elements."""
        if grad.device.type != "cpu":
            return torch.get_num_threads()  # the products run on the accelerator: the host setting is not theirs
        if self.fit_threads is not None:
            return self.fit_threads
        return max(1, min(torch.get_num_threads(), grad.numel() // 2**18))

    def _redraw(self, layer: ProjectedWeight, step: int, index: int) -> tuple[SparseProjector, SparseProjector]:
        """Fresh collision-free indices for a refit, seeded by (seed, step, layer) so a resumed run redraws alike."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 10_007 + index)
        device = layer.proj_out.indices.device
        return tuple(  # type: ignore[return-value]
            SparseProjector.random(p.dim_in, p.dim_out, p.nnz_per_column, generator=generator, device=device)
            for p in (layer.proj_out, layer.proj_in)
        )

    # ------------------------------------------------------------------------------------------- persistence
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "initial_fit_done": self._initial_fit_done,
            "last_checked_step": self._last_checked_step,
            "refits_per_layer": dict(self.refits_per_layer),
            "fits_done": self.fits_done,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._initial_fit_done = bool(state_dict["initial_fit_done"])
        self._last_checked_step = int(state_dict["last_checked_step"])
        self.refits_per_layer = dict(state_dict["refits_per_layer"])
        self.fits_done = int(state_dict["fits_done"])


@contextmanager
def _threads(count: int) -> Iterator[None]:
    # torch's intra-op thread count is process-wide: set for the fit's products only, then restored.
    previous = torch.get_num_threads()
    if count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
