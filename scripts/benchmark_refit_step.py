"""The size of the first update after a projector refit, against the updates before it.

A refit carries Adam's second moment into the new subspace and rescales it by how much more of the gradient's norm
the new projectors keep (the fit's ``ρ``); a ``ρ`` that misreads the new projectors makes the first steps after the
refit too small or too large. This trains a small LLaMA with learned projectors, refits every layer at one step, and
reports the RMS of the projected layers' first update after the refit over the median of the 20 before.

    python scripts/benchmark_refit_step.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import lightning.pytorch as pl
from harness import add_standard_arguments, begin_run, seed_everything, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_modules import ProjectedUpdateRMS, TinyCausalLM, tiny_hf_model, token_data  # noqa: E402

from lightning_offload import LSPOffloadStrategy, ProjectorRefit  # noqa: E402


def first_step_ratio(seed: int, refit_step: int, num_samples: int) -> float:
    seed_everything(seed)
    module = TinyCausalLM(tiny_hf_model("llama", seed=seed), lr=1e-3)
    strategy = LSPOffloadStrategy(rank=0.25, density=2, min_dim=16, projectors="learned", pipelined=False)
    refit = ProjectorRefit(refit_every=refit_step, threshold=0.0, num_samples=num_samples, seed=seed)
    sizes = ProjectedUpdateRMS(strategy)
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=refit_step + 1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[refit, sizes]).fit(module, token_data(n=64))
    return sizes.rms[refit_step] / statistics.median(sizes.rms[refit_step - 20:refit_step])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--refit-step", type=int, default=60)
    parser.add_argument("--num-samples", type=int, default=4)
    add_standard_arguments(parser)
    args = parser.parse_args(argv)
    begin_run(args, __file__, argv)
    ratios = [first_step_ratio(seed, args.refit_step, args.num_samples) for seed in args.seeds]
    result = {"first_step_over_before": ratios, "median": statistics.median(ratios)}
    print(json.dumps(result, indent=2))
    write_json(args.json, {"args": vars(args), **result})
    return result


if __name__ == "__main__":
    main()
