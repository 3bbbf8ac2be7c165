"""What an engine's slots share, one floor under them: the host worker, the link and its update ring, the ranks."""

from __future__ import annotations

import torch

from lightning_offload.engine.figures.phases import DISABLED, PhaseClock
from lightning_offload.engine.lanes.link import Link
from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.lanes.link import UpdateRing
from lightning_offload.engine.lanes.worker import HostWorker
from lightning_offload.engine.rules.host_rule import HostRule


class Lanes:
    """What the slots of one engine share: where the device is, the link and the dtype gradients cross it in, the
    host worker, the ring of device buffers compressed updates land in, the ranks (data parallelism), and the host
    rule every slot steps by.

    Args:
        device: the training device.
        link_dtype: dtype of gradients crossing to the host and compressed updates crossing back.
        leave_main_a_core: keep the worker thread off one core (an accelerator's kernel launches never wait).
        ranks: the ranks this engine trains with, or ``None`` for one process.
        rule: how the user's optimizer steps a tensor (:mod:`~lightning_offload.engine.rules`).
        phases: the engine's phase clock (:mod:`~lightning_offload.engine.figures.phases`).
    """

    def __init__(self, device: torch.device, link_dtype: torch.dtype, leave_main_a_core: bool,
                 ranks: RankShards | None, rule: HostRule, phases: PhaseClock = DISABLED) -> None:
        self.device = device
        self.rule = rule
        self.link_dtype = link_dtype
        self.link = Link(device)
        # With the CPU as the device and one process, host jobs run in the main thread (HostWorker explains why);
        # with ranks the thread stays: host jobs there wait on collectives in flight, measured only threaded.
        self.worker = HostWorker(leave_main_a_core=leave_main_a_core, inline=device.type == "cpu" and ranks is None,
                                 phases=phases)
        self.phases = phases
        self.ranks = ranks
        # Pinned host buffers only pay off with a CUDA device on the other end of the link.
        self.pin = device.type == "cuda"
        # Set once the projected slots are known (its buffers fit the largest compressed update).
        self.ring: UpdateRing | None = None
