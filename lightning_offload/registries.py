"""The package's strategy names in Lightning's registries, without importing Lightning to put them there.

``Trainer(strategy="lsp_offload")`` and ``Fabric(strategy="lsp_offload")`` look the names up in Lightning's
``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY``, which live in Lightning. Lightning has no entry point for
third-party strategies (only for callbacks), so ``import lightning_offload`` fills the registries itself: at once when
Lightning is already imported, and otherwise right after Lightning's import finishes, through a ``sys.meta_path``
finder that watches for it. A plain loop or Hugging Face's ``Trainer`` thus never loads Lightning (seconds at import).

"Finishes" means the outermost of the watched imports in progress: Lightning's, and this package's own modules',
because a strategy module of ours that imports Lightning first (``lightning_offload.FabricOffload`` read before any
Lightning import) is half initialized when Lightning's import ends, and filling the registries needs it whole.

Each registry gets the package's names (:func:`trainer_names`, :func:`fabric_names`) as Lightning's own presets are put
in (``deepspeed_stage_2_offload``: ``DeepSpeedStrategy`` with ``stage=2, offload_optimizer=True``): each name the one
class of its face's base (single device, DDP; MEFT's its own) with the settings the preset table
(:data:`lightning_offload.setup.settings.PRESETS`) gives it, described by its preset class's first docstring line.
Each registry is filled exactly once (:func:`register` also skips names already there), and the finder leaves
``sys.meta_path`` once both are. A failure is a :class:`StrategyRegistrationError` raised from the
import that triggered it, naming the cause. The standalone ``pytorch_lightning`` and ``lightning_fabric`` packages
have registries of their own that these strategies (subclasses of ``lightning.pytorch``'s) cannot go in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

#: Lightning's modules whose import is watched. ``lightning``'s own ``__init__`` imports ``lightning.fabric`` and
#: ``lightning.pytorch`` (and runs first when either is imported); the sub-packages are watched too in case a later
#: Lightning loads them lazily.
WATCHED = ("lightning", "lightning.pytorch", "lightning.fabric")
#: This package's modules are watched too (see the module's docstring).
WATCHED_PREFIX = "lightning_offload."


class StrategyRegistrationError(ImportError):
    """The strategy names could not be put in a Lightning registry (raised from the import whose end filled it)."""


@dataclass(frozen=True)
class StrategyName:
    """One of the package's names in a Lightning strategy registry.

    Attributes:
        name: what ``strategy=`` takes.
        cls: the strategy class the name builds.
        preset: the keyword arguments the name passes to ``cls`` (Lightning's ``init_params``, as its
            ``deepspeed_stage_2`` sets ``stage=2``); a strategy built by the user sets its own.
        public: the class a user builds for this name's settings (``ZeroOffloadStrategy``), whose docstring's first
            line describes the name. Default: ``None`` (``cls``).
    """

    name: str
    cls: type
    preset: dict[str, Any] = field(default_factory=dict)
    public: type | None = None

    @classmethod
    def of(cls, public: type) -> StrategyName:
        """The name of a face's public class: the class it is a preset of (or itself) with the name's preset."""
        from lightning_offload.setup.settings import PRESETS

        name = public.strategy_name
        return cls(name, getattr(public, "preset_of", None) or public, dict(PRESETS[name]), public)


def trainer_names() -> tuple[StrategyName, ...]:
    """The Trainer's names (imports Lightning)."""
    from lightning_offload.faces.trainer.ddp import LSPOffloadDDPStrategy, ZeroOffloadDDPStrategy
    from lightning_offload.faces.trainer.meft import MEFTOffloadStrategy
    from lightning_offload.faces.trainer.offload import LSPOffloadStrategy, ZeroOffloadStrategy

    return tuple(map(StrategyName.of, (LSPOffloadStrategy, ZeroOffloadStrategy, MEFTOffloadStrategy,
                                       LSPOffloadDDPStrategy, ZeroOffloadDDPStrategy)))


def fabric_names() -> tuple[StrategyName, ...]:
    """Fabric's names, the same five (imports Lightning)."""
    from lightning_offload.faces.fabric import (
        FabricMEFTOffload, FabricOffload, FabricOffloadDDP, FabricZeroOffload, FabricZeroOffloadDDP)

    return tuple(map(StrategyName.of, (FabricOffload, FabricZeroOffload, FabricMEFTOffload, FabricOffloadDDP,
                                       FabricZeroOffloadDDP)))


def register(registry: Any, name: str, cls: type, description: str | None = None, **preset: Any) -> None:
    """Put ``name`` in a Lightning strategy registry (the Trainer's ``StrategyRegistry`` or Fabric's
    ``STRATEGY_REGISTRY``): ``strategy=name`` then builds ``cls(**preset)``. A name already there is left as it is
    (the package imported again, or the user's own registration first).

    Args:
        registry: the registry.
        name: the name.
        cls: the strategy class it builds.
        description: what the registry says of it. Default: ``None`` (the first line of ``cls``'s docstring).
        preset: the keyword arguments the name passes to ``cls``.
    """
    if name not in registry:
        registry.register(name, cls, description=description or cls.__doc__.splitlines()[0], **preset)


def register_trainer_strategies() -> None:
    """Put :func:`trainer_names` in the Trainer's ``StrategyRegistry`` (imports Lightning; idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for entry in trainer_names():
        register(StrategyRegistry, entry.name, entry.cls, _description(entry), **entry.preset)


def register_fabric_strategies() -> None:
    """Put :func:`fabric_names` in Fabric's ``STRATEGY_REGISTRY`` (imports Lightning; idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for entry in fabric_names():
        register(STRATEGY_REGISTRY, entry.name, entry.cls, _description(entry), **entry.preset)


def _description(entry: StrategyName) -> str:
    """What a registry says of a name: the first line of its public class's docstring."""
    return (entry.public or entry.cls).__doc__.splitlines()[0]


def register_strategies() -> None:
    """Put the package's names in the Trainer's and Fabric's registries now (imports Lightning; idempotent): what
    ``import lightning_offload`` does by itself when Lightning is imported."""
    register_trainer_strategies()
    register_fabric_strategies()


#: Each registry: the Lightning module that holds it, and what fills it.
REGISTRIES: dict[str, tuple[str, Callable[[], None]]] = {
    "Trainer": ("lightning.pytorch", register_trainer_strategies),
    "Fabric": ("lightning.fabric", register_fabric_strategies),
}

_lock = threading.Lock()  # guards the two below; never held while importing (another thread may hold an import lock)
_filled: set[str] = set()
_filling = False
_watch = threading.local()  # per thread: how many watched imports are executing (nested ones run inside the first)


def register_loaded() -> None:
    """Fill every registry whose Lightning module is imported and that is not filled yet; stop watching once both are.

    Raises:
        StrategyRegistrationError: a registry could not be filled (the cause is chained).
    """
    global _filling
    with _lock:
        if _filling:  # our own imports while filling, or another thread filling: that call finishes the job
            return
        _filling = True
    try:
        # Checked again after each: filling one may import the other's Lightning module.
        while pending := [name for name, (module, _) in REGISTRIES.items()
                          if name not in _filled and module in sys.modules]:
            name = pending[0]
            try:
                REGISTRIES[name][1]()
            except Exception as exc:
                raise StrategyRegistrationError(
                    f"lightning_offload could not register its strategy names with the {name}'s registry, so "
                    f"strategy=\"lsp_offload\" and the others will not resolve: {type(exc).__name__}: {exc}"
                ) from exc
            _filled.add(name)
    finally:
        with _lock:
            _filling = False
    if len(_filled) == len(REGISTRIES):
        stop_watching()


def register_with_lightning() -> None:
    """Fill the registries whose Lightning module is already imported, and watch for the import of the others.

    Raises:
        StrategyRegistrationError: a registry of an imported Lightning could not be filled.
    """
    with _lock:
        if len(_filled) < len(REGISTRIES) and _FINDER not in sys.meta_path:
            # First, so the watched modules' specs come through here whatever other finders are installed.
            sys.meta_path.insert(0, _FINDER)
    register_loaded()


def stop_watching() -> None:
    """Take the finder off ``sys.meta_path`` (nothing is left to register, or the user wants no hook)."""
    with _lock:
        while _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


class _RegisteringLoader(importlib.abc.Loader):
    """A watched module's own loader, and :func:`register_loaded` once the outermost watched import has finished
    (a failed import registers nothing: the finder stays, and the next watched import to finish registers)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _watch.depth = getattr(_watch, "depth", 0) + 1
        try:
            self.loader.exec_module(module)
        finally:
            _watch.depth -= 1
            # Hand the module its own loader back: introspection and a reload see Lightning's import unchanged.
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        # Only after the outermost one: inside it Lightning (lightning.pytorch runs within lightning) or our module that
        # imported it is half initialized.
        if _watch.depth == 0:
            register_loaded()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _LightningWatcher(importlib.abc.MetaPathFinder):
    """Finds a watched module through the other finders and wraps its loader in :class:`_RegisteringLoader`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in WATCHED and not fullname.startswith(WATCHED_PREFIX):
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # a namespace package or an old-style loader: nothing runs that could be wrapped
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


_FINDER = _LightningWatcher()
