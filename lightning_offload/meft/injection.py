"""Putting MEFT adapters into a model: one beside every matching FFN (:func:`inject_meft`), what was changed kept on
the model so it can be given back (:class:`MEFTInjection`), and finding the adapters again (:func:`meft_adapters`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_offload.meft.adapter import MEFTAdapter
from lightning_offload.meft.config import MEFTConfig
from lightning_offload.meft.target_checks import check_target


class MEFTFFN(nn.Module):
    """An FFN with its MEFT adapter beside it: ``ffn(h) + adapter(h)``."""

    def __init__(self, ffn: nn.Module, adapter: MEFTAdapter) -> None:
        super().__init__()
        self.ffn = ffn
        self.adapter = adapter

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The FFN's output plus the adapter's."""
        fetch = self.adapter.prefetch(hidden)  # rows are gathered on the host while the FFN computes
        return self.ffn(hidden, *args, **kwargs) + self.adapter.mix(hidden, fetch)


def ffn_hidden_size(ffn: nn.Module) -> int:
    """The hidden size an FFN reads and writes (LLaMA and GPT-2 MLPs, or anything whose first Linear reads it)."""
    if hasattr(ffn, "hidden_size"):  # LlamaMLP
        return int(ffn.hidden_size)
    config = getattr(ffn, "config", None)
    if config is not None and hasattr(config, "hidden_size"):
        return int(config.hidden_size)
    first = next((m for m in ffn.modules() if isinstance(m, nn.Linear)), None)
    if first is not None:
        return first.in_features
    conv = next((m for m in ffn.modules() if type(m).__name__ == "Conv1D"), None)
    if conv is not None:
        return int(conv.weight.shape[0])  # HF Conv1D stores [in, out]
    raise TypeError(f"Cannot tell the hidden size of {type(ffn).__name__}; MEFT supports LLaMA and GPT-2 MLPs.")


def find_ffns(model: nn.Module, target_modules: str) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module whose name matches ``target_modules`` (``re.search``).

    Raises:
        ValueError: If nothing matches.
    """
    pattern = re.compile(target_modules)
    targets = [(name, module) for name, module in model.named_modules() if name and pattern.search(name)]
    if not targets:
        raise ValueError(f"target_modules={target_modules!r} matches no module of {type(model).__name__}; LLaMA "
                         f"and GPT-2 FFNs are named like 'model.layers.0.mlp'.")
    return targets


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Puts ``new`` where the submodule ``name`` was, on the device of the module it replaces."""
    param = next(model.get_submodule(name).parameters(), None)
    if param is not None:
        new.to(param.device)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def inject_meft(model: nn.Module, config: MEFTConfig) -> list[MEFTAdapter]:
    """Puts a MEFT adapter beside every FFN whose name matches ``config.target_modules``.

    The base model is frozen when ``config.freeze_base`` (the default); adapters' routers are the only new device
    parameters. A forward pre-hook on ``model`` hands its ``attention_mask`` to the adapters, so padding never
    routes. Returns the adapters in module order.

    Args:
        model: the base model (a Hugging Face LLaMA or GPT-2 model, or anything whose FFNs match); changed in place.
        config: the adapters' settings; ``MEFTConfig()`` for its defaults.

    Raises:
        ValueError: If no module matches, the model already has adapters, or a match cannot have an adapter beside
            it: a module above it reads its weights instead of calling it (``nn.TransformerEncoderLayer``'s
            ``linear2``: :mod:`~lightning_offload.meft.target_checks`), or it maps one size to another.

    Example::

        import lightning.pytorch as pl
        from lightning_offload import MEFTConfig, inject_meft

        adapters = inject_meft(model, MEFTConfig(num_neurons=4096))  # one per FFN; the base is frozen
        trainer = pl.Trainer(strategy="meft_offload", precision="bf16-mixed")
        trainer.fit(module)  # a LightningModule around model; configure_optimizers: AdamW, as usual
    """
    if any(isinstance(m, MEFTFFN) for m in model.modules()):
        raise ValueError("This model already has MEFT adapters; inject_meft once per model.")
    targets = find_ffns(model, config.target_modules)
    for name, ffn in targets:
        check_target(model, name, ffn)  # before anything is changed
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    if config.freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
    generator = torch.Generator().manual_seed(config.seed)
    adapters = []
    for name, ffn in targets:
        adapter = MEFTAdapter(ffn_hidden_size(ffn), config, generator)
        replace_submodule(model, name, MEFTFFN(ffn, adapter))
        adapters.append(adapter)

    hook = model.register_forward_pre_hook(MaskHandOver(adapters), with_kwargs=True)
    # What unload_meft (lightning_offload.meft.export) needs to give the base back exactly as it was.
    model.__dict__["_meft_injection"] = MEFTInjection(config, [name for name, _ in targets], hook, requires_grad,
                                                      model.__dict__.get("save_pretrained"))
    if callable(getattr(model, "save_pretrained", None)):
        model.__dict__["save_pretrained"] = _refuse_save_pretrained
    return adapters


class MaskHandOver:
    """The model's forward pre-hook that hands each forward's attention mask (padding) to the adapters. An object,
    not a closure: a copy of the model (deepcopy, ``torch.save``) gets one handing the mask to its own adapters.

    Args:
        adapters: the model's adapters.
    """

    def __init__(self, adapters: list[MEFTAdapter]) -> None:
        self.adapters = adapters

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        for adapter in self.adapters:
            adapter.attention_mask = mask if torch.is_tensor(mask) and mask.ndim == 2 else None


@dataclass
class MEFTInjection:
    """What :func:`inject_meft` changed on a model, kept on it so the base can be given back exactly.

    Attributes:
        config: the adapters' settings.
        ffn_names: the qualified names of the FFNs that got an adapter.
        mask_hook: the forward pre-hook that hands the attention mask to the adapters.
        requires_grad: each base parameter's ``requires_grad`` before injection froze it.
        instance_save_pretrained: a ``save_pretrained`` the user had set on the instance (``None``: the class's).
    """

    config: MEFTConfig
    ffn_names: list[str]
    mask_hook: Any
    requires_grad: dict[str, bool]
    instance_save_pretrained: Any = None


def _refuse_save_pretrained(*args: Any, **kwargs: Any) -> None:
    raise ValueError(
        "This model has MEFT adapters beside its FFNs (their weights are saved under mlp.ffn.*), so the base class's "
        "from_pretrained would load random FFNs from it. Save the adapters on their own with "
        "lightning_offload.save_meft_adapters(model, 'adapters.pt') and the base with "
        "lightning_offload.unload_meft(model).save_pretrained(path); later, from_pretrained(path) and "
        "lightning_offload.load_meft_adapters(model, 'adapters.pt') give the trained model back.")


def meft_adapters(model: nn.Module) -> list[MEFTAdapter]:
    """The MEFT adapters of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MEFTAdapter)]
