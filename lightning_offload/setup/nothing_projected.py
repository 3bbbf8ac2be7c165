"""What to say when projection finds no layer to project: what the model holds, and the fix for that case.

Lowering ``min_dim`` is the fix only for a model whose trainable Linears are merely small. A model without Linears, one
whose Linears are all frozen, or a LoRA/PEFT model (a frozen base, small trainable adapters) has nothing projection
would save: the fix there is ``zero_offload``, which sends every gradient in full anyway and skips projection's set-up.
"""

from __future__ import annotations

from torch import nn

from lightning_offload.lsp.layouts import is_projectable, weight_shape

#: How to train without projection, in each face.
ZERO_OFFLOAD = ("use zero_offload instead (strategy='zero_offload', FabricZeroOffload, or "
                "lightning_offload.offload(model, optimizer, 'zero_offload'))")


def nothing_projected_message(model: nn.Module, trained: set[int], min_dim: int, name: str) -> str:
    """The warning for a projecting strategy that found no layer to project in ``model``.

    Args:
        model: the model.
        trained: ids of the parameters the optimizer trains.
        min_dim: the ``min_dim`` setting.
        name: the strategy's name.

    Returns:
        The message: what was found (Linear/Conv1D layers, trainable or frozen, their largest shapes) and the fix for
        that case (``zero_offload``, a lower ``min_dim``, or ``target_modules``).
    """
    shapes = {module_name: weight_shape(module) for module_name, module in model.named_modules()
              if is_projectable(module)}
    if not shapes:
        found, fix = f"{type(model).__name__} has no nn.Linear or Conv1D layer", ZERO_OFFLOAD
    else:
        trainable = {module_name: shape for module_name, shape in shapes.items()
                     if _trains(model.get_submodule(module_name).weight, trained)}
        frozen = len(shapes) - len(trainable)
        large = [module_name for module_name, shape in trainable.items() if min(shape) >= min_dim]
        if not trainable:
            found, fix = f"all {len(shapes)} Linear/Conv1D layers are frozen (or not in the optimizer)", ZERO_OFFLOAD
        elif large:
            found = (f"the trainable layers with both dims ≥ min_dim={min_dim} ({_listed(large)}) are output or task "
                     f"heads, in exclude_modules or placed by head=")
            fix = f"name the layers to project in target_modules, or {ZERO_OFFLOAD}"
        else:
            biggest = max(trainable.values(), key=lambda shape: min(shape))
            found = (f"the {len(trainable)} trainable Linear/Conv1D layers are all below min_dim={min_dim} (the "
                     f"largest {biggest[0]}×{biggest[1]}: out × in)")
            if frozen:  # a frozen base with small trainable layers beside it: LoRA's, a PEFT model's adapters
                found += (f", and the other {frozen} are frozen: adapters such as LoRA's beside a frozen base, whose "
                          f"gradients are too small for projection to save anything")
                fix = ZERO_OFFLOAD
            else:
                fix = f"lower min_dim (to {min(biggest)} for the largest), or {ZERO_OFFLOAD}"
    return (f"strategy {name!r} found no layer to project: {found}. Every gradient crosses the link in full, as with "
            f"zero_offload. Fix: {fix}.")


def _trains(weight: object, trained: set[int]) -> bool:
    return getattr(weight, "requires_grad", False) and id(weight) in trained


def _listed(names: list[str], at_most: int = 3) -> str:
    return ", ".join(names[:at_most]) + (f" and {len(names) - at_most} more" if len(names) > at_most else "")
