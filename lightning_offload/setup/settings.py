"""The offload settings as the faces take them: :class:`OffloadSettings` (one frozen value, at the engine's floor, which
takes it whole), the one table of what each strategy name presets (:data:`PRESETS`), and the refusal of a setting a
face does not take, naming the fix. The registries, every face, the planner and the CLI read the names from here.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import fields
from typing import Any

from lightning_offload.engine.settings import (  # noqa: F401  (re-exported: the settings' import path)
    NON_FINITE_POLICIES, PROJECTED_ONLY_SETTINGS, PROJECTION_SETTINGS, PROJECTOR_KINDS, SCALED_ONLY_SETTINGS,
    UPDATE_RULES, NonFinitePolicy, OffloadSettings)

#: ``zero_offload`` is ``lsp_offload`` without projection (the ZeRO-Offload-style baseline); ``meft_offload`` trains
#: its adapters beside the same dense offload.
WITHOUT_PROJECTION: Mapping[str, Any] = {"projection": False}
#: Each strategy name and the settings it presets, as Lightning's own presets pass a class's init arguments
#: (``deepspeed_stage_2_offload``: ``stage=2, offload_optimizer=True``). A face built under a name takes every other
#: setting (without projection, none of the projection ones); a ``_ddp`` name is its single-device preset on the face's
#: data-parallel base.
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "lsp_offload": {}, "zero_offload": WITHOUT_PROJECTION, "meft_offload": WITHOUT_PROJECTION,
    "lsp_offload_ddp": {}, "zero_offload_ddp": WITHOUT_PROJECTION,
}


def data_parallel_form(name: str) -> str | None:
    """The name of ``name``'s form on several devices (``lsp_offload_ddp``), or ``None`` when it has none."""
    form = f"{name}_ddp"
    return form if form in PRESETS else None


def preset_name(names: Iterable[str], settings: OffloadSettings) -> str:
    """Which of ``names`` (a face class's presets) ``settings`` are: the one presetting the most of them
    (``lsp_offload`` presets nothing, so it is the last resort)."""
    names = list(names)
    matching = [n for n in names if all(getattr(settings, k) == v for k, v in PRESETS[n].items())] or names
    return max(matching, key=lambda n: len(PRESETS[n]))


def taken_settings(preset: Mapping[str, Any], exclude: Collection[str] = ()) -> tuple[str, ...]:
    """The settings a face under ``preset`` takes by name, in field order: all but what the preset sets, the projection
    ones where it turns projection off, and ``exclude``."""
    dropped = {*preset, *exclude, *(() if preset.get("projection", True) else PROJECTION_SETTINGS)}
    return tuple(f.name for f in fields(OffloadSettings) if f.name not in dropped)


def face_settings(owner: str, given: Mapping[str, Any], preset: Mapping[str, Any], exclude: Collection[str] = (),
                  face_names: Iterable[str] = (), refused: Mapping[str, str] | None = None) -> OffloadSettings:
    """The settings value of a face (a strategy class, ``offload()``, ``plan()``) under ``preset``, from the settings
    the user gave it by name: anything it does not take refused, naming the fix, then validated.

    Args:
        owner: what the settings are given to, for messages.
        given: the settings as the user passed them.
        preset: what the face's strategy name sets itself (:data:`PRESETS`); given again with that value, accepted.
        exclude: settings this face does not take beyond those (a DDP base: the scaled rule's).
        face_names: the face's own keyword arguments besides these (named in the suggestions).
        refused: settings the face refuses with its reason (a loop of one's own: ``log_telemetry``).

    Raises:
        TypeError: for an unknown setting. ValueError: for one that does not apply, or a bad value.
    """
    for name, reason in (refused or {}).items():
        if name in given:
            raise ValueError(f"{owner} does not take {name}=: {reason}")
    taken = taken_settings(preset, exclude)
    unknown = {n: v for n, v in given.items() if n not in taken and not (n in preset and v == preset[n])}
    refuse_unknown_settings(owner, unknown, (*taken, *face_names), projects=bool(preset.get("projection", True)))
    return OffloadSettings(**{**given, **preset})


def refuse_unknown_settings(owner: str, unknown: Mapping[str, Any], known: Iterable[str],
                            projects: bool = True) -> None:
    """Refuse settings ``owner`` does not take, naming the closest one it does, or a projection setting given at all
    where nothing is projected (the user expects it to do something).

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
        itself = f", which sets {'it' if len(inapplicable) == 1 else 'projection'} itself" \
            if "projection" in inapplicable else ""
        raise ValueError(f"{shown}: nothing is projected without projection (zero_offload, meft_offload), so "
                         f"{'this setting does' if len(inapplicable) == 1 else 'these settings do'} not apply to "
                         f"{owner}{itself}. Remove {'it' if len(inapplicable) == 1 else 'them'}, or use "
                         f"strategy='lsp_offload' to project.")
    name, known = names[0], sorted(set(known))
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]}=?" if close else ""
    raise TypeError(f"{owner} got an unknown setting {name}=.{hint} Its settings: {', '.join(known)}.")
