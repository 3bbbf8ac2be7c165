"""The offload settings as every face shows them, written once (in :class:`OffloadSettings`' docstring and fields).

A face's strategy class marks where its docstring lists the settings with a line holding only
:data:`SETTINGS_MARKER` under ``Args:``; :func:`documents_settings` puts there each setting's entry from
:class:`OffloadSettings` (its text and default). A face that takes the settings as ``**settings`` (Fabric's strategies)
also gets a signature that names each one with its default, so ``help()`` and :func:`inspect.signature` show them as
they show a face with explicit keyword arguments (the Trainer strategies, whose defaults are checked against the
fields by tests/test_docstrings.py). The names a face takes are its class's ``offload_setting_names``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from lightning_offload.setup.settings import PROJECTION_SETTINGS, OffloadSettings

#: The settings a face without projection (``zero_offload``, ``meft_offload``) does not take.
NOT_WITHOUT_PROJECTION = ("projection", *PROJECTION_SETTINGS)
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


def render_settings(indent: str, exclude: Collection[str] = ()) -> str:
    """The entries of every setting but ``exclude``, in field order, each line prefixed by ``indent``."""
    entries = setting_entries()
    missing = [f.name for f in dataclasses.fields(OffloadSettings) if f.name not in entries]
    if missing:
        raise RuntimeError(f"OffloadSettings documents no entry for {missing} (its Attributes: section).")
    return "\n".join(indent + line for f in dataclasses.fields(OffloadSettings) if f.name not in exclude
                     for line in entries[f.name])


def documents_settings(exclude: Collection[str] = (), signature: bool = False) -> Callable[[_Face], _Face]:
    """A decorator of a face's class or function: the :data:`SETTINGS_MARKER` line of its docstring becomes the entries
    of the settings it takes (all but ``exclude``); with ``signature`` (a constructor or function taking them as
    ``**settings``), its signature names each one, keyword-only, with its default.

    Raises:
        ValueError: when the docstring has no marker line.
    """

    def document(face: _Face) -> _Face:
        doc = face.__doc__ or ""
        marker = next((line for line in doc.splitlines() if line.strip() == SETTINGS_MARKER), None)
        if marker is None:
            raise ValueError(f"{face.__name__}'s docstring has no {SETTINGS_MARKER!r} line under Args: to list the "
                             f"offload settings at.")
        indent = marker[: len(marker) - len(marker.lstrip())]
        face.__doc__ = doc.replace(marker, render_settings(indent, exclude), 1)
        # Which settings the face takes, for readers (and tests/test_docstrings.py, which checks its signature).
        taken = tuple(f.name for f in dataclasses.fields(OffloadSettings) if f.name not in exclude)
        face.offload_setting_names = taken  # type: ignore[attr-defined]
        if signature:
            face.__signature__ = _with_settings(face, exclude)  # type: ignore[attr-defined]
        return face

    return document


def _with_settings(face: Any, exclude: Collection[str]) -> inspect.Signature:
    """The signature of ``face`` (a function, or a class's constructor) as a caller sees it: its own parameters and,
    for a class, those of the constructors it forwards ``**kwargs`` to (this package's), then the settings (but
    ``exclude``), keyword-only, with :class:`OffloadSettings`' defaults and types."""
    parameters: dict[str, inspect.Parameter] = {}
    functions = [vars(owner).get("__init__") for owner in face.__mro__
                 if owner.__module__.startswith("lightning_offload")] if inspect.isclass(face) else [face]
    for function in filter(None, functions):
        forwards = False
        for name, parameter in inspect.signature(function).parameters.items():
            forwards = forwards or parameter.kind is inspect.Parameter.VAR_KEYWORD
            if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD:
                parameters.setdefault(name, parameter)
        if not forwards:
            break  # a constructor that names all it takes: its bases' parameters are not the caller's
    settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in dataclasses.fields(OffloadSettings) if f.name not in exclude and f.name not in parameters]
    # Positional parameters first, as a signature must order them (a base's come after a subclass's keywords).
    ordered = sorted(parameters.values(), key=lambda p: p.kind is inspect.Parameter.KEYWORD_ONLY)
    returns = inspect.signature(face).return_annotation if not inspect.isclass(face) else inspect.Signature.empty
    return inspect.Signature(ordered + settings, return_annotation=returns)
