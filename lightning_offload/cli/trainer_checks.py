"""The ``trainer.*`` counts of a run checked before anything is built or written.

Lightning checks some of them when its ``Trainer`` is built (``max_steps``, ``max_epochs``, the ``limit_*`` fractions)
and others only mid-fit (``accumulate_grad_batches=0``, a negative clipping value): both after the run directory holds
the run's logs, config and checkpoint folder. Checked with the other settings instead, a bad count stops the command
with the fix, and no directory of a run that never was is left behind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from lightning_offload.tasks.schedule import SettingsError


def _int_at_least(least: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


def _fraction_or_count(value: Any, count_least: int, fraction_open_at_zero: bool) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= count_least
    if isinstance(value, float):
        return (0.0 < value if fraction_open_at_zero else 0.0 <= value) and value <= 1.0
    return False


#: setting → (the values it takes, how the message says them, an example of a good override).
_RULES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "max_steps": (_int_at_least(-1), "an int ≥ -1 (-1: no limit, the epochs decide)", "100"),
    "max_epochs": (lambda v: v is None or _int_at_least(-1)(v), "null or an int ≥ -1 (-1: no limit)", "1"),
    "min_steps": (lambda v: v is None or _int_at_least(0)(v), "null or an int ≥ 0", "null"),
    "min_epochs": (lambda v: v is None or _int_at_least(0)(v), "null or an int ≥ 0", "null"),
    "accumulate_grad_batches": (_int_at_least(1), "an int ≥ 1 (micro-batches per optimizer step)", "1"),
    "log_every_n_steps": (_int_at_least(1), "an int ≥ 1", "1"),
    "val_check_interval": (lambda v: v is None or _fraction_or_count(v, 1, fraction_open_at_zero=True),
                           "null, an int ≥ 1 (training batches) or a float in (0, 1] (of an epoch)", "20"),
    "limit_train_batches": (lambda v: v is None or _fraction_or_count(v, 0, fraction_open_at_zero=False),
                            "null, an int ≥ 0 (batches) or a float in [0, 1] (of the dataloader)", "1.0"),
    "limit_val_batches": (lambda v: v is None or _fraction_or_count(v, 0, fraction_open_at_zero=False),
                          "null, an int ≥ 0 (batches) or a float in [0, 1] (of the dataloader)", "16"),
    "gradient_clip_val": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and math.isfinite(v) and v >= 0),
                          "null (no clipping) or a finite number ≥ 0", "1.0"),
}


def check_trainer_counts(trainer: Mapping[str, Any]) -> None:
    """Refuse a ``trainer.*`` count Lightning would refuse later (or trip over mid-fit), naming it and the fix.

    Args:
        trainer: the run's ``trainer`` config node.

    Raises:
        SettingsError: ``trainer.<setting>=<value> must be …; set e.g. trainer.<setting>=…``.
    """
    for name, (valid, takes, example) in _RULES.items():
        if name in trainer and not valid(trainer[name]):
            raise SettingsError(f"trainer.{name}={trainer[name]!r} must be {takes}; set e.g. "
                                f"trainer.{name}={example}.")
