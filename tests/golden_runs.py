"""Golden results: a few steps of every offload path, recorded once and compared by ``tests/test_golden_results.py``.

The engine is being redesigned (issue 29) with results kept bit for bit. Each case below trains a tiny model for a few
steps on one path (strategy kind, embedding and head placement, accumulation, clipping, Adam's L2, ``maximize``, a
skipped non-finite step, pipelined/synchronous/speculative, bf16 and fp32, and DDP on two gloo ranks) and then saves a
checkpoint: everything in it that is a tensor (weights, host Adam moments, projectors, MEFT adapters and their row
state) is reduced to a *sketch*, a few float64 figures per tensor (its size, sum, sum of squares and dot products
with two fixed random vectors), which any change of a value beyond rounding moves.

Each machine kind the results were recorded on has its own record, ``tests/golden/<machine>.json``: bits depend on
the CPU's kernels, and sessions run on more than one kind. Record anew only for a change of results that is meant (and
say so in the commit); a case whose definition changes is dropped from the records of the kinds that cannot be run
again (``--drop``), so that no record keeps results of a case that no longer exists as recorded:

    python tests/golden_runs.py --record            # every case, ~1 minute; writes this machine's record
    python tests/golden_runs.py --record zero meft  # those cases only (the rest of this machine's record kept)
    python tests/golden_runs.py --drop zero         # drop those cases from every other machine's record
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_modules import TinyCausalLM, tiny_hf_model, token_data  # noqa: E402

import lightning_offload  # noqa: E402,F401  (registers the strategy names)
from lightning_offload import (  # noqa: E402
    LSPOffloadStrategy,
    MEFTConfig,
    MEFTOffloadStrategy,
    ProjectorRefit,
    ZeroOffloadStrategy,
    inject_meft,
)
from lightning_offload.models import tiny_llama  # noqa: E402
from lightning_offload.tasks.causal_lm import CausalLMModule  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
DDP_RUNS = Path(__file__).resolve().parent / "ddp_runs.py"
STEPS = 4
SKETCH_VECTORS = 2


class AdamLM(TinyCausalLM):
    """The tiny causal LM under ``torch.optim.Adam`` with its options (coupled L2, ``maximize``)."""

    def __init__(self, model: torch.nn.Module, **adam: Any) -> None:
        super().__init__(model)
        self.adam = adam

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, **self.adam)


class NonFiniteOnceLM(TinyCausalLM):
    """Its second batch's loss is ``inf``: that step's gradients are non-finite and the step is skipped."""

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 1 else loss


@dataclass(frozen=True)
class Case:
    """One recorded run: how to build its strategy and module, and the Trainer's settings."""

    strategy: Callable[[], Any]
    module: Callable[[], pl.LightningModule] = lambda: TinyCausalLM(tiny_hf_model("llama"))
    data: Callable[[], DataLoader] = lambda: token_data(n=32, batch_size=4)
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: Callable[[], list[pl.Callback]] = list


def _lsp(**settings: Any) -> Callable[[], LSPOffloadStrategy]:
    # The projections' kernels pinned (the CPU's native ones): "auto" picks by timing, and kernels differ in rounding.
    # The vectors on the host, as these cases were recorded before vectors= existed (the vectors_* cases put them on
    # the device).
    settings = {"rank": 0.25, "density": 2, "min_dim": 16, "projectors": "random", "kernels": "native",
                "vectors": "host", **settings}
    return lambda: LSPOffloadStrategy(**settings)


def _refit() -> list[pl.Callback]:
    return [ProjectorRefit(refit_every=2, threshold=0.0, num_samples=2, norm_samples=2, max_iters=6)]


def _meft_module() -> pl.LightningModule:
    model = tiny_llama()
    inject_meft(model, MEFTConfig(num_neurons=256, top_k=8, num_experts=16, experts_per_token=4,
                                  calibration_batches=1))
    return CausalLMModule(model, lr=1e-2)


def _meft_data() -> DataLoader:
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, 256, (2, 12), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return DataLoader(batches, batch_size=None, shuffle=False)


CLIP_NORM = {"gradient_clip_val": 0.05}
CASES: dict[str, Case] = {
    "lsp_learned": Case(_lsp(projectors="learned"), callbacks=_refit),
    "lsp_learned_accumulated_clipped": Case(_lsp(projectors="learned"), callbacks=_refit,
                                            trainer={"accumulate_grad_batches": 2, **CLIP_NORM}),
    "lsp_random": Case(_lsp()),
    "lsp_random_gpt2": Case(_lsp(), module=lambda: TinyCausalLM(tiny_hf_model("gpt2"))),
    "lsp_clip_value": Case(_lsp(), trainer={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "lsp_adam_l2": Case(_lsp(embeddings="host"), module=lambda: AdamLM(tiny_hf_model("llama"), weight_decay=0.1)),
    "lsp_maximize": Case(_lsp(), module=lambda: AdamLM(tiny_hf_model("llama"), maximize=True)),
    "lsp_nonfinite_skipped": Case(_lsp(), module=lambda: NonFiniteOnceLM(tiny_hf_model("llama"))),
    "lsp_synchronous": Case(_lsp(pipelined=False), trainer=CLIP_NORM),
    "lsp_speculative": Case(_lsp(speculative=True), trainer=CLIP_NORM),
    "lsp_bf16_link": Case(_lsp(link_dtype="bf16")),
    "lsp_bf16_true": Case(_lsp(), trainer={"precision": "bf16-true", **CLIP_NORM}),
    "embeddings_host": Case(_lsp(embeddings="host")),
    "embeddings_sparse_adam_l2": Case(_lsp(embeddings="sparse"),
                                      module=lambda: AdamLM(tiny_hf_model("llama"), weight_decay=0.1)),
    "embeddings_device": Case(_lsp(embeddings="device")),
    "embeddings_frozen": Case(_lsp(embeddings="frozen")),
    "head_projected": Case(_lsp(head="projected")),
    "head_device": Case(_lsp(head="device")),
    # update="scaled": redrawn every 2 of the 4 steps, under accumulation and clipping; and bf16 weights. At rank 0.5
    # each channel is projected to r = 4 (32×16) or 8 numbers. Not 0.25: there the 32×16 layers get r = 1, where a
    # channel's scale is 1/|R_j| of one projected number, which near a cancellation turns rounding into an O(1) change
    # of that channel's update: between two CPUs' kernels (AVX-512 against AVX2, one Intel Xeon) the checkpoint moved
    # by 1e-3 of a tensor after 4 steps, ~10⁴ times every other case, and beyond the tolerance across machine kinds.
    "lsp_scaled_accumulated_clipped": Case(lambda: LSPOffloadStrategy(rank=0.5, min_dim=16, update="scaled",
                                                                      redraw_every=2, vectors="host"),
                                           trainer={"accumulate_grad_batches": 2, **CLIP_NORM}),
    "lsp_scaled_bf16_true": Case(lambda: LSPOffloadStrategy(rank=0.5, min_dim=16, update="scaled", vectors="host"),
                                 trainer={"precision": "bf16-true", **CLIP_NORM}),
    "zero": Case(lambda: ZeroOffloadStrategy(vectors="host"), trainer=CLIP_NORM),
    "meft": Case(lambda: MEFTOffloadStrategy(device="cpu", vectors="host"), module=_meft_module, data=_meft_data,
                 trainer=CLIP_NORM),
    # The vectors (norm weights) stepped by the device Adam: otherwise lsp_random, lsp_bf16_true and zero.
    "vectors_device": Case(_lsp(vectors="device")),
    "vectors_device_bf16_true": Case(_lsp(vectors="device"), trainer={"precision": "bf16-true", **CLIP_NORM}),
    "zero_vectors_device": Case(lambda: ZeroOffloadStrategy(vectors="device"), trainer=CLIP_NORM),
}
#: Run by tests/ddp_runs.py's "golden" scenario on two gloo ranks (learned projectors, accumulation, norm clipping).
DDP_CASES = ("ddp_learned_rank0", "ddp_learned_rank1")


def sketch(value: torch.Tensor, name: str) -> list[float]:
    """Element count, sum, sum of squares and dot products with fixed random vectors (seeded by ``name``), in
    float64."""
    flat = value.detach().reshape(-1).to("cpu", torch.float64)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    vectors = torch.randn(SKETCH_VECTORS, flat.numel(), generator=generator, dtype=torch.float64)
    return [float(flat.numel()), float(flat.sum()), float(flat.square().sum()), *(float(v) for v in vectors @ flat)]


def tensors_of(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating-point or integer tensor in a nested checkpoint, with its path."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors_of(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from tensors_of(value, f"{prefix}/{index}")


def checkpoint_sketches(checkpoint: dict[str, Any]) -> dict[str, list[float]]:
    """The sketch of each tensor a checkpoint holds: its weights, optimizer state and callbacks' state."""
    parts = {key: checkpoint[key] for key in ("state_dict", "optimizer_states", "callbacks") if key in checkpoint}
    return {name: sketch(value, name) for name, value in tensors_of(parts) if value.numel() > 0}


def run_case(name: str) -> dict[str, list[float]]:
    """Train case ``name`` for ``STEPS`` steps on the CPU and return its checkpoint's sketches."""
    case = CASES[name]
    threads = torch.get_num_threads()
    # One thread, as the DDP ranks run: a reduction split over another number of threads rounds differently.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        module = case.module()
        trainer = pl.Trainer(strategy=case.strategy(), accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=case.callbacks(), **case.trainer)
        trainer.fit(module, case.data())
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "last.ckpt"
            trainer.save_checkpoint(path)
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    finally:
        torch.set_num_threads(threads)
    return checkpoint_sketches(checkpoint)


_SKETCHES: dict[tuple[str, str | None], dict[str, list[float]]] = {}


def run_case_cached(name: str) -> dict[str, list[float]]:
    """:func:`run_case`'s sketches, computed once per process for the link the environment asks for: the golden test
    and the simulated link's test (tests/test_simulated_link.py) share the synchronous runs."""
    key = (name, os.environ.get("LIGHTNING_OFFLOAD_SIMULATED_LINK"))
    if key not in _SKETCHES:
        _SKETCHES[key] = run_case(name)
    return _SKETCHES[key]


def run_ddp() -> dict[str, dict[str, list[float]]]:
    """The two-rank case, through Lightning's own launcher: each rank's checkpoint sketches."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DDP_RUNS.parent.parent),
                                                             os.environ.get("PYTHONPATH", "")])}
        for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # a clean launch: Lightning's launcher sets these for the rank it starts
        done = subprocess.run([sys.executable, str(DDP_RUNS), folder, "golden"], env=env, timeout=600,
                              capture_output=True, text=True)
        if done.returncode != 0:  # what the ranks said, not only how the launcher ended
            raise RuntimeError(f"the two-rank golden run ended with {done.returncode}:\n{done.stderr[-4000:]}")
        out = {}
        for rank, case in enumerate(DDP_CASES):
            path = Path(folder) / f"golden_rank{rank}.ckpt"
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            out[case] = checkpoint_sketches(checkpoint)
    return out


def machine() -> dict[str, str]:
    """What decides whether results can be bit-identical to the recorded ones: the CPU model (BLAS libraries pick
    their kernels by it), the kernels torch dispatches to, and torch itself."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        # The instruction sets too: a virtual machine may name several CPU generations alike.
        flags = zlib.crc32(" ".join(sorted(fields.get("flags", "").split())).encode())
        model = f"{fields.get('model name', model)} (flags {flags:08x})"
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "machine": platform.machine()}


def record_name(kind: dict[str, str]) -> str:
    """The file name of a machine kind's record: the CPU's name and flags, torch's kernels and version."""
    slug = re.sub(r"[^a-z0-9.]+", "-", f"{kind['cpu']} {kind['cpu_capability']} torch {kind['torch']}".lower())
    return slug.strip("-") + ".json"


def records() -> list[dict[str, Any]]:
    """Every machine kind's record (``machine``, ``steps``, ``cases``), in file-name order."""
    return [json.loads(path.read_text()) for path in sorted(GOLDEN_DIR.glob("*.json"))]


def _as_json(record: dict[str, Any]) -> str:
    """JSON with one tensor's sketch per line (readable diffs when a case is recorded anew)."""
    lines = ["{", f' "machine": {json.dumps(record["machine"])},', f' "steps": {record["steps"]},', ' "cases": {']
    cases = list(record["cases"].items())
    for index, (case, sketches) in enumerate(cases):
        lines.append(f"  {json.dumps(case)}: {{")
        entries = [f"   {json.dumps(name)}: {json.dumps(figures)}" for name, figures in sketches.items()]
        lines.append(",\n".join(entries))
        lines.append("  }" + ("," if index < len(cases) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def _drop(cases: list[str]) -> None:
    """Drop ``cases`` from every other machine kind's record (their definitions changed; those kinds cannot be run
    here)."""
    here = machine()
    for path in sorted(GOLDEN_DIR.glob("*.json")):
        record = json.loads(path.read_text())
        if record["machine"] != here:
            record["cases"] = {case: value for case, value in record["cases"].items() if case not in cases}
            path.write_text(_as_json(record))
            print(f"dropped {', '.join(cases)} from {path.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write the results to this machine's record")
    parser.add_argument("--drop", action="store_true", help="drop the cases from every other machine's record")
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all); names: {', '.join(CASES)}, ddp")
    args = parser.parse_args()
    if args.drop:
        unknown = sorted(set(args.cases) - {*CASES, "ddp"})
        if not args.cases or unknown:
            what = f"unknown case names {', '.join(unknown)}" if unknown else "no case named"
            parser.error(f"--drop takes the names of the cases whose definitions changed ({what}); "
                         f"names: {', '.join(CASES)}, ddp")
        _drop([name for case in args.cases for name in (DDP_CASES if case == "ddp" else (case,))])
        return
    wanted = args.cases or [*CASES, "ddp"]
    here = machine()
    path = GOLDEN_DIR / record_name(here)
    # This machine's record only: another kind's bits are never mixed into it.
    results: dict[str, Any] = json.loads(path.read_text())["cases"] if path.exists() else {}
    for name in wanted:
        print(f"golden: {name}", flush=True)
        results.update(run_ddp() if name == "ddp" else {name: run_case(name)})
    if args.record:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(_as_json({"machine": here, "steps": STEPS, "cases": results}))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
