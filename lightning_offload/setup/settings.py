"""The offload strategies' settings as one frozen value, validated once when it is built.

Every strategy constructor (``lsp_offload``, ``zero_offload``, their DDP forms, ``meft_offload``) builds an
:class:`OffloadSettings` from its keyword arguments; everything downstream reads that value and validates nothing
again. A setting that does not apply is refused rather than ignored: without projection (``zero_offload``,
``meft_offload``) a projection setting given a value other than its default is an error that names it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from lightning_offload.engine.user_optimizer import LINK_DTYPES
from lightning_offload.lsp.kernels.selection import validate_policy
from lightning_offload.lsp.projector import ProjectorFactory, random_projector
from lightning_offload.setup.embeddings_head import validate_placements

PROJECTOR_KINDS = ("learned", "random")
UPDATE_RULES = ("projected", "scaled")
#: What a step with inf/nan gradients does: the faces' and the settings' ``on_nonfinite`` (handed to the engine's).
NonFinitePolicy = Literal["skip", "raise"]
NON_FINITE_POLICIES = get_args(NonFinitePolicy)
#: The settings that only mean something when weights are projected.
PROJECTION_SETTINGS = ("rank", "density", "min_dim", "target_modules", "exclude_modules", "projectors",
                       "projector_factory", "update_buffers", "update", "redraw_every", "norm_growth_limit", "kernels")
#: The settings of ``update="projected"``'s sparse projectors and update ring, which the scaled rule has none of.
PROJECTED_ONLY_SETTINGS = ("density", "projectors", "projector_factory", "update_buffers", "kernels")
#: The settings of ``update="scaled"`` only.
SCALED_ONLY_SETTINGS = ("redraw_every", "norm_growth_limit")


@dataclass(frozen=True)
class OffloadSettings:
    """What an offload strategy was asked to do: every face's offload settings, documented here once (the strategies'
    docstrings and Fabric's signatures are generated from this, :func:`documents_settings`).

    Attributes:
        projection: compress the gradients of selected weights (LSP-Offload); ``False`` sends every gradient in
            full to a dense host Adam (ZeRO-Offload style, as ``zero_offload``). Default: ``True``.
        rank: compressed size of each side of a projected weight: a float in ``(0, 1]`` is a fraction of the
            dimension (``d = ceil(rank · dim)``), an int is an absolute size. Default: ``0.25`` (1/16 of a layer's
            gradient crosses the link).
        density: ``r``, nonzeros per projector column (each input coordinate lands in ``r`` compressed ones).
            Default: ``8``.
        min_dim: by default every Linear/Conv1D with both dims ≥ ``min_dim`` is projected, except output and task
            heads (:func:`~lightning_offload.lsp.targets.output_heads`). Default: ``128``.
        target_modules: regular expressions; when given, exactly the matching Linear/Conv1D modules are projected
            (heads included, when they match). Default: ``None`` (the ``min_dim`` rule).
        exclude_modules: regular expressions of modules never projected. Default: ``()``.
        projectors: ``"random"`` keeps the seeded draw, never fitted; ``"learned"`` fits the projector values to
            sampled gradients before the first update and refits stale ones on a schedule (under the Trainer a
            :class:`~lightning_offload.faces.trainer.refit.ProjectorRefit` with its defaults is added unless the
            Trainer has one; a loop calls ``fit_projectors``). At rank 0.25 random draws kept as much of AdamW's gain
            as learned ones or more in most measured settings, at no fit cost; at rank 0.125 the measurements split,
            so try both there (docs/benchmarks/2026-12-02.md, "Projectors at the user's own learning rate").
            Default: ``"random"``.
        projector_factory: draws each projector at set-up; a learned fit starts from it. Default:
            ``random_projector`` (seeded random, :func:`~lightning_offload.lsp.projector.random_projector`).
        seed: seed of the projector draw and of stochastic rounding (every rank draws the same projectors from it).
            Default: ``0``.
        on_nonfinite: ``"skip"`` (count and skip steps with inf/nan gradients) or ``"raise"``. Default: ``"skip"``.
        log_telemetry: log the ``offload/*`` figures through the trainer's loggers every step (in pipelined mode
            the figures of the latest *completed* step, i.e. one step behind, so none at the first step; the CLI's
            ``history.jsonl`` files each step's figures under its own number). A loop of one's own has no logger
            and refuses it: it reads ``opt.telemetry``. Default: ``True``.
        pipelined: overlap the host work with device compute: each update is applied right before its module's
            next forward. ``False`` applies every update before the optimizer step returns (same results).
            Default: ``True``.
        link_dtype: ``"fp32"`` or ``"bf16"`` for gradients sent to the host and compressed updates sent back (and
            between ranks). Default: ``"fp32"``.
        update_buffers: device buffers that compressed updates land in, shared by all layers (a ring; the next
            layers' updates are prefetched into free ones). Default: ``None`` (4 on an accelerator; none on the CPU,
            where updates are read where the host step wrote them).
        speculative: start each tensor's host Adam during backward, as soon as its gradient has landed, and roll it
            back (then redo or skip it) when the step turns out clipped by norm or non-finite; results equal the
            non-speculative path bit for bit (see :class:`~lightning_offload.engine.optimizer.OffloadOptimizer`).
            Default: ``None`` (on for a GPU, off on the CPU, where host and device share the cores).
        free_sent_gradients: set a host-stepped parameter's ``.grad`` (a dense one, a row-sparse embedding's) to
            ``None`` once its gradient has crossed and its host step is launched, so the device holds no such
            gradient into the next forward (at 6.7B under ``zero_offload``, 12.5 GiB). Default: ``None`` (on under the
            Trainer's and Fabric's strategies, whose loops zero gradients before the next backward anyway; off for
            ``offload()`` in a loop of one's own, where torch's ``p.grad`` stays readable after ``step()``).
        embeddings: where the ``nn.Embedding`` weights train: ``"host"`` (dense host Adam, exact), ``"sparse"`` (only
            the rows with a nonzero gradient — the batch's tokens — cross and are stepped; a row's moments and
            decoupled decay catch up over the steps it missed, but it does not drift on momentum while untouched as
            under dense Adam; one process only, since each rank's batch touches different rows), ``"device"`` (a
            device Adam; its state is device memory) or ``"frozen"``.
            See :mod:`lightning_offload.setup.embeddings_head`.
            Default: ``None`` (``"sparse"`` for ``lsp_offload`` on one device, else ``"host"``).
        head: where the output head (``get_output_embeddings``) trains: ``"host"``, ``"projected"`` (LSP-compressed
            like any Linear; not without projection), ``"device"`` or ``"frozen"``. A weight tied to the input
            embedding takes this setting. Default: ``None`` (with projection, ``"projected"`` for a head of 2**27
            elements or more, such as a 128K vocabulary's, else ``"host"``; without, ``"host"``).
        update: how a projected weight's host moments become its update. ``"projected"``: LSP's ``c·AᵀUB``, a
            low-rank update from Adam in the compressed space (the device never forms the weight's gradient).
            ``"scaled"``: a full-rank update, the weight's gradient scaled per channel from Adam's moments of a random
            projection ``R = G·Pᵀ`` of the same host bytes as ``rank`` gives (APOLLO's rule,
            :mod:`lightning_offload.lsp.channel_scales`; one scale per weight where a channel is projected to one
            number, as APOLLO-Mini); the device forms ``G`` and keeps it until the step's
            scales return, as native training keeps its gradients. One process only; AdamW's decoupled decay (not
            Adam's L2). Default: ``"projected"``.
        redraw_every: under ``update="scaled"``, steps between draws of the projection ``P`` (the moments are kept).
            Default: ``200``.
        norm_growth_limit: under ``update="scaled"``, the most the update's norm may grow from one step to the next
            (``None``: no limit). Default: ``1.01``.
        kernels: which kernels run the projected layers' products (``B Xᵀ``, ``A Δᵀ`` and the update):
            ``"auto"`` times each kernel that runs on the device on the first call of each distinct product and keeps
            the fastest (the choice is logged, kept per machine and listed in ``optimizer.kernel_choices``);
            ``"native"`` (the CPU's C kernels), ``"csr"`` (torch's sparse products), ``"dense"`` (the projector
            formed for each product) or ``"triton"`` (CUDA) force one, where it can run (else ``"csr"``, with a
            warning). Kernels agree within fp32 rounding; force one for runs that must repeat bit for bit across
            machines (:mod:`lightning_offload.lsp.kernels.selection`). Default: ``"auto"``.

    Example::

        from lightning_offload.setup.settings import OffloadSettings

        settings = OffloadSettings(rank=0.125, projectors="random")
        OffloadSettings(projection=False, rank=0.1)  # ValueError: rank does not apply without projection
    """

    projection: bool = True
    rank: int | float = 0.25
    density: int = 8
    min_dim: int = 128
    target_modules: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] = ()
    projectors: str = "random"
    projector_factory: ProjectorFactory = random_projector
    seed: int = 0
    on_nonfinite: NonFinitePolicy = "skip"
    log_telemetry: bool = True
    pipelined: bool = True
    link_dtype: str = "fp32"
    update_buffers: int | None = None
    speculative: bool | None = None
    free_sent_gradients: bool | None = None
    embeddings: str | None = None
    head: str | None = None
    update: str = "projected"
    redraw_every: int = 200
    norm_growth_limit: float | None = 1.01
    kernels: str = "auto"

    def __post_init__(self) -> None:
        # Lists (from a YAML config, say) become tuples: the value stays immutable and hashable.
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(_patterns("target_modules", self.target_modules)))
        object.__setattr__(self, "exclude_modules", tuple(_patterns("exclude_modules", self.exclude_modules)))
        if not self.projection:
            self._refuse_projection_settings()
        self._validate_projection()
        if self.on_nonfinite not in NON_FINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {self.on_nonfinite!r}.")
        if self.link_dtype not in LINK_DTYPES:
            raise ValueError(f"link_dtype must be one of {sorted(LINK_DTYPES)}, got {self.link_dtype!r}.")
        if self.update_buffers is not None and (isinstance(self.update_buffers, bool)
                                                or not isinstance(self.update_buffers, int) or self.update_buffers < 0):
            raise ValueError(f"update_buffers must be None or an int ≥ 0 (device buffers for updates in flight), got "
                             f"{self.update_buffers!r}.")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise TypeError(f"speculative must be True, False or None (on for a GPU, off on the CPU), got "
                            f"{self.speculative!r}.")
        if self.free_sent_gradients is not None and not isinstance(self.free_sent_gradients, bool):
            raise TypeError(f"free_sent_gradients must be True, False or None (on under the Trainer and Fabric, off "
                            f"in a loop of one's own), got {self.free_sent_gradients!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}.")
        validate_placements(self.embeddings or "host", self.head or "host")
        self._validate_update_rule()
        if self.head == "projected" and not self.projection:
            raise ValueError("head='projected' needs projection, which this strategy does not do. Use head='host', "
                             "'device' or 'frozen', or strategy='lsp_offload'.")

    @property
    def learns_projectors(self) -> bool:
        """Whether projectors are fitted (``projectors="learned"`` where something is projected): what every face
        asks to decide whether a fit is wanted."""
        return self.projection and self.projectors == "learned"

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, object]) -> OffloadSettings:
        """The settings among a constructor's arguments (its ``locals()``): each field taken by name, the rest (the
        device, Lightning's plugins) left out."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})  # type: ignore[arg-type]

    def _validate_projection(self) -> None:
        rank, density = self.rank, self.density
        if isinstance(rank, bool) or not isinstance(rank, (int, float)):
            raise TypeError(f"rank must be an int (absolute size) or a float fraction in (0, 1], got {rank!r}.")
        if isinstance(rank, float) and not 0.0 < rank <= 1.0:
            raise ValueError(f"rank={rank} as a fraction must lie in (0, 1]; pass an int for an absolute size.")
        if isinstance(rank, int) and rank < 1:
            raise ValueError(f"rank={rank} must be at least 1 (rows kept) or a fraction in (0, 1] of each dimension; "
                             f"the default 0.25 sends 1/16 of a layer's gradient.")
        if not isinstance(density, int) or isinstance(density, bool) or density < 1:
            raise ValueError(f"density must be a positive int (nonzeros per projector column), got {density!r}.")
        if isinstance(self.min_dim, bool) or not isinstance(self.min_dim, int) or self.min_dim < 1:
            raise ValueError(f"min_dim must be a positive int (the smallest dimension projected), got "
                             f"{self.min_dim!r}.")
        validate_policy(self.kernels)
        if self.projectors not in PROJECTOR_KINDS:
            raise ValueError(f"projectors must be one of {PROJECTOR_KINDS}, got {self.projectors!r}.")
        if not callable(self.projector_factory):
            raise TypeError(f"projector_factory must be callable (see lsp.projector.random_projector), got "
                            f"{self.projector_factory!r}.")

    def _validate_update_rule(self) -> None:
        if self.update not in UPDATE_RULES:
            raise ValueError(f"update must be one of {UPDATE_RULES}, got {self.update!r}.")
        if isinstance(self.redraw_every, bool) or not isinstance(self.redraw_every, int) or self.redraw_every < 1:
            raise ValueError(f"redraw_every must be a positive int (steps between draws of the scaled rule's "
                             f"projection), got {self.redraw_every!r}.")
        limit = self.norm_growth_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 1.0):
            raise ValueError(f"norm_growth_limit must be None (no limiter) or a number above 1 (the most the update's "
                             f"norm may grow per step, e.g. 1.01), got {limit!r}.")
        defaults = {f.name: f.default for f in fields(self)}
        foreign = SCALED_ONLY_SETTINGS if self.update == "projected" else PROJECTED_ONLY_SETTINGS
        given = [name for name in foreign if getattr(self, name) != defaults[name]]
        if given:
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in given)
            other = "scaled" if self.update == "projected" else "projected"
            raise ValueError(f"{shown}: {'this setting applies' if len(given) == 1 else 'these settings apply'} only "
                             f"to update={other!r}, and this strategy was given update={self.update!r}. Remove "
                             f"{'it' if len(given) == 1 else 'them'}, or use update={other!r}.")

    def _refuse_projection_settings(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        given = [name for name in PROJECTION_SETTINGS if getattr(self, name) != defaults[name]]
        if given:
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in given)
            raise ValueError(f"{shown}: nothing is projected without projection (zero_offload, meft_offload), so "
                             f"{'this setting does' if len(given) == 1 else 'these settings do'} not apply. Remove "
                             f"{'it' if len(given) == 1 else 'them'}, or use strategy='lsp_offload' to project.")


def _patterns(name: str, value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of regular expressions (strings), got {value!r}; wrap a single "
                        f"pattern in a list.")
    return list(value)


def keyword_settings(cls: type) -> list[str]:
    """The keyword-only arguments of ``cls``'s constructor (a strategy's settings, for naming the closest to a
    misspelt one)."""
    return [name for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY]


def refuse_unknown_settings(owner: str, unknown: Mapping[str, Any], known: Iterable[str],
                            projects: bool = True) -> None:
    """Refuse settings ``owner`` does not take, naming the closest one it does (a misspelt ``rnak=``), or saying that a
    projection setting does not apply where nothing is projected (whatever its value: given at all, the user expects
    it to do something).

    Raises:
        ValueError: for a projection setting where nothing is projected. TypeError: for an unknown setting (the first
            in sorted order).
    """
    names = sorted(unknown)
    if not names:
        return
    inapplicable = [name for name in names if name in (*PROJECTION_SETTINGS, "projection")] if not projects else []
    if inapplicable:
        shown = ", ".join(f"{name}={unknown[name]!r}" for name in inapplicable)
        raise ValueError(f"{shown}: nothing is projected without projection (zero_offload, meft_offload), so "
                         f"{'this setting does' if len(inapplicable) == 1 else 'these settings do'} not apply to "
                         f"{owner}. Remove {'it' if len(inapplicable) == 1 else 'them'}, or use "
                         f"strategy='lsp_offload' to project.")
    name, known = names[0], sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]}=?" if close else ""
    raise TypeError(f"{owner} got an unknown setting {name}=.{hint} Its settings: {', '.join(known)}.")


def loop_face_settings(owner: str, given: Mapping[str, Any], forced: Mapping[str, Any],
                       face_settings: Iterable[str] = ()) -> OffloadSettings:
    """The settings value of a face that takes them as keyword arguments (``offload()``, Fabric's strategies, MEFT's):
    unknown names refused with the closest known one, a projection setting given at all where ``forced`` turns
    projection off refused (whatever its value), then validated as always.

    Args:
        owner: what the settings are given to, for messages.
        given: the settings as the user passed them.
        forced: what the face sets itself (``projection=False``).
        face_settings: the face's own keyword arguments besides these (named in the suggestions).

    Raises:
        TypeError: for an unknown setting. ValueError: for one that does not apply, or a bad value.
    """
    known = {f.name for f in fields(OffloadSettings)} - set(forced)
    projects = forced.get("projection", True)
    if not projects:
        known -= set(PROJECTION_SETTINGS)
    refuse_unknown_settings(owner, {name: value for name, value in given.items() if name not in known},
                            known | set(face_settings), projects=bool(projects))
    return OffloadSettings(**{**given, **forced})
