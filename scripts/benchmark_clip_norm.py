"""How well the clipping norm of projected layers is estimated on gradients the projector fit never saw.

Gradient clipping under ``lsp_offload`` needs the full gradient's norm, which never exists for a projected weight: it
is estimated per layer as ``‖S‖/ρ``, ``ρ`` being the layer's ``‖S‖/‖G‖`` pooled over ``--norm-samples`` batches that
the fit did not use (random draws take ``ρ = 1``). This script runs one step
of ``lsp_offload`` with clipping on (the fit and the measurement), then computes full gradients on fresh batches and
reports, over them, the median of the estimated-to-true norm ratio: per layer and for the projected layers' global
norm (the figure clipping uses), on fresh training batches (or, with ``--held-out-books``, on other books' text). 1.0
is unbiased. ``--data-seed`` changes which batches the fit, the measurement and the fresh set are.

    python scripts/benchmark_clip_norm.py --model smollm2 --batches 16
    python scripts/benchmark_clip_norm.py --model small_llama --projectors random --data-seed 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import lightning.pytorch as pl
import torch

from lightning_offload import LSPOffloadStrategy, ProjectorRefit
from lightning_offload.data.bible import BibleLMDataModule
from lightning_offload.models import load_smollm2_tokenizer, tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule


def _model(kind: str, vocab: int, hidden: int) -> torch.nn.Module:
    if kind == "smollm2":
        from lightning_offload.models.smollm2 import load_smollm2

        return load_smollm2()[0]
    return tiny_llama(vocab_size=vocab, hidden=hidden, layers=2, heads=4, intermediate=2 * hidden, seed=0,
                      max_positions=128)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "small_llama"], default="small_llama")
    parser.add_argument("--projectors", choices=["learned", "random"], default="learned")
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--hidden", type=int, default=128, help="the small LLaMA's width")
    parser.add_argument("--batches", type=int, default=16, help="fresh held-out batches to measure on")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--norm-samples", type=int, default=8, help="batches ρ is pooled over")
    parser.add_argument("--data-seed", type=int, default=0, help="the data order's seed")
    parser.add_argument("--held-out-books", action="store_true",
                        help="measure on the held-out books (other text) instead of fresh training batches")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    data = BibleLMDataModule(load_smollm2_tokenizer(), block_size=args.block, batch_size=args.batch_size,
                             max_val_blocks=args.batch_size * args.batches, seed=args.data_seed)
    data.prepare_data()
    data.setup("fit")
    module = CausalLMModule(_model(args.model, len(data.tokenizer), args.hidden), lr=1e-4)
    strategy = LSPOffloadStrategy(rank=args.rank, projectors=args.projectors, min_dim=64)
    callbacks = [ProjectorRefit(norm_samples=args.norm_samples)] if args.projectors == "learned" else []
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0,
               callbacks=callbacks).fit(module, data)
    layers = {layer.name: layer for layer in strategy.offload_optimizer.projected_layers}
    per_layer: dict[str, list[float]] = {name: [] for name in layers}
    global_ratios = []
    drawn = 4 + args.norm_samples  # past the fit's and the measurement's batches, the first of the order
    fresh = itertools.islice(iter(data.train_dataloader()), drawn, drawn + args.batches)
    for batch in (data.val_dataloader() if args.held_out_books else fresh):
        module.zero_grad(set_to_none=True)
        module.model(**batch).loss.backward()
        estimated_sq = true_sq = 0.0
        for name, layer in layers.items():
            grad = layer.weight.grad.float()
            true = float(grad.norm())
            estimate = float(layer.compress(grad).norm()) / layer.norm_ratio
            per_layer[name].append(estimate / true)
            estimated_sq += estimate**2
            true_sq += true**2
        global_ratios.append((estimated_sq / true_sq) ** 0.5)
    layer_medians = [statistics.median(v) for v in per_layer.values()]
    result = {"model": args.model, "projectors": args.projectors, "rank": args.rank, "batches": len(global_ratios),
              "batch_size": args.batch_size, "norm_samples": args.norm_samples, "data_seed": args.data_seed,
              "global_median": statistics.median(global_ratios), "global_min": min(global_ratios),
              "global_max": max(global_ratios), "layer_median_min": min(layer_medians),
              "layer_median_max": max(layer_medians), "layer_median_median": statistics.median(layer_medians)}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
