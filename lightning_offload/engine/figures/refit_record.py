"""What one projector fit did (:class:`RefitRecord`): kept by
:class:`~lightning_offload.faces.trainer.refit.ProjectorRefit` in its history, and its figures for the loggers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RefitRecord:
    """What one fit did.

    :class:`ProjectorRefit` makes one at the initial fit and at each scheduled check, and keeps them in its
    ``history``; ``step`` and ``initial`` are required, the rest start empty and are filled in as the fit goes.

    Attributes:
        step: the optimizer step before which it ran (0 for the initial fit). Required.
        initial: whether this was the initial fit. Required.
        errors: per layer, ``err`` on the first fresh gradient of the projectors in use (at a refit, compared with
            the threshold) or, at the initial fit, of the norm-scaled random draw the fit starts from (≈ 1.0; the
            ``±1/√r`` draw itself sits near 5 because ``AᵀA`` is far from a projection). Default: ``{}``.
        refit: names of the layers that were (re)fitted. Default: ``[]``.
        fitted_errors: per refit layer, ``err`` of the new projectors on the last sampled gradient before fitting
            on it (a held-out error when ``num_samples ≥ 2``, else the error after fitting). Default: ``{}``.
        norm_ratios: per refit layer, ``ρ = ‖S‖/‖G‖`` of the new projectors pooled over ``norm_samples`` batches the
            fit did not use: the share of a full gradient's norm that the compressed gradient keeps (gradient
            clipping divides by it). Default: ``{}``.
        norm_ratio_from_fit: refit layers whose ``ρ`` is the fit's own one-batch figure (the last sample before
            fitting on it) because no batch was left to measure on (``norm_samples=0``, or a dataloader with no more
            than ``num_samples`` batches). Default: ``[]``.
        seconds: wall time of the sampling passes and fits. Default: ``0.0``.
        device_fit_state_bytes: the most fit state (values, their Adam moments, indices) held on the training device
            at once: one layer's on an accelerator, where the others wait on the host; every layer's on the CPU.
            Default: ``0``.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import ProjectorRefit

        refit = ProjectorRefit(refit_every=200)
        pl.Trainer(strategy="lsp_offload", callbacks=[refit]).fit(module)
        for record in refit.history:  # the initial fit first, then one per check
            print(record.step, record.refit, record.metrics()["projector_refit/error_mean"])
    """

    step: int
    initial: bool
    errors: dict[str, float] = field(default_factory=dict)
    refit: list[str] = field(default_factory=list)
    fitted_errors: dict[str, float] = field(default_factory=dict)
    norm_ratios: dict[str, float] = field(default_factory=dict)
    norm_ratio_from_fit: list[str] = field(default_factory=list)
    seconds: float = 0.0
    device_fit_state_bytes: int = 0

    def metrics(self) -> dict[str, float]:
        """Summary figures for loggers: error min/mean/max over layers before, mean after, counts, time."""
        before = list(self.errors.values()) or [0.0]
        after = list(self.fitted_errors.values())
        out = {
            "projector_refit/error_min": min(before),
            "projector_refit/error_mean": sum(before) / len(before),
            "projector_refit/error_max": max(before),
            "projector_refit/layers_refit": float(len(self.refit)),
            "projector_refit/seconds": self.seconds,
            "projector_refit/device_fit_state_bytes": float(self.device_fit_state_bytes),
        }
        if after:
            out["projector_refit/fitted_error_mean"] = sum(after) / len(after)
            out["projector_refit/fitted_error_max"] = max(after)
        if self.norm_ratios:
            ratios = list(self.norm_ratios.values())
            out["projector_refit/norm_ratio_mean"] = sum(ratios) / len(ratios)
            out["projector_refit/norm_ratio_min"] = min(ratios)
        return out

    def summary_line(self, num_layers: int) -> str:
        """One line on what the fit did: layers, time, and the errors before and after."""
        def mean(values: dict[str, float]) -> str:
            return f"{sum(values.values()) / len(values):.3f}" if values else "n/a"

        if self.initial:
            return (f"ProjectorRefit: fitted {len(self.refit)} of {num_layers} layers in {self.seconds:.1f} s; mean "
                    f"reconstruction error {mean(self.errors)} (norm-scaled random) -> {mean(self.fitted_errors)} "
                    f"(held-out).")
        return (f"ProjectorRefit at step {self.step}: refitted {len(self.refit)} of {num_layers} layers in "
                f"{self.seconds:.1f} s; mean error {mean(self.errors)} (in use) -> {mean(self.fitted_errors)} "
                f"(refitted, held-out).")

    def stuck_warning(self, threshold: float) -> str | None:
        """What to say when fitted layers stay above ``threshold`` (each check would refit them), else ``None``."""
        stuck = [name for name in self.refit if self.fitted_errors.get(name, 0.0) > threshold]
        if not stuck:
            return None
        if self.initial:
            # Fitted, yet no better than the threshold the schedule holds them to: the first check will refit them.
            return (f"ProjectorRefit: the initial fit left {len(stuck)} of {len(self.refit)} layers above "
                    f"threshold={threshold} (e.g. {stuck[0]}: {self.fitted_errors[stuck[0]]:.3f} on a held-out "
                    f"gradient, from {self.errors.get(stuck[0], math.nan):.3f} drawn), so each check will refit them. "
                    f"On such data learned projectors gain little over projectors='random'; or raise threshold, "
                    f"num_samples or max_iters.")
        # Such layers are refitted at every check: the cost of a full fit each time, for nothing.
        return (f"ProjectorRefit at step {self.step}: {len(stuck)} of {len(self.refit)} refitted layers stay above "
                f"threshold={threshold} after fitting (e.g. {stuck[0]}: {self.fitted_errors[stuck[0]]:.2f} on a "
                f"held-out gradient), so they will be refitted at every check. Raise threshold (fresh fits reach "
                f"~0.6–0.9 held out), num_samples or max_iters.")
