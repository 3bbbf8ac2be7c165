"""Projected weights: a Linear (or Hugging Face ``Conv1D``, or any registered layout's layer) whose gradient is
produced already compressed.

For ``y = x Wᵀ + b`` with ``W`` of shape ``o × i``, the weight gradient is ``G = Δᵀ X`` (``Δ`` the output
gradient). LSP-Offload needs only ``S = A G Bᵀ = (Δ Aᵀ)ᵀ (X Bᵀ)``, so forward keeps ``X Bᵀ`` (``d_i`` numbers
per token instead of ``i``) and backward does one small ``d_o × d_i`` GEMM; ``G`` is never formed and
``W.grad`` stays ``None``. The module object, its parameters and so its ``state_dict`` keys are untouched: only
its ``forward`` is rebound, so a checkpoint loads into the plain model.

Its products are in :mod:`~lightning_offload.lsp.linear_ops`, where a ``torch.compile``'d model reaches them through
custom operators; how the layer stores ``W`` (``o × i``, or transposed for ``Conv1D``) is its layout's
(:mod:`lightning_offload.lsp.layouts`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_offload.lsp.kernels.selection import KernelSelector
from lightning_offload.lsp.layouts import LayerLayout, layout_of, weight_shape
from lightning_offload.lsp.layouts.conv1d import is_hf_conv1d  # noqa: F401  (its import path of before the layouts)
from lightning_offload.lsp.linear_ops import backward_products, compiled_forward, compute_dtype, forward_products, \
    register_layer
from lightning_offload.lsp.model_attachments import CopiedAsAbsent
from lightning_offload.lsp.norm_probe import NormProbe, is_isometry
from lightning_offload.lsp.projector import SparseProjector, product_dtype_of
from lightning_offload.lsp.update_size import match_element_rms_, update_scale
from lightning_offload.lsp.weight_hooks import WeightHooks


class _Untimed:
    """The phase clock of a layer no engine drives (the engine's clock lives in a later layer of the package)."""

    @staticmethod
    def phase(name: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()


_UNTIMED = _Untimed()


class ProjectedWeight(CopiedAsAbsent):
    """The LSP state of one weight: its projectors and the device buffer that accumulates ``S``.

    Args:
        name: the module's qualified name, used in messages and checkpoints.
        module: a layer a registered layout recognises (``nn.Linear``, Hugging Face ``Conv1D``).
        proj_out: ``A`` (``d_o × o``).
        proj_in: ``B`` (``d_i × i``).
        kernels: the kernels of this layer's products, shared by the layers of one engine. Default: ``None`` (a
            selector of its own that times the kernels, ``"auto"``).
    """

    def __init__(self, name: str, module: nn.Module, proj_out: SparseProjector, proj_in: SparseProjector,
                 kernels: KernelSelector | None = None) -> None:
        self.name = name
        #: Every module's qualified name whose forward uses this weight (the first is ``name``).
        self.names = [name]
        self.module = module
        #: How the module stores its weight and computes its product (lsp/layouts).
        self.layout: LayerLayout = _layout_of(name, module)
        out_features, in_features = self.layout.weight_shape(module)
        if proj_out.dim_in != out_features or proj_in.dim_in != in_features:
            raise ValueError(
                f"Projectors for {name} must compress ({out_features}, {in_features}); got "
                f"({proj_out.dim_in}, {proj_in.dim_in})."
            )
        self.proj_out = proj_out
        self.proj_in = proj_in
        self.kernels = kernels if kernels is not None else KernelSelector("auto")
        self.update_scale = update_scale(proj_out, proj_in)
        # ‖S‖/‖G‖ of these projectors (a fit sets it; random draws keep norms in expectation): clipping divides ‖S‖ by
        # it to estimate the full gradient's norm, and the probes below keep it true as training goes on.
        self.norm_ratio = 1.0
        self.norm_probe = NormProbe(name)
        #: Whether both projectors are signed permutations, which keep every norm exactly (nothing to measure).
        self.keeps_norms = is_isometry(proj_out) and is_isometry(proj_in)
        self.norm_probe.measured = not self.keeps_norms
        # S in fp32, or None between steps; micro-batches add into it, which projection's linearity makes exact.
        self.grad_buffer: Tensor | None = None
        self.has_grad = False
        # Called once this layer's gradient is complete, so its device→host copy overlaps the rest of backward.
        self.on_grad_ready: Callable[[ProjectedWeight], None] | None = None
        # Forwards whose backward has not run yet; not reset by zero_grad, which Lightning calls before backward.
        self.open_backwards = 0
        # Bytes of B Xᵀ kept for backward by this step's forwards (telemetry; reset with the forward count).
        self.saved_projection_bytes = 0
        self.grad_version = 0  # bumped by every accumulation: tells whether a copy already sent is still current
        # While a fit samples full gradients, the plain forward runs so autograd produces W.grad (lsp/sampling.py).
        self.sampling = False
        # The user's gradient hooks on the weight, which a projected weight cannot call (lsp/weight_hooks.py). Its
        # anchor is made now: made inside a compiled forward, a tensor that requires grad would break the graph.
        self.hooks = WeightHooks()
        self.hooks.anchor(self.weight.device)
        # The key a compiled forward passes its operators in place of this object (lsp/linear_ops.py).
        self.key = register_layer(self)
        # The products' dtypes under autocast, settled now: a compiled forward's shape inference cannot probe them.
        for dtype in (torch.bfloat16, torch.float16):
            product_dtype_of(self.weight.device, dtype)
        # The engine's phase clock, charging the projections below to their phases; untimed until an engine drives it.
        self.phases: Any = _UNTIMED
        # Every module whose forward uses this weight (shared weights: each use's backward adds into the one S).
        self.modules: list[nn.Module] = []
        # Per module (by id): the forward the user set on the instance, to be put back (None: the class's, so detach
        # stores no bound method, a reference cycle), and the plain forward the projected one falls back to.
        self._instance_forwards: dict[int, Callable[..., Tensor] | None] = {}
        self._original_forwards: dict[int, Callable[..., Tensor]] = {}
        self._bind(module)

    def _bind(self, module: nn.Module) -> None:
        self.modules.append(module)
        self._instance_forwards[id(module)] = module.__dict__.get("forward")
        self._original_forwards[id(module)] = module.forward
        module.forward = _ProjectedForward(module, self._instance_forwards[id(module)])
        module._lsp_state = self

    def add_use(self, name: str, module: nn.Module) -> None:
        """Serve another module that holds this same weight; its uses' compressed gradients join this one's ``S``.

        Raises:
            ValueError: when ``module`` does not hold this weight, or holds it in another layout (a ``Conv1D``
                and a ``Linear`` sharing one tensor compute different products).
        """
        layout = layout_of(module)
        if module.weight is not self.weight or layout != self.layout:
            theirs = layout.name if layout is not None else type(module).__name__
            raise ValueError(f"{name} cannot share the projection of {self.name}: it must hold the same weight "
                             f"tensor in the same layout (both {self.layout.name}; {name} is {theirs}).")
        self.names.append(name)
        self._bind(module)

    @staticmethod
    def weight_shape(module: nn.Module) -> tuple[int, int]:
        """``(o, i)`` of the mathematical weight, whatever the storage layout (its layout's, lsp/layouts)."""
        return weight_shape(module)

    @property
    def transposed(self) -> bool:
        """Whether the stored weight is ``i × o`` (its layout's; Hugging Face ``Conv1D``)."""
        return self.layout.transposed

    @property
    def weight(self) -> nn.Parameter:
        """The module's weight parameter (device, possibly bf16)."""
        return self.module.weight

    @property
    def compressed_shape(self) -> tuple[int, int]:
        """``(d_o, d_i)``: the shape of ``S``, ``U`` and the host moments."""
        return (self.proj_out.dim_out, self.proj_in.dim_out)

    def set_projectors(self, proj_out: SparseProjector, proj_in: SparseProjector) -> None:
        """Replace ``A`` and ``B`` (a refit); the accumulator is resized and cleared."""
        out_features, in_features = self.layout.weight_shape(self.module)
        if proj_out.dim_in != out_features or proj_in.dim_in != in_features:
            raise ValueError(f"Projectors for {self.name} must compress ({out_features}, {in_features}).")
        self.proj_out, self.proj_in = proj_out, proj_in
        self.update_scale = update_scale(proj_out, proj_in)
        self.grad_buffer = None
        self.has_grad = False
        # The probes' averages measured the old projectors; the new ones start from the ρ their installer gives.
        self.keeps_norms = is_isometry(proj_out) and is_isometry(proj_in)
        self.norm_probe.measured = not self.keeps_norms
        self.norm_probe.reset_window()
        self.norm_probe.clear_step()

    def accumulate(self, compressed_grad: Tensor) -> None:
        """Add one backward pass's ``S`` (called from autograd; the first one is kept, not copied)."""
        self._add(compressed_grad)
        self.grad_version += 1
        self.open_backwards = max(self.open_backwards - 1, 0)
        if self.open_backwards == 0 and self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def accumulate_dense(self, grad: Tensor) -> None:
        """Add a full gradient of the weight (from a use outside its module's forward) as ``A G Bᵀ``.

        Projection is linear, so this is exactly the compressed image of that part of the gradient. It does not
        count as the module's own backward: if ``S`` was already sent, the changed version sends it again at the step.
        """
        self._add(self.compress(grad))
        if self.norm_probe.active:
            grad_math = self.layout.math_view(grad.detach())  # o × i
            probe = self.norm_probe.probe(grad_math.shape[1], grad_math.device, torch.float32)
            self.norm_probe.add(grad_math.float() @ probe)
        self.grad_version += 1

    def _add(self, compressed_grad: Tensor) -> None:
        if self.grad_buffer is None:
            self.grad_buffer = compressed_grad.float()
        else:
            self.grad_buffer.add_(compressed_grad)
        self.has_grad = True

    def zero_grad(self) -> None:
        """Release ``S`` (and the probes' ``G z``) after it has been consumed by an optimizer step (or skipped)."""
        self.grad_buffer = None
        self.has_grad = False
        self.norm_probe.clear_step()

    def expect_backwards(self, count: int) -> None:
        """Count ``count`` more backwards of this layer before its gradient is complete: a loss that runs the layer
        chunk by chunk inside backward (lm_loss.py), where forwards are not counted, says how many it will run."""
        self.open_backwards += count

    def reset_forward_count(self) -> None:
        """Forget forward calls whose backward never ran (called before each optimizer step's forward)."""
        self.open_backwards = 0
        self.saved_projection_bytes = 0

    def compress(self, matrix: Tensor) -> Tensor:
        """``A M Bᵀ`` in fp32 for a weight-shaped ``M`` (stored layout: transposed for ``Conv1D``)."""
        matrix = self.layout.math_view(matrix.detach())  # o × i
        out_compressed = self.proj_out.compress_rows(matrix)  # d_o × i
        return self.proj_in.compress_rows(out_compressed.t()).t()  # d_o × d_i

    def compress_weight(self) -> Tensor:
        """``A W Bᵀ`` in fp32: the compressed image of the weight, for Adam's coupled (L2) weight decay."""
        return self.compress(self.weight)

    @torch.no_grad()
    def apply_update(self, update: Tensor, decay: float, stochastic_generator: torch.Generator | None,
                     one_step_size: bool = False) -> None:
        """``W ← W·decay + c·Aᵀ U B`` on the device in one pass over ``W``; ``c`` is :attr:`update_scale`.

        The small side is expanded first (``U B``, or ``Uᵀ A`` for ``Conv1D``: :meth:`LayerLayout.update_sides
        <lightning_offload.lsp.layouts.layout.LayerLayout.update_sides>`), then each row of ``W`` is updated from it by
        :attr:`kernels`; no fp32 temporary the size of the weight exists.

        Args:
            update: ``U``, the host step's ``d_o × d_i`` update, already on the device.
            decay: the decoupled weight-decay factor ``1 − lr·wd`` (1.0 for none).
            stochastic_generator: generator for stochastic rounding of low-precision weights; ignored for fp32.
            one_step_size: the host rule steps every element by one size (Lion): ``c`` is instead chosen so the
                expanded update's per-element RMS is ``U``'s
                (:func:`~lightning_offload.lsp.update_size.match_element_rms_`), except for exact isometries, which
                keep it.
        """
        update = update.float()
        keep_rms = one_step_size and not self.keeps_norms
        if self.update_scale != 1.0 and not keep_rms:
            update = update * self.update_scale  # on the small d_o × d_i side, before expanding
        row_projector, column_projector, small_side = self.layout.update_sides(self.proj_out, self.proj_in, update)
        half = self.kernels.expand_columns(column_projector, small_side)
        if keep_rms:
            match_element_rms_(half, row_projector, update)
        self.kernels.update_rows_(self.weight.data, row_projector, half, decay, stochastic_generator)

    def detach(self) -> None:
        """Give each module back as it was: its own forward, and no attribute this class added (idempotent)."""
        for module in self.modules:
            attributes = module.__dict__
            if attributes.get("_lsp_state") is not self:
                continue
            instance_forward = self._instance_forwards[id(module)]
            if instance_forward is None:
                attributes.pop("forward", None)
            else:
                attributes["forward"] = instance_forward
            del attributes["_lsp_state"]


def _layout_of(name: str, module: nn.Module) -> LayerLayout:
    """``module``'s layout; a module no layout recognises cannot be projected."""
    layout = layout_of(module)
    if layout is None:
        raise TypeError(f"{name} ({type(module).__name__}) cannot be projected: no registered layer layout "
                        f"recognises it. Register its layout with lightning_offload.lsp.layouts.register_layout, or "
                        f"leave it out of target_modules.")
    return layout


class _ProjectedForward:
    """A projected module's ``forward``; a copy or a pickle of the module gets its own forward back
    (lsp/model_attachments.py): the one the user had set on the instance, else its class's.

    Args:
        module: the projected module.
        instance_forward: the forward the user had set on the instance, or ``None``.
    """

    __slots__ = ("module", "instance_forward")

    def __init__(self, module: nn.Module, instance_forward: Callable[..., Tensor] | None) -> None:
        self.module = module
        self.instance_forward = instance_forward

    def __call__(self, x: Tensor) -> Tensor:
        return _projected_forward(self.module, x)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Reached while the module itself is copied or pickled, so the reconstruction receives the copy's module.
        return _plain_forward, (self.module, self.instance_forward)


def _plain_forward(module: nn.Module, instance_forward: Callable[..., Tensor] | None) -> Callable[..., Tensor]:
    """A copy's forward: the instance's own where the user had set one, else its class's, bound to it."""
    return instance_forward if instance_forward is not None else types.MethodType(type(module).forward, module)


def _projected_forward(self: nn.Module, x: Tensor) -> Tensor:
    """A projected module's forward (called by :class:`_ProjectedForward`)."""
    state: ProjectedWeight = self._lsp_state
    if state.sampling or not (torch.is_grad_enabled() and self.weight.requires_grad):
        # No weight gradient can be asked of this call (or a fit samples full ones): the plain forward.
        return state._original_forwards[id(self)](x)
    if torch.compiler.is_compiling():
        return compiled_forward(self, state, x)
    # A layer called twice is complete after both backwards; a checkpoint's recomputation is not counted again.
    if torch._C._current_graph_task_id() == -1:
        state.open_backwards += 1
    # Said here, at the forward after the hook was registered; a compiled forward leaves it to the step.
    state.hooks.check(state.name, self.weight)
    # The Function takes the layer's anchor, not the weight: autograd would call the weight's hooks with None.
    return _ProjectedLinearFunction.apply(x, state.hooks.anchor(x.device), self.bias, state)


class _ProjectedLinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b`` whose backward accumulates ``S = (A Δᵀ)(B Xᵀ)ᵀ`` instead of returning ``∂L/∂W``. It takes
    the layer's anchor in the weight's place (lsp/weight_hooks.py) and reads the weight from the layer's state."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor, bias: Tensor | None, state: ProjectedWeight) -> Tensor:
        weight = state.weight
        out, w_c, x_proj, x_probe = forward_products(state, x, weight, bias, compute_dtype(x, weight),
                                                     keep=weight.requires_grad, probing=state.norm_probe.active)
        ctx.state = state
        ctx.has_bias = bias is not None
        ctx.save_for_backward(w_c, x_proj, x_probe)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, Tensor | None, None]:
        w_c, x_proj, x_probe = ctx.saved_tensors
        grad_x, grad_bias = backward_products(ctx.state, grad_out, w_c, x_proj, x_probe, ctx.needs_input_grad[0],
                                              ctx.has_bias and ctx.needs_input_grad[2])
        # No gradient for the weight (nor its anchor): its .grad stays None; S is its gradient in the compressed space.
        return grad_x, None, grad_bias, None
