"""The :class:`Plan` value: its figures under the run's own names (so a run is compared with its plan figure by
figure), its printable table, and the prediction errors of a finished run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_offload.planning.cost import StepTime

_GIB = 2**30


@dataclass(frozen=True)
class Plan:
    """A predicted run.

    Attributes:
        strategy: ``"auto"``, ``"zero_offload"``, ``"lsp_offload"`` or ``"meft_offload"``.
        settings: the strategy's settings that differ from their defaults.
        batch_size, seq_len, precision: the step planned.
        gradient_checkpointing: whether ``device_bytes`` is with every block checkpointed.
        device_bytes: peak device bytes (weights, gradients as the engine keeps them, device state and buffers,
            activations).
        device_bytes_by_checkpointing: the peak without (``False``) and with (``True``) gradient checkpointing.
        device_parts: ``device_bytes``' parts.
        host_bytes: host bytes of the optimizer (masters, moments, buffers; MEFT's rows).
        host_state_bytes: the engine's part of it (``offload/host_state_bytes``).
        host_rows_bytes: MEFT's adapter rows (the run summary adds them to ``host_state_bytes``).
        host_speculation_bytes: the speculative host steps' backups, part of ``host_state_bytes`` (``speculative``
            is on for a GPU by default; ``speculative=False`` saves them and overlaps less).
        link_bytes_to_host, link_bytes_to_device: bytes over the link per step, each way.
        device_memory, host_memory: what the plan was checked against (0: unknown).
        fits_device, fits_host: whether it fits (the device: within ``device_memory × (1 − headroom)``; the host:
            ``host_needed_bytes`` within ``host_memory``).
        step: the predicted step and its parts.
        hardware: the machine the step time is for.
        persistent: the offload machinery's device bytes between steps, by category.
        projected_layers: layers projected (or scaled).
        notes: what the placement decided, one line each.
        optimizer: the user's optimizer planned for (its state is what the host keeps; shown where not AdamW).
        step_is_lower_bound: the step time leaves out what dominates on this hardware (a CPU: the model's own Python,
            autograd and elementwise work), so a run takes longer; said in the table.
        device_shares_host_memory: the device is the CPU, whose memory is the host's: ``fits_host`` counts both, and
            the table says so.
        headroom: the share of ``device_memory`` kept free (the allocator's fragmentation, the CUDA context).
    """

    strategy: str
    settings: dict[str, Any]
    batch_size: int
    seq_len: int
    precision: str
    gradient_checkpointing: bool
    device_bytes: int
    device_bytes_by_checkpointing: dict[bool, int]
    device_parts: dict[str, int]
    host_bytes: int
    host_state_bytes: int
    host_rows_bytes: int
    host_speculation_bytes: int
    link_bytes_to_host: int
    link_bytes_to_device: int
    device_memory: int
    host_memory: int
    fits_device: bool
    fits_host: bool
    step: StepTime
    hardware: str
    persistent: dict[str, int] = field(default_factory=dict)
    projected_layers: int = 0
    notes: tuple[str, ...] = ()
    step_is_lower_bound: bool = False
    optimizer: str = "AdamW"
    device_shares_host_memory: bool = False
    headroom: float = 0.0

    def _host_line(self, verdict: str) -> str:
        """The host memory row: on a CPU device, the device's bytes are in the same memory and counted with it."""
        memory = gib(self.host_memory) if self.host_memory else "?"
        rows = f" (adapter rows {gib(self.host_rows_bytes)})" if self.host_rows_bytes else ""
        if self.host_speculation_bytes:
            rows += f" (speculation backups {gib(self.host_speculation_bytes)})"
        if self.device_shares_host_memory:
            return (f"{gib(self.host_bytes)}{rows} + the CPU device's {gib(self.device_bytes)} in the same memory = "
                    f"{gib(self.host_bytes + self.device_bytes)} of {memory}: {verdict}")
        return f"{gib(self.host_bytes)} of {memory}: {verdict}{rows}"

    @property
    def fits(self) -> bool:
        """Fits the device and the host."""
        return self.fits_device and self.fits_host

    @property
    def device_usable_bytes(self) -> float:
        """The device bytes a run may reach and fit: ``device_memory`` less the headroom."""
        return self.device_memory * (1 - self.headroom)

    @property
    def host_needed_bytes(self) -> int:
        """The host bytes ``fits_host`` counts: the optimizer's, and a CPU device's own in the same memory."""
        return self.host_bytes + (self.device_bytes if self.device_shares_host_memory else 0)

    @property
    def link_bytes_per_step(self) -> int:
        """Both directions."""
        return self.link_bytes_to_host + self.link_bytes_to_device

    @property
    def step_seconds(self) -> float:
        """The predicted step time."""
        return self.step.step

    @property
    def tokens_per_second(self) -> float:
        """Predicted throughput."""
        return self.batch_size * self.seq_len / self.step.step if self.step.step > 0 else 0.0

    def figures(self) -> dict[str, float]:
        """The plan's figures under the names the run logs: the engine's ``offload/*`` telemetry (per step) and the run
        summary's keys (``summary.json``), each prefixed ``plan/``."""
        figures = {
            "plan/offload/host_state_bytes": self.host_state_bytes,
            "plan/offload/bytes_device_to_host": self.link_bytes_to_host,
            "plan/offload/bytes_host_to_device": self.link_bytes_to_device,
            "plan/offload/device_state_bytes": 0,
            **{f"plan/offload/device_persistent_bytes/{k}": v for k, v in self.persistent.items()},
            "plan/offload/timeline/device_seconds": self.step.device,
            "plan/offload/timeline/host_seconds": self.step.host,
            "plan/offload/timeline/link_seconds": self.step.link,
            "plan/offload/host_optimizer_seconds": self.step.host,
        }
        figures.update({f"plan/{name}": value for name, value in self.summary_figures().items()})
        figures["plan/fits"] = float(self.fits)
        return {name: float(value) for name, value in figures.items()}

    def summary_figures(self) -> dict[str, float]:
        """The figures the run summary also holds, under its keys."""
        return {"host_state_bytes": self.host_bytes, "link_bytes_to_host_per_step": self.link_bytes_to_host,
                "link_bytes_to_device_per_step": self.link_bytes_to_device, "device_peak_bytes": self.device_bytes,
                "median_step_seconds": self.step.step, "host_optimizer_seconds_per_step": self.step.host}

    def record(self) -> dict[str, Any]:
        """The plan as plain values (for the run's record and JSON)."""
        return {"strategy": self.strategy, "settings": {k: str(v) if not isinstance(v, (int, float, str, bool))
                                                        else v for k, v in self.settings.items()},
                "batch_size": self.batch_size, "seq_len": self.seq_len, "precision": self.precision,
                "gradient_checkpointing": self.gradient_checkpointing, "hardware": self.hardware,
                "fits": self.fits, "fits_device": self.fits_device, "fits_host": self.fits_host,
                "device_parts": dict(self.device_parts),
                "device_bytes_without_checkpointing": self.device_bytes_by_checkpointing[False],
                "device_bytes_with_checkpointing": self.device_bytes_by_checkpointing[True],
                **self.summary_figures(), "step_device_seconds": self.step.device,
                "step_link_seconds": self.step.link, "step_exposed_seconds": self.step.exposed}

    def table(self) -> str:
        """The plan as a printable table."""
        shown = ", ".join(f"{k}={v!r}" for k, v in self.settings.items()) or "defaults"
        ok = lambda fits: "fits" if fits else "DOES NOT FIT"  # noqa: E731
        rows = [
            ("strategy", f"{self.strategy} ({shown}); "
                         + (f"{self.optimizer}; " if self.optimizer != "AdamW" else "")
                         + f"{self.precision}; {self.projected_layers} projected layers"),
            ("step", f"batch {self.batch_size} × {self.seq_len} tokens, gradient checkpointing "
                     f"{'on' if self.gradient_checkpointing else 'off'}"),
            ("device memory", f"{gib(self.device_bytes)} of {gib(self.device_memory)}: {ok(self.fits_device)} "
                              f"(checkpointing off {gib(self.device_bytes_by_checkpointing[False])}, on "
                              f"{gib(self.device_bytes_by_checkpointing[True])})"),
            ("  parts", ", ".join(f"{k} {gib(v)}" for k, v in self.device_parts.items() if v)),
            ("host memory", self._host_line(ok(self.fits_host))),
            ("link / step", f"{self.link_bytes_to_host / 2**20:,.1f} MiB to host, "
                            f"{self.link_bytes_to_device / 2**20:,.1f} MiB to device"),
            ("step time", f"{self.step.step:.3f} s ({self.tokens_per_second:,.0f} tokens/s) on {self.hardware}"
                          + (" (a lower bound on a CPU: the model's own Python, autograd and elementwise work are "
                             "not modelled)" if self.step_is_lower_bound else "")),
            ("  parts", f"device {self.step.device:.3f} s, link {self.step.link:.3f} s, host Adam "
                        f"{self.step.host:.3f} s, not overlapped {self.step.exposed:.3f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def gib(value: float) -> str:
    """``value`` bytes in GiB, for tables."""
    return f"{value / _GIB:.2f} GiB"


def prediction_errors(plan_figures: Mapping[str, float], measured: Mapping[str, Any]) -> dict[str, float]:
    """Each predicted figure's relative error against a finished run's summary: ``(measured − predicted) /
    predicted``, as ``plan_error/<summary key>``, for the figures both hold (measured ones that are missing, zero
    or ``None`` are left out: a CPU run has no device peak)."""
    errors = {}
    for name, predicted in plan_figures.items():
        key = name.removeprefix("plan/")
        value = measured.get(key)
        if "/" in key or not isinstance(value, (int, float)) or not value or not predicted:
            continue
        errors[f"plan_error/{key}"] = (float(value) - predicted) / predicted
    return errors
