"""What an engine's slots share, one floor under them: the host worker, the link and its update ring, the ranks, the
host jobs' working buffers."""

from __future__ import annotations

import logging

import torch

from lightning_offload.engine.figures.phases import DISABLED, PhaseClock
from lightning_offload.engine.lanes.host_scratch import HostScratch
from lightning_offload.engine.lanes.link import Link, UpdateRing
from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.lanes.simulated_link import simulated_link_for
from lightning_offload.engine.lanes.thread_split import ThreadSplit
from lightning_offload.engine.lanes.worker import HostWorker
from lightning_offload.engine.rules.host_rule import HostRule

log = logging.getLogger("lightning_offload")


class Lanes:
    """What the slots of one engine share: where the device is, the link and the dtype gradients cross it in, the
    host worker, the ring of device buffers compressed updates land in, the ranks (data parallelism), the host rule
    every slot steps by, and the host jobs' working buffers.

    Args:
        device: the training device.
        link_dtype: dtype of gradients crossing to the host and compressed updates crossing back.
        ranks: the ranks this engine trains with, or ``None`` for one process.
        rule: how the user's optimizer steps a tensor (:mod:`~lightning_offload.engine.rules`).
        phases: the engine's phase clock (:mod:`~lightning_offload.engine.figures.phases`).
    """

    def __init__(self, device: torch.device, link_dtype: torch.dtype, ranks: RankShards | None, rule: HostRule,
                 phases: PhaseClock = DISABLED) -> None:
        self.device = device
        self.rule = rule
        self.link_dtype = link_dtype
        simulated = simulated_link_for(device, log.info, one_process=ranks is None)
        self.link = simulated if simulated is not None else Link(device)
        # Under the simulated link the device is the main thread: it and the worker each keep to half of the cores.
        self.split = ThreadSplit.halves() if simulated is not None else None
        if self.split is not None:
            self.split.apply_to_main()
            log.info("lightning_offload: simulated link: %s.", self.split.describe())
        # Host jobs run in the main thread where the device's compute shares the host's cores (the CPU as the device,
        # not split by the simulation) and one process trains (HostWorker explains why); with ranks the thread stays:
        # host jobs there wait on collectives in flight, measured only threaded. An accelerator's launches never wait
        # for a core: the worker leaves it one.
        self.worker = HostWorker(leave_main_a_core=device.type != "cpu",
                                 inline=device.type == "cpu" and self.split is None and ranks is None, phases=phases,
                                 split=self.split)
        self.phases = phases
        self.ranks = ranks
        # Pinned host buffers need a CUDA build and only pay off with a CUDA device on the other end of the link.
        self.pin = device.type == "cuda"
        # Set once the projected slots are known (its buffers fit the largest compressed update).
        self.ring: UpdateRing | None = None
        # The host jobs' shared fp32 working buffers, reserved by the slots at set-up (host_scratch.py).
        self.scratch = HostScratch()

    def close(self) -> None:
        """Stop the worker and the link's own threads, and give the main thread back its cores."""
        self.worker.close()
        self.link.close()
        if self.split is not None:
            self.split.restore_main()
