"""How well the clipping norm of projected layers is estimated on gradients neither the fit nor training saw.

Gradient clipping under ``lsp_offload`` needs the full gradient's norm, which never exists for a projected weight: it
is estimated per layer as ``‖S‖/ρ``. ``ρ`` starts as the layer's ``‖S‖/‖G‖`` pooled over ``--norm-samples`` batches
that the fit did not use (random draws take ``ρ = 1``); while clipping is on, the probes of every step's backward
keep it up to date (``lightning_offload/lsp/norm_probe.py``). This script trains ``--steps`` steps of ``lsp_offload``
with clipping on (``--steps 1``: the fit and its measurement only), then computes full gradients on fresh batches and
reports, over them, the median of the estimated-to-true norm ratio: per layer and for the projected layers' global
norm (the figure clipping uses), on fresh training batches (or, with ``--held-out-books``, on other books' text). 1.0
is unbiased. ``--probes 0`` turns the probes off (the ``ρ`` of the fit, or 1, all along); ``--data-seed`` changes
which batches the fit, the measurement, training and the fresh set are.

``--timing`` measures the probes' cost instead: the same model trained in a loop of one's own with clipping, in
blocks of steps with the probes on and off, alternated in one process; the median step time of each.

    python scripts/benchmark_clip_norm.py --model smollm2 --batches 16
    python scripts/benchmark_clip_norm.py --model small_llama --projectors random --data-seed 1
    python scripts/benchmark_clip_norm.py --projectors learned --steps 300 --lr 1e-3 [--probes 0]
    python scripts/benchmark_clip_norm.py --projectors random --steps 300 --lr 1e-3 --clip 0 --unclipped-every 4
    python scripts/benchmark_clip_norm.py --timing --steps 10 --repeats 30
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys

import lightning.pytorch as pl
import torch
from harness import add_standard_arguments, alternate, begin_run, seed_everything, spread, time_steps, write_json

from lightning_offload import LSPOffloadStrategy, ProjectorRefit, offload
from lightning_offload.data.bible import BibleLMDataModule
from lightning_offload.lsp import norm_probe
from lightning_offload.models import load_smollm2_tokenizer, tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule


def _model(kind: str, vocab: int, hidden: int) -> torch.nn.Module:
    if kind == "smollm2":
        from lightning_offload.models.smollm2 import load_smollm2

        return load_smollm2()[0]
    return tiny_llama(vocab_size=vocab, hidden=hidden, layers=2, heads=4, intermediate=2 * hidden, seed=0,
                      max_positions=128)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "small_llama"], default="small_llama")
    parser.add_argument("--projectors", choices=["learned", "random"], default="learned")
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--hidden", type=int, default=128, help="the small LLaMA's width")
    parser.add_argument("--batches", type=int, default=16, help="fresh held-out batches to measure on")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--norm-samples", type=int, default=8, help="batches the fit's ρ is pooled over")
    parser.add_argument("--data-seed", type=int, default=0, help="the data order's seed")
    parser.add_argument("--steps", type=int, default=1, help="training steps before the measurement")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (clipping by norm)")
    parser.add_argument("--probes", type=int, default=norm_probe.PROBES,
                        help="probes per layer and step for ρ while clipping (0: off, the ρ of the fit all along)")
    parser.add_argument("--window", type=int, default=norm_probe.WINDOW_STEPS,
                        help="the span in steps of the probes' averages (each step's weight decays by 1 − 1/window)")
    parser.add_argument("--unclipped-every", type=int, default=norm_probe.UNCLIPPED_EVERY,
                        help="with --clip 0: the probes run at every this many-th step")
    parser.add_argument("--held-out-books", action="store_true",
                        help="measure on the held-out books (other text) instead of fresh training batches")
    parser.add_argument("--timing", action="store_true", help="measure the probes' cost (step time, on and off)")
    add_standard_arguments(parser, repeats=5, json_aliases=("--out",),
                           repeats_help="--timing: blocks of --steps steps per setting, alternated")
    return parser


def _data(args: argparse.Namespace) -> BibleLMDataModule:
    data = BibleLMDataModule(load_smollm2_tokenizer(), block_size=args.block, batch_size=args.batch_size,
                             max_val_blocks=args.batch_size * args.batches, seed=args.data_seed)
    data.prepare_data()
    data.setup("fit")
    return data


class _PerStepRatios:
    """Beside each layer's averages (the package's ``ρ``, a ratio of averages), the other pooling it was chosen
    against: the mean of per-step ratios ``‖S‖²/(‖G z‖²/m)`` under the same decaying weights, ``√`` of
    ``ratio_sums[0] / ratio_sums[1]``. Kept here, not in the package: only this comparison reads it.

    While installed, each :meth:`NormProbe.record <lightning_offload.lsp.norm_probe.NormProbe.record>` also adds
    ``[ratio, 1]`` to the probe's ``ratio_sums``, restarted with the package's averages (new projectors).
    """

    def __enter__(self) -> _PerStepRatios:
        self._record = record = norm_probe.NormProbe.record

        def recording(probe: norm_probe.NormProbe, figures: torch.Tensor) -> None:
            fresh = probe.sums is None  # the first step, or the first after new projectors reset the window
            record(probe, figures)
            pair = torch.stack([figures[0] / figures[1], torch.ones_like(figures[0])])
            keep = 1.0 - 1.0 / norm_probe.WINDOW_STEPS
            probe.ratio_sums = pair if fresh else probe.ratio_sums.mul_(keep).add_(pair)

        norm_probe.NormProbe.record = recording
        return self

    def __exit__(self, *exc: object) -> None:
        norm_probe.NormProbe.record = self._record

    @staticmethod
    def mean_of_ratios(probe: norm_probe.NormProbe) -> float:
        """``√(avg_step ‖S‖²/(‖G z‖²/m))`` of ``probe``'s measured steps; ``nan`` unless positive and finite."""
        ratios, weights = probe.ratio_sums.tolist()
        return math.sqrt(ratios / weights) if weights > 0 and ratios > 0 and math.isfinite(ratios) else math.nan


def estimate_after_training(args: argparse.Namespace) -> dict:
    """Train ``--steps`` steps with clipping, then compare the estimated and true norms on fresh batches."""
    with _PerStepRatios():
        return _estimate_after_training(args)


def _estimate_after_training(args: argparse.Namespace) -> dict:
    seed_everything(0)
    data = _data(args)
    module = CausalLMModule(_model(args.model, len(data.tokenizer), args.hidden), lr=args.lr)
    strategy = LSPOffloadStrategy(rank=args.rank, projectors=args.projectors, min_dim=64)
    callbacks = [ProjectorRefit(norm_samples=args.norm_samples)] if args.projectors == "learned" else []
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               gradient_clip_val=args.clip, callbacks=callbacks).fit(module, data)
    layers = {layer.name: layer for layer in strategy.offload_optimizer.projected_layers}
    per_layer: dict[str, list[float]] = {name: [] for name in layers}
    # Per batch and layer, ‖S‖² and ‖G‖²: what ρ pooled on the fresh batches themselves would read (the floor that
    # the pooling alone sets, whatever the measurement).
    squares: dict[str, list[tuple[float, float]]] = {name: [] for name in layers}
    drawn = args.steps + 4 + args.norm_samples  # past training's, the fit's and the measurement's batches
    fresh = itertools.islice(iter(data.train_dataloader()), drawn, drawn + args.batches)
    for batch in (data.val_dataloader() if args.held_out_books else fresh):
        module.zero_grad(set_to_none=True)
        module.model(**batch).loss.backward()
        for name, layer in layers.items():
            grad = layer.weight.grad.float()
            true_sq, compressed_sq = float(grad.square().sum()), float(layer.compress(grad).square().sum())
            squares[name].append((compressed_sq, true_sq))
            per_layer[name].append((compressed_sq / true_sq) ** 0.5 / layer.norm_ratio)
    in_use = {name: layer.norm_ratio for name, layer in layers.items()}
    # The other pooling of the probes' averages, √(mean of per-step ratios), beside the ratio of averages in use.
    mean_of_ratios = {name: _PerStepRatios.mean_of_ratios(layer.norm_probe)
                      for name, layer in layers.items() if layer.norm_probe.ready()}
    fresh_sums = {name: (sum(s for s, _ in v) / sum(g for _, g in v)) ** 0.5 for name, v in squares.items()}
    fresh_means = {name: statistics.mean(s / g for s, g in v) ** 0.5 for name, v in squares.items()}
    global_ratios = _global_ratios(squares, in_use)
    layer_medians = [statistics.median(v) for v in per_layer.values()]
    return {"model": args.model, "projectors": args.projectors, "rank": args.rank, "steps": args.steps,
            "lr": args.lr, "clip": args.clip, "probes": args.probes, "window": args.window,
            "unclipped_every": args.unclipped_every, "batches": len(global_ratios), "batch_size": args.batch_size,
            "norm_samples": args.norm_samples,
            "data_seed": args.data_seed,
            "global_median": statistics.median(global_ratios), "global_min": min(global_ratios),
            "global_max": max(global_ratios), "layer_median_min": min(layer_medians),
            "layer_median_max": max(layer_medians), "layer_median_median": statistics.median(layer_medians),
            "norm_ratio_min": min(in_use.values()), "norm_ratio_max": max(in_use.values()),
            "global_median_mean_of_ratios": (statistics.median(_global_ratios(squares, mean_of_ratios))
                                             if mean_of_ratios else None),
            "global_median_fresh_ratio_of_sums": statistics.median(_global_ratios(squares, fresh_sums)),
            "global_median_fresh_mean_of_ratios": statistics.median(_global_ratios(squares, fresh_means))}


def _global_ratios(squares: dict[str, list[tuple[float, float]]], ratios: dict[str, float]) -> list[float]:
    """Per fresh batch, the estimated over the true global norm of the projected layers with the layers' ``ratios``
    (a layer missing from ``ratios`` counts exactly)."""
    batches = len(next(iter(squares.values())))
    out = []
    for index in range(batches):
        estimated = sum(v[index][0] / ratios.get(name, (v[index][0] / v[index][1]) ** 0.5) ** 2
                        for name, v in squares.items())
        out.append((estimated / sum(v[index][1] for v in squares.values())) ** 0.5)
    return out


def probe_cost(args: argparse.Namespace) -> dict:
    """Median step time with the probes on and off: ``--repeats`` blocks of ``--steps`` steps each, alternated in
    one process (this machine's speed drifts), after a warm-up block; clipping on throughout (``--clip 0``: off, the
    probes then run at every ``--unclipped-every``-th step)."""
    seed_everything(0)
    data = _data(args)
    model = _model(args.model, len(data.tokenizer), args.hidden)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=args.lr), rank=args.rank, min_dim=64,
                        projectors="random", max_grad_norm=args.clip or None)
    batches = itertools.cycle(list(itertools.islice(iter(data.train_dataloader()), 64)))

    def step(_: int) -> None:
        model(**next(batches)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def block(setting: str, _: int) -> list[float]:
        norm_probe.PROBES = args.probes if setting == "on" else 0
        # The probes switch with the step after a clipped one: the block's first step runs the old setting.
        return time_steps(step, args.steps, warmup=1)

    try:
        block("on", 0)  # warm-up
        blocks = alternate(["on", "off"], args.repeats, block)
    finally:
        optimizer.close()
    # Every timed step of a setting pooled: a block is too short for a median of its own to settle.
    on, off = (spread(itertools.chain.from_iterable(blocks[setting])).median for setting in ("on", "off"))
    # Unclipped, a quarter of the steps probe: the median step is an unprobed one, so the mean of each block's steps
    # (median over blocks) is what tells the cost.
    block_means = {setting: statistics.median(statistics.mean(block) for block in blocks[setting])
                   for setting in ("on", "off")}
    return {"model": args.model, "hidden": args.hidden, "rank": args.rank, "probes": args.probes,
            "clip": args.clip, "unclipped_every": args.unclipped_every, "steps_per_block": args.steps,
            "repeats": args.repeats, "step_seconds_probes_on": on,
            "step_seconds_probes_off": off, "cost": on / off - 1.0,
            "block_mean_seconds_probes_on": block_means["on"], "block_mean_seconds_probes_off": block_means["off"],
            "cost_of_block_means": block_means["on"] / block_means["off"] - 1.0, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    begin_run(args, __file__, argv)
    settings = norm_probe.PROBES, norm_probe.WINDOW_STEPS, norm_probe.UNCLIPPED_EVERY
    norm_probe.PROBES, norm_probe.WINDOW_STEPS, norm_probe.UNCLIPPED_EVERY = (args.probes, args.window,
                                                                              args.unclipped_every)
    try:
        result = probe_cost(args) if args.timing else estimate_after_training(args)
    finally:
        norm_probe.PROBES, norm_probe.WINDOW_STEPS, norm_probe.UNCLIPPED_EVERY = settings
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
