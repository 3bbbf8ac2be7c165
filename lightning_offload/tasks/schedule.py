"""The command line's optimizer settings as one validated value, and the learning-rate schedule they describe.

``OptimSettings`` is what ``optim:`` in ``conf/train.yaml`` holds: Adam's ``lr``, ``weight_decay``, ``betas`` and
``eps``, then a linear warm-up (``warmup_steps``, or ``warmup_ratio`` of the run) and a decay after it to a floor
(``decay: constant | linear | cosine``, ``min_lr_ratio``). Every bad value is refused at construction, named with the
values it accepts, before a model is loaded.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

DECAYS = ("constant", "linear", "cosine")


class SettingsError(ValueError):
    """A setting of the command line that is refused before anything is built."""


class LinearWarmup:
    """LR multiplier rising linearly from ``1/warmup_steps`` to 1 over ``warmup_steps`` steps, then 1.

    A class rather than a lambda so ``LambdaLR.state_dict()`` (and thus checkpoints) can capture it.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup_steps)


class WarmupDecay:
    """LR multiplier: linear warm-up over ``warmup_steps``, then a linear or cosine decay from 1 to ``floor`` at step
    ``total_steps`` (and ``floor`` after it).

    A plain class with plain attributes, so ``LambdaLR.state_dict()`` checkpoints it.
    """

    def __init__(self, warmup_steps: int, total_steps: int, decay: str, floor: float) -> None:
        self.warmup_steps, self.total_steps, self.decay, self.floor = warmup_steps, total_steps, decay, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.floor + (1.0 - self.floor) * shape


def _is_number(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (``True`` and ``nan`` are not)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class OptimSettings:
    """Adam's settings and the learning-rate schedule of a command-line run.

    Attributes:
        lr: peak learning rate (> 0).
        weight_decay: decoupled weight decay of matrices (≥ 0).
        betas: Adam's ``(β₁, β₂)``, each in [0, 1).
        eps: Adam's ε (> 0).
        warmup_steps: linear warm-up length in optimizer steps (0: none).
        warmup_ratio: warm-up as a share of the run's optimizer steps, in [0, 1); set this or ``warmup_steps``.
        decay: after warm-up, ``constant``, ``linear`` or ``cosine`` down to ``min_lr_ratio · lr`` at the last step.
        min_lr_ratio: the floor of the decay as a share of ``lr``, in [0, 1].

    Example::

        OptimSettings(lr=3e-4, warmup_ratio=0.05, decay="cosine", min_lr_ratio=0.1)
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    decay: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not (_is_number(self.lr) and self.lr > 0):
            raise SettingsError(f"optim.lr={self.lr!r} must be a finite number > 0; set e.g. optim.lr=1e-4.")
        if not (_is_number(self.weight_decay) and self.weight_decay >= 0):
            raise SettingsError(f"optim.weight_decay={self.weight_decay!r} must be a finite number ≥ 0.0; set e.g. "
                                f"optim.weight_decay=0.0 or 0.01.")
        betas = self.betas
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1
                                                                              for b in betas)):
            raise SettingsError(f"optim.betas={self.betas!r} must be two numbers in [0, 1); set e.g. "
                                f"optim.betas=[0.9,0.999].")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not (_is_number(self.eps) and self.eps > 0):
            raise SettingsError(f"optim.eps={self.eps!r} must be a finite number > 0; set e.g. optim.eps=1e-8.")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise SettingsError(f"optim.warmup_steps={self.warmup_steps!r} must be an int ≥ 0 (0: no warmup).")
        if not (_is_number(self.warmup_ratio) and 0 <= self.warmup_ratio < 1):
            raise SettingsError(f"optim.warmup_ratio={self.warmup_ratio!r} must be in [0, 1) (a share of the run's "
                                f"steps; 0: no warmup).")
        if self.warmup_steps and self.warmup_ratio:
            raise SettingsError(f"optim.warmup_steps={self.warmup_steps} and optim.warmup_ratio={self.warmup_ratio} "
                                f"both set the warm-up; set one of them to 0.")
        if self.decay not in DECAYS:
            raise SettingsError(f"optim.decay={self.decay!r} is not one of {DECAYS}.")
        if not (_is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            raise SettingsError(f"optim.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1] (the decay's floor as "
                                f"a share of optim.lr).")

    @classmethod
    def from_mapping(cls, node: Mapping[str, Any]) -> OptimSettings:
        """The settings of a config node (``cfg.optim``), refusing keys it does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(node) - known)
        if unknown:
            raise SettingsError(f"optim.{unknown[0]} is not an optimizer setting; the settings are {sorted(known)}.")
        values = {key: (list(value) if key == "betas" and not isinstance(value, (str, bytes)) and value is not None
                        and hasattr(value, "__iter__") else value) for key, value in node.items()}
        return cls(**values)

    @property
    def schedules(self) -> bool:
        """Whether the learning rate changes during the run (a scheduler is needed)."""
        return bool(self.warmup_steps or self.warmup_ratio or self.decay != "constant")

    def scheduler(self, optimizer: torch.optim.Optimizer,
                  total_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR | None:
        """The per-step scheduler of these settings over a run of ``total_steps`` optimizer steps (``None``: none
        needed). Warns when the warm-up is as long as the run, which then never trains at ``lr``."""
        if not self.schedules:
            return None
        if total_steps is None or total_steps <= 0:
            if self.warmup_ratio or self.decay != "constant":
                raise SettingsError(f"optim.warmup_ratio and optim.decay={self.decay!r} need the run's length: set "
                                    f"trainer.max_steps (got {total_steps!r} steps).")
            return torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(self.warmup_steps))
        warmup = self.warmup_steps or round(self.warmup_ratio * total_steps)
        if warmup >= total_steps:
            warnings.warn(f"The warm-up ({warmup} steps) is as long as the run ({total_steps} optimizer steps): the "
                          f"learning rate never reaches optim.lr={self.lr}. Shorten optim.warmup_steps or use "
                          f"optim.warmup_ratio.", UserWarning, stacklevel=2)
        if self.decay == "constant":
            return torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(warmup)) if warmup else None
        return torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                 WarmupDecay(warmup, total_steps, self.decay, self.min_lr_ratio))
