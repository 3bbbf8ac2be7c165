"""How the learned fit's thread setting changes its time: ``ProjectorRefit(fit_threads=None)`` against a fixed count.

A tiny LLaMA (hidden 64, two blocks; its projected layers are ~4K elements) is fitted with the default thread
choice (one thread per 256K gradient elements: one here) and with ``--threads`` threads for the fit's products,
alternating over ``--repeats`` rounds; medians of the fit's seconds are reported. Run it once on a quiet machine and
once beside another busy process: small products gain nothing from more threads, and under contention the threads
wait for each other.

    python scripts/benchmark_fit_threads.py --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import lightning.pytorch as pl
import torch

from lightning_offload import LSPOffloadStrategy, ProjectorRefit
from lightning_offload.models.tiny import tiny_llama


def fit_seconds(fit_threads: int | None) -> float:
    """Seconds of the initial fit of a tiny LLaMA's projectors (one optimizer step after it)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_offload.tasks.causal_lm import CausalLMModule

    torch.manual_seed(0)
    model = tiny_llama(vocab_size=256, hidden=64, intermediate=172, heads=4, kv_heads=2)
    tokens = torch.randint(0, 256, (32, 32), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=4,
                        collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows]),
                                                 "labels": torch.stack([r[0] for r in rows])})
    refit = ProjectorRefit(fit_threads=fit_threads)
    strategy = LSPOffloadStrategy(rank=0.25, density=2, min_dim=16, projectors="learned")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[refit])
    trainer.fit(CausalLMModule(model, lr=1e-3), train_dataloaders=loader)
    return refit.history[0].seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="the fixed thread count compared with the default")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"default": [], f"{args.threads} threads": []}
    for _ in range(args.repeats):
        times["default"].append(fit_seconds(None))
        times[f"{args.threads} threads"].append(fit_seconds(args.threads))
    print(f"tiny LLaMA initial fit, torch {torch.__version__}, {torch.get_num_threads()} threads for the run")
    for name, values in times.items():
        print(f"fit_threads {name:<12} median {statistics.median(values):.2f} s  {[round(v, 2) for v in values]}")


if __name__ == "__main__":
    main()
