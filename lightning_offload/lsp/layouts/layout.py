"""What one kind of projectable layer looks like to LSP-Offload's products: :class:`LayerLayout`.

Every projectable layer computes ``y = x Wᵀ + b`` with ``W`` of shape ``o × i`` (the weight as the math sees it); the
kinds differ in how they are recognised and in how they store ``W`` in their ``weight`` parameter: as it is
(``o × i``, ``nn.Linear``) or transposed (``i × o``, Hugging Face's ``Conv1D``). Everything else the set-up, the
projected forward and backward, the update's kernels, the scaled rule, the gradient sampling and the planner need of a
layer follows from those two facts, and is derived here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_offload.lsp.projector import SparseProjector


@dataclass(frozen=True)
class LayerLayout:
    """One kind of projectable layer: how to recognise it and how it stores its weight.

    The module must hold its weight as a 2-D ``weight`` parameter and its bias as ``bias`` (``None`` when it has none,
    else ``o`` elements), and its own forward must compute ``y = x Wᵀ + b``: the projected forward that replaces it
    (``lsp/linear.py``) computes exactly that, with :meth:`forward`. A layer whose product is computed another way
    (a fused kernel, another dtype rule) subclasses this class and overrides :meth:`forward` and :meth:`input_grad`
    together, keeping the same ``y``: LSP-Offload's compressed gradient ``S = (A Δᵀ)(B Xᵀ)ᵀ`` assumes it.

    Attributes:
        name: how messages name this kind of layer (``"nn.Linear"``, ``"Conv1D"``).
        recognises: whether a module is a layer of this kind.
        transposed: the stored weight is ``Wᵀ`` (``i × o``: its rows are input features), not ``W``.
    """

    name: str
    recognises: Callable[[nn.Module], bool]
    transposed: bool

    def weight_shape(self, module: nn.Module) -> tuple[int, int]:
        """``(o, i)``: the weight's shape as the math sees it, whatever its storage.

        Raises:
            ValueError: when the module's weight is not 2-D (no layer of this layout stores it so).
        """
        shape = tuple(module.weight.shape)
        if len(shape) != 2:
            raise ValueError(f"A {self.name} layer's weight must be 2-D to be projected; {type(module).__name__}'s "
                             f"weight has shape {shape}. Keep such a module out of projection (exclude_modules=) "
                             f"or register a layout that recognises only 2-D ones.")
        rows, cols = shape
        return (cols, rows) if self.transposed else (rows, cols)

    def math_view(self, stored: Tensor) -> Tensor:
        """The ``o × i`` view of a tensor in the stored layout (the weight, its gradient); no copy."""
        return stored.t() if self.transposed else stored

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``y = x Wᵀ + b`` from the stored ``weight``, as the projected forward computes it."""
        return F.linear(x, self.math_view(weight), bias)

    def input_grad(self, grad_out: Tensor, weight: Tensor) -> Tensor:
        """``∂L/∂x = Δ W`` from the output's gradient ``Δ`` and the stored ``weight``."""
        return grad_out @ self.math_view(weight)

    def update_sides(self, proj_out: SparseProjector, proj_in: SparseProjector,
                     update: Tensor) -> tuple[SparseProjector, SparseProjector, Tensor]:
        """How the update ``Aᵀ U B`` reaches the stored weight row by row: ``(rows' projector, columns' projector,
        small side)``. The kernels expand the small side by the columns' projector (``U B``, ``d_o × i``, or for a
        transposed storage ``Uᵀ A``, ``d_i × o``), then update each stored row from it through the rows' projector.

        Args:
            proj_out: ``A``, the output side's projector.
            proj_in: ``B``, the input side's projector.
            update: ``U`` (``d_o × d_i``).
        """
        if self.transposed:
            # Storage is (Aᵀ U B)ᵀ = Bᵀ (Uᵀ A): rows are input features, expanded by B from Uᵀ A (a view of U).
            return proj_in, proj_out, update.t()
        # Rows are output features, expanded by A from U B.
        return proj_out, proj_in, update
