"""The user's optimizer as the offload engine takes it over: which ones it accepts, the hooks registered on it (run
where torch runs them), and the row Adam's hyper-parameters read from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.rows.row_adam_kernel import RowAdamSettings
from lightning_offload.engine.rules.host_rule import host_rule_for


LINK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def validate_user_optimizer(optimizer: Any) -> Optimizer:
    """Check the optimizer an offload strategy can take over (one a host rule steps: ``torch.optim.Adam``/``AdamW``,
    :class:`~lightning_offload.engine.rules.lion.Lion`; :mod:`~lightning_offload.engine.rules`); return it unwrapped.

    Raises:
        TypeError: for an optimizer no rule takes over (subclasses are refused too: their ``step`` may do something
            the host step would not reproduce).
        ValueError: for a configuration its rule cannot step (capturable or differentiable Adam).
    """
    inner = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    host_rule_for(inner)
    return inner


def is_decoupled(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay multiplies the weight by ``1 − lr·λ`` (AdamW's, Lion's) rather than adding
    ``λW`` to the gradient (Adam's L2), as the user's optimizer applies it."""
    return host_rule_for(optimizer).decoupled(optimizer, group)


def named_parameters_of(groups: list[dict[str, Any]], model: torch.nn.Module | None) -> list[tuple[str, Tensor]]:
    """Each parameter of the optimizer's groups with its name in ``model`` (``param<i>`` where unknown)."""
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    params = [p for group in groups for p in group["params"]]
    return [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]


def refuse_rows_across_ranks() -> None:
    """The one rule of row-sparse embeddings and data parallelism, wherever it is checked (the DDP strategies at
    construction, the engine at set-up).

    Raises:
        ValueError: always, naming the settings that work instead.
    """
    raise ValueError("embeddings='sparse' is not available with data parallelism: each rank's batch touches "
                     "different embedding rows. Use embeddings='host' (the DDP strategies' default), 'device' or "
                     "'frozen'.")


def check_engine_arguments(link_dtype: str, on_nonfinite: str, pipelined_without_model: bool,
                           rows_across_ranks: bool) -> None:
    """Refuse settings the engine cannot run, naming the bad value and the accepted ones.

    Raises:
        ValueError: for an unknown link dtype or non-finite policy, ``pipelined=True`` without the model, or
            row-sparse embeddings with data parallelism.
    """
    if rows_across_ranks:
        refuse_rows_across_ranks()
    if on_nonfinite not in ("skip", "raise"):
        raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}.")
    if link_dtype not in LINK_DTYPES:
        raise ValueError(f"link_dtype must be one of {sorted(LINK_DTYPES)}, got {link_dtype!r}.")
    if pipelined_without_model:
        raise ValueError("pipelined=True needs the model, whose forward pre-hooks apply the updates.")


def row_adam_settings(optimizer: Optimizer, group: dict[str, Any], lr: float | None = None,
                      weight_decay: float | None = None) -> RowAdamSettings:
    """The row Adam's hyper-parameters at this step, from the user's ``optimizer`` and its param ``group``.

    Args:
        optimizer: the user's optimizer (its class decides whether its weight decay is decoupled).
        group: the param group whose settings the rows follow (its scheduler's learning rate included).
        lr: a learning rate of the rows' own instead of the group's. Default: ``None``.
        weight_decay: a decoupled weight decay of the rows' own instead of the group's. Default: ``None``.

    Raises:
        ValueError: for ``amsgrad=True``, which the row Adam does not have.
    """
    if group.get("amsgrad", False):
        raise ValueError("The host row Adam has no amsgrad: its per-row maxima would have to cross the host for "
                         "every row ever touched. Use amsgrad=False.")
    return RowAdamSettings(
        lr=lr if lr is not None else float(group["lr"]),
        betas=tuple(group.get("betas", (0.9, 0.999))),
        eps=float(group.get("eps", 1e-8)),
        weight_decay=weight_decay if weight_decay is not None else float(group.get("weight_decay", 0)),
        # A weight decay of the rows' own is decoupled, as AdamW's; else the user's optimizer decides.
        decoupled=weight_decay is not None or is_decoupled(optimizer, group),
        maximize=bool(group.get("maximize", False)),
    )


#: The hooks ``torch.optim.Optimizer`` keeps per instance (``register_step_pre_hook`` and the rest).
_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


def share_hooks(offload: Optimizer, user: Optimizer) -> None:
    """Give ``offload`` the user's optimizer's hook dicts, as it shares its ``param_groups``: a hook registered on
    either (before the offload or after) runs once where the user's optimizer would run it, at the offload's step,
    ``state_dict`` and ``load_state_dict`` (the user's optimizer never steps)."""
    for name in _HOOK_DICTS:
        setattr(offload, name, getattr(user, name))


def hooked_state_dict(optimizer: Optimizer, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``build()`` between the state-dict hooks, as ``torch.optim.Optimizer.state_dict`` calls them (a post-hook may
    return a new dict)."""
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state = build()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        returned = post_hook(optimizer, state)
        if returned is not None:
            state = returned
    return state


def hooked_load_state_dict(optimizer: Optimizer, state: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
    """``load(state)`` between the load-state-dict hooks, as ``torch.optim.Optimizer.load_state_dict`` calls them (a
    pre-hook may return a new dict)."""
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        returned = pre_hook(optimizer, state)
        if returned is not None:
            state = returned
    load(state)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)
