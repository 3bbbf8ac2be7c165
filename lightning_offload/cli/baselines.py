"""The comparison methods run beside the offload strategies in the same harness: frozen, LoRA (``peft``), GaLore
(``galore-torch``), and a dense parallel adapter (MEFT's on-device counterpart).

Frozen, LoRA and GaLore act on the layers ``lsp_offload`` would project (same selection rule,
:func:`projectable_layers`) and leave every other trainable parameter (embeddings, norms, head) trained, so "gain over
the frozen run" measures exactly what each method earns on those layers. ``peft`` and ``galore-torch`` are optional
(``pip install lightning_offload[baselines]``); the functions that need them say so when they are missing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_offload.lsp.targets import select_projected_modules


def projectable_layers(model: nn.Module, min_dim: int = 128) -> dict[str, nn.Module]:
    """The Linear/Conv1D modules ``LSPOffloadStrategy(min_dim=min_dim)`` would project, by qualified name."""
    return select_projected_modules(model, min_dim, None, [])


def freeze_projectable(model: nn.Module, min_dim: int = 128) -> list[str]:
    """Freeze the weights of the projectable layers (the "frozen" reference run); returns their module names."""
    layers = projectable_layers(model, min_dim)
    for module in layers.values():
        module.weight.requires_grad_(False)
    return list(layers)


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, min_dim: int = 128,
             dropout: float = 0.0, train_others: bool = True) -> nn.Module:
    """Wrap ``model`` with LoRA adapters on the projectable layers; the other parameters stay trainable.

    Args:
        model: a Hugging Face model.
        rank: LoRA rank.
        alpha: LoRA scaling numerator (default ``2·rank``, the common choice).
        min_dim: the projection rule's size threshold.
        dropout: LoRA dropout.
        train_others: keep training the non-projectable parameters (embeddings, norms, head), as the frozen
            reference run does; ``False`` trains the adapters only (plain PEFT).

    Returns:
        The ``peft`` model (same forward signature).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("LoRA needs peft: pip install 'lightning_offload[baselines]'.") from error
    names = list(projectable_layers(model, min_dim))
    if not names:
        raise ValueError(f"No Linear layer with both dims ≥ {min_dim} to put LoRA on; lower min_dim.")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    projected_weights = {f"{name}.weight" for name in names}
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                        target_modules=names, bias="none")
    peft_model = get_peft_model(model, config)
    # peft freezes the whole base model; the comparison keeps training what the frozen run trains.
    for name, param in peft_model.base_model.model.named_parameters():
        if train_others and name in trainable and name not in projected_weights and "lora_" not in name:
            param.requires_grad_(True)
    return peft_model


def layer_param_groups(model: nn.Module, lr: float, projected_lr: float | None = None, weight_decay: float = 0.0,
                       min_dim: int = 128) -> list[dict[str, Any]]:
    """Adam groups that give the projectable layers their own learning rate.

    Projections, low-rank gradients and adapters all change the effective step size of those layers only, so a fair
    comparison tunes their learning rate while everything else keeps one.

    Returns:
        ``[projectable weights and LoRA adapters (lr=projected_lr), other matrices (decayed), the rest (no decay)]``,
        empty groups dropped.
    """
    projected = {id(m.weight) for m in projectable_layers(model, min_dim).values()}
    layer, matrices, others = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) in projected or "lora_" in name:
            layer.append(param)
        else:
            (matrices if param.ndim >= 2 else others).append(param)
    groups = [
        {"params": layer, "lr": projected_lr if projected_lr is not None else lr, "weight_decay": weight_decay},
        {"params": matrices, "lr": lr, "weight_decay": weight_decay},
        {"params": others, "lr": lr, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def galore_optimizer(model: nn.Module, lr: float, rank: int, update_proj_gap: int = 200, scale: float = 0.25,
                     weight_decay: float = 0.0, min_dim: int = 128, projected_lr: float | None = None,
                     **adam_kwargs: Any) -> torch.optim.Optimizer:
    """``galore_torch.GaLoreAdamW`` with GaLore on the projectable layers' weights and plain AdamW on the rest.

    Args:
        model: the model to train.
        lr: learning rate of the other parameters (and of the GaLore group unless ``projected_lr`` is given).
        rank: GaLore rank (the low-rank gradient is ``rank × max(o, i)``).
        update_proj_gap: steps between the SVDs that refresh the projection.
        scale: GaLore's update scale.
        weight_decay: decoupled weight decay of matrices (rank ≥ 2 parameters).
        min_dim: the projection rule's size threshold.
        projected_lr: learning rate of the GaLore group.
    """
    try:
        from galore_torch import GaLoreAdamW
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("GaLore needs galore-torch: pip install 'lightning_offload[baselines]'.") from error
    groups = layer_param_groups(model, lr, projected_lr, weight_decay, min_dim)
    if groups and groups[0]["params"] and any(p.ndim >= 2 for p in groups[0]["params"]):
        groups[0].update(rank=rank, update_proj_gap=update_proj_gap, scale=scale, proj_type="std")
    return GaLoreAdamW(groups, lr=lr, **adam_kwargs)


class ParallelAdapter(nn.Module):
    """A dense adapter beside an FFN, ``ffn(h) + ReLU(h Kᵀ) V`` with ``K, V`` of ``width × h`` on the device.

    The same function as a MEFT adapter with every neuron active and no routing: the reference MEFT is compared with
    at equal device memory. ``V`` starts at zero, so the wrapped model is unchanged until trained.
    """

    def __init__(self, ffn: nn.Module, hidden_size: int, width: int, generator: torch.Generator) -> None:
        super().__init__()
        self.ffn = ffn
        self.keys = nn.Parameter(torch.randn(width, hidden_size, generator=generator) * hidden_size**-0.5)
        self.values = nn.Parameter(torch.zeros(width, hidden_size))

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The FFN's output plus the adapter's."""
        adapter = torch.relu(hidden @ self.keys.T.to(hidden.dtype)) @ self.values.to(hidden.dtype)
        return self.ffn(hidden, *args, **kwargs) + adapter


def add_parallel_adapters(model: nn.Module, width: int, target_modules: str = r"(^|\.)mlp$", seed: int = 0) -> int:
    """Freezes ``model`` and puts a dense :class:`ParallelAdapter` of ``width`` neurons beside every matching FFN.

    Returns:
        The number of adapters added.
    """
    from lightning_offload.meft.injection import ffn_hidden_size, find_ffns, replace_submodule

    if width < 1:
        raise ValueError(f"Parallel adapter width={width} must be a positive integer.")
    targets = find_ffns(model, target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name, ffn in targets:
        replace_submodule(model, name, ParallelAdapter(ffn, ffn_hidden_size(ffn), width, generator))
    return len(targets)
