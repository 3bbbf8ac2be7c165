"""Stepping the package's own inner ``torch.optim`` optimizers (a host Adam per tensor, a device Adam, a projector
fit's Adam) without the user's optimizer hooks.

``torch.optim.Optimizer`` wraps every optimizer class's ``step`` so that it calls the hooks registered with
``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook`` (global: every optimizer's step) and the
instance's own. A user's global hook is meant for the optimizer they train with: called once per training step, by the
offload optimizer's own ``step``. The engine steps dozens of inner optimizers per training step, which would call it
dozens of times, with optimizers the user never built. Their steps run the class's step as torch defined it, unwrapped.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


def step_unhooked(optimizer: Optimizer, cls: type | None = None) -> Any:
    """``optimizer.step()`` without the step hooks torch's wrapper calls (the plain ``step`` where torch has none);
    ``cls``: the class whose ``step`` to run (a subclass's step running its parent's, which torch may have wrapped
    too once an instance of the parent was built: the hooks would run twice)."""
    own = optimizer.__dict__.get("step") if cls is None else None
    if own is not None:
        return own()  # a step set on the instance (torch wraps only the class's)
    step = (cls or type(optimizer)).step
    if getattr(step, "hooked", False):  # torch's wrapper (Optimizer._patch_step_function) marks itself so
        step = step.__wrapped__
    return step(optimizer)
