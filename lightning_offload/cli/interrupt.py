"""Ctrl-C during a command-line run: finish the optimizer step in progress, save ``last.ckpt``, stop, summarise.

Lightning's own answer to Ctrl-C is a ``KeyboardInterrupt`` wherever the main thread happens to be (inside backward,
or while the host worker holds half an update), then ``sys.exit(1)``: no checkpoint and no summary. The command line
adds this callback and runs the fit inside :meth:`StopOnInterrupt.catching_ctrl_c`; a second Ctrl-C still aborts at
once, as users expect.
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

    Args:
        checkpoint_path: where the checkpoint is written (``<run dir>/checkpoints/last.ckpt``, which a resumed run
            recognises as its own directory).

    Attributes:
        stopped_at_step: the optimizer step the run stopped after, once it did (``None`` otherwise).
        checkpoint: the checkpoint written then.
    """

    #: Reads no weights after a step, or applies pending updates itself first (see strategies/weight_readers.py).
    leaves_weights_alone = True

    def __init__(self, checkpoint_path: str | Path) -> None:
        self.checkpoint_path = Path(checkpoint_path)
        self.requested = False
        self.stopped_at_step: int | None = None
        self.checkpoint: Path | None = None
        self._previous_handler: Any = signal.default_int_handler
        self._last_step: int | None = None

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
        if trainer.global_step == self._last_step:
            return  # mid-accumulation: the step in progress has more micro-batches to come
        self._last_step = trainer.global_step
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
        log.warning("Interrupted: stopped after step %d; checkpoint saved to %s.", trainer.global_step,
                    self.checkpoint_path)
