"""The engine driven by a training loop that steps it itself: what Lightning Fabric's strategies, a plain PyTorch loop
and Hugging Face's ``Trainer`` share (:class:`LoopOffloadOptimizer`, set up by :func:`lightning_offload.offload` or
Fabric's strategies from the same settings as the Trainer strategies' engine: :mod:`lightning_offload.setup.engine`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_offload.engine.figures.refit_record import RefitRecord
from lightning_offload.engine.fitting.batch_gradients import BatchGradients, LossFn
from lightning_offload.engine.fitting.projector_fitting import (
    FitAgreement, OneProcess, ProjectorFitting, fit_projectors)
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.inner_optimizers import step_unhooked
from lightning_offload.lsp.model_attachments import EngineHook
from lightning_offload.setup.engine import EngineSetup
from lightning_offload.setup.refit_schedule import check_refit_every, refit_due
from lightning_offload.setup.settings import OffloadSettings

log = logging.getLogger(__name__)

#: What a loop face takes besides the offload settings (the keyword arguments of :func:`~lightning_offload.offload`).
LOOP_SETTINGS = ("device", "max_grad_norm", "fitting", "refit_every", "accumulation_steps")
#: The offload settings a loop face refuses, with the reason its error gives.
LOOP_REFUSED = {"log_telemetry": "a loop of one's own has no logger; read opt.telemetry (its figures) instead."}


@dataclass(frozen=True)
class LoopSettings:
    """What a loop face adds to the offload settings (the Args of :func:`~lightning_offload.offload`), validated at
    construction, before anything is set up.

    Attributes:
        max_grad_norm: clip every step to this global norm unless a clipping call came first. Default: ``None``.
        accumulation_steps: training forwards per optimizer step, or ``None``. Default: ``1``.
        refit_every: steps between refit checks; 0 for none. Default: ``500``.
        fitting: how projector fits run. Default: ``ProjectorFitting()``.
    """

    max_grad_norm: float | None = None
    accumulation_steps: int | None = 1
    refit_every: int = 500
    fitting: ProjectorFitting = field(default_factory=ProjectorFitting)

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be positive (or None: no clipping unless "
                             f"clip_grad_norm_ is called).")
        check_refit_every(self.refit_every)
        steps = self.accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"accumulation_steps={steps!r} must be the number of micro-batches per optimizer step "
                             f"(an int ≥ 1), or None: gradients cross at the step.")


@dataclass
class LoopControl:
    """What a loop's optimizer keeps beside the engine: its set-up, clipping, fits and the step's micro-batches.

    One object, not attributes of the optimizer: Fabric's optimizer wrapper forwards reads but keeps writes to itself.
    """

    setup: EngineSetup
    settings: LoopSettings
    name: str
    wants_fit: bool
    fits: list[RefitRecord] = field(default_factory=list)
    last_fit_step: int = -1  # the step count at the latest fit (-1: none yet)
    forwards: int = 0  # training forwards since the last step
    warned_unfitted: bool = False
    warned_unsettled_save: bool = False
    forward_counter: Any = None
    #: Called first at close, newest first: what was attached to the engine after it was built (MEFT's adapters).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    #: How the ranks agree on a projector fit (one process: every value its own).
    agreement: FitAgreement = field(default_factory=OneProcess)


class LoopOffloadOptimizer(OffloadOptimizer):
    """The engine as the optimizer of a loop of one's own (built by :func:`~lightning_offload.offload`, or by the
    Fabric strategies).

    Beside what :class:`~lightning_offload.engine.optimizer.OffloadOptimizer` does, it sends the last micro-batch's
    gradients during its backward (``accumulation_steps``), clips every step to ``max_grad_norm`` unless a clipping
    call came first, fits and refits the projectors when asked (:meth:`fit_projectors`, :attr:`refit_due`), and
    gives the model back at :meth:`close`: what a loop has no callback for.
    """

    loop: LoopControl

    def configure_loop(self, setup: EngineSetup, loop: LoopSettings, name: str,
                       agreement: FitAgreement | None = None) -> None:
        """Called once by the set-up that built it (:func:`~lightning_offload.offload`, the Fabric strategies;
        ``agreement``: how the ranks agree on a projector fit, one process's by default)."""
        wants_fit = self.settings.learns_projectors and bool(self.projected_layers)
        self.loop = LoopControl(setup, loop, name, wants_fit)
        if agreement is not None:
            self.loop.agreement = agreement
        if loop.accumulation_steps is not None:
            # The last micro-batch's forward marks the backward whose final gradients may cross during it; an
            # EngineHook, so a copy of the model (deepcopy, torch.save) holds an inert hook, not this optimizer.
            self.loop.forward_counter = setup.model.register_forward_pre_hook(EngineHook(self._count_forward))
        else:
            self.orchestrator.routing.measure_every_backward = True  # any backward may be the step's last

    def _count_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # an evaluation forward: no backward follows
        self.loop.forwards += 1
        if self.loop.forwards == self.loop.settings.accumulation_steps:
            for layer in self.projected_layers:
                layer.reset_forward_count()  # as at the start of the Trainer's closure
            self.orchestrator.routing.collecting = True

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken, skipped ones and one still running included; restored by :meth:`load_state_dict`."""
        return self.telemetry.steps + self.telemetry.skipped_steps + int(self.step_in_flight)

    @property
    def max_grad_norm(self) -> float | None:
        """The global norm every step is clipped to unless a clipping call came first (``None``: no clipping unless
        asked); set it to change the limit from the next step on (Hugging Face's ``OffloadCallback`` does)."""
        return self.loop.settings.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self.loop.settings = replace(self.loop.settings, max_grad_norm=value)  # validated as at construction

    @property
    def fits(self) -> list[RefitRecord]:
        """What each projector fit did, oldest first."""
        return self.loop.fits

    # ------------------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One step: clipped to ``max_grad_norm`` when no clipping call came since the last step, then the engine's
        step (see :meth:`OffloadOptimizer.step`)."""
        loop = self.loop
        self.orchestrator.routing.collecting, loop.forwards = False, 0  # the next step's micro-batches count afresh
        if self.needs_first_fit and not loop.warned_unfitted:
            loop.warned_unfitted = True
            warnings.warn(f"{loop.name}: projectors='learned' but fit_projectors() was not called before the first "
                          f"step, so the projectors are still their random draw. Call opt.fit_projectors(batches, "
                          f"loss_fn) before training, or use projectors='random'.", stacklevel=2)
        loss = self.orchestrator.collect(closure) if closure is not None else None
        if loop.settings.max_grad_norm is not None and self.norms.clip is None:
            self.clip_grad_norm_(loop.settings.max_grad_norm)
        # The engine's step as defined, not as torch wraps it: this step already ran the optimizer hooks once.
        step_unhooked(self, OffloadOptimizer)
        return loss

    def settle(self) -> None:
        """Apply every pending update and the decay untouched row-sparse embedding rows owe; call before reading or
        saving the weights outside a forward (with ``pipelined=True`` updates wait for each module's next forward)."""
        self.synchronize()
        self.settle_row_decay()

    # ------------------------------------------------------------------------------------------ projector fits
    @property
    def needs_first_fit(self) -> bool:
        """Whether learned projectors are still their random draw (no fit yet, none restored by a resume)."""
        return self.loop.wants_fit and self.loop.last_fit_step < 0

    @property
    def refit_due(self) -> bool:
        """Whether ``refit_every`` steps have passed since the latest fit or check (never with ``refit_every=0`` or
        before the first fit): the rule every face follows (:func:`~lightning_offload.setup.refit_schedule.refit_due`).
        """
        loop = self.loop
        return loop.wants_fit and refit_due(self.steps_taken, loop.last_fit_step, loop.settings.refit_every)

    def fit_projectors(self, batches: Iterable[Any], loss_fn: LossFn) -> RefitRecord:
        """Fit the projectors now: every projected layer at the first call (the initial fit), then a check that
        refits the layers whose error on fresh gradients exceeds the threshold.

        The passes draw ``num_samples`` batches for the fit and ``norm_samples`` more to measure the new projectors'
        norm ratio (for clipping), from the start of ``batches``, under an RNG forked and seeded by the seed and
        the step (the loop's own random stream is untouched; a resumed run fits alike). Gradients are not kept.

        Args:
            batches: training batches (a DataLoader, a list).
            loss_fn: ``loss_fn(model, batch) -> loss`` (it moves the batch to the device); ``None`` skips a batch.

        Returns:
            What the fit did (also appended to :attr:`fits`).

        Raises:
            ValueError: for random projectors (``projectors="random"``, the default): they are never fitted, and
                fitting them would silently make them another kind.
        """
        loop = self.loop
        if self.projected_layers and not loop.wants_fit:
            raise ValueError(f"{loop.name}: fit_projectors() fits learned projectors, but this optimizer was built "
                             f"with projectors='random' (the default), which are never fitted. Pass "
                             f"projectors='learned' to offload() (or to the Fabric strategy) to fit them.")
        step = self.steps_taken
        initial = loop.last_fit_step < 0
        fitting = loop.settings.fitting
        source = BatchGradients(loop.setup.model, batches, loss_fn, fitting.num_samples + fitting.norm_samples)
        log.info(fitting.describe(len(self.projected_layers), step, initial))
        # The passes' forwards are no micro-batches of the loop's: its count is as it was after the fit.
        forwards, collecting = loop.forwards, self.orchestrator.routing.collecting
        try:
            record = fit_projectors(loop.setup.optimizer, source, fitting, step, initial, agreement=loop.agreement,
                                    show_progress=False,
                                    sampling=lambda: _forked_rng(self.device, fitting.seed * 1_000_003 + step))
        finally:
            loop.forwards, self.orchestrator.routing.collecting = forwards, collecting
        loop.last_fit_step = step
        loop.fits.append(record)
        log.info(record.summary_line(len(self.projected_layers)))
        for message in (fitting.missing_measurement_warning(record), record.stuck_warning(fitting.threshold)):
            if message is not None:
                warnings.warn(message, stacklevel=2)
        return record

    # ------------------------------------------------------------------------------------------------ state
    def _state_dict(self) -> dict[str, Any]:
        """The engine's state (:meth:`OffloadOptimizer.state_dict`) and when the projectors were last fitted.

        Warns once when the latest step's updates were still pending: reads through the model apply them first, but a
        checkpoint that read the weights by other means (tensors held from before) holds the step before.
        """
        loop = self.loop
        if not loop.warned_unsettled_save and any(self.orchestrator.pending(slot) for slot in self.slots):
            loop.warned_unsettled_save = True
            warnings.warn(f"{loop.name}: state_dict() was called with the latest step's updates still pending (they "
                          f"are applied before each module's next forward, or when the weights are read through the "
                          f"model): weights read since that step from tensors held outside the model lack them. Read "
                          f"them through the model (model.state_dict()), or call optimizer.settle() first.",
                          stacklevel=4)
        return {**super()._state_dict(), "loop": {"last_fit_step": loop.last_fit_step}}

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (after the model's weights: :meth:`OffloadOptimizer.load_state_dict`)."""
        state = dict(state_dict)
        saved = state.pop("loop", {})
        super()._load_state_dict(state)
        self.loop.last_fit_step = int(saved.get("last_fit_step", self.loop.last_fit_step))

    def close(self) -> None:
        """Apply what is pending and give the model back as it was (plain modules, no hooks; idempotent)."""
        loop = self.loop
        if loop.forward_counter is not None:
            loop.forward_counter.remove()
            loop.forward_counter = None
        try:
            while loop.on_close:
                loop.on_close.pop()()
        finally:
            loop.setup.release()


@contextmanager
def _forked_rng(device: torch.device, seed: int) -> Iterator[None]:
    """The block under a forked RNG seeded with ``seed``, as :meth:`LoopOffloadOptimizer.fit_projectors` describes."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def loop_settings(settings: OffloadSettings, max_grad_norm: float | None, accumulation_steps: int | None,
                  refit_every: int, fitting: ProjectorFitting | None) -> LoopSettings:
    """A loop face's own settings beside ``settings`` (validated; the fit's seed is the offload's by default).

    Raises:
        ValueError: for a bad value, or a fit setting where nothing is projected (``zero_offload``, ``meft_offload``).
    """
    if not settings.projection and (fitting is not None or refit_every != LoopSettings.refit_every):
        given = "fitting" if fitting is not None else f"refit_every={refit_every!r}"
        raise ValueError(f"{given}: nothing is projected without projection (zero_offload, meft_offload), so there "
                         f"are no projectors to fit. Remove it, or use strategy='lsp_offload'.")
    return LoopSettings(max_grad_norm, accumulation_steps, refit_every,
                        fitting if fitting is not None else ProjectorFitting(seed=settings.seed))
