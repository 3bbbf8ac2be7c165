"""The run summary: the figures printed at the end of a run and written to ``summary.json``, built from what the run
logged and the strategy's facts (never its internals), and their terminal form."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_offload.reporting.run_record import (
    RunRecorder,
    device_peak_bytes,
    host_peak_rss_bytes,
    optimizer_state_bytes,
)
from lightning_offload.setup.report import OffloadFacts, facts_of, fit_records_of


@dataclass(frozen=True)
class RunNames:
    """What a run trained: the model's name, the task, the offload policy, and the task's primary metric."""

    model: str
    task: str
    offload: str
    metric: str


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _device_trainable_bytes(module: pl.LightningModule, trainer: pl.Trainer, facts: OffloadFacts,
                            row_bytes_per_step: float) -> float:
    """Bytes of training state on the device: trainable parameters, their gradients and device optimizer state.

    Offload strategies stream gradients to the host tensor by tensor, so none persist on the device; under
    ``meft_offload`` the adapters add their buffers (routing keys, input statistics) and, per step, the fetched rows
    (keys and values, ``row_bytes_per_step`` as they crossed the link) and their gradients.
    """
    device = trainer.strategy.root_device.type
    params = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
                 and p.device.type == device)
    grads = 0 if facts.gradients_offloaded else params
    state = 0.0 if facts.gradients_offloaded else optimizer_state_bytes(trainer.optimizers)
    return float(params + grads + state + facts.adapter_device_bytes + 2 * row_bytes_per_step)


def summarize(names: RunNames, module: pl.LightningModule, trainer: pl.Trainer, recorder: RunRecorder,
              before: dict[str, float], after: dict[str, float], train_seconds: float) -> dict[str, Any]:
    """The figures printed at the end of a run and written to ``summary.json``, from the figures the run logged
    (``recorder``), the strategy's facts and the evaluations before and after training.

    Args:
        names: what ran (model, task, offload policy) and the task's primary metric.
        module: the trained LightningModule. trainer: its Trainer.
        recorder: the run's logged figures.
        before, after: the evaluations' metrics. train_seconds: this session's training time.
    """
    metric = names.metric
    telemetry = recorder.telemetry
    steps = [r for r in recorder.records if r["kind"] == "train"]
    steady = steps[2:] or steps  # the first steps include warm-up

    def med(key: str) -> float:
        return _median([r[key] for r in steady if key in r]) or 0.0

    facts = facts_of(trainer.strategy)
    # MEFT's adapter rows live on the host as plain tensors, not module parameters: Lightning's model summary does
    # not count them.
    host_rows = facts.host_trainable_parameters
    summary: dict[str, Any] = {
        "model": names.model,
        "task": names.task,
        "offload": names.offload,
        "strategy": type(trainer.strategy).__name__,
        "precision": str(trainer.precision),
        "steps": trainer.global_step,
        # A resumed run: the steps taken in this session (train_seconds and the step times are this session's).
        "steps_this_run": trainer.global_step - recorder.start_step,
        # Offload strategies file every step's figures, the skipped count among them (0 for other strategies).
        "skipped_steps": int(telemetry[-1].get("offload/skipped_steps", 0)) if telemetry else 0,
        "projected_layers": facts.projected_layers,
        # The kernel each distinct product of the projected layers ran on (chosen by timing them on this device).
        "kernels": dict(facts.kernels),
        "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad) + host_rows,
        "host_trainable_parameters": host_rows,
        "device": str(trainer.strategy.root_device),
        "device_peak_bytes": device_peak_bytes(trainer.strategy.root_device),
        "host_peak_rss_bytes": host_peak_rss_bytes(),
        "device_trainable_bytes": _device_trainable_bytes(module, trainer, facts, med("meft/bytes_host_to_device")),
        "rows_moved_per_step": med("meft/rows_moved") or None,
        # The share of all adapter rows a step moves: the link bytes against moving the whole adapter, in any dtype.
        "rows_share_per_step": (med("meft/rows_moved") / facts.adapter_rows) if facts.adapter_rows else None,
        # What moving every adapter row each way would cost: MEFT's link bytes are compared with it.
        "whole_adapter_bytes": float(host_rows * 4) or None,
        # Dense/compressed offload traffic plus, under meft_offload, the adapter rows' traffic.
        "link_bytes_to_host_per_step": med("offload/bytes_device_to_host") + med("meft/bytes_device_to_host"),
        # Data parallelism: what rank 0 handed to collectives per step (0 on one device; None where no offload
        # strategy counts them, e.g. Lightning's own DDP).
        "bytes_between_ranks_per_step": _median([r["offload/bytes_between_ranks"] for r in steady
                                                 if "offload/bytes_between_ranks" in r]),
        "world_size": trainer.world_size,
        "link_bytes_to_device_per_step": med("offload/bytes_host_to_device") + med("meft/bytes_host_to_device"),
        "host_optimizer_seconds_per_step": med("offload/host_optimizer_seconds") + med("meft/host_optimizer_seconds"),
        "host_state_bytes": (telemetry[-1]["offload/host_state_bytes"] if telemetry else 0.0)
        + facts.host_rows_bytes,
        "device_state_bytes": (telemetry[-1]["offload/device_state_bytes"] if telemetry
                               else optimizer_state_bytes(trainer.optimizers)),
        "median_step_seconds": _median(recorder.step_seconds[2:] or recorder.step_seconds),
        "train_seconds": train_seconds,
        "loss_before": before.get("val/loss"),
        "loss_after": after.get("val/loss"),
        "metric": metric,
        "metric_before": before.get(metric),
        "metric_after": after.get(metric),
    }
    fits = fit_records_of(trainer.callbacks)
    if fits:
        first = fits[0]
        summary["projector_fit_seconds"] = first.seconds
        summary["projector_error_drawn"] = statistics.fmean(first.errors.values())
        summary["projector_error_fitted"] = statistics.fmean(first.fitted_errors.values())
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as aligned lines for the terminal."""
    mib = 1024**2

    def num(value: Any, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    def size(value: float | None) -> str:
        if value is None:
            return "n/a"
        # Tiny models move kilobytes: a fixed MiB format would print them as 0.
        for unit, scale in (("GiB", 1024**3), ("MiB", mib), ("KiB", 1024)):
            if value >= scale:
                return f"{value / scale:.1f} {unit}"
        return f"{value:.0f} B"

    peak = summary["device_peak_bytes"]
    device_memory = (f"{peak / mib:.0f} MiB peak on {summary['device']}" if peak is not None else
                     f"n/a on {summary['device']} (host peak RSS {summary['host_peak_rss_bytes'] / mib:.0f} MiB)")
    step = summary["median_step_seconds"]
    this_run = summary.get("steps_this_run", summary["steps"])
    steps_line = (f"steps               {summary['steps']} in {summary['train_seconds']:.1f} s "
                  f"(median {num(step, '.2f')} s / step)")
    if this_run != summary["steps"]:
        steps_line = (f"steps               {summary['steps']}, resumed at step {summary['steps'] - this_run}: "
                      f"{this_run} in {summary['train_seconds']:.1f} s (median {num(step, '.2f')} s / step)")
    lines = [
        f"model               {summary['model']}  ({summary['task']})",
        f"offload             {summary['offload']} ({summary['strategy']}, {summary['precision']})",
        f"trainable params    {summary['trainable_parameters']:,}" + (
            f" ({summary['trainable_parameters'] - host_rows:,} module parameters, which Lightning's model summary "
            f"counts, + {host_rows:,} adapter rows held on the host)" if (host_rows := summary.get(
                "host_trainable_parameters") or 0) else ""),
        f"device memory       {device_memory}",
        f"link bytes / step   {size(summary['link_bytes_to_host_per_step'])} to host, "
        f"{size(summary['link_bytes_to_device_per_step'])} to device",
        *([f"between ranks       {size(summary['bytes_between_ranks_per_step'])} / step from rank 0 "
           f"({summary['world_size']} ranks)"] if summary.get("world_size", 1) > 1 else []),
        f"host optimizer      {summary['host_optimizer_seconds_per_step'] * 1e3:.0f} ms / step, "
        f"state {size(summary['host_state_bytes'])} on host, {size(summary['device_state_bytes'])} on device",
        *([f"run size            {summary['run_size']['description']}"]
          if summary.get("run_size", {}).get("sized_to_machine") else []),
        steps_line
        + (f", {summary['skipped_steps']} skipped (non-finite gradients)" if summary.get("skipped_steps") else ""),
        f"eval loss           {num(summary['loss_before'], '.4f')} -> {num(summary['loss_after'], '.4f')}",
        *([f"held-out text loss  {num(summary['heldout_loss_before'], '.4f')} -> "
           f"{num(summary['heldout_loss_after'], '.4f')} ({summary['heldout_task']}, never trained on)"]
          if "heldout_loss_after" in summary else []),
    ]
    if summary["metric"] != "val/loss":
        lines.append(f"{summary['metric']:<20}{num(summary['metric_before'], '.4f')} -> "
                     f"{num(summary['metric_after'], '.4f')}")
    if "projector_fit_seconds" in summary:
        lines.append(f"projector fit       {summary['projector_fit_seconds']:.1f} s, mean error "
                     f"{summary['projector_error_drawn']:.3f} -> {summary['projector_error_fitted']:.3f} (held-out)")
    if summary.get("interrupted"):
        lines.append(f"interrupted         Ctrl-C: stopped after step {summary['steps']}; checkpoint "
                     f"{summary['checkpoint']}")
        lines.append(f"resume with         {summary['resume_command']}")
    return "\n".join(lines)
