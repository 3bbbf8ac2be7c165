"""An offload checkpoint turned into one plain Lightning resumes: ``torch.optim`` state in place of the host state.

The weights need nothing (their keys are the same under every strategy). The optimizer state is converted tensor by
tensor, as far as it exists in full size:

- a parameter stepped by the dense host Adam (or by a device Adam): its moments and step count, exactly;
- an embedding stepped row-sparsely: its moments with every row's skipped steps caught up (``β^gap``, what dense
  AdamW's zero-gradient steps give), at the matrix's step count — exactly dense AdamW's moments;
- a projected weight: its moments live in the compressed space (``d_o × d_i``) and have no full-size equivalent, so
  they start afresh (step 0) under plain AdamW; the report names them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_offload.engine.checkpoint_kinds import checkpoint_kind

if TYPE_CHECKING:  # only annotations name Lightning: converting a checkpoint needs no Trainer
    import lightning.pytorch as pl


@dataclass
class PlainConversion:
    """What :func:`to_plain_adamw_checkpoint` carried over.

    Attributes:
        exact: parameters whose Adam state was carried over exactly.
        caught_up: row-sparse embeddings whose moments were caught up over their rows' skipped steps.
        restarted: parameters whose state starts afresh under plain AdamW (projected weights, under either
            ``update=`` rule, and any other state that had no full-size form).
    """

    exact: list[str] = field(default_factory=list)
    caught_up: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)


def dense_moments_of_rows(state: dict[str, Any], betas: tuple[float, float]) -> dict[str, Tensor]:
    """A row-sparse embedding's saved row Adam state as dense AdamW's: each row's moments decayed over the steps it
    missed (and times its stored scales, which are 1 for rows stepped by gathering)."""
    step = int(state["step"])
    missed = (step - state["last_step"]).clamp(min=0).to(torch.float64).unsqueeze(1)
    beta1, beta2 = (torch.tensor(b, dtype=torch.float64) for b in betas)
    # One matrix of one-row blocks; checkpoints from before the one row Adam hold it bare, with no scales.
    exp_avg, exp_avg_sq = (state[key][0] if isinstance(state[key], list) else state[key]
                           for key in ("exp_avg", "exp_avg_sq"))
    ones = torch.ones_like(missed)
    scale1, scale2 = (state[key].unsqueeze(1) if key in state else ones for key in ("scale1", "scale2"))
    exp_avg = (exp_avg.double() * scale1 * beta1.pow(missed)).float()
    exp_avg_sq = (exp_avg_sq.double() * scale2 * beta2.pow(missed)).float()
    return {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _user_optimizer(module: pl.LightningModule) -> torch.optim.Optimizer:
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    elif isinstance(configured, (list, tuple)):
        configured = configured[0][0] if isinstance(configured[0], (list, tuple)) else configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers returned {type(configured).__name__}; a torch optimizer is needed.")
    return configured


def to_plain_adamw_checkpoint(checkpoint: str | os.PathLike[str], module: pl.LightningModule,
                              out: str | os.PathLike[str]) -> PlainConversion:
    """Writes ``out``: the offload checkpoint ``checkpoint`` with its optimizer state in ``torch.optim`` form, which
    ``Trainer(strategy="auto").fit(module, ckpt_path=out)`` resumes.

    Args:
        checkpoint: a checkpoint written by ``lsp_offload`` or ``zero_offload`` (single device or DDP).
        module: the LightningModule of that run (its ``configure_optimizers`` gives the optimizer to fill).
        out: where the converted checkpoint goes (written beside it, then renamed: never half-written).

    Returns:
        What was carried over exactly, caught up, or restarted.

    Raises:
        ValueError: for a checkpoint that is not an offload one, or one trained with an optimizer other than
            Adam/AdamW.

    Example::

        report = to_plain_adamw_checkpoint("last.ckpt", MyModule(), "plain.ckpt")
        pl.Trainer(max_steps=2000).fit(MyModule(), ckpt_path="plain.ckpt")  # plain AdamW from here on
    """
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    if checkpoint_kind(saved) != "offload":
        raise ValueError(f"{checkpoint} holds no offload optimizer state (a plain checkpoint already, or none).")
    offload = saved["optimizer_states"][0]
    if offload["host_rule"] != "Adam":
        raise ValueError(f"{checkpoint} was trained with {offload['host_rule']}, not Adam/AdamW: its state has no "
                         f"AdamW form. Resume it under the offload strategy that wrote it, or start plain training "
                         f"from its weights only (module.load_state_dict(checkpoint['state_dict'])).")
    module.load_state_dict(saved["state_dict"])
    optimizer = _user_optimizer(module)
    names = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {names[id(p)]: i for i, p in enumerate(params)}
    betas = [tuple(group["betas"]) for group in offload["param_groups"]]
    group_of = {names[id(p)]: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    state: dict[int, dict[str, Tensor]] = {}
    report = PlainConversion()
    slot_params = set()
    for slot, host_state in zip(offload["slots"], offload["host_adam"]):
        # A projected weight's moments (compressed, or of the scaled rule's projection) have no full-size form.
        if slot in offload["projectors"] or "scaled" in host_state:
            report.restarted.append(f"{slot}.weight")
            slot_params.add(f"{slot}.weight")
            continue
        slot_params.add(slot)
        if "last_step" in host_state:  # a row-sparse embedding's row Adam
            state[index[slot]] = dense_moments_of_rows(host_state, betas[group_of[slot]])
            report.caught_up.append(slot)
        else:
            (only,) = host_state["state"].values()
            state[index[slot]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in only.items()}
            report.exact.append(slot)
    # A device Adam's entries (vectors, embeddings/head="device"), named where the checkpoint names them; an older
    # one's are the remaining trained parameters in group order.
    device_optimizer = offload.get("device_adam")
    if device_optimizer is not None:
        rest = device_optimizer.get("names") or \
            [names[id(p)] for p in params if names[id(p)] not in slot_params and p.requires_grad]
        if len(rest) == len(device_optimizer["adam"]) and all(name in index for name in rest):
            for name, entry in zip(rest, device_optimizer["adam"]):
                for only in entry["state"].values():  # none where it never had a gradient: it starts as torch's would
                    state[index[name]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in only.items()}
                report.exact.append(name)
        else:
            report.restarted += rest
    plain = optimizer.state_dict()
    plain["state"] = state
    for group, hyper in zip(plain["param_groups"], offload["param_groups"]):
        group.update({k: v for k, v in hyper.items() if k in group and k != "params"})
    saved["optimizer_states"] = [plain]
    target = Path(out)
    partial = target.with_name(target.name + ".partial")
    torch.save(saved, partial)
    os.replace(partial, target)
    return report
