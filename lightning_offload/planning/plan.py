"""``plan(model, strategy, ...)``: before a run, whether it fits the device and the host and how long a step will take,
from the model's parameters (any device, ``meta`` included), the strategy's settings and the machine's speeds.

Every figure is computed by the rules the run itself follows: which tensors are projected or placed elsewhere comes
from the set-up layer (:mod:`lightning_offload.planning.inventory`), activations from a forward on the meta device
(:mod:`~lightning_offload.planning.activations`), speeds from a short calibration or a named profile
(:mod:`~lightning_offload.planning.calibration`), step time from the cost model
(:mod:`~lightning_offload.planning.cost`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_offload.engine.rules.host_rule import MEFT_ROWS, HostRule, host_rule_of, optimizer_class
from lightning_offload.lm_loss import check_loss_kind
from lightning_offload.lsp.layouts import is_projectable
from lightning_offload.meft.config import MEFTConfig
from lightning_offload.planning.activations import Activations, blocks_of, measure_activations, network_of
from lightning_offload.planning.calibration import Hardware, hardware as hardware_of
from lightning_offload.planning.cost import Workload, device_flops, device_seconds, host_seconds, step_time
from lightning_offload.planning.device_bytes import DeviceParts, device_parts
from lightning_offload.planning.inventory import (Inventory, Link, host_bytes, host_scratch_bytes, inventory,
                                                 link_bytes, speculation_bytes)
from lightning_offload.planning.meft_sizes import MEFTSizes, meft_sizes
from lightning_offload.planning.projection_time import projection_seconds
from lightning_offload.planning.report import Plan
from lightning_offload.setup.settings import PRESETS, OffloadSettings, face_settings

STRATEGIES = ("auto", "zero_offload", "lsp_offload", "meft_offload")
#: Each precision's ``(parameter dtype, compute dtype)``.
PRECISIONS = {"32-true": (torch.float32, torch.float32), "bf16-true": (torch.bfloat16, torch.bfloat16),
              "bf16-mixed": (torch.float32, torch.bfloat16)}
#: Lightning's short spellings of the precisions above.
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed"}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


def parse_bytes(value: int | float | str, name: str) -> int:
    """``value`` in bytes: a number, or a string like ``"24GiB"`` / ``"4 GB"``.

    Raises:
        ValueError: for a value that is not positive or not a size, naming it and the forms accepted.
    """
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size: use bytes (an int) or a string like '24GiB' or '4GB'.")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number of bytes (or a string like '24GiB').")
    return int(value)


def settings_for(strategy: str, settings: dict[str, Any],
                 value: OffloadSettings | None = None) -> OffloadSettings | None:
    """The strategy's settings value, validated as the strategy validates it (``None`` for plain training): ``value``
    (a strategy's own, taken whole) with ``settings`` given by name put in, or those alone.

    Raises:
        ValueError: for an unknown strategy, a setting it refuses, or a ``value`` its preset contradicts. TypeError:
            for an unknown setting.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one a plan knows; use one of {STRATEGIES} ('auto': plain "
                         f"AdamW on the device).")
    owner = f"plan(strategy={strategy!r})"
    if strategy == "auto":
        if settings or value is not None:
            shown = ", ".join(sorted(settings)) or "settings"
            raise ValueError(f"{owner}: {shown} do not apply to plain training on the device. "
                             f"Remove them, or plan strategy='lsp_offload' or 'zero_offload'.")
        return None
    preset = PRESETS[strategy]
    named = face_settings(owner, settings, preset)  # each setting given by name refused or kept as the strategy would
    if value is None:
        return named
    contradicted = {name: want for name, want in preset.items() if getattr(value, name) != want}
    if contradicted:
        given = ", ".join(f"{name}={getattr(value, name)!r}" for name in contradicted)
        raise ValueError(f"{owner}: the settings value has {given}, which {strategy} sets to "
                         f"{', '.join(f'{k}={v!r}' for k, v in contradicted.items())}. Plan the strategy those "
                         f"settings are for (zero_offload for projection=False).")
    return replace(value, **settings)


@dataclass(frozen=True)
class _Shape:
    """What the plan reads of the model beyond its parameters."""

    hidden: int
    blocks: int
    matmul: dict[str, nn.Module]
    # The output head's weight (None without one): by its module's name (as projected entries are named) and by the
    # parameter's own name (as dense entries are; a tied head's is the embedding's).
    head: str | None
    head_parameter: str | None
    head_elements: int


def _shape(model: nn.Module) -> _Shape:
    network = network_of(model)
    config = network.config
    blocks = blocks_of(network)
    matmul = {name: m for name, m in model.named_modules() if is_projectable(m)}
    head = network.get_output_embeddings()
    head_name = next((f"{name}.weight" for name, m in model.named_modules() if m is head), None) if head else None
    parameter = next((n for n, p in model.named_parameters() if p is head.weight), None) if head else None
    return _Shape(int(getattr(config, "hidden_size", getattr(config, "n_embd", 0))),
                  len(blocks) if blocks is not None else 0, matmul, head_name, parameter,
                  head.weight.numel() if head is not None else 0)


def plan(model: nn.Module, strategy: str = "lsp_offload", *, batch_size: int, seq_len: int,
         device_memory: int | float | str, precision: str = "bf16-mixed", gradient_checkpointing: bool = False,
         hardware: str | Hardware | None = None, device: torch.device | str | None = None,
         host_memory: int | float | str | None = None, meft: MEFTConfig | None = None,
         activation_bytes: int | None = None, headroom: float = 0.05,
         optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | str | None = None, loss: str = "chunked",
         settings: OffloadSettings | None = None, **named: Any) -> Plan:
    """Predict a run: device and host bytes, link bytes per step, whether it fits, and the step time with its parts.

    Args:
        model: the model to train (a Hugging Face causal LM, or a module holding one), on any device, ``meta``
            included; every parameter that requires grad is taken to be trained by ``optimizer``.
        strategy: ``"auto"`` (plain AdamW on the device), ``"zero_offload"``, ``"lsp_offload"`` or
            ``"meft_offload"``. Default: ``"lsp_offload"``.
        batch_size: sequences per step.
        seq_len: tokens per sequence.
        device_memory: the device's memory (bytes, or a string such as ``"24GiB"``).
        precision: ``"32-true"``, ``"bf16-true"`` or ``"bf16-mixed"``. Default: ``"bf16-mixed"``.
        gradient_checkpointing: plan with every block checkpointed (both figures are in the plan either way).
            Default: ``False``.
        hardware: a profile name (``"h200"``, ``"rtx4090"``, ``"laptop-4gb"``), a ``Hardware`` value, or ``None``
            to calibrate this machine (then cached). Default: ``None``.
        device: the device the run trains on, calibrated when ``hardware`` is ``None``. Default: ``None`` (the
            profile's device, or CUDA when present, else the CPU).
        host_memory: the host's memory (bytes or a size string). Default: ``None`` (the hardware's).
        meft: ``meft_offload``'s adapters, when the model has none injected yet. Default: ``None`` (``MEFTConfig()``).
        activation_bytes: bytes a forward keeps for backward, for a model that is not a Hugging Face causal LM.
            Default: ``None`` (measured by a forward on the meta device).
        headroom: the share of ``device_memory`` kept free: the allocator's fragmentation and the CUDA context count
            against a memory cap, not in ``max_memory_allocated``. Default: ``0.05``.
        optimizer: the user's optimizer, its class, or the class's name (``"adamw"``, ``"adam"``, ``"lion"``); its
            state is what the host (the device, for plain training) keeps. Default: ``None`` (``torch.optim.AdamW``).
        loss: ``"chunked"`` (:func:`lightning_offload.causal_lm_loss`: what the package's task and CLI use; no
            ``tokens × vocabulary`` logits) or ``"model"`` (the model's own loss over all the logits). Default:
            ``"chunked"``.
        settings: the strategy's settings as one value (a strategy's ``.settings``). Default: ``None`` (its
            defaults).
        named: the strategy's settings by name, as the strategies take them (``rank=0.125``, ``update="scaled"``,
            ``embeddings="host"``, ``link_dtype="bf16"``...), in place of those of ``settings``.

    Raises:
        ValueError: for an unknown strategy or precision, a setting the strategy refuses, or a size that is not
            positive. TypeError: for an unknown setting, or an optimizer the offload does not take over.

    Example::

        import lightning_offload
        plan = lightning_offload.plan(model, "lsp_offload", batch_size=4, seq_len=512, device_memory="24GiB",
                                      precision="bf16-true", gradient_checkpointing=True, hardware="rtx4090")
        print(plan.table())  # plan.fits, plan.device_bytes, plan.host_bytes, plan.step_seconds, plan.figures()
    """
    offload = settings_for(strategy, named, settings)
    user_optimizer = optimizer_class(optimizer)
    rule = host_rule_of(user_optimizer)
    if strategy == "meft_offload":
        rule.refuse_rows(*MEFT_ROWS)  # as the engine refuses it at set-up
    memory = parse_bytes(device_memory, "device_memory")
    precision = _checked_step(precision, batch_size, seq_len, headroom, loss)
    param_dtype, compute_dtype = PRECISIONS[precision]
    hw = hardware_of(hardware, device, compute_dtype)
    # Allocations follow the device the run trains on; the speeds may be another machine's (a profile).
    accelerator = (torch.device(device).type if device is not None else hw.device) != "cpu"
    meft_part = meft_sizes(model, meft, batch_size, seq_len, compute_dtype, accelerator) \
        if strategy == "meft_offload" else None
    found = inventory(model, offload, param_dtype, meft_part.trained if meft_part else None, user_optimizer)
    if meft_part is not None:
        found.entries += meft_part.routers
    link = Link(_link_itemsize(offload), accelerator, _speculative(offload, accelerator or hw.simulated_link),
                batch_size * seq_len)
    parts = device_parts(found, offload is None, offload.density if offload else 0, accelerator,
                         offload.update_buffers if offload else None, link.itemsize, rule,
                         _csr_kernels(offload, accelerator), asynchronous=accelerator or hw.simulated_link,
                         device_memory=memory)
    activations = _activations(model, found, batch_size, seq_len, compute_dtype, accelerator, activation_bytes, loss)
    work, shape = _workload(model, found, batch_size * seq_len, seq_len, offload is None, gradient_checkpointing, loss)
    run = dict(batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=user_optimizer.__name__)
    return _assemble(strategy, offload, found, parts, activations, link, work, hw, memory,
                     parse_bytes(host_memory, "host_memory") if host_memory is not None else hw.host_memory,
                     meft_part, run, headroom, rule, _head_gradient_bytes(shape, found))


def _checked_step(precision: str, batch_size: int, seq_len: int, headroom: float, loss: str) -> str:
    """The precision's full name, once the step's arguments are checked.

    Raises:
        ValueError: naming a precision no plan knows, a batch size or length that is not a positive int, a headroom
            outside ``[0, 1)``, or a loss that is not one of :data:`~lightning_offload.lm_loss.LOSS_KINDS`.
    """
    check_loss_kind(loss)
    precision = PRECISION_ALIASES.get(str(precision), str(precision))
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one a plan knows; use one of {sorted(PRECISIONS)}.")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int.")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r} must be a share of device_memory in [0, 1) (default 0.05).")
    return precision


def _link_itemsize(settings: OffloadSettings | None) -> int:
    return 2 if settings is not None and settings.link_dtype == "bf16" else 4


def _speculative(settings: OffloadSettings | None, accelerator: bool) -> bool:
    if settings is None:
        return False
    return settings.speculative if settings.speculative is not None else accelerator


def _formed_elements(found: Inventory, shape: _Shape, plain: bool) -> int:
    """Elements of the matmul weights whose full gradient autograd forms (trained, not projected)."""
    weights = {f"{name}.weight" for name in shape.matmul}
    kinds = ("device",) if plain else ("dense", "device", "scaled")
    return sum(e.numel for e in found.of(*kinds) if e.name in weights)


def _workload(model: nn.Module, found: Inventory, tokens: int, seq_len: int, plain: bool, checkpointing: bool,
              loss: str) -> tuple[Workload, _Shape]:
    """The step's device work, and the model's shape it was read from."""
    shape = _shape(model)
    work = Workload(tokens, seq_len, shape.hidden, shape.blocks, sum(m.weight.numel() for m in shape.matmul.values()),
                    _formed_elements(found, shape, plain), checkpointing, _recomputed_elements(found, shape, loss))
    return work, shape


def _recomputed_elements(found: Inventory, shape: _Shape, loss: str) -> int:
    """Elements of the head the chunked loss runs again in backward: a projected head's (its compressed gradient is
    made in its own backward); a plain head's gradients are made in forward, by the products the loss needs anyway."""
    projected = {e.name for e in found.of("projected")}
    return shape.head_elements if loss == "chunked" and shape.head in projected else 0


def _activations(model: nn.Module, found: Inventory, batch_size: int, seq_len: int, dtype: torch.dtype,
                 accelerator: bool, given: int | None, loss: str) -> Activations:
    if given is not None:
        return Activations(int(given), int(given), 0, 0)
    projected = {e.name.removesuffix(".weight"): e.compressed[1] for e in found.of("projected")}
    return measure_activations(model, batch_size, seq_len, dtype, projected,
                               dtype if accelerator else torch.float32, loss)


def _assemble(strategy: str, settings: OffloadSettings | None, found: Inventory, parts: DeviceParts,
              activations: Activations, link: Link, work: Workload, hw: Hardware, device_memory: int,
              host_memory: int, meft_part: MEFTSizes | None, run: dict[str, Any], headroom: float,
              rule: HostRule, head_gradient: int) -> Plan:
    """The plan's figures from its parts."""
    plain = settings is None
    to_host = sum(link_bytes(e, link)[0] for e in found.entries)
    to_device = sum(link_bytes(e, link)[1] for e in found.entries)
    host = sum(host_bytes(e, link, rule) for e in found.entries)
    host += 0 if plain else host_scratch_bytes(found.entries, link)  # the host jobs' shared working buffers
    meft_host = meft_part.host_bytes if meft_part else 0
    meft_rows = meft_part.row_elements if meft_part else 0
    if meft_part is not None:
        to_host, to_device = to_host + meft_part.to_host, to_device + meft_part.to_device
    # The Trainer's default (plan() plans what the strategies do): gradients that crossed are dropped at the launch.
    freed = not plain and settings.free_sent_gradients is not False
    first_freed = head_gradient if freed else None
    peaks = {checkpointing: _device_peak(parts, activations, checkpointing, plain, found, first_freed)
             + (meft_part.device_bytes if meft_part else 0) for checkpointing in (False, True)}
    projections = 0.0 if plain else projection_seconds(found.of("projected"), work.tokens, settings.density, hw,
                                                        PRECISIONS[run["precision"]][1], settings.kernels)
    device_s, forward_s = device_seconds(found, work, hw, plain, projections)
    host_s, largest_host = host_seconds(found.entries, hw, link.rows_touched, meft_rows)
    largest_link = max((link_bytes(e, link)[0] for e in found.entries), default=0)
    held_back = sum(link_bytes(e, link)[1] for e in found.of("dense"))  # a speculative dense value waits for the step
    step = step_time(device_s, forward_s, host_s, largest_host, to_host, to_device, largest_link, hw, plain,
                     link.speculative, device_flops(found, work), pipelined=plain or settings.pipelined,
                     held_back=held_back)
    device_peak = peaks[work.checkpointing]
    shares_memory = not link.pinned  # a CPU device's memory is the host's
    host_needed = host + meft_host + (device_peak if shares_memory else 0)
    return Plan(strategy=strategy, settings=_shown_settings(settings), **run,
                gradient_checkpointing=work.checkpointing, device_bytes=device_peak,
                device_bytes_by_checkpointing=peaks, device_parts=_parts(parts, activations, work.checkpointing),
                host_bytes=host + meft_host, host_state_bytes=host, host_rows_bytes=meft_host,
                host_speculation_bytes=sum(speculation_bytes(e, link, rule) for e in found.entries),
                link_bytes_to_host=to_host, link_bytes_to_device=to_device, device_memory=device_memory,
                host_memory=host_memory, fits_device=device_peak <= device_memory * (1 - headroom),
                fits_host=host_memory == 0 or host_needed <= host_memory, step=step, hardware=hw.name,
                persistent=dict(parts.persistent), projected_layers=len(found.of("projected", "scaled")),
                notes=tuple(found.messages), step_is_lower_bound=hw.device == "cpu",
                device_shares_host_memory=shares_memory, headroom=headroom)


def _device_peak(parts: DeviceParts, activations: Activations, checkpointing: bool, plain: bool,
                 found: Inventory, first_freed: int | None) -> int:
    """Peak device bytes, at the start of backward: what persists, the gradients still held in ``.grad`` from the
    previous step, every saved activation and the logits' gradient.

    A ``param.grad`` lives from its backward until the next ``zero_grad``, which Lightning calls after the next
    forward: so a plain run's gradients, and a device-placed one's, are there while the forward saves its activations.
    An offload's dense and row gradients are too unless dropped once crossed (``free_sent_gradients``, on under the
    Trainer and Fabric); then, like the compressed ``S`` and the scaled rule's ``G``, they exist only from backward on,
    as activations are freed: the peak is the larger of those and the activations with the first gradient made
    (``first_freed``: the head's; ``None`` when gradients are kept).
    """
    kept = activations.kept(checkpointing) + activations.transient
    persistent = parts.weights + parts.optimizer_state + sum(parts.persistent.values())
    if plain:
        return persistent + parts.gradients + kept
    freed = first_freed is not None
    crossed = sum(e.numel * e.itemsize for e in found.of("dense", "rows"))
    held = sum(e.numel * e.itemsize for e in found.of("device")) + (0 if freed else crossed)
    grown = sum(e.numel * e.itemsize for e in found.of("scaled")) + (crossed if freed else 0)
    return persistent + held + max(kept + (first_freed or 0), grown)


def _head_gradient_bytes(shape: _Shape, found: Inventory) -> int:
    """Bytes of the output head's gradient where it crosses whole (a dense head's): backward makes it first (the
    chunked loss, in forward), so it exists beside every saved activation even when crossed gradients are dropped."""
    return sum(e.numel * e.itemsize for e in found.of("dense", "rows") if e.name == shape.head_parameter)


def _parts(parts: DeviceParts, activations: Activations, checkpointing: bool) -> dict[str, int]:
    return {"weights": parts.weights, "gradients": parts.gradients, "optimizer_state": parts.optimizer_state,
            **{f"persistent/{k}": v for k, v in parts.persistent.items()},
            "activations": activations.kept(checkpointing), "activations_transient": activations.transient}


def _shown_settings(settings: OffloadSettings | None) -> dict[str, Any]:
    """The settings that differ from their defaults, for the table and the run's record."""
    if settings is None:
        return {}
    defaults = OffloadSettings(projection=settings.projection)
    return {name: value for name, value in vars(settings).items()
            if name != "projector_factory" and value != getattr(defaults, name)}


def _csr_kernels(offload: OffloadSettings | None, accelerator: bool) -> bool:
    """Whether the projections are expected on torch's CSR kernels, which keep the CSR structure (on the CPU, its
    forms) beside the projectors: where forced, or where ``"auto"`` has none faster (a CPU without native kernels)."""
    if offload is None or offload.kernels == "csr":
        return True
    if offload.kernels != "auto":
        return False
    if accelerator:
        return False
    from lightning_offload.lsp.kernels.native import native_projection  # noqa: PLC0415  (builds it once)

    return native_projection() is None
