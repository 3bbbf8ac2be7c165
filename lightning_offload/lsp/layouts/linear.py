"""``nn.Linear``'s layout: the weight stored as the math sees it, ``o × i``."""

from __future__ import annotations

from torch import nn

from lightning_offload.lsp.layouts.layout import LayerLayout


def is_linear(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and its subclasses (a later registered layout may claim a subclass first)."""
    return isinstance(module, nn.Linear)


LINEAR = LayerLayout("nn.Linear", is_linear, transposed=False)
