"""Which modules MEFT can put an adapter beside: those their parents call.

:func:`~lightning_offload.meft.injection.inject_meft` puts a wrapper (``MEFTFFN``: the target, then the adapter) in
each target's place. That is sound only where the model reaches the target by calling it. Some modules read their
children instead: ``nn.TransformerEncoderLayer``'s fused fast path (taken in evaluation) passes ``linear2.weight`` and
the other weights straight to one kernel, ``nn.MultiheadAttention`` hands ``out_proj.weight`` to its functional form,
``nn.TransformerEncoder`` reads its first layer's ``self_attn``. A wrapper there fails (it has no ``weight``), or, were
it to forward such reads, is bypassed: the adapter would train and then be silently left out. So such a target is
refused at injection, naming the module that reads it and what to target instead.

The rule, checked for every module above the target: its ``forward`` (and the methods of its own that ``forward``
calls) must not read an attribute of the target that a wrapper lacks (``self.linear2.weight``, or through a name bound
to ``self.layers[0]``). Sources that cannot be read (a compiled extension) are not checked, except torch's modules
above, which are known.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

#: torch's modules whose forward reads the named children's attributes (a fast path, or a functional form), kept here
#: too so the rule holds where their sources cannot be read.
KNOWN_READERS: dict[type[nn.Module], tuple[str, ...]] = {
    nn.MultiheadAttention: ("out_proj",),
    nn.TransformerEncoderLayer: ("self_attn", "linear1", "linear2", "norm1", "norm2"),
    nn.TransformerEncoder: ("layers.0",),
}

# What any module has, so a wrapper has it too: a parent may read these of its child.
_MODULE_ATTRIBUTES = frozenset(dir(nn.Module())) | {"ffn", "adapter"}


def unwrappable_reason(model: nn.Module, name: str) -> str | None:
    """Why the submodule ``name`` of ``model`` cannot be wrapped, or ``None`` when every module above it calls it.

    Args:
        model: the model.
        name: the qualified name of the would-be target.

    Returns:
        ``"<module name> (<class>) reads its <attributes> directly"`` for the nearest module above it that does, else
        ``None``.
    """
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner_name = ".".join(parts[:depth])
        owner = model.get_submodule(owner_name) if owner_name else model
        relative = ".".join(parts[depth:])
        read = sorted(attr for path, attr in _reads(type(owner)) if path == relative)
        if relative in KNOWN_READERS.get(type(owner), ()) and not read:
            read = ["weights or attributes"]
        if read:
            where = f"{owner_name!r}" if owner_name else "the model"
            how = " (in its fused fast path, or its functional form)" if type(owner) in KNOWN_READERS else ""
            return f"{where} ({type(owner).__name__}) reads its {', '.join(dict.fromkeys(read))} directly{how}"
    return None


def block_pattern(model: nn.Module, name: str) -> str | None:
    """A ``target_modules`` pattern for the nearest module above ``name`` that can be wrapped (its stack's indices as
    ``\\d+``, so it matches every block of the stack), or ``None`` when there is none below the model itself.
    Containers and attention modules (which return tuples, not hidden states) are passed over."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        block = ".".join(parts[:depth])
        if not isinstance(model.get_submodule(block), (nn.ModuleList, nn.ModuleDict, nn.MultiheadAttention)) \
                and unwrappable_reason(model, block) is None:
            return "^" + r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in parts[:depth]) + "$"
    return None


@functools.lru_cache(maxsize=None)
def _reads(cls: type[nn.Module]) -> frozenset[tuple[str, str]]:
    """``(path, attribute)`` of every read ``self.<path>.<attribute>`` in ``cls.forward`` and the methods of ``cls``
    it calls, where ``<attribute>`` is one a wrapper lacks; ``path`` is dotted, indices included (``layers.0``)."""
    found: set[tuple[str, str]] = set()
    seen: set[str] = set()
    pending = ["forward"]
    while pending:
        method = pending.pop()
        if method in seen:
            continue
        seen.add(method)
        tree = _parsed(getattr(cls, method, None))
        if tree is None:
            continue
        for path, attr, called in _attribute_reads(tree):
            if not path and called and callable(getattr(cls, attr, None)):
                pending.append(attr)  # a method of the module's own, run by its forward
            elif path and attr not in _MODULE_ATTRIBUTES:
                found.add((".".join(path), attr))
    return frozenset(found)


def _parsed(function: Callable[..., Any] | None) -> ast.AST | None:
    """The syntax tree of a Python function's source, or ``None`` (a builtin, a missing source, nn.Module's own)."""
    if function is None or getattr(function, "__qualname__", "").startswith("Module."):
        return None
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _attribute_reads(tree: ast.AST) -> Iterator[tuple[list[str], str, bool]]:
    """``(path, attribute, called)`` of each ``self.<path>.<attribute>`` in ``tree``: ``path`` through attributes and
    constant indices, and through local names bound to such an expression (``first = self.layers[0]``)."""
    aliases: dict[str, list[str]] = {}

    def path_of(node: ast.AST) -> list[str] | None:
        if isinstance(node, ast.Name):
            return [] if node.id == "self" else aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = path_of(node.value)
            return None if base is None else [*base, node.attr]
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            base = path_of(node.value)
            return None if base is None else [*base, str(node.slice.value)]
        return None

    calls = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = path_of(node.value)
            if path:
                aliases[node.targets[0].id] = path
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = path_of(node.value)
            if path is not None:
                yield path, node.attr, id(node) in calls


def check_target(model: nn.Module, name: str, target: nn.Module) -> None:
    """Refuse a target MEFT cannot put an adapter beside, naming why and what to target instead.

    Args:
        model: the model.
        name: the target's qualified name (a match of ``MEFTConfig.target_modules``).
        target: the module itself.

    Raises:
        ValueError: when a module above reads the target instead of calling it (the rule of this module), or the
            target is a Linear/Conv1D whose output size is not its input's (the adapter adds, to the output, what it
            computes from the input).
    """
    reason = unwrappable_reason(model, name)
    if reason is not None:
        block = block_pattern(model, name)
        instead = (f"target the block that holds it (the adapter then sits beside the whole block), e.g. "
                   f"target_modules=r'{block}', or " if block else "")
        raise ValueError(
            f"MEFT cannot put an adapter beside {name!r} ({type(target).__name__}): {reason} instead of calling it. "
            f"MEFT puts a wrapper in a target's place, so a target must be a module its parent calls, an FFN block "
            f"like LLaMA's or GPT-2's 'mlp': here the wrapper would fail, or be bypassed, the adapter silently left "
            f"out. Fix: {instead}write the FFN as a module of its own whose forward calls its layers, and target "
            f"that.")
    sizes = _linear_sizes(target)
    if sizes is not None and sizes[0] != sizes[1]:
        raise ValueError(
            f"MEFT cannot put an adapter beside {name!r}: the adapter adds to a target's output what it computes from "
            f"its input, so both must have the hidden size, but this {type(target).__name__} maps {sizes[0]} features "
            f"to {sizes[1]}. Target the whole FFN whose input and output are the hidden states (LLaMA's or GPT-2's "
            f"'mlp').")


def _linear_sizes(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` features of an ``nn.Linear`` or Hugging Face ``Conv1D`` (weight stored ``in × out``)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0]), int(module.nf)
    return None
