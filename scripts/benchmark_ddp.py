"""Step time and bytes between ranks of plain DDP, ``zero_offload_ddp`` and ``lsp_offload_ddp`` on 2 CPU processes.

Each method is one run of the command line (``lightning-offload-train``, so Lightning's launcher starts the second
process) on SmolLM2-135M with ``trainer.devices=2`` and gloo, one torch thread per process (the machine's 2 cores),
fp32, random projectors (no fit in the timed run), the same steps and data; methods are interleaved over
``--repeats`` so machine noise hits each alike. Reported per method: the median steady step seconds (from the run's
summary), and the bytes rank 0 handed to collectives per step, an all-reduce counted as two passes (a reduce and a
broadcast). Plain DDP's figure is computed, not measured: it all-reduces every fp32 gradient once, 2 × parameters ×
4 bytes in this count.

    python scripts/benchmark_ddp.py --out docs/benchmarks/ddp_cpu.json
    python scripts/benchmark_ddp.py --smoke       # the tiny LLaMA, 3 steps: checks the script end to end
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, spread, write_json

from lightning_offload.reporting.run_record import read_summary

METHODS = {
    "plain DDP (AdamW on the device)": ["offload=none"],
    "zero_offload_ddp": ["offload=zero"],
    "lsp_offload_ddp": ["offload=lsp", "offload.strategy.projectors=random"],
}


def run(method: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One 2-process run of ``method``; returns its summary."""
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    model = ["model=tiny_llama"] if args.smoke else []
    overrides = [*METHODS[method], *model, "trainer=cpu", "trainer.devices=2", "trainer.precision=32-true",
                 f"trainer.max_steps={args.steps}", "trainer.val_check_interval=100000", "eval_before=false",
                 "data.max_val_blocks=8", "trainer.limit_val_batches=2", "logger=none", f"seed={args.seed}",
                 f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "lightning_offload.cli.train", *overrides], env=env, text=True,
                          capture_output=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
    summary = read_summary(run_dir)
    assert summary is not None
    return summary


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per method: the median over repeats of the runs' step seconds and bytes between ranks."""
    rows = {}
    for method, runs in results.items():
        measured = spread(r["bytes_between_ranks_per_step"] for r in runs).median
        # Plain DDP all-reduces every fp32 gradient: counted, as the offload strategies count theirs, as two passes.
        bytes_per_step = measured if measured else runs[0]["trainable_parameters"] * 4.0 * 2
        rows[method] = {"median_step_seconds": spread(r["median_step_seconds"] for r in runs).median,
                        "bytes_between_ranks_per_step": bytes_per_step, "bytes_measured": bool(measured),
                        "host_state_bytes_rank0": runs[0]["host_state_bytes"], "runs": runs}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--smoke", action="store_true", help="tiny LLaMA, 3 steps, 1 repeat")
    add_standard_arguments(parser, repeats=3, seed=0, json_aliases=("--out",))
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 3, 1
    begin_run(args, __file__)
    settings = vars(args) | {"json": args.json and str(args.json)}
    with tempfile.TemporaryDirectory() as workdir:

        def measure(method: str, repeat: int) -> dict[str, Any]:
            summary = run(method, args, Path(workdir))
            return {"median_step_seconds": summary["median_step_seconds"],
                    # None where no offload strategy counts them (plain DDP).
                    "bytes_between_ranks_per_step": summary.get("bytes_between_ranks_per_step") or 0.0,
                    "trainable_parameters": summary["trainable_parameters"],
                    "host_state_bytes": summary.get("host_state_bytes")}

        def progress(method: str, repeat: int, result: dict[str, Any]) -> None:
            print(f"[{repeat + 1}/{args.repeats}] {method}: {result['median_step_seconds']:.2f} s/step", flush=True)
            partial[method].append(result)
            write_json(args.json, {"settings": settings, "runs": partial})  # a run cut short keeps what it measured

        partial: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
        rows = summarize(alternate(list(METHODS), args.repeats, measure, progress))
    against = ratios({method: row["median_step_seconds"] for method, row in rows.items()},
                     "plain DDP (AdamW on the device)")
    print()
    print(markdown_table(["method", "s/step", "× DDP", "MiB between ranks / step"],
                         [[method, f"{row['median_step_seconds']:.2f}", f"{against[method]:.2f}",
                           f"{row['bytes_between_ranks_per_step'] / 2**20:.1f}"
                           + ("" if row["bytes_measured"] else " (computed)")] for method, row in rows.items()]))
    write_json(args.json, {"settings": settings, "methods": rows})


if __name__ == "__main__":
    main()
