"""When a projector refit check is due: one rule, with one knob (``refit_every``), that every face calls (the Trainer's
``ProjectorRefit``, and the loop optimizer's ``refit_due`` under Fabric, a plain loop and Hugging Face's
``Trainer``), so the same schedule refits at the same steps whatever the loop.
"""

from __future__ import annotations


def check_refit_every(refit_every: object) -> int:
    """``refit_every`` if it is an int ≥ 0.

    Raises:
        ValueError: naming the value and what it must be.
    """
    if isinstance(refit_every, bool) or not isinstance(refit_every, int) or refit_every < 0:
        raise ValueError(f"refit_every={refit_every!r} must be an int ≥ 0: the optimizer steps between refit checks "
                         f"(0: no refits after the first fit).")
    return refit_every


def refit_due(steps_taken: int, last_fit_step: int, refit_every: int) -> bool:
    """Whether a refit check is due before the next step, after ``steps_taken`` optimizer steps: ``refit_every`` steps
    or more have passed since the latest fit or check (taken at step ``last_fit_step``; ``-1``: none yet, so none is
    due). With fits from step 0, checks fall at ``refit_every``, ``2·refit_every``, ...; never with ``refit_every=0``.
    """
    return refit_every > 0 and last_fit_step >= 0 and steps_taken - last_fit_step >= refit_every
