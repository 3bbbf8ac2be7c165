"""MEFT adapters leaving the model: unload (the base as it was loaded), save the adapters alone, load them into a
freshly loaded base, as PEFT users expect of adapters.

Example::

    save_meft_adapters(model, "adapters.pt")           # keys, values, routers, input statistics and the config
    unload_meft(model).save_pretrained("base")         # the base, bit for bit as loaded
    model = LlamaForCausalLM.from_pretrained("base")
    load_meft_adapters(model, "adapters.pt")           # the trained model again: the same logits
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_offload.meft.injection import MEFTFFN, MEFTInjection, inject_meft, replace_submodule
from lightning_offload.meft.config import MEFTConfig

#: The layout of an adapters file; a file of another is refused.
ADAPTERS_FORMAT = 1


def _injection(model: nn.Module) -> MEFTInjection:
    injection = model.__dict__.get("_meft_injection")
    if injection is None:
        raise ValueError("This model has no MEFT adapters (inject_meft was not called on it).")
    return injection


def meft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' state only (host keys and values, routers, input statistics), by qualified name."""
    _injection(model)
    return {f"{name}.{key}": value for name, module in model.named_modules() if isinstance(module, MEFTFFN)
            for key, value in module.adapter.state_dict().items()}


def save_meft_adapters(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Writes the adapters and their config to ``path`` (written beside it, then renamed: never half-written)."""
    injection = _injection(model)
    payload = {"format": ADAPTERS_FORMAT, "config": dataclasses.asdict(injection.config),
               "ffn_names": injection.ffn_names,
               "adapters": {k: v.detach().cpu().clone() for k, v in meft_state_dict(model).items()}}
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, target)


def load_meft_adapters(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Puts the saved adapters beside ``model``'s FFNs (injecting them with the saved config first when the model
    has none) and loads their state; returns ``model``.

    Raises:
        ValueError: for a file of another format, or adapters whose FFNs this model does not have.
    """
    payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != ADAPTERS_FORMAT:
        raise ValueError(f"{path} is not a MEFT adapters file of format {ADAPTERS_FORMAT} "
                         f"(save one with lightning_offload.save_meft_adapters).")
    if "_meft_injection" not in model.__dict__:
        inject_meft(model, MEFTConfig(**payload["config"]))
    names = _injection(model).ffn_names
    if names != payload["ffn_names"]:
        raise ValueError(f"The adapters in {path} sit beside {payload['ffn_names'][:2]}… "
                         f"({len(payload['ffn_names'])} FFNs), this model's beside {names[:2]}… ({len(names)}).")
    for name in names:
        adapter = model.get_submodule(name).adapter
        prefix = f"{name}."
        adapter.load_state_dict({k[len(prefix):]: v for k, v in payload["adapters"].items() if k.startswith(prefix)})
    return model


def unload_meft(model: nn.Module) -> nn.Module:
    """Removes every adapter and gives the base model back as it was before :func:`inject_meft`: its FFN modules,
    its parameters' ``requires_grad``, its ``save_pretrained``. Returns ``model`` (changed in place)."""
    injection = _injection(model)
    for name in injection.ffn_names:
        wrapper = model.get_submodule(name)
        replace_submodule(model, name, wrapper.ffn)
    injection.mask_hook.remove()
    for name, param in model.named_parameters():
        param.requires_grad_(injection.requires_grad.get(name, param.requires_grad))
    model.__dict__.pop("save_pretrained", None)
    if injection.instance_save_pretrained is not None:
        model.__dict__["save_pretrained"] = injection.instance_save_pretrained
    del model.__dict__["_meft_injection"]
    return model
