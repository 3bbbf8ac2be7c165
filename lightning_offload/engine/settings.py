"""What an offload was asked to do, as one frozen value validated once when it is built: :class:`OffloadSettings`.

It lives at the engine's floor because the engine takes it whole (:class:`~lightning_offload.engine.optimizer.
OffloadOptimizer`), as do the set-up, the planner and every face; a new setting is its field here (with its entry in
the docstring, which every face's ``help()`` shows), the code that reads it, and its line in ``conf/offload/lsp.yaml``.
A setting that does not apply is refused, not ignored: without projection (``zero_offload``, ``meft_offload``) a
projection setting given a non-default value is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from lightning_offload.engine.user_optimizer import LINK_DTYPES
from lightning_offload.lsp.kernels.selection import validate_policy
from lightning_offload.lsp.projector import ProjectorFactory, random_projector

#: Where embeddings, the output head and the vectors may train (:mod:`lightning_offload.setup.embeddings_head`).
EMBEDDING_PLACEMENTS = ("host", "sparse", "device", "frozen")
HEAD_PLACEMENTS = ("host", "projected", "device", "frozen")
VECTOR_PLACEMENTS = ("device", "host")
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
    """What an offload strategy was asked to do: every face's offload settings, documented here once (every face's
    signature and ``help()`` are generated from this: :mod:`lightning_offload.setup.settings_docs`).

    Attributes:
        projection: compress the gradients of selected weights (LSP-Offload); ``False`` sends every gradient in full to
            a dense host Adam (ZeRO-Offload style, as ``zero_offload``). Default: ``True``.
        rank: compressed size of each side of a projected weight: a float in ``(0, 1]`` is a fraction of the dimension
            (``d = ceil(rank · dim)``), an int an absolute size. Default: ``0.25`` (1/16 of a gradient).
        density: ``r``, nonzeros per projector column. Default: ``8``.
        min_dim: by default every Linear/Conv1D with both dims ≥ ``min_dim`` is projected, except output and task heads
            (:func:`~lightning_offload.lsp.targets.output_heads`). Default: ``128``.
        target_modules: regular expressions; when given, exactly the matching Linear/Conv1D modules are projected (heads
            included). Default: ``None`` (the ``min_dim`` rule).
        exclude_modules: regular expressions of modules never projected. Default: ``()``.
        projectors: ``"random"`` keeps the seeded draw; ``"learned"`` fits the values to sampled gradients before the
            first update and refits stale ones (:class:`~lightning_offload.faces.trainer.refit.ProjectorRefit`, or
            ``fit_projectors`` in a loop). Default: ``"random"`` (no fit cost; at rank 0.125 try both).
        projector_factory: draws each projector at set-up; a learned fit starts from it. Default: ``random_projector``
            (seeded random, :func:`~lightning_offload.lsp.projector.random_projector`).
        seed: seeds the projector draw (the same on every rank) and stochastic rounding. Default: ``0``.
        on_nonfinite: ``"skip"`` (count and skip steps with inf/nan gradients) or ``"raise"``. Default: ``"skip"``.
        log_telemetry: log the ``offload/*`` figures through the trainer's loggers at the steps it writes its logs
            (every ``log_every_n_steps``; pipelined: the latest *completed* step's); a loop of one's own refuses it
            (it reads ``opt.telemetry``). Default: ``True``.
        pipelined: overlap host work with device compute, each update applied right before its module's next forward;
            ``False`` applies every update before the optimizer step returns (same results). Default: ``True``.
        link_dtype: ``"fp32"`` or ``"bf16"`` for gradients sent to the host and compressed updates sent back (and
            between ranks). Default: ``"fp32"``.
        update_buffers: device buffers, a ring shared by all layers, that compressed updates cross into as soon as their
            host step ends. Default: ``None`` (on a GPU, or behind the simulated link, one per projected layer within
            1/64 of the device's memory, at least 4; none on the CPU, where updates are read in place).
        speculative: start each tensor's host Adam in backward once its gradient has landed, rolled back (then redone or
            skipped) if the step is clipped or non-finite; results are bit-identical. Default: ``None`` (on for a GPU
            and behind the simulated link, off on the CPU, where host and device share the cores).
        free_sent_gradients: set a parameter's ``.grad`` to ``None`` once its step is launched (crossed to the host,
            or queued on the device), freeing its device memory before the next forward. Default: ``None`` (on under
            the Trainer and Fabric, whose loops zero gradients anyway; off for ``offload()``, where ``p.grad`` stays
            readable).
        embeddings: where the ``nn.Embedding`` weights train: ``"host"`` (dense host Adam), ``"sparse"`` (only rows with
            a nonzero gradient cross and are stepped; a row's moments and decay catch up over missed steps, without
            dense Adam's momentum drift; one process only), ``"device"`` or ``"frozen"``
            (:mod:`lightning_offload.setup.embeddings_head`). Default: ``None`` (``"sparse"`` for ``lsp_offload`` on one
            device, else ``"host"``).
        head: where the output head (``get_output_embeddings``, and a weight tied to it) trains: ``"host"``,
            ``"projected"`` (needs projection), ``"device"`` or ``"frozen"``. Default: ``None`` (with projection,
            ``"projected"`` for a head of 2**27 elements or more, else ``"host"``; without, ``"host"``).
        vectors: where the 1-D and 0-D parameters (norm weights, biases) train: ``"device"`` (a device Adam: their
            state is 8 bytes an element there, 12 for bf16 weights, and their step needs no host job, whose fixed
            cost outweighs a small tensor's Adam) or ``"host"`` (dense host Adam, like every other dense parameter).
            Default: ``None`` (``"device"``).
        update: how a projected weight's host moments become its update: ``"projected"``, LSP's low-rank ``c·AᵀUB`` (no
            dense gradient on the device); ``"scaled"``, APOLLO's rule (:mod:`lightning_offload.lsp.channel_scales`):
            the full gradient ``G``, kept until the scales return, scaled per channel from Adam's moments of
            ``R = G·Pᵀ`` in the host bytes ``rank`` gives (one process only; AdamW's decay). Default: ``"projected"``.
        redraw_every: under ``update="scaled"``, steps between draws of ``P`` (the moments are kept). Default: ``200``.
        norm_growth_limit: under ``update="scaled"``, the most the update's norm may grow from one step to the next
            (``None``: no limit). Default: ``1.01``.
        kernels: which kernels run the projected layers' products: ``"auto"`` times each device kernel on the first call
            of each distinct product and keeps the fastest (logged, kept per machine, in ``optimizer.kernel_choices``);
            ``"native"``, ``"csr"``, ``"dense"`` or ``"triton"`` force one where it can run (else ``"csr"``, with a
            warning). Kernels agree within fp32 rounding: force one for bit-identical runs across machines
            (:mod:`lightning_offload.lsp.kernels.selection`). Default: ``"auto"``.

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
    vectors: str | None = None
    update: str = "projected"
    redraw_every: int = 200
    norm_growth_limit: float | None = 1.01
    kernels: str = "auto"

    def __post_init__(self) -> None:
        # Lists (from a YAML config) become tuples: the value stays immutable and hashable.
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
        validate_placements(self.embeddings or "host", self.head or "host", self.vectors or "device")
        self._validate_update_rule()
        if self.head == "projected" and not self.projection:
            raise ValueError("head='projected' needs projection, which this strategy does not do. Use head='host', "
                             "'device' or 'frozen', or strategy='lsp_offload'.")

    @property
    def learns_projectors(self) -> bool:
        """Whether projectors are fitted (``projectors="learned"`` where something is projected)."""
        return self.projection and self.projectors == "learned"

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, object]) -> OffloadSettings:
        """The settings among a constructor's arguments (its ``locals()``), taken by field name."""
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


def engine_settings(settings: OffloadSettings | None, one_by_one: Mapping[str, Any]) -> OffloadSettings:
    """The settings the engine's constructor runs under: ``settings`` (by default the settings' defaults but
    ``pipelined=False``, as the engine always defaulted), with the settings it was given one by one put in (its keyword
    arguments from before it took one value; ``rounding_seed`` is ``seed``).

    Raises:
        TypeError: for a ``settings`` that is no :class:`OffloadSettings`, or a keyword that names no setting.
    """
    if settings is not None and not isinstance(settings, OffloadSettings):
        raise TypeError(f"OffloadOptimizer's settings must be an OffloadSettings, got {settings!r}: pass "
                        f"settings=OffloadSettings(...), or the settings by name (pipelined=..., link_dtype=...).")
    given = {"seed" if name == "rounding_seed" else name: value for name, value in one_by_one.items()}
    unknown = sorted(set(given) - {f.name for f in fields(OffloadSettings)})
    if unknown:
        raise TypeError(f"OffloadOptimizer got an unexpected keyword argument {unknown[0]!r}: it takes the offload "
                        f"settings as settings=OffloadSettings(...), or their fields by name.")
    base = settings if settings is not None else OffloadSettings(pipelined=False)
    return replace(base, **given) if given else base


def validate_placements(embeddings: str, head: str, vectors: str = "device") -> None:
    """Raise a ValueError naming the accepted values when ``embeddings``, ``head`` or ``vectors`` is not one of them."""
    if embeddings not in EMBEDDING_PLACEMENTS:
        raise ValueError(f"embeddings={embeddings!r} is not one of {EMBEDDING_PLACEMENTS}: 'host' steps them densely "
                         f"on the host (exact), 'sparse' only the batch's rows.")
    if head not in HEAD_PLACEMENTS:
        raise ValueError(f"head={head!r} is not one of {HEAD_PLACEMENTS}: 'host' steps it densely on the host "
                         f"(exact), 'projected' compresses it like any Linear.")
    if vectors not in VECTOR_PLACEMENTS:
        raise ValueError(f"vectors={vectors!r} is not one of {VECTOR_PLACEMENTS}: 'device' steps the norm weights and "
                         f"biases by an Adam on the device, 'host' on the host like the other dense parameters.")


def _patterns(name: str, value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of regular expressions (strings), got {value!r}; wrap a single "
                        f"pattern in a list.")
    for pattern in value:
        # Compiled here, where the setting is given: a bad one would otherwise fail at set-up as a bare re.error.
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"{name}: {pattern!r} is not a regular expression ({error}). The patterns are matched with re.search "
                f"against module names such as 'model.layers.0.mlp.up_proj': escape a literal '[', '(', '.' or '*' "
                f"with a backslash (re.escape(name) does it for a whole name).") from error
    return list(value)
