"""A user's gradient hooks on a projected weight, which has no full gradient to hand them.

A projected layer's backward produces ``S`` in the compressed space and no ``∂L/∂W`` (``lsp/linear.py``), so a tensor
hook (``weight.register_hook``) or a post-accumulate hook (``weight.register_post_accumulate_grad_hook``) the user put
on the weight has nothing to be called with. Autograd would call it with ``None`` if the weight were an input of the
layer's autograd Function; it is not: the Function takes a one-element *anchor* per layer instead (an input that
requires grad, so the layer's backward runs even where ``x`` needs no gradient), and the weight's own hooks are called
only when it gets a real gradient (a use outside its module's forward). Each such hook is said once, when the layer's
first forward after it was registered runs (a hook cannot be seen as it is registered), naming the layer and the ways
to get a full gradient; hooks on every other parameter (``wandb.watch``'s, say) are called as torch calls them. A
compiled forward does not look (a hook's dict would be guarded per layer, and past 8 layers the compiler gives up on
the frame): the engine's step does, for every projected layer, once a forward ran compiled.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor


class ProjectedWeightHookWarning(UserWarning):
    """A gradient hook on a projected weight is not called: the weight has no full gradient."""


class WeightHooks:
    """The gradient hooks of one projected weight: the engine's own, and those of the user it has said.

    Attributes:
        engine_ids: the ids of the post-accumulate hooks the engine registered on the weight (not the user's).
    """

    def __init__(self) -> None:
        self.engine_ids: set[int] = set()
        self._said: set[int] = set()
        self._anchors: dict[torch.device, Tensor] = {}

    def anchor(self, device: torch.device) -> Tensor:
        """The one-element tensor requiring grad that the layer's autograd Function takes in place of the weight."""
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = self._anchors[device] = torch.zeros((), device=device, requires_grad=True)
        return anchor

    def check(self, name: str, weight: Tensor, stacklevel: int = 4) -> None:
        """Say once of each user hook on ``weight`` that it is not called (two dict reads when there is none).

        Args:
            name: the layer's qualified name.
            weight: its weight.
            stacklevel: where the warning points (the default: the call of the model, from the layer's forward).
        """
        tensor_hooks: Any = weight._backward_hooks or {}
        post_hooks: Any = weight._post_accumulate_grad_hooks or {}
        if not tensor_hooks and len(post_hooks) <= len(self.engine_ids):
            return
        users = [key for key in tensor_hooks if key not in self._said]
        users += [key for key in post_hooks if key not in self.engine_ids and key not in self._said]
        if not users:
            return
        self._said.update(users)
        warnings.warn(
            f"{len(users)} gradient hook(s) registered on {name}.weight (register_hook or "
            f"register_post_accumulate_grad_hook) will not be called: it is a projected weight, whose gradient is "
            f"compressed on the device and never formed in full, so there is no gradient to hand them. Hooks on the "
            f"other parameters are called as usual. For a full gradient of this weight leave the layer unprojected "
            f"(exclude_modules=[{name!r}]) or train with strategy='zero_offload'.",
            ProjectedWeightHookWarning, stacklevel=stacklevel)
