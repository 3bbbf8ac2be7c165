"""What the package attaches to a user's modules in training, and what a copy or a pickle of the model keeps of it.

EMA and SWA callbacks deep-copy the model mid-run (``copy.deepcopy``, ``torch.optim.swa_utils.AveragedModel``) and
scripts ``torch.save`` whole models. Such a copy is a plain model holding the current weights: it has no engine, so
each engine hook on a module becomes :func:`inert_hook` in it, a projected module's forward becomes its own again
(``lsp/linear.py``), and its projection state is absent. The model in training keeps all of it, untouched by the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What an engine hook is in a copy of the model: nothing to do (the copy has no engine behind it)."""
    return None


def _inert() -> Callable[..., None]:
    return inert_hook


def _absent() -> None:
    return None


class EngineHook:
    """A hook the engine puts on a user's module; copied or pickled as :func:`inert_hook`.

    Args:
        call: what the hook does in the model in training (any arguments, passed through).
    """

    __slots__ = ("call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _inert, ()


class CopiedAsAbsent:
    """Mixin: state the engine keeps on a module (``module._lsp_state``) that a copy or a pickle of it holds as
    ``None``."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _absent, ()
