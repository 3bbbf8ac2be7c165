"""``ProjectorRefit``: learn LSP projectors before training and keep them fresh on a schedule.

The callback fits the projector values of every projected layer to sampled gradients before the first update
(the *initial fit*) and, every ``refit_every`` optimizer steps, measures each layer's reconstruction error on
fresh gradients and refits the layers whose error exceeds ``threshold``, carrying their host Adam moments into the
new subspace: the schedule of every face (:func:`~lightning_offload.setup.refit_schedule.refit_due`), so a plain loop,
Fabric and Hugging Face's ``Trainer`` with the same ``refit_every`` refit at the same steps.
``Trainer(strategy="lsp_offload")`` adds one with the default schedule when none is given.

Gradients are sampled by extra forward/backward passes over ``num_samples`` batches drawn from the training
dataloader with a seeded, forked RNG (the run's own data order and random state are untouched, and a resumed run
draws the same batches). Each pass runs ``training_step`` with logging muted (or ``loss_fn`` when given); the
per-layer full gradient exists for one layer at a time (:mod:`lightning_offload.lsp.sampling`). Like plain
training, these passes keep every projected layer's full input for backward.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_offload.engine.figures.refit_record import RefitRecord
from lightning_offload.engine.fitting.projector_fitting import FitAgreement, ProjectorFitting, fit_projectors
from lightning_offload.faces.trainer.gradient_sampling import GradientPasses, LossFn, sampling_rng, stop_if_terminated
from lightning_offload.setup.refit_schedule import check_refit_every, refit_due
from lightning_offload.setup.settings import OffloadSettings


@runtime_checkable
class ProjectedTraining(Protocol):
    """What the refit needs of the Trainer's strategy (``lsp_offload`` and its DDP form provide it): the projected
    layers' optimizer, and agreement between ranks on what was sampled and fitted. A protocol, so this module does not
    import the strategies (which add this callback)."""

    settings: OffloadSettings
    offload_optimizer: Any
    fit_agreement: FitAgreement  # how ranks agree on what was sampled and fitted

    def synchronize(self) -> None:
        """Finish the step in flight."""


class ProjectorRefit(Callback):
    """Fit LSP projectors before training and refit stale ones every ``refit_every`` optimizer steps.

    Args:
        refit_every: measure (and refit when needed) once ``refit_every`` optimizer steps have passed since the latest
            fit or check (from the initial fit at step 0: before steps ``refit_every``, ``2·refit_every``, ...; without
            an initial fit, counted from the start of training); 0 turns refits off and keeps only the initial fit.
            Default: ``500``.
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
        every_n_steps: the former name of ``refit_every`` (deprecated: a ``DeprecationWarning`` says so). Default:
            ``None``.

    ``strategy="lsp_offload"`` with ``projectors="learned"`` adds ``ProjectorRefit(seed=...)`` with
    the strategy's seed when the Trainer has none; pass your own to change the schedule.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import LSPOffloadStrategy, ProjectorRefit

        refit = ProjectorRefit(refit_every=200, threshold=0.8, num_samples=2)
        trainer = pl.Trainer(strategy=LSPOffloadStrategy(projectors="learned"), precision="bf16-mixed",
                             callbacks=[refit])
        trainer.fit(module)  # refit.history then holds a RefitRecord per fit or check
    """

    #: Reads no weights after a step, or applies pending updates itself first
    #: (see lightning_offload/faces/trainer/weight_readers.py).
    leaves_weights_alone = True

    def __repr__(self) -> str:
        return (f"ProjectorRefit(refit_every={self.refit_every}, threshold={self.threshold}, "
                f"num_samples={self.num_samples}, max_iters={self.settings.max_iters})")

    def __init__(
        self,
        refit_every: int = 500,
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
        *,
        every_n_steps: int | None = None,
    ) -> None:
        if every_n_steps is not None:
            warnings.warn("ProjectorRefit(every_n_steps=...) is deprecated: the knob is refit_every, its name in every "
                          "face (offload(), Fabric's strategies). Pass ProjectorRefit(refit_every=...).",
                          DeprecationWarning, stacklevel=2)
            refit_every = every_n_steps
        # The fit itself, and the validation of its settings, is the engine's
        # (any loop's): engine/fitting/projector_fitting.py.
        self.fitting = ProjectorFitting(threshold=float(threshold), num_samples=num_samples, norm_samples=norm_samples,
                                        max_iters=max_iters, target_error=target_error, lr=lr, l2=l2,
                                        fit_threads=fit_threads, seed=seed)
        self.refit_every = check_refit_every(refit_every)
        self.initial_fit = initial_fit
        self.loss_fn = loss_fn
        self.log = log
        self.history: list[RefitRecord] = []
        self.refits_per_layer: dict[str, int] = {}
        self.fits_done = 0
        self._initial_fit_done = False
        self._last_fit_step = -1  # the step of the latest fit or check (-1: none yet)

    # The fit's settings, read from the one value that holds them (kept as attributes of the callback for its users).
    threshold = property(lambda self: self.fitting.threshold, doc="Refit a layer whose error exceeds this.")
    num_samples = property(lambda self: self.fitting.num_samples, doc="Gradients sampled per fit.")
    norm_samples = property(lambda self: self.fitting.norm_samples, doc="Batches on which ρ is measured.")
    fit_threads = property(lambda self: self.fitting.fit_threads, doc="Threads of the fit's products on the CPU.")
    seed = property(lambda self: self.fitting.seed, doc="Seeds batch sampling and the indices redrawn at refits.")
    settings = property(lambda self: self.fitting.fit, doc="The per-layer optimisation's settings.")

    @property
    def every_n_steps(self) -> int:
        """The former name of :attr:`refit_every` (deprecated)."""
        warnings.warn("ProjectorRefit.every_n_steps is deprecated: read refit_every.", DeprecationWarning, stacklevel=2)
        return self.refit_every

    # -------------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Each fit draws new projectors; a checkpoint being resumed restores this flag after `setup`.
        self._initial_fit_done = False
        self._last_fit_step = -1
        strategy = trainer.strategy
        if not isinstance(strategy, ProjectedTraining) or not strategy.settings.projection:
            raise ValueError(
                f"ProjectorRefit fits the projectors of strategy='lsp_offload', but this Trainer uses "
                f"{type(strategy).__name__}{' (projection off)' if isinstance(strategy, ProjectedTraining) else ''}. "
                f"Remove the callback or use strategy='lsp_offload'."
            )
        if strategy.settings.projectors != "learned":
            raise ValueError(
                f"ProjectorRefit fits learned projectors, but this Trainer's {type(strategy).__name__} keeps "
                f"projectors={strategy.settings.projectors!r} (the default), which are never fitted. Use "
                f"LSPOffloadStrategy(projectors='learned') (offload=lsp_learned on the CLI), or remove the callback."
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
        if self._last_fit_step < 0:  # no fit (initial_fit=False), none restored: the schedule counts from here
            self._last_fit_step = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # on_train_batch_start fires for every micro-batch; the first one of an optimizer step checks (the later ones
        # find the check just taken).
        if refit_due(trainer.global_step, self._last_fit_step, self.refit_every):
            self._run(trainer, pl_module, initial=False)

    # ------------------------------------------------------------------------------------------------ fitting
    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, initial: bool) -> None:
        strategy = trainer.strategy
        optimizer = strategy.offload_optimizer
        step = self._last_fit_step = trainer.global_step
        layers = len(optimizer.projected_layers)
        if not layers:
            return
        fitting = self.fitting
        rank_zero_info(fitting.describe(layers, step, initial))
        passes = GradientPasses(trainer, pl_module, fitting.num_samples + fitting.norm_samples, self.loss_fn)
        record = fit_projectors(
            optimizer, passes, fitting, step, initial, agreement=strategy.fit_agreement,
            show_progress=trainer.progress_bar_callback is not None and trainer.is_global_zero,
            stop=lambda: stop_if_terminated(trainer),
            sampling=lambda: sampling_rng(trainer, self.seed * 1_000_003 + step))
        for name in record.refit:
            self.refits_per_layer[name] = self.refits_per_layer.get(name, 0) + 1
        self.history.append(record)
        rank_zero_info(record.summary_line(layers))
        for message in (fitting.missing_measurement_warning(record), record.stuck_warning(self.threshold)):
            if message is not None:
                rank_zero_warn(message)
        self.fits_done += 1
        if self.log:
            for logger in trainer.loggers:
                logger.log_metrics({**record.metrics(), "projector_refit/fits_done": float(self.fits_done)}, step=step)

    def fit_history(self) -> list[RefitRecord]:
        """What each fit or refit check did, oldest first (the run's reporting reads it through
        :class:`~lightning_offload.setup.report.RecordsFits`)."""
        return self.history

    # ------------------------------------------------------------------------------------------- persistence
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "initial_fit_done": self._initial_fit_done,
            "last_fit_step": self._last_fit_step,
            "refits_per_layer": dict(self.refits_per_layer),
            "fits_done": self.fits_done,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._initial_fit_done = bool(state_dict["initial_fit_done"])
        # Saved before the one schedule (issue 66): checks fell on multiples of every_n_steps from the initial fit at 0.
        self._last_fit_step = int(state_dict["last_fit_step"]) if "last_fit_step" in state_dict else \
            max(int(state_dict["last_checked_step"]), 0 if self._initial_fit_done else -1)
        self.refits_per_layer = dict(state_dict["refits_per_layer"])
        self.fits_done = int(state_dict["fits_done"])
