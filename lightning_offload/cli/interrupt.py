"""Ctrl-C during a command-line run: finish the optimizer step in progress, save ``last.ckpt``, stop, summarise.

Lightning's own answer to Ctrl-C is a ``KeyboardInterrupt`` wherever the main thread happens to be (inside backward,
or while the host worker holds half an update), then ``sys.exit(1)``: no checkpoint and no summary. The command line
adds this callback and runs the fit inside :meth:`StopOnInterrupt.catching_ctrl_c`; a second Ctrl-C still aborts at
once, as users expect.

The stop is prompt: Lightning runs a whole validation whenever ``trainer.should_stop`` is set (its fit loop treats it
as early stopping, which wants a final score), minutes on a CPU; this callback turns the fit's validation off at the
stop, so the run ends seconds after the checkpoint. A Ctrl-C during a validation lets that validation finish (cut
short, its metrics would be logged, recorded and monitored as if complete) and stops right after it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl

log = logging.getLogger(__name__)


class StopOnInterrupt(pl.Callback):
    """On the first SIGINT of a fit, stops at the next optimizer-step boundary with a checkpoint saved there.

    The boundary is the end of the step in progress, or the end of the validation in progress when the validation
    follows a completed optimizer step. No validation runs after the stop.

    Args:
        checkpoint_path: where the checkpoint is written (``<run dir>/checkpoints/last.ckpt``, which a resumed run
            recognises as its own directory).

    Attributes:
        stopped_at_step: the optimizer step the run stopped after, once it did (``None`` otherwise).
        checkpoint: the checkpoint written then.
    """

    #: Reads no weights after a step, or applies pending updates itself first
    #: (see lightning_offload/faces/trainer/weight_readers.py).
    leaves_weights_alone = True

    def __init__(self, checkpoint_path: str | Path) -> None:
        self.checkpoint_path = Path(checkpoint_path)
        self.requested = False
        self.stopped_at_step: int | None = None
        self.checkpoint: Path | None = None
        self._previous_handler: Any = signal.default_int_handler
        self._last_step: int | None = None
        # Whether the latest training batch completed an optimizer step: a validation after it sits on a boundary.
        self._step_ended = False
        # The fit's ``limit_val_batches``, put back at teardown after the stop has set it to 0.
        self._limit_val_batches: int | float | None = None

    def _request(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        # A second Ctrl-C gets whatever handled SIGINT before (Python's KeyboardInterrupt): abort at once. A process
        # started in the background ignored SIGINT before; the second press must still abort, as announced.
        previous = self._previous_handler
        signal.signal(signal.SIGINT, previous if callable(previous) else signal.default_int_handler)
        print("\nCtrl-C: stopping after the optimizer step in progress and saving a checkpoint "
              "(Ctrl-C again aborts without one).", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def catching_ctrl_c(self) -> Iterator[None]:
        """Handles SIGINT as described above while the block runs (a fit), then gives the previous handler back.

        Around the fit rather than in its hooks: Lightning's signal connector puts back, at the fit's end, every
        handler it found at the start, which would leave this one installed after the run.
        """
        # Signal handlers can only be set from the main thread (a fit driven from another thread keeps Python's).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._previous_handler = signal.signal(signal.SIGINT, self._request)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._previous_handler)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._step_ended = trainer.global_step != self._last_step
        if not self._step_ended:
            return  # mid-accumulation: the step in progress has more micro-batches to come
        self._last_step = trainer.global_step
        self._stop_if_requested(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A Ctrl-C during one of the fit's validations: stop now rather than after another step (and, before, another
        # validation). Only where the validation follows a completed optimizer step (with accumulation, a validation
        # can fall between the micro-batches of one: stopping there would lose their gradients), and only when the
        # fit goes on after it: when it ends here anyway, the run is complete and not interrupted.
        if (trainer.sanity_checking or trainer.state.fn != "fit" or self.stopped_at_step is not None
                or not self._step_ended or _fit_ends_after_this_batch(trainer)):
            return
        self._stop_if_requested(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._limit_val_batches is not None:
            # The trainer validates again if asked to (`trainer.validate`, a multi-device run's final evaluation).
            trainer.limit_val_batches, self._limit_val_batches = self._limit_val_batches, None

    def _stop_if_requested(self, trainer: pl.Trainer) -> None:
        """At an optimizer-step boundary: after a Ctrl-C, saves the checkpoint and stops the fit without validating."""
        requested = self.requested
        if trainer.world_size > 1:
            # Every rank got the terminal's SIGINT, but not necessarily within the same step: all stop at the step
            # where the first one saw it, or a rank left behind would wait forever in the next collective.
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if not requested:
            return
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(self.checkpoint_path)
        self.checkpoint, self.stopped_at_step = self.checkpoint_path, trainer.global_step
        trainer.should_stop = True
        # Lightning's fit loop validates once more when `should_stop` is set (early stopping's final score): a whole
        # validation set, minutes on a CPU, before the run can end. With no validation batches the loop skips it (and
        # a scheduled one due at this very step, which the resumed run does not redo either: Lightning takes a
        # checkpoint from the end of a step as followed by its validation); a ModelCheckpoint that would have waited
        # for it saves at once.
        self._limit_val_batches = trainer.limit_val_batches
        trainer.limit_val_batches = 0
        log.warning("Interrupted: stopped after step %d; checkpoint saved to %s.", trainer.global_step,
                    self.checkpoint_path)


def _fit_ends_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the fit ends after the training batch just run anyway: ``max_steps`` reached, or the last epoch's
    last batch."""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_ends = epoch_loop.batch_progress.is_last_batch or epoch_loop.batch_idx + 1 >= trainer.num_training_batches
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
    return epoch_ends and last_epoch
