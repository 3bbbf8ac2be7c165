"""What an offload run keeps where, counted from the model's parameters alone: which tensor becomes which kind of slot
(the set-up layer's own placement and projection rules decide, :func:`inventory`), and the bytes each kind holds on
the host and sends over the link per step (:func:`host_bytes`, :func:`link_bytes`).

Nothing here allocates: shapes and dtypes are read, so a model on the ``meta`` device is planned as cheaply as a real
one. The per-kind byte counts follow the slot modules of ``engine/slots/`` buffer for buffer (each function names the
one it follows); ``tests/test_planning.py`` holds them to the engine's own telemetry on real engines, so a slot that
grows a buffer without this file following fails there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_offload.engine.rules.host_rule import HostRule, host_rule_of, refuse_rule_without_scales
from lightning_offload.lsp.channel_scales import scaled_projection_size
from lightning_offload.lsp.layouts import LINEAR, LayerLayout, layout_of
from lightning_offload.setup.embeddings_head import plan_placement
from lightning_offload.setup.engine import Placements, rows_stepped_densely
from lightning_offload.setup.projection import compressed_dim, projected_modules
from lightning_offload.setup.settings import OffloadSettings

#: Bytes of a fused ``torch.optim.Adam``'s ``step`` (a 0-d fp32 tensor beside each tensor's moments).
#: Slot kinds: how each trained tensor is stepped.
KINDS = ("projected", "scaled", "dense", "rows", "device", "frozen")


@dataclass(frozen=True)
class Entry:
    """One trained tensor and how the engine steps it.

    Attributes:
        name: the parameter's (or module's) qualified name.
        kind: one of :data:`KINDS`.
        shape: the parameter's shape.
        itemsize: bytes per element of the parameter as it trains (its dtype under the run's precision).
        compressed: ``(d_o, d_i)`` of a projected weight, ``(channels, r)`` of a scaled one; else ``None``.
        projector_sizes: ``(o, i)`` of a projected weight (the dims its projectors compress), else ``None``.
        layout: how a projected or scaled weight's layer stores it (``lsp/layouts``). Default: ``LINEAR`` (an entry
            made without its layer is taken as stored as a Linear's).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    itemsize: int
    compressed: tuple[int, int] | None = None
    projector_sizes: tuple[int, int] | None = None
    layout: LayerLayout = LINEAR

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)

    @property
    def host_numel(self) -> int:
        """Elements the host steps each step: the compressed ones for a projected or scaled weight."""
        return math.prod(self.compressed) if self.compressed is not None else self.numel


@dataclass
class Inventory:
    """Every trained tensor of a model under a strategy's settings, by kind.

    Attributes:
        entries: one per trained tensor (tied weights once).
        weight_bytes: bytes of every parameter on the device, trained or not.
        parameters: elements of every parameter.
        messages: what the placement decided, one line each (as the strategy logs it).
    """

    entries: list[Entry] = field(default_factory=list)
    weight_bytes: int = 0
    parameters: int = 0
    messages: list[str] = field(default_factory=list)

    def of(self, *kinds: str) -> list[Entry]:
        """The entries of the given kinds."""
        return [e for e in self.entries if e.kind in kinds]


def trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a user's ``AdamW(model.parameters())`` trains (those that require grad; tied ones once)."""
    return [p for p in model.parameters() if p.requires_grad]


def inventory(model: nn.Module, settings: OffloadSettings | None, param_dtype: torch.dtype | None,
              trained: list[nn.Parameter] | None = None,
              optimizer: type[Optimizer] = torch.optim.AdamW) -> Inventory:
    """Which trained tensor of ``model`` becomes which kind of slot under ``settings`` (``None``: plain training, every
    tensor stepped on the device).

    Args:
        model: the model (any device, ``meta`` included); the user's optimizer is taken to train every parameter that
            requires grad, in one group with its defaults.
        settings: the strategy's settings.
        param_dtype: the dtype parameters train in (``bf16-true``: bf16); ``None`` keeps each parameter's own.
        trained: the parameters trained, where not those that require grad (a base model MEFT will freeze).
        optimizer: the user's optimizer class (its rule decides, as at set-up, whether embeddings step by rows).

    Raises:
        ValueError: a setting that does not fit the model (a ``target_modules`` pattern that matches nothing, a rank
            larger than a layer), from the set-up layer's own checks.
    """
    trained = trained_parameters(model) if trained is None else trained
    found = Inventory(parameters=sum(p.numel() for p in model.parameters()))
    itemsize = (lambda p: torch.empty((), dtype=param_dtype).element_size()) if param_dtype is not None else \
        (lambda p: p.element_size())
    found.weight_bytes = sum(p.numel() * itemsize(p) for p in model.parameters())
    names = {id(p): name for name, p in model.named_parameters()}
    if settings is None:
        found.entries = [Entry(names[id(p)], "device", tuple(p.shape), itemsize(p)) for p in trained]
        return found
    placements = Placements.of(settings)
    ids = {id(p) for p in trained}
    # The user's optimizer as the set-up sees it (built over the parameters' identities: nothing is allocated), so
    # the row placement follows the same rule as the engine's (setup/engine.py: rows_stepped_densely).
    if settings.projection and settings.update == "scaled":
        refuse_rule_without_scales(host_rule_of(optimizer))
    reasons = rows_stepped_densely(optimizer(trained), placements.embeddings_by_default) if trained else {}
    placement = plan_placement(model, ids, placements.embeddings, placements.head, dense_reasons=reasons,
                               vectors=placements.vectors, explicit=placements.explicit)
    found.messages = list(placement.messages) + list(placement.warnings)
    kinds: dict[int, Entry] = {}
    if settings.projection:
        groups = SimpleNamespace(param_groups=[{"params": trained}])
        for name, module in projected_modules(model, groups, settings, placement).items():
            weight = module.weight
            if id(weight) not in kinds:
                kinds[id(weight)] = _projected_entry(name, module, settings, itemsize(weight))
    for kind, tensors in (("device", placement.device), ("frozen", placement.frozen), ("rows", placement.row_sparse)):
        for p in tensors:
            kinds.setdefault(id(p), Entry(names[id(p)], kind, tuple(p.shape), itemsize(p)))
    found.entries = [kinds.get(id(p)) or Entry(names[id(p)], "dense", tuple(p.shape), itemsize(p)) for p in trained]
    return found


def _projected_entry(name: str, module: nn.Module, settings: OffloadSettings, itemsize: int) -> Entry:
    """A projected (or scaled) weight's entry, sized and checked by the set-up layer's own rules."""
    layout = layout_of(module)
    out_features, in_features = layout.weight_shape(module)
    shape = tuple(module.weight.shape)
    if settings.update == "scaled":
        for side, size in (("output", out_features), ("input", in_features)):
            compressed_dim(settings, name, side, size, density=1)
        channels = max(out_features, in_features)
        return Entry(f"{name}.weight", "scaled", shape, itemsize,
                     (channels, scaled_projection_size(out_features, in_features, settings.rank)),
                     (out_features, in_features), layout)
    d_out = compressed_dim(settings, name, "output", out_features)
    d_in = compressed_dim(settings, name, "input", in_features)
    return Entry(f"{name}.weight", "projected", shape, itemsize, (d_out, d_in), (out_features, in_features), layout)


@dataclass(frozen=True)
class Link:
    """What the run's link carries and how it is staged.

    Attributes:
        itemsize: bytes per element of gradients (and compressed updates) on the link (``link_dtype``).
        pinned: host buffers are pinned (an accelerator device): staging copies exist even for fp32 parameters.
        speculative: host steps run speculatively, each keeping a backup of its variable and moments.
        rows_touched: embedding rows a step touches (``embeddings="sparse"``).
    """

    itemsize: int
    pinned: bool
    speculative: bool
    rows_touched: int


def host_bytes(entry: Entry, link: Link, rule: HostRule) -> int:
    """Host bytes one slot holds in steady state (after its first step, when its optimizer's state exists), as
    ``OffloadOptimizer.host_state_bytes`` counts them, under the user's optimizer's ``rule``."""
    n = entry.host_numel
    moments, step = 4 * rule.moments, rule.step_bytes
    # A gradient's fp32 working copy is the host jobs' shared buffer (host_scratch_bytes), no slot's own.
    if entry.kind == "dense":  # engine/slots/dense_slot.py + host_step_slot.py
        staged = entry.itemsize if entry.itemsize != 4 else 0  # the value crosses back in the parameter's dtype
        held = n * (4 + link.itemsize + staged + moments) + step
    elif entry.kind == "projected":  # engine/slots/projected_slot.py: Z, landing, staging in the link dtype
        # The landing, and what U crosses from: Z itself at an fp32 link, else U staged in the link dtype (Z then
        # lives in the shared buffer): the link's itemsize twice either way.
        held = n * (2 * link.itemsize + moments) + step
    elif entry.kind == "scaled":  # engine/slots/scaled_slot.py: Z = channels × r, and two fp32 vectors per channel
        held = n * (4 + link.itemsize + moments) + step + 8 * entry.compressed[0]
    elif entry.kind == "rows":  # engine/slots/row_slot.py and the row Adam (engine/rows/block_row_adam.py)
        return _row_slot_bytes(entry, link)
    else:
        return 0
    return held + speculation_bytes(entry, link, rule)


def speculation_bytes(entry: Entry, link: Link, rule: HostRule) -> int:
    """Host bytes of one slot's speculation backup (part of :func:`host_bytes`): the speculative commit
    (engine/step/speculation.py, its ``Backup`` in engine/step/slot_step.py) backs up the moments (and step) before a
    speculative step, and a dense parameter's fp32 master (a projected weight's ``Z`` restarts from zero)."""
    if not link.speculative or entry.kind not in ("dense", "projected"):
        return 0
    master = 4 if entry.kind == "dense" else 0
    return entry.host_numel * (master + 4 * rule.moments) + rule.step_bytes


def host_scratch_bytes(entries: list[Entry], link: Link) -> int:
    """Bytes of the host jobs' shared fp32 working buffers (engine/lanes/host_scratch.py) where gradients land
    narrower: the largest gradient a host-Adam slot steps, and the largest projected ``Z``. (A speculative step that
    clamps an fp32 gradient grows the first at its first such step: not planned, as before.)"""
    if link.itemsize == 4:
        return 0
    gradient = max((e.host_numel for e in entries if e.kind in ("dense", "projected", "scaled")), default=0)
    variable = max((e.host_numel for e in entries if e.kind == "projected"), default=0)
    return 4 * (gradient + variable)


def _row_slot_bytes(entry: Entry, link: Link) -> int:
    rows, width = entry.shape
    cells = rows * width
    # engine/slots/row_slot.py: a full-size master; landing, staging, fp32 copy and row numbers sized to the most
    # rows a step sent (at most the step's tokens).
    capacity = min(rows, link.rows_touched)
    staged = entry.itemsize if (link.pinned or entry.itemsize != 4) else 0
    fp32_copy = 4 if link.itemsize != 4 else 0
    slot = cells * 4 + capacity * (width * (link.itemsize + staged + fp32_copy) + 8)
    row_adam = cells * 8 + rows * (8 + 16 + 8)  # moments; last step, two scales (float64), decay marks
    workspace = capacity * (3 * width * 4 + 4 * 4 + 8 + 8)  # engine/rows/row_adam_kernel.py:RowWorkspace
    return slot + row_adam + workspace


def link_bytes(entry: Entry, link: Link) -> tuple[int, int]:
    """``(device→host, host→device)`` bytes one slot moves per step, as its ``prepare`` counts them."""
    n = entry.host_numel
    if entry.kind == "dense":
        return n * link.itemsize, n * entry.itemsize
    if entry.kind == "projected":
        return n * link.itemsize, n * link.itemsize
    if entry.kind == "scaled":
        channels = entry.compressed[0]
        return n * link.itemsize + 4 * channels, 4 * channels
    if entry.kind == "rows":
        rows = min(entry.shape[0], link.rows_touched)
        return rows * (entry.shape[1] * link.itemsize + 8), rows * entry.shape[1] * entry.itemsize
    return 0, 0
