"""The public classes and constructors document every argument with its default, and show an example, so that
``help()`` is enough to use them.

Each argument (or dataclass field) with a default must have its own entry under ``Args:``/``Attributes:`` that says
``Default: ``<value>``.``, where ``<value>`` is the real default: a Python literal equal to it (``0.25``, ``"fp32"``,
``None``, ``()``) or, for a function, its name. Arguments without a default must have an entry too.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pydoc
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import lightning_offload as lo
from lightning_offload.setup.settings import PROJECTION_SETTINGS, OffloadSettings
from lightning_offload.setup.settings_docs import SETTINGS_MARKER

# Lightning's own plumbing, filled in by the Trainer: documented as a group, not one by one.
PLUMBING = {
    "accelerator", "checkpoint_io", "precision_plugin", "precision", "parallel_devices", "cluster_environment",
    "process_group_backend", "timeout", "start_method", "ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper",
    "model_averaging_period",
}
STRATEGIES = [lo.LSPOffloadStrategy, lo.ZeroOffloadStrategy, lo.LSPOffloadDDPStrategy, lo.ZeroOffloadDDPStrategy,
              lo.MEFTOffloadStrategy]
# These set projection=False themselves and take none of the projection settings.
NO_PROJECTION = {lo.ZeroOffloadStrategy, lo.ZeroOffloadDDPStrategy, lo.MEFTOffloadStrategy, lo.FabricZeroOffload,
                 lo.FabricZeroOffloadDDP, lo.FabricMEFTOffload}
DATACLASSES = [OffloadSettings, lo.MEFTConfig, lo.FitSettings, lo.RowAdamSettings, lo.RefitRecord, lo.ProjectorFitting]
FABRIC_STRATEGIES = [lo.FabricOffload, lo.FabricZeroOffload, lo.FabricMEFTOffload, lo.FabricOffloadDDP,
                     lo.FabricZeroOffloadDDP]
CLASSES = [lo.ProjectorRefit, lo.SparseProjector, lo.BlockRowAdam, lo.OffloadOptimizer, lo.MEFTAdapter,
           *FABRIC_STRATEGIES]
FUNCTIONS = [lo.inject_meft, lo.random_projector, lo.signed_permutation_projector, lo.offload, lo.plan, lo.choose]
PUBLIC = STRATEGIES + DATACLASSES + CLASSES + FUNCTIONS

_SECTION = re.compile(r"(Args|Arguments|Attributes):")
_ENTRY = re.compile(r"(\*{0,2}\w+(?:, \*{0,2}\w+)*)(?: \([^)]*\))?:(?: (.*))?$")
_DEFAULT = re.compile(r"Default: ``(.+?)``")


def _entries(doc: str) -> dict[str, str]:
    """Each name under the ``Args:``/``Attributes:`` sections mapped to its entry's text (joined lines)."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent: int | None = None
    in_section = False
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if _SECTION.fullmatch(stripped):
            in_section, indent, current = True, None, None
            continue
        if not in_section:
            continue
        lead = len(line) - len(line.lstrip())
        if not stripped or (indent is not None and lead < indent):
            in_section, current = False, None
            continue
        if indent is None:
            indent = lead
        if lead == indent:
            match = _ENTRY.match(stripped)
            current = None
            if match:
                current = [match.group(2) or ""]
                for name in match.group(1).split(", "):
                    entries[name.lstrip("*")] = current
        elif current is not None:
            current.append(stripped)
    return {name: " ".join(text) for name, text in entries.items()}


def _example(doc: str) -> str:
    """The code of the ``Example::`` block, dedented."""
    lines = inspect.cleandoc(doc).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Example::")
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip()


def _own_parameters(obj: Any) -> dict[str, Any]:
    """Named parameters of a function, or of the ``__init__`` of a class and of the package's classes it forwards
    ``**kwargs`` to: name → default (``inspect.Parameter.empty`` when required)."""
    if inspect.isclass(obj) and "__signature__" in vars(obj):  # the signature it shows help() (settings included)
        return {name: param.default for name, param in inspect.signature(obj).parameters.items()
                if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL) and name not in PLUMBING}
    if not inspect.isclass(obj):
        functions = [obj]
    else:
        functions = [vars(c)["__init__"] for c in obj.__mro__
                     if "__init__" in vars(c) and c.__module__.startswith("lightning_offload")]
    params: dict[str, Any] = {}
    for function in functions:
        forwards = False
        for name, param in inspect.signature(function).parameters.items():
            forwards = forwards or param.kind == param.VAR_KEYWORD
            if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or name in PLUMBING:
                continue
            params.setdefault(name, param.default)
        if not forwards:
            break  # a constructor that names all it takes: its bases' arguments are not the caller's
    return params


def documented_parameters(obj: Any) -> dict[str, Any]:
    """What ``obj``'s docstring must document: name → default (``inspect.Parameter.empty`` when required)."""
    if dataclasses.is_dataclass(obj):
        params = {}
        for field in dataclasses.fields(obj):
            if field.default is not dataclasses.MISSING:
                params[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                params[field.name] = field.default_factory()
            else:
                params[field.name] = inspect.Parameter.empty
        return params
    params = _own_parameters(obj)
    if obj in NO_PROJECTION:
        for name in ("projection", *PROJECTION_SETTINGS):  # refused there, so not documented as arguments
            params.pop(name, None)
    return params


def _same(text: str, default: Any) -> bool:
    """Whether the docstring's ``Default: ``text``.`` states ``default``."""
    if inspect.isfunction(default):
        return text.rsplit(".", 1)[-1] == default.__name__
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return type(value) is type(default) and value == default


def missing_defaults(obj: Any) -> list[str]:
    """The problems with ``obj``'s documented arguments, one line each (empty: none)."""
    entries = _entries(obj.__doc__ or "")
    problems = []
    for name, default in documented_parameters(obj).items():
        if name not in entries:
            problems.append(f"{name}: no entry under Args/Attributes")
        elif default is not inspect.Parameter.empty:
            stated = _DEFAULT.findall(entries[name])
            if not stated:
                problems.append(f"{name}: the entry states no 'Default: ``{default!r}``'")
            elif not _same(stated[0], default):
                problems.append(f"{name}: documented default ``{stated[0]}``, real default {default!r}")
    return problems


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_every_argument_is_documented_with_its_default(obj: Any) -> None:
    problems = missing_defaults(obj)
    assert not problems, f"{obj.__name__}'s docstring:\n" + "\n".join(problems)


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_docstring_has_a_short_example_that_parses(obj: Any) -> None:
    doc = obj.__doc__ or ""
    assert "Example::" in doc, f"{obj.__name__} has no Example:: block"
    code = _example(doc)
    lines = [line for line in code.splitlines() if line.strip()]
    assert 2 <= len(lines) <= 8, f"{obj.__name__}'s example has {len(lines)} lines"
    compile(code, f"<{obj.__name__} example>", "exec")


@pytest.mark.parametrize("obj", STRATEGIES, ids=lambda obj: obj.__name__)
def test_strategy_registry_description_is_the_first_line(obj: Any) -> None:
    # The registries describe each name by its class's first docstring line (registries.register).
    assert obj.__doc__.splitlines()[0].strip()


def test_a_missing_or_wrong_default_is_caught() -> None:
    # The check itself: drop or change one documented default and it must complain.
    doc = lo.ProjectorRefit.__doc__
    assert "Default: ``500``." in doc

    class Dropped(lo.ProjectorRefit):
        __doc__ = doc.replace("Default: ``500``.", "", 1)

    class Wrong(lo.ProjectorRefit):
        __doc__ = doc.replace("Default: ``500``.", "Default: ``200``.", 1)

    assert any(p.startswith("refit_every: the entry states no") for p in missing_defaults(Dropped))
    assert any(p.startswith("refit_every: documented default ``200``") for p in missing_defaults(Wrong))
    assert not missing_defaults(lo.ProjectorRefit)


def test_entries_parser_reads_grouped_and_wrapped_entries() -> None:
    doc = """Summary.

    Args:
        a, b: first and second. Default: ``1``.
        c: a long entry
            that wraps. Default: ``"x"``.

    Returns:
        nothing: at all.
    """
    entries = _entries(doc)
    assert entries["a"] == entries["b"] == "first and second. Default: ``1``."
    assert entries["c"] == 'a long entry that wraps. Default: ``"x"``.'
    assert "nothing" not in entries


def _registered_strategies() -> list[type]:
    """Every strategy class this package registers, in Lightning's Trainer and Fabric registries (the classes of the
    faces' bases, which the names build with their presets)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    names = ("lsp_offload", "zero_offload", "meft_offload", "lsp_offload_ddp", "zero_offload_ddp")
    trainer = [StrategyRegistry[name]["strategy"] for name in names]
    fabric = [STRATEGY_REGISTRY[name]["strategy"] for name in names if name in STRATEGY_REGISTRY]
    return trainer + fabric


def test_help_of_every_face_lists_its_settings_with_defaults() -> None:
    # Written once (OffloadSettings), shown by every face: help() gives each setting the face takes by name, with its
    # default in the signature and its entry under Args; the registered classes and their preset classes alike.
    registered = _registered_strategies()
    assert len(registered) == 10 and len(set(registered)) == 6
    for cls in dict.fromkeys([*registered, *STRATEGIES, *FABRIC_STRATEGIES, lo.offload]):  # the loop face's too
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        signature = inspect.signature(cls)
        fields = {f.name: f.default for f in dataclasses.fields(OffloadSettings)}
        # The settings its docstring lists are exactly those its constructor takes.
        assert set(cls.offload_setting_names) == set(signature.parameters) & set(fields), cls.__name__
        assert {"seed", "pipelined", "link_dtype", "embeddings", "head"} <= set(cls.offload_setting_names)
        assert (cls in NO_PROJECTION) != ({"rank", "density", "projectors"} <= set(cls.offload_setting_names))
        loop = cls.__module__ == "lightning_offload.faces.fabric" or cls is lo.offload
        assert loop != ("log_telemetry" in cls.offload_setting_names)
        if inspect.isclass(cls):  # what tools that read the constructor itself see (LightningCLI's parser)
            assert list(inspect.signature(cls.__init__).parameters)[1:] == list(signature.parameters), cls.__name__
        for name in cls.offload_setting_names:
            default = fields[name]
            assert signature.parameters[name].default == default, f"{cls.__name__}: {name}'s default"
            shown = f"<function {default.__name__}" if inspect.isfunction(default) else repr(default)
            pattern = rf"\b{name}(?:: (?:'[^']*'|\"[^\"]*\"))? = {re.escape(shown)}"
            assert re.search(pattern, text), f"{cls.__name__}'s help() does not show {name}={shown}"
        assert not missing_defaults(cls), f"{cls.__name__}: {missing_defaults(cls)}"
        assert SETTINGS_MARKER not in text


def test_a_face_without_the_marker_is_refused() -> None:
    from lightning_offload.setup.settings_docs import documents_settings

    class Face:
        """A face.

        Args:
            device: where. Default: ``None``.
        """

    with pytest.raises(ValueError, match="no '<offload settings>' line"):
        documents_settings()(Face)


def _readme_settings_rows() -> dict[str, str]:
    """The README's settings table: each setting named in a row's first cell mapped to the row's default cell."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| setting | default | meaning |"):].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        defaults = re.findall(r"`([^`]+)`", cells[1]) or ["—"]
        for i, name in enumerate(re.findall(r"`(\w+)`", cells[0])):
            rows[name] = defaults[min(i, len(defaults) - 1)]
    return rows


def test_the_readme_settings_table_matches_the_settings() -> None:
    # The table is the user's first view of OffloadSettings: every setting a strategy takes (projection is implied by
    # the strategy's name), each literal default as the field's (None is resolved per strategy in the table).
    rows = _readme_settings_rows()
    fields = {f.name: f.default for f in dataclasses.fields(OffloadSettings)}
    assert set(rows) == set(fields) - {"projection"}, "README settings table and OffloadSettings differ"
    for name, text in rows.items():
        try:
            stated = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue  # described in words ("seeded random", "—")
        if fields[name] is not None:
            assert stated == fields[name], f"README: {name}'s default is {text}, OffloadSettings says {fields[name]!r}"
