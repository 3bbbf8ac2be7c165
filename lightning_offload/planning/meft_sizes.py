"""What ``meft_offload``'s adapters add to a plan: their routers (trained as dense host slots), host rows, device
buffers and the rows that cross per step, from the MEFT config and the FFNs it targets (``meft/injection.py``'s own
rules: :func:`~lightning_offload.meft.injection.find_ffns`, :func:`~lightning_offload.meft.injection.ffn_hidden_size`).
A model with adapters injected already is read as it is."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_offload.meft.config import MEFTConfig
from lightning_offload.meft.injection import MEFTFFN, ffn_hidden_size, find_ffns
from lightning_offload.planning.inventory import Entry, trained_parameters

#: Host fp32 ``N × h`` arrays per adapter: keys, values, their gradient accumulators and Adam moments
#: (``meft/figures.py:host_rows_bytes``).
HOST_ARRAYS = 8
#: Device bytes per hidden unit of an adapter's input statistics (fp32 mean, fp64 sum).
STATISTICS_BYTES = 4 + 8


@dataclass
class MEFTSizes:
    """The adapters' share of a plan.

    Attributes:
        trained: the base model's parameters still trained (none when the config freezes the base).
        routers: the routers' entries (dense host slots).
        host_bytes: the host rows' bytes (keys, values, accumulators, moments).
        device_bytes: routing keys (bf16, device routing) and input statistics on the device.
        to_device: bytes of the rows fetched per step (keys and values, in the compute dtype), at most.
        to_host: bytes of their gradients sent back, at most.
        row_elements: row elements the host steps per step, at most.
    """

    trained: list[nn.Parameter] = field(default_factory=list)
    routers: list[Entry] = field(default_factory=list)
    host_bytes: int = 0
    device_bytes: int = 0
    to_device: int = 0
    to_host: int = 0
    row_elements: int = 0


def meft_sizes(model: nn.Module, config: MEFTConfig | None, batch_size: int, seq_len: int, compute_dtype: torch.dtype,
               accelerator: bool) -> MEFTSizes:
    """The adapters' sizes for a step of ``batch_size × seq_len`` tokens (the rows a step touches are bounded by
    :meth:`MEFTConfig.row_bound`: an upper bound, since routing decides the real count).

    Raises:
        ValueError: when ``config.target_modules`` matches no FFN.
    """
    injected = [(name, m) for name, m in model.named_modules() if isinstance(m, MEFTFFN)]
    if injected:
        adapters = [(name, m.adapter.config, m.adapter.hidden_size) for name, m in injected]
        trained = [p for p in trained_parameters(model) if not any(p is a.adapter.router.weight for _, a in injected)]
    else:
        config = config or MEFTConfig()
        adapters = [(name, config, ffn_hidden_size(ffn)) for name, ffn in find_ffns(model, config.target_modules)]
        trained = [] if config.freeze_base else trained_parameters(model)
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    sizes = MEFTSizes(trained=trained)
    for name, cfg, hidden in adapters:
        rows = cfg.row_bound(batch_size, batch_size * seq_len)
        sizes.routers.append(Entry(f"{name}.adapter.router.weight", "dense", (cfg.num_experts, hidden), 4))
        sizes.host_bytes += HOST_ARRAYS * cfg.num_neurons * hidden * 4
        routing_keys = cfg.num_neurons * hidden * 2 if cfg.routing == "device" else 0  # bf16
        sizes.device_bytes += hidden * STATISTICS_BYTES + routing_keys
        sizes.to_device += 2 * rows * hidden * itemsize
        sizes.to_host += 2 * rows * hidden * itemsize
        block = cfg.neurons_per_expert
        sizes.row_elements += 2 * min(cfg.num_neurons, -(-rows // block) * block) * hidden
    return sizes
