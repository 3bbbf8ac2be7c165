"""The offload settings as every face shows and takes them, written once (in :class:`OffloadSettings`' docstring and
fields), and the strategy classes built on them.

A face's docstring marks where its settings go with a line holding only :data:`SETTINGS_MARKER` under ``Args:``; it
becomes each setting's entry from :class:`OffloadSettings` (its text and default). A face takes its settings as
``**settings``, and its signature names each one, keyword-only, with its default, so ``help()``,
:func:`inspect.signature` and tools that read a constructor's signature (LightningCLI) show them as explicit keyword
arguments would. Strategy classes get all this from their metaclass, :class:`FaceClass`; ``offload()`` from
:func:`documents_settings`. The names a face takes are its ``offload_setting_names``.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABCMeta
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from lightning_offload.setup.settings import PRESETS, OffloadSettings, face_settings, preset_name, taken_settings

#: The line of a face's docstring (under ``Args:``) that becomes the entries of its settings.
SETTINGS_MARKER = "<offload settings>"

_Face = TypeVar("_Face")  # a strategy class, or a face's function (``offload``)


def setting_entries() -> dict[str, list[str]]:
    """Each setting's entry in :class:`OffloadSettings`' ``Attributes:`` section: its lines, the first one starting
    with ``name:``, relative indentation kept (continuations indented by four spaces)."""
    lines = inspect.cleandoc(OffloadSettings.__doc__ or "").splitlines()
    start = lines.index("Attributes:") + 1
    entries: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines[start:]:
        if not line.strip() or not line.startswith("    "):
            break
        if not line.startswith("        "):  # an entry's first line: "    name: text"
            current = entries.setdefault(line.strip().split(":", 1)[0], [])
        current.append(line[4:])
    return entries


def render_settings(indent: str, names: Collection[str]) -> str:
    """The entries of the settings ``names``, in field order, each line prefixed by ``indent``."""
    entries = setting_entries()
    missing = [f.name for f in dataclasses.fields(OffloadSettings) if f.name not in entries]
    if missing:
        raise RuntimeError(f"OffloadSettings documents no entry for {missing} (its Attributes: section).")
    return "\n".join(indent + line for f in dataclasses.fields(OffloadSettings) if f.name in names
                     for line in entries[f.name])


def _document(face: Any, doc: str, names: Collection[str]) -> None:
    """``face``'s docstring from ``doc``, its :data:`SETTINGS_MARKER` line the entries of ``names``.

    Raises:
        ValueError: when ``doc`` has no marker line.
    """
    marker = next((line for line in doc.splitlines() if line.strip() == SETTINGS_MARKER), None)
    if marker is None:
        raise ValueError(f"{face.__name__}'s docstring has no {SETTINGS_MARKER!r} line under Args: to list the "
                         f"offload settings at.")
    face.__doc__ = doc.replace(marker, render_settings(marker[: len(marker) - len(marker.lstrip())], names), 1)
    face.offload_setting_names = tuple(names)  # which settings it takes, for readers and tests/test_docstrings.py


def _signature(face: Any, names: Collection[str]) -> inspect.Signature:
    """The signature of ``face`` (a function, or a class's constructor) as a caller sees it: its own parameters and,
    for a class, those of the constructors it forwards ``**kwargs`` to (this package's), then the settings ``names``,
    keyword-only, with :class:`OffloadSettings`' defaults and types."""
    parameters: dict[str, inspect.Parameter] = {}
    functions = [vars(owner).get("__init__") for owner in face.__mro__
                 if owner.__module__.startswith("lightning_offload")] if inspect.isclass(face) else [face]
    for function in filter(None, functions):
        forwards = False
        own = vars(function).get("own_signature") or inspect.signature(function)  # before a face class set its own
        for name, parameter in own.parameters.items():
            forwards = forwards or parameter.kind is inspect.Parameter.VAR_KEYWORD
            if name != "self" and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                parameters.setdefault(name, parameter)
        if not forwards:
            break  # a constructor that names all it takes: its bases' parameters are not the caller's
    settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in dataclasses.fields(OffloadSettings) if f.name in names and f.name not in parameters]
    # Positional parameters first, as a signature must order them (a base's come after a subclass's keywords).
    ordered = sorted(parameters.values(), key=lambda p: p.kind is inspect.Parameter.KEYWORD_ONLY)
    returns = inspect.signature(face).return_annotation if not inspect.isclass(face) else inspect.Signature.empty
    return inspect.Signature(ordered + settings, return_annotation=returns)


def documents_settings(exclude: Collection[str] = ()) -> Callable[[_Face], _Face]:
    """A decorator of a face's function taking the settings as ``**settings`` (``offload``): its docstring's
    :data:`SETTINGS_MARKER` line becomes the entries of the settings it takes (all but ``exclude``), and its signature
    names each one, keyword-only, with its default.

    Raises:
        ValueError: when the docstring has no marker line.
    """

    def document(face: _Face) -> _Face:
        names = taken_settings({}, exclude)
        _document(face, face.__doc__ or "", names)
        face.__signature__ = _signature(face, names)  # type: ignore[attr-defined]
        return face

    return document


def _args_section(doc: str) -> str:
    """The ``Args:`` section of ``doc`` as written (its lines up to the first blank one), or ``""``."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return ""
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start:end])


class FaceClass(ABCMeta):
    """The metaclass of the faces' strategy classes (the Trainer's and Fabric's): each takes the settings its names
    preset allows (:data:`~lightning_offload.setup.settings.PRESETS`), as ``**settings`` that its signature and
    ``help()`` show one by one, generated from :class:`OffloadSettings`.

    A class states the strategy names it stands for (``presets``; one name: that name's preset is its own) and the
    settings it never takes (``excluded_settings``, and ``refused_settings`` with the reason its error gives). A class
    statement with ``preset="zero_offload"`` makes a *preset class*: its base under that name's settings, as Lightning's
    registries build a preset (``strategy="zero_offload"`` builds the base with ``projection=False``), and
    ``isinstance`` takes such a base instance as one of it.
    """

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], preset: str | None = None,
                **kwargs: Any) -> FaceClass:
        if preset is not None:
            namespace.update(presets=(preset,), preset_of=bases[0])
            if "__init__" not in namespace:  # its own constructor, to carry its own signature
                namespace["__init__"] = _forwarding_init(bases[0], f"{namespace['__qualname__']}.__init__")
        cls = super().__new__(mcs, name, bases, namespace, **kwargs)
        presets = getattr(cls, "presets", ())
        if not presets:
            return cls  # a class of the machinery below the faces' classes
        missing = [n for n in presets if n not in PRESETS]
        if missing:
            raise ValueError(f"{name}: {missing} are not strategy names of the preset table (setup/settings.py).")
        cls.strategy_name = presets[0]  # the class's own name; an instance's says which preset its settings are
        cls.preset_settings = PRESETS[presets[0]] if len(presets) == 1 else {}
        cls.excluded_settings = tuple(getattr(cls, "excluded_settings", ()))
        cls.refused_settings = dict(getattr(cls, "refused_settings", {}))
        names = taken_settings(cls.preset_settings, (*cls.excluded_settings, *cls.refused_settings))
        cls.offload_setting_names = names
        template = namespace.get("__doc__") or ""
        if preset is not None and "Args:" not in template:  # the base's arguments, this name's settings
            base = vars(bases[0]).get("doc_template", "")
            example = next((line for line in template.splitlines() if line.strip() == "Example::"), None)
            args = _args_section(base)
            template = template.replace(example, f"{args}\n\n{example}", 1) if example else f"{template}\n\n{args}"
        cls.doc_template = template
        if SETTINGS_MARKER in template:
            _document(cls, template, names)
        signature = _signature(cls, names)
        cls.__signature__ = signature
        cls.face_parameter_names = tuple(p for p in signature.parameters if p not in names)
        init = vars(cls).get("__init__")
        if init is not None:  # tools that read the constructor itself (LightningCLI's parser) see the same
            init.own_signature = inspect.signature(init)
            self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            init.__signature__ = signature.replace(parameters=[self, *signature.parameters.values()])
        return cls

    def __instancecheck__(cls, instance: Any) -> bool:
        if super().__instancecheck__(instance):
            return True
        base = vars(cls).get("preset_of")
        return base is not None and type(instance) is base and instance.strategy_name == cls.strategy_name

    def settings_from(cls, given: Mapping[str, Any]) -> OffloadSettings:
        """The settings value of ``cls`` from the settings a user gave its constructor by name.

        Raises:
            TypeError: for an unknown setting (naming the closest one). ValueError: for one that does not apply here
                (its preset's, or excluded), or a bad value.
        """
        return face_settings(cls.__name__, given, cls.preset_settings, cls.excluded_settings, cls.face_parameter_names,
                             cls.refused_settings)

    def name_for(cls, settings: OffloadSettings) -> str:
        """The strategy name an instance of ``cls`` with ``settings`` goes by (``zero_offload`` for the base under
        ``projection=False``)."""
        return preset_name(cls.presets, settings)


def _forwarding_init(base: type, qualname: str) -> Callable[..., None]:
    """A preset class's constructor: its base's, under a signature of its own."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)

    __init__.__qualname__ = qualname
    return __init__
