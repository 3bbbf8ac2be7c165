"""Step time of the offload strategies against plain fused AdamW on a small LLaMA, side by side (CPU).

A small LLaMA (hidden 256, 4 layers, vocab 8192 by default), 8×128 tokens, random projectors, runs interleaved over
``--repeats`` so that machine noise hits every configuration alike; the median over the steady steps (the first
``--warmup`` excluded) of each run, then the median over repeats. On a CPU the device *is* the host: the step
includes the host Adam (on a worker thread, sharing the cores), so this measures the fixed per-step costs the
offload machinery adds (per-tensor Python, synchronisation, small kernels), which a GPU step cannot hide either.

    python scripts/benchmark_small_step.py --repeats 5
    python scripts/benchmark_small_step.py --precision 32-true
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.cli.benchmark_run import StepClock
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule

# The offload strategies at their CPU defaults (not speculative) and with speculation forced on (the GPU default).
CONFIGS: dict[str, Any] = {
    "plain fused AdamW": lambda: "auto",
    "lsp_offload": lambda: LSPOffloadStrategy(projectors="random"),
    "lsp_offload, speculative": lambda: LSPOffloadStrategy(projectors="random", speculative=True),
    "zero_offload": lambda: ZeroOffloadStrategy(),
    "zero_offload, speculative": lambda: ZeroOffloadStrategy(speculative=True),
    # The embeddings and head off the dense host path (the model's tied embedding takes the head's setting).
    "lsp_offload, host/host": lambda: LSPOffloadStrategy(projectors="random", embeddings="host", head="host"),
    "lsp_offload, sparse/projected": lambda: LSPOffloadStrategy(projectors="random", embeddings="sparse",
                                                                head="projected"),
    "lsp_offload, frozen/frozen": lambda: LSPOffloadStrategy(projectors="random", embeddings="frozen",
                                                             head="frozen"),
}


def measure(name: str, precision: str, steps: int, warmup: int, vocab: int, hidden: int,
            untied: bool = False) -> float:
    """Median steady step seconds of one configuration."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=vocab, hidden=hidden, intermediate=hidden * 11 // 4, heads=8, kv_heads=4, layers=4,
                       tie_word_embeddings=not untied)
    tokens = torch.randint(0, vocab, (8 * steps, 128), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=8,
                        collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows]),
                                                 "labels": torch.stack([r[0] for r in rows])})
    clock = StepClock()
    # Plain training with torch's fused AdamW, the baseline a user would otherwise run (the offload strategies step
    # a fused Adam on the host whatever the flag).
    module = CausalLMModule(model, lr=1e-4, fused=True if name.startswith("plain") else None)
    trainer = pl.Trainer(strategy=CONFIGS[name](), accelerator="cpu", devices=1, precision=precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock])
    trainer.fit(module, train_dataloaders=loader)
    return statistics.median(clock.seconds[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--untied", action="store_true", help="an LM head of its own (the default ties it)")
    args = parser.parse_args()
    if "plain fused AdamW" not in args.configs:
        parser.error("--configs must include 'plain fused AdamW': every figure is a ratio to it.")
    results: dict[str, list[float]] = {name: [] for name in args.configs}
    for repeat in range(args.repeats):
        for name in args.configs:
            seconds = measure(name, args.precision, args.steps, args.warmup, args.vocab, args.hidden, args.untied)
            results[name].append(seconds)
            print(f"[repeat {repeat}] {name}: {seconds * 1e3:.1f} ms/step", flush=True)
    baseline = statistics.median(results["plain fused AdamW"])
    print(f"\nsmall LLaMA (hidden {args.hidden}, 4 layers, vocab {args.vocab}, {'untied' if args.untied else 'tied'} "
          f"head), 8×128 tokens, {args.precision}, "
          f"{args.repeats} repeats, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| configuration | ms / step (median) | × plain fused AdamW |")
    print("|---|---|---|")
    for name, values in results.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / baseline:.2f} |")


if __name__ == "__main__":
    main()
