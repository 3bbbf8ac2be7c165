"""One projector fit or check over an :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`'s projected layers,
in any training loop: the fit of every layer before training (the *initial fit*), or a check that refits the layers
whose reconstruction error on fresh gradients is above ``threshold``, carrying their host Adam moments over.

The caller supplies the gradients (:class:`GradientSource`) and the agreement between ranks (:class:`FitAgreement`).
Each gradient is consumed layer by layer as backward produces it, so one layer's full gradient exists at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from tqdm.auto import tqdm

from lightning_offload.engine.figures.refit_record import RefitRecord
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.lsp.fit import FitSettings, LayerFit, fit_initial_values, reconstruction_error
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.norm_ratio import NormRatioPool
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.lsp.sampling import GradientConsumer


class GradientSource(Protocol):
    """Forward/backward passes that hand the projected layers' full gradients to a consumer.

    Attributes:
        drawn: batches drawn so far.
        used: passes that delivered gradients so far.
    """

    drawn: int
    used: int

    def run(self, passes: int, layers: Callable[[], Sequence[ProjectedWeight]], consume: GradientConsumer) -> int:
        """Run up to ``passes`` usable passes, each delivering every layer of ``layers()`` (asked before each pass;
        an empty answer ends the phase) to ``consume``; returns how many ran."""

    def no_gradients_error(self) -> str:
        """What to say when no pass delivered a gradient (how to give the source usable batches)."""


class FitAgreement(Protocol):
    """How ranks agree on a fit: one process is its own agreement (:class:`OneProcess`)."""

    def reduce_sampled_gradient(self, grad: Tensor) -> Tensor:
        """The mean over ranks of a sampled gradient."""

    def agree(self, value: Any) -> Any:
        """Rank 0's value of a decision, on every rank."""

    def agree_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float,
                         second_moment_scale: float) -> tuple[SparseProjector, SparseProjector, float, float]:
        """Rank 0's fitted projectors, on every rank."""


class OneProcess:
    """The agreement of a single process: every value is its own (the single-device strategies and loops)."""

    def reduce_sampled_gradient(self, grad: Tensor) -> Tensor:
        """A full gradient sampled for a projector fit, made the same on every rank (here: itself)."""
        return grad

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank, for decisions every rank must share (here: itself)."""
        return value

    def agree_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float,
                         second_moment_scale: float) -> tuple[SparseProjector, SparseProjector, float, float]:
        """A fit's result as every rank installs it: rank 0's (here: its own)."""
        return proj_out, proj_in, norm_ratio, second_moment_scale


@dataclass(frozen=True)
class ProjectorFitting:
    """How a fit runs (see :class:`~lightning_offload.faces.trainer.refit.ProjectorRefit`'s Args for more).

    Attributes:
        threshold: refit a layer whose error ``‖AᵀA G BᵀB − G‖/‖G‖`` on a fresh gradient exceeds it. Default: ``0.9``.
        num_samples: gradients sampled per fit. Default: ``4``.
        norm_samples: further batches on which the new projectors' ``ρ = ‖S‖/‖G‖`` is measured. Default: ``8``.
        max_iters: Adam iterations per layer per fit, spread over the samples. Default: ``32``.
        target_error: a layer stops fitting once its error on the current sample is at most this. Default: ``0.1``.
        lr: Adam learning rate on the projector values. Default: ``0.05``.
        l2: L2 penalty on the projector values. Default: ``1e-4``.
        fit_threads: torch threads for the fit's products on the CPU. Default: ``None`` (one per 256K gradient
            elements, at most the run's count).
        seed: seeds the indices redrawn at refits. Default: ``0``.

    Example::

        from lightning_offload import ProjectorFitting, offload

        fitting = ProjectorFitting(num_samples=2, norm_samples=4, threshold=0.8)
        opt = offload(model, torch.optim.AdamW(model.parameters()), fitting=fitting, refit_every=200)
    """

    threshold: float = 0.9
    num_samples: int = 4
    norm_samples: int = 8
    max_iters: int = 32
    target_error: float = 0.1
    lr: float = 0.05
    l2: float = 1e-4
    fit_threads: int | None = None
    seed: int = 0

    @property
    def fit(self) -> FitSettings:
        """The per-layer optimisation's settings."""
        return FitSettings(max_iters=self.max_iters, target_error=self.target_error, lr=self.lr, l2=self.l2)

    def __post_init__(self) -> None:
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples!r} must be an int ≥ 1.")
        if not isinstance(self.norm_samples, int) or self.norm_samples < 0:
            raise ValueError(f"norm_samples={self.norm_samples!r} must be an int ≥ 0 (0: no measurement passes).")
        if self.fit_threads is not None and (not isinstance(self.fit_threads, int) or self.fit_threads < 1):
            raise ValueError(f"fit_threads={self.fit_threads!r} must be an int ≥ 1, or None to choose per layer.")
        if not self.threshold >= 0:
            raise ValueError(f"threshold={self.threshold!r} must be ≥ 0 (a relative error).")

    def describe(self, layers: int, step: int, initial: bool) -> str:
        """The line said before a fit starts."""
        when = "before the first step" if initial else f"at step {step}"
        return (f"ProjectorRefit: {'fitting' if initial else 'checking'} the projectors of {layers} layers {when} "
                f"on {self.num_samples} sampled batches (up to {self.fit.max_iters} Adam iterations per layer), "
                f"then measures the new projectors' norm ratio on {self.norm_samples} more.")

    def missing_measurement_warning(self, record: RefitRecord) -> str | None:
        """What to warn when refitted layers' ``ρ`` had to come from the fit itself (no batch was left)."""
        if not (record.norm_ratio_from_fit and self.norm_samples):
            return None
        return (f"ProjectorRefit: the training dataloader had no batch left after the fit's {self.num_samples} to "
                f"measure the norm ratio of {len(record.norm_ratio_from_fit)} refitted layers on, so their gradient "
                f"clipping norm rests on one batch's figure (0.85–1.22× the true norm at 256 tokens). Give the "
                f"dataloader at least num_samples + norm_samples = {self.num_samples + self.norm_samples} batches, or "
                f"lower num_samples.")


def fit_projectors(optimizer: OffloadOptimizer, source: GradientSource, fitting: ProjectorFitting, step: int,
                   initial: bool, agreement: FitAgreement | None = None, show_progress: bool = True,
                   stop: Callable[[], None] = lambda: None,
                   sampling: Callable[[], AbstractContextManager[Any]] = nullcontext) -> RefitRecord:
    """Fit (``initial``) or check and refit the projectors of ``optimizer``'s projected layers, and install them.

    Args:
        optimizer: the engine whose projected layers are fitted.
        source: the gradient passes (``num_samples`` for the fit, then up to ``norm_samples`` for ``ρ``).
        fitting: how the fit runs.
        step: the optimizer step before which it runs (seeds the indices redrawn at a refit).
        initial: fit every layer from its current projectors (else: check each, refit those above the threshold).
        agreement: how ranks agree. Default: ``None`` (one process).
        show_progress: a progress bar while fitting. Default: ``True``.
        stop: called before each layer's sample (raises to stop a preempted run between layers).
        sampling: the context the passes run in (a forked, seeded RNG, so the run's own random stream is untouched).

    Returns:
        What the fit did (its ``seconds`` included).

    Raises:
        ValueError: when no pass delivered a gradient.
    """
    if not optimizer.projected_layers:
        return RefitRecord(step=step, initial=initial)
    # Pending updates belong to the current projectors and must land before the weights are sampled.
    optimizer.synchronize()
    optimizer.settle_row_decay()
    start = time.perf_counter()
    layers = list(optimizer.projected_layers)
    # Fits take from seconds to minutes before the training bar moves: a bar of its own, when bars are shown.
    with tqdm(total=fitting.num_samples * len(layers), desc="Projector fit", unit="layer", leave=False,
              disable=not show_progress) as progress:
        fit = ProjectorFit(layers, fitting, step, initial, agreement if agreement is not None else OneProcess(),
                           stop, progress)
        with sampling():
            fit.sample_and_fit(source)
            fit.measure_ratios(source)
    fit.install(optimizer)
    fit.record.seconds = time.perf_counter() - start
    # The fit has its own figure (projector_refit/seconds); the next step's device time must not include it.
    optimizer.restart_step_clock()
    return fit.record


class ProjectorFit:
    """One fit or refit check over projected layers, in the steps :func:`fit_projectors` runs:
    :meth:`sample_and_fit`, :meth:`measure_ratios` and :meth:`install`.

    Args:
        layers: the engine's projected layers.
        fitting: how the fit runs.
        step: the optimizer step before which it runs (seeds the indices redrawn at a refit).
        initial: fit every layer from its current projectors (else: check each, refit those above the threshold).
        agreement: how ranks agree.
        stop: called before each layer's sample (raises to stop a preempted run between layers).
        progress: the fit's progress bar (a ``tqdm``), advanced by each sample and resized as layers are skipped.
    """

    def __init__(self, layers: list[ProjectedWeight], fitting: ProjectorFitting, step: int, initial: bool,
                 agreement: FitAgreement, stop: Callable[[], None], progress: Any) -> None:
        self.layers = layers
        self.fitting = fitting
        self.step = step
        self.initial = initial
        self.agreement = agreement
        self.stop = stop
        self.record = RefitRecord(step=step, initial=initial)
        self.progress = progress
        self._order = {layer.name: i for i, layer in enumerate(layers)}
        self._iters_per_sample = math.ceil(fitting.fit.max_iters / fitting.num_samples)
        self._fits: dict[str, LayerFit] = {}
        self._skipped: set[str] = set()  # layers a check found good enough: no more samples for them
        # ρ of the projectors in use on the check's samples, pooled: every one is held out for them.
        self._old_ratios = NormRatioPool()
        self._fitted: dict[str, tuple[SparseProjector, SparseProjector]] = {}
        self._measured = NormRatioPool()

    # ------------------------------------------------------------------------------------------- the fit
    def sample_and_fit(self, source: GradientSource) -> None:
        """Fit on ``num_samples`` sampled gradients, then move each fitted layer's projectors to its device.

        Raises:
            ValueError: when no pass delivered a gradient.
        """
        if source.run(self.fitting.num_samples, lambda: self._active(source), self._consume) == 0:
            raise ValueError(source.no_gradients_error())
        for name, fit in self._fits.items():
            if fit.samples_seen > 0:  # where the gradients are: a fit's state may wait on the host
                device = self.layers[self._order[name]].proj_out.indices.device
                self._fitted[name] = tuple(projector.to(device) for projector in fit.projectors())  # type: ignore

    def _active(self, source: GradientSource) -> list[ProjectedWeight]:
        """The layers still fitting (asked before each pass), the progress bar's total updated to them."""
        remaining = [layer for layer in self.layers if layer.name not in self._skipped]
        self.progress.total = self.progress.n + (self.fitting.num_samples - source.used) * len(remaining)
        self.progress.refresh()
        return remaining

    def _consume(self, layer: ProjectedWeight, grad: Tensor) -> None:
        """One sampled gradient of ``layer``: its fit started (after a check, at a refit) or continued."""
        self.stop()  # a fit takes minutes on a CPU: a preempted job stops between layers
        self.progress.update(1)
        # With data parallelism every rank fits to the mean of the ranks' samples, as to one larger batch.
        grad = self.agreement.reduce_sampled_gradient(grad)
        with _threads(_threads_for(grad, self.fitting.fit_threads)):
            fit = self._fits.get(layer.name)
            if fit is None:
                fit = self._start(layer, grad)
                if fit is None:
                    return
            if not self.initial:
                # The stale projectors' ρ, so the carried Adam v can be rescaled to keep Adam's step size.
                self._old_ratios.add(layer.name, layer.proj_out, layer.proj_in, grad)
            before, after = fit.fit(grad, self._iters_per_sample)
            held = sum(f.nbytes() for f in self._fits.values() if f.device == grad.device)
            self.record.device_fit_state_bytes = max(self.record.device_fit_state_bytes, held)
            park = _park_device(grad)
            if park is not None:
                # Until this layer's next sample, its fit state waits on the host: the device holds one layer's.
                fit.to(park)
        if not math.isnan(before):
            if self.initial and fit.samples_seen == 1:
                self.record.errors[layer.name] = before  # the norm-scaled random start, on the first usable gradient
            # The error before fitting on a sample the fit has not seen yet is a held-out error.
            self.record.fitted_errors[layer.name] = before if fit.samples_seen > 1 else after

    def _start(self, layer: ProjectedWeight, grad: Tensor) -> LayerFit | None:
        """``layer``'s fit, from its projectors (initial) or, at a check that finds them above the threshold, from a
        fresh draw; ``None`` while it waits for a usable sample or once the check found it good enough."""
        if self.initial:
            proj_out, proj_in = layer.proj_out, layer.proj_in
        else:
            # Rank 0's figure decides, so every rank skips the same layers and issues the same reductions.
            error = self.agreement.agree(reconstruction_error(layer.proj_out, layer.proj_in, grad))
            if math.isnan(error):
                return None  # a zero or non-finite gradient: wait for a usable sample
            self.record.errors[layer.name] = error
            if error <= self.fitting.threshold:
                self._skipped.add(layer.name)
                return None
            proj_out, proj_in = redraw_projectors(layer, self.fitting.seed, self.step, self._order[layer.name])
        fit = self._fits[layer.name] = LayerFit(fit_initial_values(proj_out), fit_initial_values(proj_in),
                                                self.fitting.fit)
        return fit

    # ------------------------------------------------------------------------------------------- ρ
    def measure_ratios(self, source: GradientSource) -> None:
        """``ρ = ‖S‖/‖G‖`` of the fitted projectors on up to ``norm_samples`` batches the fit never used."""
        if not self._fitted or not self.fitting.norm_samples:
            return
        measuring = [layer for layer in self.layers if layer.name in self._fitted]
        source.run(self.fitting.norm_samples, lambda: measuring, self._measure)

    def _measure(self, layer: ProjectedWeight, grad: Tensor) -> None:
        proj_out, proj_in = self._fitted[layer.name]
        self._measured.add(layer.name, proj_out, proj_in, self.agreement.reduce_sampled_gradient(grad))

    # ------------------------------------------------------------------------------------------- installing
    def install(self, optimizer: OffloadOptimizer) -> None:
        """Put rank 0's fitted projectors in ``optimizer``, with their ``ρ`` and the carried second moments' scale."""
        for layer in self.layers:
            if layer.name not in self._fitted:
                continue
            ratio = self._measured.ratio(layer.name)
            if not ratio > 0:
                # No batch was left for the measurement: the fit's own held-out figure, one batch's worth.
                ratio = self._fits[layer.name].norm_ratio
                self.record.norm_ratio_from_fit.append(layer.name)
            old = self._old_ratios.ratio(layer.name)
            scale = (ratio / old) ** 2 if old > 0 else 1.0
            proj_out, proj_in = self._fitted[layer.name]
            # Every rank must hold the same projectors (the ranks' S are summed): rank 0's fit is installed.
            proj_out, proj_in, ratio, scale = self.agreement.agree_projectors(proj_out, proj_in, ratio, scale)
            optimizer.replace_projectors(layer, proj_out, proj_in, norm_ratio=ratio, second_moment_scale=scale)
            self.record.norm_ratios[layer.name] = ratio
            self.record.refit.append(layer.name)


def _park_device(grad: Tensor) -> torch.device | None:
    """Where a layer's fit state waits between its samples (``None``: stay where it is)."""
    return torch.device("cpu") if grad.device.type != "cpu" else None


def _threads_for(grad: Tensor, fit_threads: int | None) -> int:
    """Threads for one layer's fit products: ``fit_threads``, or one per 256K gradient elements."""
    if grad.device.type != "cpu":
        return torch.get_num_threads()  # the products run on the accelerator: the host setting is not theirs
    if fit_threads is not None:
        return fit_threads
    return max(1, min(torch.get_num_threads(), grad.numel() // 2**18))


def redraw_projectors(layer: ProjectedWeight, seed: int, step: int,
                      index: int) -> tuple[SparseProjector, SparseProjector]:
    """Fresh random projectors of ``layer``'s shapes (collision-free indices, ``±1/√r`` values), seeded by
    ``(seed, step, index)`` so a resumed run redraws alike: a refit's starting point, or a redraw of random ones."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 10_007 + index)
    device = layer.proj_out.indices.device
    return tuple(  # type: ignore[return-value]
        SparseProjector.random(p.dim_in, p.dim_out, p.nnz_per_column, generator=generator, device=device)
        for p in (layer.proj_out, layer.proj_in)
    )


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
