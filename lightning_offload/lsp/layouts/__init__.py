"""The layouts of the layers LSP-Offload can project, registered from one list, and the lookup every consumer uses.

A layer kind is one :class:`~lightning_offload.lsp.layouts.layout.LayerLayout` in a file of this folder plus its
entry in :data:`BUILT_IN` (a layout of the package) or a call of :func:`register_layout` (a user's own layer class).
The set-up's selection (:func:`is_projectable`, :func:`weight_shape`), the projected layer's forward, backward and
update (``lsp/linear.py``), the scaled rule, the gradient sampling and the planner all read a layer's layout through
:func:`layout_of`, so nothing else in the package knows which classes are projectable or how they store their weight.
"""

from __future__ import annotations

from torch import nn

from lightning_offload.lsp.layouts.conv1d import HF_CONV1D, is_hf_conv1d
from lightning_offload.lsp.layouts.layout import LayerLayout
from lightning_offload.lsp.layouts.linear import LINEAR

__all__ = ["BUILT_IN", "HF_CONV1D", "LINEAR", "LayerLayout", "is_hf_conv1d", "is_projectable", "layout_of",
           "register_layout", "registered_layouts", "unregister_layout", "weight_shape"]

#: The package's own layouts, registered at import.
BUILT_IN: tuple[LayerLayout, ...] = (LINEAR, HF_CONV1D)

# Asked from the last registered to the first: a user's layout for a subclass of nn.Linear claims it before LINEAR.
_registered: list[LayerLayout] = list(BUILT_IN)


def register_layout(layout: LayerLayout) -> None:
    """Make the layers ``layout`` recognises projectable, by every strategy and plan set up after this call; it is
    asked before every layout registered earlier (the package's included), so it may claim a subclass of one.

    Example::

        register_layout(LayerLayout("MyLinearT", lambda m: isinstance(m, MyLinearT), transposed=True))

    Raises:
        ValueError: when a layout of the same name is registered already.
    """
    if any(known.name == layout.name for known in _registered):
        raise ValueError(f"A layer layout named {layout.name!r} is registered already; give yours another name, or "
                         f"unregister_layout() the one there first.")
    _registered.append(layout)


def unregister_layout(layout: LayerLayout) -> None:
    """Forget a layout :func:`register_layout` added (layers already projected keep it until they are given back).

    Raises:
        ValueError: when ``layout`` is not registered, or is one of the package's own (:data:`BUILT_IN`).
    """
    if layout in BUILT_IN:
        raise ValueError(f"{layout.name!r} is one of the package's own layouts and stays registered; register a "
                         f"layout that claims your modules first instead.")
    if layout not in _registered:
        raise ValueError(f"Layer layout {layout.name!r} is not registered; nothing to unregister.")
    _registered.remove(layout)


def registered_layouts() -> tuple[LayerLayout, ...]:
    """Every registered layout, in the order :func:`layout_of` asks them (the last registered first)."""
    return tuple(reversed(_registered))


def layout_of(module: nn.Module) -> LayerLayout | None:
    """The layout of ``module``, or ``None`` when it is no layer LSP-Offload can project."""
    for layout in reversed(_registered):
        if layout.recognises(module):
            return layout
    return None


def is_projectable(module: nn.Module) -> bool:
    """Whether ``module`` is a layer LSP-Offload can project (an ``nn.Linear``, Hugging Face's ``Conv1D``, or a
    registered layout's)."""
    return layout_of(module) is not None


def weight_shape(module: nn.Module) -> tuple[int, int]:
    """``(o, i)`` of ``module``'s weight as the math sees it, whatever its storage.

    Raises:
        TypeError: when no registered layout recognises ``module``.
    """
    layout = layout_of(module)
    if layout is None:
        names = ", ".join(known.name for known in registered_layouts())
        raise TypeError(f"{type(module).__name__} is not a layer LSP-Offload can project (those are: {names}). "
                        f"Register its layout with lightning_offload.lsp.layouts.register_layout, or leave it out "
                        f"of target_modules.")
    return layout.weight_shape(module)
