"""Command-line overrides checked before Hydra composes them, where Hydra's own error would not name the fix.

A misspelt strategy setting given without ``+`` (``offload.strategy.rnak=0.1``) stops in Hydra's composition with
"Key 'rnak' is not in struct" and a suggestion to append it with ``+``, which would only move the error to the
strategy's constructor. Checked here first, it is refused naming the closest setting an offload strategy takes.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Sequence

from lightning_offload.registries import trainer_names

# ``offload.strategy.<setting>=value``, with or without Hydra's ``+``/``++`` (a deeper key's first part is checked).
_STRATEGY_SETTING = re.compile(r"^\+{0,2}offload\.strategy\.([A-Za-z_][A-Za-z0-9_]*)(?:[.=]|$)")


def strategy_settings() -> list[str]:
    """Every setting an offload strategy of the command line takes (its ``offload.strategy`` keys)."""
    names = {"_target_"}
    for entry in trainer_names():  # each name's class and its preset class: their signatures show every setting
        names.update(inspect.signature(entry.cls).parameters, inspect.signature(entry.public).parameters)
    return sorted(names)


def refuse_unknown_strategy_settings(overrides: Sequence[str]) -> None:
    """Refuse an ``offload.strategy.<setting>=`` override whose setting no offload strategy takes.

    Raises:
        SystemExit: naming the setting, the closest known one, and the known ones.
    """
    known = strategy_settings()
    for override in overrides:
        match = _STRATEGY_SETTING.match(override)
        if match is None or match.group(1) in known:
            continue
        name = match.group(1)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean offload.strategy.{close[0]}=?" if close else ""
        raise SystemExit(f"lightning-offload-train: {override}: no offload strategy has a setting {name}=.{hint} "
                         f"The strategies' settings: {', '.join(name for name in known if not name.startswith('_'))}.")
