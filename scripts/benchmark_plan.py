"""The planner against measured runs (issue 44 item 4, issue 55 item 6): on this CPU, for five shapes (a small LLaMA, a
GPT-2 shape, the real SmolLM2-135M, and the two shapes of ``benchmark_small_step.py``; fp32), the plan's host bytes
and link bytes per step against the engine's telemetry, and the predicted step-time ratio of ``lsp_offload`` to plain
fused AdamW against the measured one.

Each shape trains a few steps with plain fused AdamW and with ``lightning_offload.offload(..., "lsp_offload")`` (a
loop of its own, no Lightning), interleaved over ``--repeats`` so that machine noise hits both alike; a run's figure is
the median of its steps after ``--warmup``, the shape's the median over repeats. The machine is calibrated once at
the start (``calibrate(cache=False)``), and the CPU and torch are printed with every table.

    python scripts/benchmark_plan.py --repeats 3
    python scripts/benchmark_plan.py --shapes llama gpt2     # without SmolLM2
    python scripts/benchmark_plan.py --shapes small h1024 --threads 2   # issue 55's shapes, as the small step runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import lightning_offload
from lightning_offload.models.tiny import tiny_gpt2, tiny_llama
from lightning_offload.planning.calibration import Hardware, calibrate
from lightning_offload.planning.plan import plan

#: name → (builder, batch size, sequence length, vocabulary).
SHAPES: dict[str, tuple[Callable[[], torch.nn.Module], int, int]] = {
    "llama": (lambda: tiny_llama(vocab_size=8192, hidden=256, intermediate=704, heads=8, kv_heads=4, layers=4,
                                 seed=0, tie_word_embeddings=False), 8, 128),
    "gpt2": (lambda: tiny_gpt2(vocab_size=8192, hidden=256, layers=4, heads=4, intermediate=1024, seed=0), 8, 128),
    "smollm2": (lambda: __import__("lightning_offload.models.smollm2", fromlist=["load_smollm2"]).load_smollm2()[0],
                4, 128),
    # The two shapes of scripts/benchmark_small_step.py (issue 55's): hidden 256 with a 256-token vocabulary, and
    # hidden 1024, each 4 layers, tied, 8×128 tokens.
    "small": (lambda: tiny_llama(vocab_size=256, hidden=256, intermediate=704, heads=8, kv_heads=4, layers=4, seed=0),
              8, 128),
    "h1024": (lambda: tiny_llama(vocab_size=8192, hidden=1024, intermediate=2816, heads=8, kv_heads=4, layers=4,
                                 seed=0), 8, 128),
}
NAMES = {"llama": "small LLaMA (h256, 4 layers, vocab 8192, untied)",
         "gpt2": "GPT-2 shape (h256, 4 layers, vocab 8192)", "smollm2": "SmolLM2-135M (real weights, tied)",
         "small": "small step's small shape (h256, 4 layers, vocab 256, tied)",
         "h1024": "small step's hidden 1024 (4 layers, vocab 8192, tied)"}


def _batch(model: torch.nn.Module, batch: int, seq: int, seed: int) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (batch, seq), generator=generator)


def measure(shape: str, strategy: str, steps: int, warmup: int) -> tuple[float, dict[str, float]]:
    """Median step seconds of one run, and the engine's byte figures (none for plain AdamW)."""
    build, batch, seq = SHAPES[shape]
    model = build()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    optimizer = adamw if strategy == "auto" else lightning_offload.offload(model, adamw, strategy)
    times = []
    try:
        for step in range(warmup + steps):
            ids = _batch(model, batch, seq, step)
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        if strategy == "auto":
            return statistics.median(times[warmup:]), {}
        telemetry = optimizer.telemetry
        return statistics.median(times[warmup:]), {
            "host_state_bytes": telemetry.host_state_bytes, "to_host": telemetry.last.bytes_device_to_host,
            "to_device": telemetry.last.bytes_host_to_device}
    finally:
        if strategy != "auto":
            optimizer.close()


def planned(shape: str, strategy: str, hw: Hardware):
    build, batch, seq = SHAPES[shape]
    # loss="model": the loop above trains on the model's own loss.
    return plan(build(), strategy, batch_size=batch, seq_len=seq, device_memory="24GiB", precision="32-true",
                hardware=hw, device="cpu", loss="model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    # One thread by default: on a 2-core machine shared with other jobs, torch's two OpenMP threads wait on each other
    # for time slices (a small kernel then takes ~25 ms instead of ~0.4 ms), which no cost model predicts.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    hw = calibrate("cpu", torch.float32, cache=False)
    print(f"calibrated in {time.perf_counter() - start:.1f} s: {hw}")
    print(f"\n{hw.name}; fp32; medians of {args.repeats} repeats × {args.steps} steps after {args.warmup}\n")
    print("| shape | tokens | plan: lsp / AdamW | measured | ratio error | plan s/step lsp, AdamW | measured s/step "
          "lsp, AdamW | host bytes plan / telemetry | link bytes plan / telemetry |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        runs: dict[str, list[float]] = {"auto": [], "lsp_offload": []}
        figures: dict[str, float] = {}
        for _ in range(args.repeats):
            for strategy in runs:
                seconds, found = measure(shape, strategy, args.steps, args.warmup)
                runs[strategy].append(seconds)
                figures = found or figures
        lsp, native = planned(shape, "lsp_offload", hw), planned(shape, "auto", hw)
        measured = {k: statistics.median(v) for k, v in runs.items()}
        predicted_ratio = lsp.step_seconds / native.step_seconds
        measured_ratio = measured["lsp_offload"] / measured["auto"]
        link = figures["to_host"] + figures["to_device"]
        _, batch, seq = SHAPES[shape]
        print(f"| {NAMES[shape]} | {batch}×{seq} | {predicted_ratio:.2f} | {measured_ratio:.2f} | "
              f"{(measured_ratio - predicted_ratio) / predicted_ratio:+.0%} | {lsp.step_seconds:.3f}, "
              f"{native.step_seconds:.3f} | {measured['lsp_offload']:.3f}, {measured['auto']:.3f} | "
              f"{lsp.host_state_bytes / 2**20:.1f} / {figures['host_state_bytes'] / 2**20:.1f} MiB "
              f"({lsp.host_state_bytes / figures['host_state_bytes'] - 1:+.1%}) | "
              f"{lsp.link_bytes_per_step / 2**20:.1f} / {link / 2**20:.1f} MiB "
              f"({lsp.link_bytes_per_step / link - 1:+.1%}) |", flush=True)
        print(f"<!-- {shape} lsp parts: device {lsp.step.device:.3f} s, link {lsp.step.link:.3f} s, host "
              f"{lsp.step.host:.3f} s; AdamW device {native.step.device:.3f} s -->", flush=True)


if __name__ == "__main__":
    main()
