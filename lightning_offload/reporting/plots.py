"""``lightning-offload-plots``: figures comparing the runs of a sweep (or any set of runs).

Reads every run directory below the given paths (a directory holding the ``history.jsonl`` that ``train()`` writes,
and its ``summary.json`` when the run finished) and writes PNGs:

- ``eval_vs_step.png`` and ``eval_vs_time.png``: the evaluation loss (and the task's metric when it is not the loss)
  against optimizer steps and against wall time since the start of ``fit``, with each run's projector fit shaded;
- ``link_bytes.png``: bytes over the link per step, each way;
- ``memory.png``: training state on the device (parameters, gradients, optimizer state) and optimizer state on the
  host, the same quantities as ``summary.md``, and the device's peak memory on a GPU run;
- ``step_time.png``: median seconds per step;
- ``summary.md``: one table row per finished run (the figures of its ``summary.json``), also printed.

Every figure's title says what was run (model, task, steps). Runs are labelled by the overrides that differ between
them (``offload=zero``, ``offload.strategy.rank=0.125``), so a sweep's legend says what was swept; each run has its
own line style and marker, so curves that coincide (``zero`` and ``none`` train identically) stay visible.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_offload.reporting.run_record import HISTORY_FILE, read_history, read_summary

MIB = 1024**2


@dataclass
class Run:
    """One run directory's records."""

    path: Path
    history: list[dict[str, Any]]
    summary: dict[str, Any] | None
    overrides: list[str] = field(default_factory=list)
    label: str = ""

    def evaluations(self) -> list[dict[str, Any]]:
        """Validation records in step order."""
        return sorted((r for r in self.history if r.get("kind") == "val"), key=lambda r: r["step"])


def _read_overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def find_runs(paths: Sequence[str | os.PathLike[str]]) -> list[Run]:
    """Every run directory at or below ``paths``, labelled by the overrides that tell them apart.

    Raises:
        FileNotFoundError: If a path does not exist or no run is found.
    """
    dirs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist; pass a run directory or a sweep directory "
                                    f"(logs/<task_name>/multiruns/<time>).")
        dirs += sorted({f.parent for f in p.rglob(HISTORY_FILE)}, key=lambda d: (len(d.parts), str(d)))
    if not dirs:
        raise FileNotFoundError(f"No runs ({HISTORY_FILE}) found under {', '.join(map(str, paths))}.")
    runs = [Run(d, read_history(d), read_summary(d), _read_overrides(d)) for d in dirs]
    common = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    for run in runs:
        varying = [o for o in run.overrides if o not in common]
        name = (run.summary or {}).get("offload")
        if varying:
            run.label = ", ".join(varying)
        elif name:
            run.label = name if len(runs) == 1 else f"{name} ({run.path.name})"
        else:
            run.label = run.path.name
    return runs


def _metric_names(runs: list[Run]) -> list[str]:
    names = ["val/loss"]
    for run in runs:
        metric = (run.summary or {}).get("metric")
        if metric and metric not in names:
            names.append(metric)
    return names


LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def context(runs: list[Run]) -> str:
    """What the runs ran, for figure titles: model, task and steps (each once when shared, else listed)."""
    summaries = [run.summary for run in runs if run.summary is not None]

    def shared(key: str, unit: str = "") -> str:
        values = list(dict.fromkeys(str(s.get(key)) for s in summaries if s.get(key) is not None))
        return ", ".join(values) + unit if values else ""

    parts = [shared("model"), shared("task"), shared("steps", " steps")]
    return " · ".join(p for p in parts if p) or ", ".join(run.label for run in runs)


def _fit_span(run: Run) -> tuple[float, float] | None:
    """Wall-clock span of the run's initial projector fit: it ends where the first step starts."""
    seconds = (run.summary or {}).get("projector_fit_seconds")
    first = next((r for r in run.history if r.get("kind") == "train"), None)
    if not seconds or first is None:
        return None
    end = first["wall_seconds"] - first.get("step_seconds", 0.0)
    return max(0.0, end - seconds), end


def _curves(runs: list[Run], x_key: str, x_label: str, out: Path) -> Path:
    import matplotlib.pyplot as plt

    metrics = _metric_names(runs)
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for index, run in enumerate(runs):
            style = dict(linestyle=LINE_STYLES[index % len(LINE_STYLES)], marker=MARKERS[index % len(MARKERS)],
                         markersize=4, markerfacecolor="none", linewidth=1.6, alpha=0.9)
            points = [(r[x_key], r[metric]) for r in run.evaluations() if metric in r]
            if not points:
                continue
            xs, ys = zip(*points)
            (line,) = ax.plot(xs, ys, label=run.label, **style)
            span = _fit_span(run) if x_key == "wall_seconds" else None
            if span is not None:
                ax.axvspan(*span, color=line.get_color(), alpha=0.12, linewidth=0,
                           label=f"projector fit ({run.label})")
        ax.set_xlabel(x_label)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} against {x_label.split(' (')[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(context(runs), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _bars(runs: list[Run], series: dict[str, list[float]], ylabel: str, title: str, out: Path) -> Path:
    import matplotlib.pyplot as plt

    labels = [run.label for run in runs]
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(runs) + 2), 4.2))
    for i, (name, values) in enumerate(series.items()):
        positions = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        bars = ax.bar(positions, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{context(runs)}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _summary_value(run: Run, key: str) -> float:
    value = (run.summary or {}).get(key)
    return float(value) if value is not None else 0.0


def _mib(value: float | None) -> float | None:
    return None if value is None else value / MIB


#: For language modelling the summary's metric is the loss itself; the table shows the next-token accuracy (or the
#: perplexity) from the evaluations instead, so its metric column says something the loss column does not.
LM_METRICS = ("val/token_acc", "val/ppl")


def display_metric(run: Run) -> tuple[str, float | None, float | None] | None:
    """``(name, before, after)`` of the run's metric column: the task's metric, or an LM's token accuracy."""
    s = run.summary or {}
    if s.get("metric") and s["metric"] != "val/loss":
        return s["metric"], s.get("metric_before"), s.get("metric_after")
    evaluations = run.evaluations()
    for name in LM_METRICS:
        values = [r[name] for r in evaluations if name in r]
        if values:
            return name, values[0], values[-1]
    return None


def summary_table(runs: list[Run]) -> str:
    """A Markdown table of the finished runs' summaries (memory columns as in ``memory.png``)."""
    header = ("| run | steps | eval loss | metric | s / step | link MiB / step (to host, to device) | "
              "device training state MiB | host optimizer state MiB | device peak MiB |")
    lines = [f"{context(runs)}", "", header, "|---" * (header.count("|") - 1) + "|"]

    def num(value: Any, fmt: str) -> str:
        return "–" if value is None else format(value, fmt)

    for run in runs:
        s = run.summary
        if s is None:
            continue
        shown = display_metric(run)
        metric = "" if shown is None else f"{shown[0]} {num(shown[1], '.4f')} → {num(shown[2], '.4f')}"
        lines.append(
            f"| {run.label} | {s['steps']} | {num(s['loss_before'], '.4f')} → {num(s['loss_after'], '.4f')} | "
            f"{metric} | {num(s['median_step_seconds'], '.2f')} | "
            f"{s['link_bytes_to_host_per_step'] / MIB:.1f}, {s['link_bytes_to_device_per_step'] / MIB:.1f} | "
            f"{num(_mib(s.get('device_trainable_bytes')), '.1f')} | {s['host_state_bytes'] / MIB:.1f} | "
            f"{num(_mib(s.get('device_peak_bytes')), '.0f')} |")
    return "\n".join(lines)


def plot_runs(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Writes the comparison figures for the runs under ``paths`` into ``out_dir``; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    except ImportError as error:
        raise ImportError("Plots need matplotlib: pip install 'lightning_offload[plots]'.") from error
    runs = find_runs(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        _curves(runs, "step", "optimizer step", out / "eval_vs_step.png"),
        _curves(runs, "wall_seconds", "wall time (s since fit start)", out / "eval_vs_time.png"),
    ]
    finished = [run for run in runs if run.summary is not None]
    if finished:
        written.append(_bars(finished, {
            "to host": [_summary_value(r, "link_bytes_to_host_per_step") / MIB for r in finished],
            "to device": [_summary_value(r, "link_bytes_to_device_per_step") / MIB for r in finished],
        }, "MiB per step", "Link bytes per step", out / "link_bytes.png"))
        # The same two quantities as summary.md's memory columns.
        memory = {
            "device training state (params, grads, optimizer)": [
                _summary_value(r, "device_trainable_bytes") / MIB for r in finished],
            "host optimizer state": [_summary_value(r, "host_state_bytes") / MIB for r in finished],
        }
        # Peak memory is measured only on CUDA (on a CPU run the "device" is the host process itself).
        if any(r.summary.get("device_peak_bytes") is not None for r in finished):
            memory["device peak"] = [_summary_value(r, "device_peak_bytes") / MIB for r in finished]
        written.append(_bars(finished, memory, "MiB", "Memory", out / "memory.png"))
        written.append(_bars(finished, {
            "median step": [_summary_value(r, "median_step_seconds") for r in finished],
        }, "seconds", "Median time per optimizer step", out / "step_time.png"))
        table = out / "summary.md"
        table.write_text(summary_table(finished) + "\n", encoding="utf-8")
        written.append(table)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning-offload-plots``."""
    parser = argparse.ArgumentParser(description="PNG figures comparing the runs of a sweep.")
    parser.add_argument("paths", nargs="+", help="sweep directories (logs/<task>/multiruns/<time>) or run directories")
    parser.add_argument("--out", default=None, help="output directory (default: <first path>/plots)")
    args = parser.parse_args(argv)
    out = args.out or str(Path(args.paths[0]) / "plots")
    try:
        files = plot_runs(args.paths, out)
    except (FileNotFoundError, ImportError) as error:
        parser.exit(2, f"lightning-offload-plots: error: {error}\n")
    for f in files:
        print(f)
    table = Path(out) / "summary.md"
    if table.is_file():
        print("\n" + table.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
