"""What the host side of an offloaded step costs, per job: page faults (allocations), nanoseconds per element.

A small LLaMA (hidden 256, 4 layers, vocab 8192 by default, head untied) trains ``--steps`` steps with
``zero_offload``, ``lsp_offload`` (its defaults: row-sparse embedding, projected head) and ``lsp_offload`` with
embedding and head dense on the host, in each precision and link dtype. From the strategy's telemetry, over the steady
steps (the first ``--warmup`` excluded): minor page faults the host worker took per step (0 means no host buffer is
allocated in the hot path), host Adam seconds per step, and nanoseconds per host element (the elements the host
steps: compressed ``d_o × d_i`` for projected weights, every element of a dense parameter, the touched rows of a
row-sparse embedding).

    python scripts/benchmark_host_jobs.py --steps 12
    python scripts/benchmark_host_jobs.py --steps 12 --vocab 32000 --hidden 512
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from harness import add_standard_arguments, begin_run, markdown_table, seed_everything, spread, steady, write_json
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.engine.slots.row_slot import RowSlot
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule


def measure(strategy_name: str, precision: str, link_dtype: str, steps: int, warmup: int, vocab: int,
            hidden: int) -> dict[str, float]:
    """Median host figures per steady step of one configuration."""
    generator = seed_everything(0)
    model = tiny_llama(vocab_size=vocab, hidden=hidden, intermediate=hidden * 11 // 4, heads=8, kv_heads=4, layers=4,
                       tie_word_embeddings=False)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (8 * steps, 128), generator=generator)
    loader = DataLoader(TensorDataset(tokens), batch_size=8,
                        collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows]),
                                                 "labels": torch.stack([r[0] for r in rows])})
    if strategy_name == "zero_offload":
        strategy = ZeroOffloadStrategy(link_dtype=link_dtype)
    elif strategy_name == "lsp_offload":
        strategy = LSPOffloadStrategy(projectors="random", link_dtype=link_dtype)
    else:  # embedding and head dense on the host
        strategy = LSPOffloadStrategy(projectors="random", link_dtype=link_dtype, embeddings="host", head="host")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision=precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(CausalLMModule(model, lr=1e-4), train_dataloaders=loader)
    # Every step's figures, the last one's included (fit's end settles it); the telemetry keeps the latest 64.
    steps_seen = steady([metrics for _, metrics in strategy.offload_optimizer.telemetry.completed], warmup)
    slots = strategy.offload_optimizer.slots
    rows = spread(s["offload/sparse_rows"] for s in steps_seen).median
    elements = sum(slot.host_param.numel() for slot in slots if not isinstance(slot, RowSlot)) + sum(
        rows * slot.host_param.shape[1] for slot in slots if isinstance(slot, RowSlot))
    seconds = spread(s["offload/host_optimizer_seconds"] for s in steps_seen).median
    faults = spread(s["offload/host_page_faults"] for s in steps_seen)
    return {"faults": faults.median, "faults_max": faults.high,
            "host_ms": seconds * 1e3, "elements": elements, "ns_per_element": seconds / elements * 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256,
                        help="with --vocab 32000 --hidden 512 the embedding (64 MiB in fp32) is above glibc's largest "
                             "heap reuse size, so a per-step allocation of it shows up as page faults")
    add_standard_arguments(parser, warmup=3)
    args = parser.parse_args()
    if not args.warmup < args.steps <= 64:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup} and be at most 64 (the telemetry "
                     f"keeps the latest 64 steps' figures).")
    begin_run(args, __file__)
    print(f"small LLaMA (hidden {args.hidden}, 4 layers, vocab {args.vocab}), 8x128 tokens\n")
    rows, figures = [], {}
    for strategy in ("zero_offload", "lsp_offload", "lsp_offload, dense ends"):
        for precision, link in (("32-true", "fp32"), ("bf16-mixed", "bf16"), ("bf16-true", "bf16")):
            m = figures[f"{strategy}|{precision}"] = measure(strategy, precision, link, args.steps, args.warmup,
                                                             args.vocab, args.hidden)
            rows.append([strategy, precision, link, f"{m['elements']:,}", f"{m['faults']:.0f}, {m['faults_max']:.0f}",
                         f"{m['host_ms']:.1f}", f"{m['ns_per_element']:.2f}"])
            print(f"{strategy}, {precision}: {m['host_ms']:.1f} ms", flush=True)
    print()
    print(markdown_table(["strategy", "precision", "link", "host elements / step",
                          "host page faults / step (median, max)", "host Adam ms / step", "ns / element"], rows))
    write_json(args.json, {"args": vars(args), "figures": figures})


if __name__ == "__main__":
    main()
