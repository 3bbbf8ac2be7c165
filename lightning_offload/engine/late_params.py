"""Parameters that join training after set-up: a param group added mid-run (``optimizer.add_param_group``, Lightning's
``BackboneFinetuning``) or a parameter of the user's groups that was frozen at set-up and is unfrozen.

``torch.optim`` steps any parameter of its groups that has a gradient, and creates its state at that first step; so
does the engine: at each step, a parameter of the groups that has no slot and now requires a gradient gets a dense
host slot (an fp32 master and the host rule's optimizer, created fresh as torch creates its state), and from then on
trains as every dense parameter does. Such a parameter is never projected, even where its layer is projectable (the
projection of a layer is decided at set-up, from the weights trained then): one log line names the parameters. Weights
the strategy itself froze (``embeddings="frozen"``, ``head="frozen"``) stay refused, as before, and so does any
change under data parallelism, whose reductions and owners are fixed at set-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.slots.dense_slot import DenseSlot
from lightning_offload.engine.slots.slot import Slot

log = logging.getLogger(__name__)


def _groups_signature(groups: list[dict[str, Any]]) -> tuple[int, int]:
    """What changes when a group is added or a parameter appended to one (cheap: one pass over the groups)."""
    return len(groups), sum(len(group["params"]) for group in groups)


class LateParameters:
    """Finds, at each step, the parameters of the user's groups that train now and have no slot yet.

    Args:
        groups: the user's param groups (the shared list ``add_param_group`` appends to).
        slots: the engine's slots at set-up.
        elsewhere: ids of parameters stepped elsewhere (on the device): never adopted.
        strategy_frozen: ids of the weights the strategy froze: refused if they get a gradient.
        frozen_at_setup: ``(parameter, name)`` of the groups' parameters that did not require a gradient at set-up.
        names: the model's parameter names by id (``param<i>`` where unknown).
    """

    def __init__(self, groups: list[dict[str, Any]], slots: list[Slot], elsewhere: set[int],
                 strategy_frozen: set[int], frozen_at_setup: list[tuple[Tensor, str]], names: dict[int, str]) -> None:
        self._groups = groups
        self._known = {id(slot.param) for slot in slots} | elsewhere | strategy_frozen
        self._strategy_frozen = [(p, name) for p, name in frozen_at_setup if id(p) in strategy_frozen]
        self._frozen = [(p, name) for p, name in frozen_at_setup if id(p) not in strategy_frozen]
        self._names = names
        self._signature = _groups_signature(groups)

    def due(self) -> bool:
        """Whether a group changed or a parameter frozen at set-up now requires a gradient (no tensor is read).

        Raises:
            ValueError: for a weight the strategy froze that now has a gradient.
        """
        for param, name in self._strategy_frozen:
            if param.requires_grad or param.grad is not None:
                raise ValueError(
                    f"{name} was frozen by the strategy's own setting (embeddings='frozen' or head='frozen') and now "
                    f"has a gradient: choose another embeddings=/head= placement to train it.")
        return (_groups_signature(self._groups) != self._signature
                or any(param.requires_grad for param, _ in self._frozen))

    def take(self, lanes: Lanes, decoupled: Callable[[dict[str, Any]], bool]) -> list[Slot]:
        """The dense slots of the parameters that train now and had none (each parameter once).

        Raises:
            ValueError: for any new parameter under data parallelism.
        """
        self._signature = _groups_signature(self._groups)
        adopted: list[Slot] = []
        for group in self._groups:
            for param in group["params"]:
                if id(param) in self._known or not param.requires_grad:
                    continue
                name = self._names.get(id(param), f"param{len(self._known)}")
                if lanes.ranks is not None:
                    raise ValueError(
                        f"{name} joined the optimizer's groups (or was unfrozen) after set-up, under data "
                        f"parallelism, whose reductions and owner ranks are fixed at set-up. Unfreeze it and add its "
                        f"group before the fit starts (e.g. in configure_optimizers).")
                self._known.add(id(param))
                adopted.append(DenseSlot(name, param, group, lanes, decoupled(group)))
        self._frozen = [(param, name) for param, name in self._frozen if id(param) not in self._known]
        if adopted:
            log.info("Training %d parameter(s) that joined after set-up, each by a dense host step (not projected: "
                     "the projection is decided at set-up): %s.", len(adopted),
                     ", ".join(slot.name for slot in adopted[:8]) + (" …" if len(adopted) > 8 else ""))
        return adopted
