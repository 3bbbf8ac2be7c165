"""Callbacks that read or write the weights right after an optimizer step (EMA, SWA, a user's own).

Under ``pipelined=True`` a step's updates land just before each module's next forward, so a callback that reads the
weights after the step would see the previous step's (or, on a CPU, weights the host worker is still writing), and one
that writes them (weight averaging copies the average in at the end of fit) would have pending updates applied over
its values. The strategies apply each step's updates before the step returns when such a callback is present.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)

#: Lightning's callbacks that leave the weights alone after a step (progress, logging, timing, metrics), or read them
#: only through the strategy, which applies pending updates itself (checkpoints).
LEAVE_WEIGHTS_ALONE: tuple[type[Callback], ...] = (DeviceStatsMonitor, EarlyStopping, LearningRateMonitor,
                                                   ModelCheckpoint, ModelSummary, ProgressBar, ThroughputMonitor,
                                                   Timer)

#: The hooks that run after an optimizer step and before the next forward.
AFTER_STEP_HOOKS = ("on_train_batch_end", "on_train_epoch_end", "on_train_end")


def _uses_hook(callback: Callback, hook: str) -> bool:
    # A subclass's own method, or one set on the instance (LambdaCallback).
    return getattr(type(callback), hook) is not getattr(Callback, hook) or hook in vars(callback)


def weight_readers(callbacks: Iterable[pl.Callback]) -> list[str]:
    """The class names of the callbacks that may touch the weights right after a step.

    A callback counts when it uses one of :data:`AFTER_STEP_HOOKS` and is neither one of
    :data:`LEAVE_WEIGHTS_ALONE` nor marked with a class attribute ``leaves_weights_alone = True`` (this package's own
    callbacks, which apply pending updates themselves where they need weights).
    """
    return [type(c).__name__ for c in callbacks
            if not isinstance(c, LEAVE_WEIGHTS_ALONE) and not getattr(c, "leaves_weights_alone", False)
            and any(_uses_hook(c, hook) for hook in AFTER_STEP_HOOKS)]
