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

import lightning.pytorch as pl
import torch
from harness import add_standard_arguments, alternate, begin_run, markdown_table, seed_everything, spread, write_json

from lightning_offload import LSPOffloadStrategy, ProjectorRefit
from lightning_offload.models.tiny import tiny_llama


def fit_seconds(fit_threads: int | None) -> float:
    """Seconds of the initial fit of a tiny LLaMA's projectors (one optimizer step after it)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_offload.tasks.causal_lm import CausalLMModule

    seed_everything(0)
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
    parser.add_argument("--threads", type=int, default=2, help="the fixed thread count compared with the default")
    add_standard_arguments(parser, repeats=3)
    args = parser.parse_args()
    if begin_run(args, __file__) is None:
        return
    settings: dict[str, int | None] = {"default": None, f"{args.threads} threads": args.threads}
    times = alternate(list(settings), args.repeats, lambda name, _: fit_seconds(settings[name]))
    print("\ntiny LLaMA initial fit, seconds\n")
    rows = [[name, spread(values).cell(), [round(v, 2) for v in values]] for name, values in times.items()]
    print(markdown_table(["fit_threads", "median s (min–max)", "each round"], rows))
    write_json(args.json, {"args": vars(args), "seconds": times})


if __name__ == "__main__":
    main()
