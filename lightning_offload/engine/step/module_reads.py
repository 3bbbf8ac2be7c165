"""Weights read through a module see the last step, with no call of the user's.

With ``pipelined=True`` a step's update of a module's weights is applied right before that module's next forward (a
forward pre-hook), and a row-sparse embedding's idle rows owe their decoupled decay until they are stepped again. A
read of the weights through the module in between (``model.state_dict()``, ``save_pretrained``,
``model.named_parameters()`` after the loop, ``model.lm_head.weight``) would see the step before. So, while a module's
weights owe anything, its ``_parameters`` dict is replaced by :class:`PendingParameters`: the same parameters, and on
the first access of any kind it puts the module's own dict back, has the module's updates applied (and owed decay paid),
then answers. ``torch.nn.Module`` reads and writes its parameters only through that dict (``__getattr__``,
``named_parameters``, ``state_dict``, ``load_state_dict``, ``_apply``), so every such read is covered; the module's
own forward finds the plain dict back already (its pre-hook applied the update), so the training step pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Applies what a module's weights owe (its pending updates, and the decay its idle rows owe).
Settle = Callable[[torch.nn.Module], None]


class PendingParameters(dict):
    """A module's ``_parameters`` while its weights owe an update: the same entries; any access first settles.

    Args:
        module: the module whose ``_parameters`` it stands in for.
        settle: applies what the module's weights owe.
    """

    __slots__ = ("_module", "_original", "_settle")

    def __init__(self, module: torch.nn.Module, settle: Settle) -> None:
        original = module.__dict__["_parameters"]
        super().__init__(original)
        self._module: torch.nn.Module | None = module
        self._original: dict[str, Any] = original
        self._settle = settle

    def restore(self, settle: bool = True) -> dict[str, Any]:
        """Put the module's own dict back (first, so reads made while settling find it), settle unless told not to
        (the forward pre-hook applied the update itself), and return the dict."""
        module, self._module = self._module, None
        if module is not None:
            if module.__dict__.get("_parameters") is self:
                module.__dict__["_parameters"] = self._original
            if settle:
                self._settle(module)
        return self._original

    # Every dict method torch.nn.Module (or anyone) may call: settle, then answer from the module's own dict.
    def __getitem__(self, key: str) -> Any:
        return self.restore()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.restore()

    def __iter__(self) -> Any:
        return iter(self.restore())

    def __setitem__(self, key: str, value: Any) -> None:
        self.restore()[key] = value

    def __delitem__(self, key: str) -> None:
        del self.restore()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.restore().get(key, default)

    def items(self) -> Any:
        return self.restore().items()

    def keys(self) -> Any:
        return self.restore().keys()

    def values(self) -> Any:
        return self.restore().values()

    def pop(self, *args: Any) -> Any:
        return self.restore().pop(*args)

    def popitem(self) -> Any:
        return self.restore().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        return self.restore().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.restore().update(*args, **kwargs)

    def clear(self) -> None:
        self.restore().clear()

    def copy(self) -> dict[str, Any]:
        return self.restore().copy()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled or deep-copied (torch.save(model), copy.deepcopy(model)) as the plain dict it stands for, settled:
        # never with the engine behind it.
        return dict, (dict(self.restore()),)


def expose(module: torch.nn.Module, settle: Settle) -> None:
    """Until its weights are settled, reads through ``module`` settle them first."""
    if not isinstance(module.__dict__.get("_parameters"), PendingParameters):
        module.__dict__["_parameters"] = PendingParameters(module, settle)


def conceal(module: torch.nn.Module) -> bool:
    """Give ``module`` its own dict back without settling (its pre-hook is about to apply the update itself, or the
    engine is handing the model back); returns whether it owed anything."""
    pending = module.__dict__.get("_parameters")
    if isinstance(pending, PendingParameters):
        pending.restore(settle=False)
        return True
    return False
