"""Which layers ``lsp_offload`` projects, and with which projectors: the trainable Linear/Conv1D weights the
settings select (``min_dim``, ``target_modules``, ``exclude_modules``) and the placement leaves to projection, each
with projectors drawn at its compressed sizes (``rank``, ``density``), or under ``update="scaled"`` with the scaled
rule's projection of the same host bytes."""

from __future__ import annotations

import torch

from lightning_offload.lsp.channel_scales import ScaledRule, ScaledWeight
from lightning_offload.lsp.kernels.selection import KernelSelector
from lightning_offload.lsp.layouts import weight_shape
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.targets import ProjectionSelection, compressed_size, projection_selection
from lightning_offload.setup.embeddings_head import Placement
from lightning_offload.setup.settings import OffloadSettings


def attach_projections(modules: dict[str, torch.nn.Module], settings: OffloadSettings,
                       device: torch.device) -> list[ProjectedWeight] | list[ScaledWeight]:
    """Project ``modules`` (:func:`projection_of`'s selection, by qualified name); returns their projected weights
    (under ``update="scaled"``: their scaled weights, whose modules are left as they are).

    Raises:
        ValueError: when a rank or density does not fit a layer.
    """
    if settings.update == "scaled":
        return scaled_weights(modules, settings, device)
    generator = torch.Generator().manual_seed(settings.seed)
    kernels = KernelSelector(settings.kernels)  # one per engine: each distinct product is timed once
    layers = []
    by_weight: dict[int, ProjectedWeight] = {}
    for name, module in modules.items():
        shared = by_weight.get(id(module.weight))
        if shared is not None:
            # A weight held by several modules (net[2].weight = net[0].weight) is one projected tensor: every use's
            # backward adds into its S, as every use's gradient adds into a dense weight's .grad.
            shared.add_use(name, module)
            continue
        out_features, in_features = weight_shape(module)
        d_out = compressed_dim(settings, name, "output", out_features)
        d_in = compressed_dim(settings, name, "input", in_features)
        proj_out = settings.projector_factory(out_features, d_out, settings.density, generator, device)
        proj_in = settings.projector_factory(in_features, d_in, settings.density, generator, device)
        layers.append(ProjectedWeight(name, module, proj_out, proj_in, kernels))
        by_weight[id(module.weight)] = layers[-1]
    return layers


def scaled_weights(modules: dict[str, torch.nn.Module], settings: OffloadSettings,
                   device: torch.device) -> list[ScaledWeight]:
    """The scaled rule's weights of the selected modules (a weight several modules hold: once, its gradient sums every
    use's)."""
    rule = ScaledRule(settings.redraw_every, settings.norm_growth_limit)
    weights: dict[int, ScaledWeight] = {}
    for name, module in modules.items():
        if id(module.weight) not in weights:
            for side, size in zip(("output", "input"), weight_shape(module)):
                compressed_dim(settings, name, side, size, density=1)
            weights[id(module.weight)] = ScaledWeight(name, module, settings.rank, settings.seed, len(weights), rule,
                                                      device)
    return list(weights.values())


def projected_modules(model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: OffloadSettings,
                      placement: Placement) -> dict[str, torch.nn.Module]:
    """The modules whose weights the settings project: :func:`projection_of`'s ``selected``."""
    return projection_of(model, optimizer, settings, placement).selected


def projection_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: OffloadSettings,
                  placement: Placement) -> ProjectionSelection:
    """Which modules' weights the settings project, and why each other Linear/Conv1D is not: selected by ``min_dim``
    and the patterns, trained by ``optimizer``, not placed elsewhere by ``embeddings=``/``head=``, plus a head placed
    for projection.

    Raises:
        ValueError: when ``target_modules`` matches no trained weight.
    """
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    target = list(settings.target_modules) if settings.target_modules is not None else None
    selection = projection_selection(model, settings.min_dim, target, list(settings.exclude_modules))
    placed = {id(p): kind for kind, tensors in (("device", placement.device), ("frozen", placement.frozen),
                                                 ("row_sparse", placement.row_sparse)) for p in tensors}
    for name, module in list(selection.selected.items()):
        # A weight that embeddings=/head= put elsewhere is not projected, even when a target pattern matches it.
        if id(module.weight) not in in_optimizer:
            selection.left_out[name] = "not in the optimizer's param groups"
        elif id(module.weight) in placed:
            selection.left_out[name] = f"placed by embeddings=/head= ({placed[id(module.weight)]})"
        else:
            continue
        del selection.selected[name]
    for name, module in placement.projected_heads.items():
        selection.left_out.pop(name, None)
        selection.selected[name] = module
    if target is not None and not selection.selected:
        raise ValueError(
            f"target_modules={target} matched no weight that the optimizer trains. Match modules whose weights are in "
            f"configure_optimizers' param groups."
        )
    return selection


def compressed_dim(settings: OffloadSettings, name: str, side: str, size: int, density: int | None = None) -> int:
    """The compressed size of one side of layer ``name`` (``size`` rows or columns) under ``settings`` (checked
    against ``density``, the settings' own unless given).

    Raises:
        ValueError: when an integer rank exceeds the size, or the density the compressed size.
    """
    dim = compressed_size(size, settings.rank)
    # An int rank is an absolute size, which rank=1 (not 1.0, the full size) or a rank meant as a fraction is not.
    absolute = (f" rank={settings.rank!r} is an int: an absolute size, {dim} features of each side whatever its dim "
                f"(a float in (0, 1] is a fraction of each dim, rank=1.0 the full size)."
                if isinstance(settings.rank, int) else "")
    if dim > size:  # an integer rank; a fraction in (0, 1] never exceeds the size
        raise ValueError(
            f"rank={dim} is larger than the {side} dim {size} of {name} allows.{absolute} Use rank ≤ {size}, a "
            f"fraction such as rank=0.25, or raise min_dim / exclude_modules to skip that layer."
        )
    density = settings.density if density is None else density
    if density > dim:
        raise ValueError(
            f"density={density} is larger than the compressed {side} size {dim} of {name} allows (each column "
            f"needs {density} distinct rows).{absolute} Use density ≤ {dim} or a larger rank"
            f"{' (rank=1.0 for the full size)' if absolute and dim == 1 else ''}."
        )
    return dim
