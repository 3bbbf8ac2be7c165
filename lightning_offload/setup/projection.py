"""Which layers ``lsp_offload`` projects, and with which projectors: the trainable Linear/Conv1D weights the
settings select (``min_dim``, ``target_modules``, ``exclude_modules``) and the placement leaves to projection, each
with projectors drawn at its compressed sizes (``rank``, ``density``), or under ``update="scaled"`` with the scaled
rule's projection of the same host bytes."""

from __future__ import annotations

import torch

from lightning_offload.lsp.channel_scales import ScaledRule, ScaledWeight
from lightning_offload.lsp.kernels.selection import KernelSelector
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.targets import compressed_size, select_projected_modules
from lightning_offload.setup.embeddings_head import Placement
from lightning_offload.setup.settings import OffloadSettings


def attach_projections(model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: OffloadSettings,
                       placement: Placement, device: torch.device) -> list[ProjectedWeight] | list[ScaledWeight]:
    """Project the selected layers of ``model`` whose weights ``optimizer`` trains; returns their projected weights
    (under ``update="scaled"``: their scaled weights, whose modules are left as they are).

    Raises:
        ValueError: when ``target_modules`` matches no trained weight, or a rank or density does not fit a layer.
    """
    modules = projected_modules(model, optimizer, settings, placement)
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
        out_features, in_features = ProjectedWeight.weight_shape(module)
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
            for side, size in zip(("output", "input"), ProjectedWeight.weight_shape(module)):
                compressed_dim(settings, name, side, size, density=1)
            weights[id(module.weight)] = ScaledWeight(name, module, settings.rank, settings.seed, len(weights), rule,
                                                      device)
    return list(weights.values())


def projected_modules(model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: OffloadSettings,
                      placement: Placement) -> dict[str, torch.nn.Module]:
    """The modules whose weights the settings project: selected by ``min_dim`` and the patterns, trained by
    ``optimizer``, not placed elsewhere by ``embeddings=``/``head=``, plus a head placed for projection.

    Raises:
        ValueError: when ``target_modules`` matches no trained weight.
    """
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    target = list(settings.target_modules) if settings.target_modules is not None else None
    modules = select_projected_modules(model, settings.min_dim, target, list(settings.exclude_modules))
    placed = {id(p) for p in (*placement.device, *placement.frozen, *placement.row_sparse)}
    # A weight that embeddings=/head= put elsewhere is not projected, even when a target pattern matches it.
    modules = {name: m for name, m in modules.items() if id(m.weight) in in_optimizer and id(m.weight) not in placed}
    modules.update(placement.projected_heads)
    if target is not None and not modules:
        raise ValueError(
            f"target_modules={target} matched no weight that the optimizer trains. Match modules whose weights are in "
            f"configure_optimizers' param groups."
        )
    return modules


def compressed_dim(settings: OffloadSettings, name: str, side: str, size: int, density: int | None = None) -> int:
    """The compressed size of one side of layer ``name`` (``size`` rows or columns) under ``settings`` (checked
    against ``density``, the settings' own unless given).

    Raises:
        ValueError: when an integer rank exceeds the size, or the density the compressed size.
    """
    dim = compressed_size(size, settings.rank)
    if dim > size:  # an integer rank; a fraction in (0, 1] never exceeds the size
        raise ValueError(
            f"rank={dim} is larger than the {side} dim {size} of {name} allows. Use rank ≤ {size}, a fraction such as "
            f"rank=0.25, or raise min_dim / exclude_modules to skip that layer."
        )
    density = settings.density if density is None else density
    if density > dim:
        raise ValueError(
            f"density={density} is larger than the compressed {side} size {dim} of {name} allows (each column "
            f"needs {density} distinct rows). Use density ≤ {dim} or a larger rank."
        )
    return dim
