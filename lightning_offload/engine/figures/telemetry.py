"""Per-step figures the offload strategies keep and hand to the trainer's loggers."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_offload.engine.figures.timeline import LANES


@dataclass
class StepTelemetry:
    """What one optimizer step cost.

    Attributes:
        bytes_device_to_host: gradient bytes copied over the link to the host.
        bytes_host_to_device: update / parameter bytes copied back.
        host_optimizer_seconds: wall time of the host Adam work (all host optimizers of the step).
        skipped: 1.0 when the step was skipped for non-finite gradients, else 0.0.
        host_page_faults: minor page faults the host worker took during the step's jobs (Linux; 0 elsewhere). In
            steady state it should be 0: every host buffer is preallocated, and a fault means a fresh allocation.
        speculative_steps: tensors whose host step ran during backward and was confirmed at the step.
        rolled_back_steps: tensors whose speculative step was rolled back and redone (clipping fired, a gradient or
            hyper-parameter changed after it started).
        host_share_before_backward_end: share of the step's host Adam seconds that ran before its backward ended.
        device_compressed_grad_bytes: bytes of the compressed gradients ``S`` held on the device when the step was
            launched (transient: each is released once sent).
        device_saved_projection_bytes: bytes of ``B Xᵀ`` the step's forwards kept for backward (transient: the
            projected layers' share of saved activations, in place of their inputs).
        device_held_gradient_bytes: bytes of full gradients the device held from the step until their scales were
            applied (``update="scaled"``: the scaled weights' gradients, as native training holds until its step).
        sparse_rows: rows of row-sparse embeddings (``embeddings="sparse"``) that crossed and were stepped.
        bytes_between_ranks: with data parallelism, the bytes this rank handed to collectives for one step: its
            gradient buckets, the global norm, and the updates it broadcast or received (payload sizes; see
            :mod:`lightning_offload.engine.lanes.ranks`). 0 for one process.
        deferred_sends: tensors whose gradient crossed at the step's launch rather than during backward, the deepest
            layers' while the link lags behind backward (:mod:`~lightning_offload.engine.step.send_deferral`).
    """

    bytes_device_to_host: float = 0.0
    bytes_host_to_device: float = 0.0
    host_optimizer_seconds: float = 0.0
    skipped: float = 0.0
    host_page_faults: float = 0.0
    speculative_steps: float = 0.0
    rolled_back_steps: float = 0.0
    host_share_before_backward_end: float = 0.0
    device_compressed_grad_bytes: float = 0.0
    device_saved_projection_bytes: float = 0.0
    device_held_gradient_bytes: float = 0.0
    sparse_rows: float = 0.0
    bytes_between_ranks: float = 0.0
    deferred_sends: float = 0.0


@dataclass
class OffloadTelemetry:
    """Running figures of an offload optimizer; ``last`` is the latest step, the rest are totals or sizes.

    Attributes:
        last: the latest step's figures.
        steps: optimizer steps taken (skipped ones excluded).
        skipped_steps: steps skipped because a gradient was non-finite.
        host_state_bytes: bytes of optimizer state held on the host (moments, fp32 masters, update buffers).
        device_state_bytes: bytes of optimizer state found on the device — measured, expected to be 0.
        device_persistent_bytes: bytes the offload machinery keeps on the device between steps, by category:
            ``projectors`` (indices, values, CSR structure), ``update_ring`` (buffers updates land in),
            ``scaled_projections`` (the scaled rule's ``P`` of every scaled weight) and
            ``device_optimizer`` (state and fp32 masters of parameters kept on the device with a device Adam).
        update_ring_fallbacks: compressed updates so far that found no free buffer in the device update ring and were
            copied into a one-off allocation instead (costs speed, not correctness; raise ``update_buffers``).
        kernel_products: distinct products of the projected layers (by shape and kind) per kernel that runs them
            (:mod:`lightning_offload.lsp.kernels.selection`), as chosen so far; logged as
            ``offload/kernel_products/<kernel>``.
        data_parallel: whether the engine trains with other ranks (``bytes_between_ranks`` is logged only then).
        last_timeline: the latest completed step's
            :class:`~lightning_offload.engine.figures.timeline.StepTimeline` (busy seconds per lane: device compute,
            link each way, host Adam, device waiting for updates).
        completed: ``(optimizer step number, metrics())`` of the latest completed steps (skipped ones included),
            so a reader that looks only now and then misses none: a pipelined step completes during the next one,
            and a skip right after it completes in the same call.
    """

    last: StepTelemetry = field(default_factory=StepTelemetry)
    steps: int = 0
    skipped_steps: int = 0
    host_state_bytes: int = 0
    device_state_bytes: int = 0
    device_persistent_bytes: dict[str, int] = field(default_factory=dict)
    update_ring_fallbacks: int = 0
    kernel_products: dict[str, int] = field(default_factory=dict)
    last_timeline: Any = None
    data_parallel: bool = False
    completed: deque[tuple[int, dict[str, float]]] = field(default_factory=lambda: deque(maxlen=64), repr=False)

    def metrics(self) -> dict[str, float]:
        """Flat scalars for a logger, named ``offload/<figure>``."""
        flat = {f"offload/{key}": float(value) for key, value in asdict(self.last).items()
                if self.data_parallel or key != "bytes_between_ranks"}  # always 0 on one process: not logged
        if self.last_timeline is not None:
            for lane in LANES:
                flat[f"offload/timeline/{lane}_seconds"] = self.last_timeline.busy(lane)
        flat.update(
            {
                "offload/skipped_steps": float(self.skipped_steps),
                "offload/host_state_bytes": float(self.host_state_bytes),
                "offload/device_state_bytes": float(self.device_state_bytes),
                "offload/update_ring_fallbacks": float(self.update_ring_fallbacks),
            }
        )
        for category, size in self.device_persistent_bytes.items():
            flat[f"offload/device_persistent_bytes/{category}"] = float(size)
        for kernel, products in self.kernel_products.items():
            flat[f"offload/kernel_products/{kernel}"] = float(products)
        return flat

    def complete_step(self) -> None:
        """Files the figures of the step just completed or skipped under its optimizer step number."""
        self.completed.append((self.steps + self.skipped_steps, self.metrics()))

    def state_dict(self) -> dict[str, int]:
        """Counters that a resumed run continues from."""
        return {"steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
