"""The offload engine set up for a model and the user's Adam/AdamW from one :class:`OffloadSettings` value: where the
embeddings and the output head train, which layers are projected, and the
:class:`~lightning_offload.engine.optimizer.OffloadOptimizer` in place of the user's optimizer; and the model handed
back as it was. Every face sets up through here (the Trainer strategies, Fabric's, a plain loop's
:func:`~lightning_offload.faces.loop.offload`), so no face decides any of this on its own. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.engine.rules.host_rule import host_rule_for
from lightning_offload.engine.user_optimizer import is_decoupled, validate_user_optimizer
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.setup.embeddings_head import HEAD_BY_SIZE, Placement, plan_placement
from lightning_offload.setup.nothing_projected import nothing_projected_message
from lightning_offload.setup.projection import attach_projections, projection_of
from lightning_offload.setup.settings import OffloadSettings


@dataclass(frozen=True)
class Placements:
    """Where the embeddings, the output head and the vectors train, with the strategy's defaults filled in.

    Attributes:
        embeddings: ``"host"``, ``"sparse"``, ``"device"`` or ``"frozen"``.
        head: ``"host"``, ``"projected"``, ``"device"`` or ``"frozen"``.
        embeddings_by_default: whether ``embeddings`` is the default (which gives way where it cannot apply:
            ``amsgrad``), not the user's choice (which is refused there instead).
        vectors: ``"device"`` or ``"host"`` (norm weights and biases).
        explicit: which of ``"embeddings"`` and ``"head"`` the user set (one that applies to nothing is a warning).
    """

    embeddings: str
    head: str
    embeddings_by_default: bool
    vectors: str = "device"
    explicit: tuple[str, ...] = ()

    @classmethod
    def of(cls, settings: OffloadSettings, sparse_embeddings_by_default: bool = True) -> Placements:
        """The placements ``settings`` ask for; ``sparse_embeddings_by_default`` is ``False`` where rows cannot be
        stepped sparsely (data parallelism)."""
        # Defaults chosen by measurement (docs/benchmarks/2026-12-01.md, "Embeddings and head off the dense host
        # path"): the row-sparse embedding kept the dense one's quality; projecting the head cost a fifth of AdamW's
        # gain.
        # Without projection (zero_offload, the ZeRO-Offload baseline) everything stays dense.
        default = "sparse" if settings.projection and sparse_embeddings_by_default else "host"
        # A large head is projected (memory, and the GPU step's floor); a small one stays dense (quality).
        head = HEAD_BY_SIZE if settings.projection else "host"
        # Vectors on the device whatever the strategy (docs/benchmarks/2026-12-07.md, "Vectors on the device"): a
        # host job costs a tiny tensor more than its Adam, and their state is a few MB at most.
        return cls(settings.embeddings if settings.embeddings is not None else default,
                   settings.head if settings.head is not None else head, settings.embeddings is None,
                   settings.vectors if settings.vectors is not None else "device",
                   tuple(key for key in ("embeddings", "head") if getattr(settings, key) is not None))


@dataclass
class EngineSetup:
    """The engine in place of the user's optimizer, and what was changed on the model to put it there.

    Attributes:
        model: the model it trains.
        optimizer: the engine.
        placement: where embeddings and head train (frozen weights get their ``requires_grad`` back at release).
    """

    model: torch.nn.Module
    optimizer: OffloadOptimizer
    placement: Placement
    #: The hook that refuses a step of the user's own optimizer while the engine stands in for it.
    guard: Any = None

    def release(self) -> None:
        """Finish what is pending and give the model back as it was: plain modules, frozen weights trainable again,
        no hooks, the worker stopped, the user's optimizer usable again (idempotent)."""
        # The engine's own close (a face's optimizer closes through this release: its close is not called back).
        OffloadOptimizer.close(self.optimizer)
        for layer in self.optimizer.projected_layers:
            layer.detach()
        for weight in self.placement.frozen:
            weight.requires_grad_(True)
        self.placement = Placement()
        if self.guard is not None:
            self.guard.remove()
            self.guard = None
        if getattr(self.model, ENGINE_ATTRIBUTE, None) is self:
            delattr(self.model, ENGINE_ATTRIBUTE)


#: The attribute a model set up for offloading carries: its set-up, until released.
ENGINE_ATTRIBUTE = "_lightning_offload_engine"


def refuse_unusable_model(model: torch.nn.Module, name: str) -> None:
    """Refuse a model the engine cannot be put on: one already offloaded (a notebook cell run twice), or one on the
    ``meta`` device.

    Raises:
        RuntimeError: for a model another engine trains. ValueError: for parameters on the meta device.
    """
    owner = next((m for m in model.modules() if getattr(m, ENGINE_ATTRIBUTE, None) is not None), None)
    if owner is not None:
        raise RuntimeError(
            f"{name}: this model is already trained by an offload optimizer that was not closed (a notebook cell run "
            f"twice?); a second one would stack its hooks on the first's. Call close() on the optimizer offload() "
            f"returned (or let the Trainer or Fabric finish), then offload again; if that optimizer is lost, "
            f"model.{ENGINE_ATTRIBUTE}.release() closes it.")
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"{name}: {meta} (and maybe more) is on the meta device: it has no values to train. Materialize the model "
            f"first: model.to_empty(device=...) and load its weights (or build it on a real device), then offload.")


def _refuse_a_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if isinstance(optimizer, OffloadOptimizer):
        return  # the offload optimizer shares the user's optimizer's hooks (engine/user_optimizer.py): its step is fine
    raise RuntimeError(
        f"The {type(optimizer).__name__} handed to the offload was stepped itself: its state and arithmetic now live "
        f"in the offload optimizer that stands in for it (the one lightning_offload.offload(...) returned, or "
        f"Fabric's setup handed back). Step that one (optimizer = offload(model, {type(optimizer).__name__}(...)); "
        f"optimizer.step()); this one steps again once the offload is closed.")


def rows_stepped_densely(optimizer: Optimizer, embeddings_by_default: bool) -> dict[int, str]:
    """The parameters whose group the row-sparse embedding step cannot follow, with the reason: an optimizer the row
    Adam is not (Lion), Adam's coupled L2 (it moves every row at every step), and ``amsgrad`` where
    ``embeddings="sparse"`` is only the default (asked for explicitly, amsgrad is refused instead)."""
    reasons = {}
    rule = host_rule_for(optimizer)
    for group in optimizer.param_groups:
        reason = None
        if not rule.rows:
            reason = f"is stepped by {rule.name}, which the engine's row-sparse step (a row Adam) does not implement"
        elif group.get("weight_decay") and not is_decoupled(optimizer, group):
            reason = ("uses Adam's coupled L2 (weight_decay of torch.optim.Adam), which moves every row at every "
                      "step, so a row-sparse step could not be exact")
        elif group.get("amsgrad") and embeddings_by_default:
            reason = "uses amsgrad=True, which the default row-sparse step does not have"
        if reason is not None:
            reasons.update({id(p): reason for p in group["params"]})
    return reasons


def _scaled_layers_message(name: str, layers: list[Any]) -> str:
    """What ``update="scaled"`` does to ``layers``, for the log."""
    sizes = sorted({f"{layer.channels}×{layer.projected_side}→{layer.channels}×{layer.rank}" for layer in layers})
    whole = sum(layer.rank == 1 for layer in layers)
    return (f"{name}: update='scaled': {len(layers)} layers get full-rank updates scaled per channel from host moments "
            f"of their gradients' projections ({', '.join(sizes[:4])}{', …' if len(sizes) > 4 else ''}); their full "
            f"gradients stay on the device until the step's scales return."
            + (f" {whole} of them project each channel to 1 number and take one scale per weight instead (per "
               f"channel, 1/|R_j| of a single projection is unbounded); a larger rank keeps them per channel."
               if whole else ""))


def _project(model: torch.nn.Module, user_optimizer: Any, settings: OffloadSettings, placement: Placement,
             device: torch.device, name: str, say: Callable[[str], None]) -> list[Any]:
    """The projected (or scaled) weights the settings select, attached to ``model``; what is projected, and why the
    other layers are not, said in one line."""
    if not settings.projection:
        return []
    selection = projection_of(model, user_optimizer, settings, placement)
    say(f"{name} {selection.describe()}.")
    layers = attach_projections(selection.selected, settings, device)
    if settings.update == "scaled" and layers:
        say(_scaled_layers_message(name, layers))
    return layers


def build_engine(model: torch.nn.Module, user_optimizer: Any, settings: OffloadSettings, placements: Placements,
                 device: torch.device, name: str, say: Callable[[str], None], warn: Callable[[str], None],
                 rank_shards: RankShards | None = None,
                 optimizer_class: type[OffloadOptimizer] = OffloadOptimizer,
                 frees_sent_gradients: bool = True) -> EngineSetup:
    """Put the engine in place of ``user_optimizer`` for ``model`` (on ``device`` already).

    Args:
        model: the module whose parameters ``user_optimizer`` trains (a LightningModule or any module).
        user_optimizer: the user's ``torch.optim.Adam``/``AdamW``; its ``param_groups`` are shared, never copied.
        settings: the offload settings.
        placements: where embeddings and head train.
        device: the training device.
        name: what the set-up is called in messages (the strategy's name).
        say: where decisions go (the log).
        warn: where warnings go.
        rank_shards: the ranks the engine shares its work with. Default: ``None`` (one process).
        optimizer_class: the engine's class (a face's subclass of it). Default: ``OffloadOptimizer``.
        frees_sent_gradients: the face's default for ``settings.free_sent_gradients`` (``None``): ``True`` where the
            loop zeroes gradients before the next backward anyway (the Trainer, Fabric), ``False`` for a loop of
            one's own (torch's semantics). Default: ``True``.

    Raises:
        ValueError: for an optimizer or a setting the engine cannot take (each names the value and the fix).
    """
    refuse_unusable_model(model, name)
    user_optimizer = validate_user_optimizer(user_optimizer)
    trained = {id(p) for group in user_optimizer.param_groups for p in group["params"]}
    placement = plan_placement(model, trained, placements.embeddings, placements.head,
                               dense_reasons=rows_stepped_densely(user_optimizer, placements.embeddings_by_default),
                               vectors=placements.vectors, explicit=placements.explicit)
    for weight in placement.frozen:
        weight.requires_grad_(False)  # no gradient is computed for it at all; restored at release
    for message in placement.messages:
        say(f"{name}: {message}")
    for message in placement.warnings:
        warn(f"{name}: {message}")
    layers = _project(model, user_optimizer, settings, placement, device, name, say)
    if settings.projection and not layers:
        warn(nothing_projected_message(model, trained, settings.min_dim, name))
    try:
        freeing = settings.free_sent_gradients
        optimizer = optimizer_class(
            user_optimizer,
            layers,
            device,
            model=model,
            settings=settings if freeing is not None else replace(settings, free_sent_gradients=frees_sent_gradients),
            keep_on_device=placement.device,
            row_sparse=placement.row_sparse,
            frozen=placement.frozen,
            tied_projected=[m.weight for m in placement.projected_heads.values()
                            if id(m.weight) in placement.tied_projected],
            data_parallel=rank_shards,
        )
    except BaseException:
        # A refused set-up (a setting the engine cannot take) gives the model back as it was.
        for layer in layers:
            if isinstance(layer, ProjectedWeight):
                layer.detach()
        for weight in placement.frozen:
            weight.requires_grad_(True)
        raise
    selector = next((layer.kernels for layer in layers if isinstance(layer, ProjectedWeight)), None)
    if selector is not None:
        optimizer.telemetry.kernel_products = selector.products  # the live counts, filled as products are chosen
        if rank_shards is not None:
            # Every rank applies each update to its own replica: rank 0's kernel for every rank, so they round alike.
            selector.agree = lambda kernel: rank_shards.broadcast_object(kernel, src=0)
    setup = EngineSetup(model, optimizer, placement, guard=user_optimizer.register_step_pre_hook(_refuse_a_step))
    setattr(model, ENGINE_ATTRIBUTE, setup)
    return setup


def as_offload_optimizer(optimizer: Any) -> OffloadOptimizer:
    """The engine inside a framework's optimizer wrapper (Lightning's and Fabric's keep it as ``_optimizer``)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(inner, OffloadOptimizer):
        raise TypeError(f"Expected the strategy's OffloadOptimizer, got {type(inner).__name__}.")
    return inner
