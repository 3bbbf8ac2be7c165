"""Step time of the offload strategies against plain fused AdamW on a small LLaMA, side by side (CPU).

A small LLaMA (hidden 256, 4 layers, vocab 8192 by default), 8×128 tokens, random projectors, runs interleaved over
``--repeats`` so that machine noise hits every configuration alike; the median over the steady steps (the first
``--warmup`` excluded) of each run, then the median over repeats. On a CPU the device *is* the host: the step
includes the host Adam (on a worker thread, sharing the cores), so this measures the fixed per-step costs the
offload machinery adds (per-tensor Python, synchronisation, small kernels), which a GPU step cannot hide either.

    python scripts/benchmark_small_step.py --repeats 5
    python scripts/benchmark_small_step.py --precision bf16-mixed

After the ratios it prints where each offload configuration's step goes: the engine's own phases
(lightning_offload/engine/figures/phases.py: projections, hooks, sends, host Adam, updates applied, launch, telemetry,
waits) and the rest (the model's forward and backward).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from benchmark_run import PhaseReader, StepClock
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, seed_everything, spread, \
    steady, write_json
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.engine.figures.phases import PHASES
from lightning_offload.engine.slots.scaled_slot import ScaledSlot
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule

# The offload strategies at their CPU defaults (not speculative) and with speculation forced on (the GPU default).
CONFIGS: dict[str, Any] = {
    "plain fused AdamW": lambda: "auto",
    "lsp_offload": lambda: LSPOffloadStrategy(projectors="random"),
    # The projections' kernels forced, beside the timed choice above (lsp/kernels/selection.py).
    "lsp_offload, csr kernels": lambda: LSPOffloadStrategy(projectors="random", kernels="csr"),
    "lsp_offload, native kernels": lambda: LSPOffloadStrategy(projectors="random", kernels="native"),
    "lsp_offload, dense kernels": lambda: LSPOffloadStrategy(projectors="random", kernels="dense"),
    "lsp_offload, speculative": lambda: LSPOffloadStrategy(projectors="random", speculative=True),
    "zero_offload": lambda: ZeroOffloadStrategy(),
    # Full-rank updates from compressed moments at the same host bytes (update="scaled").
    "lsp_offload, scaled": lambda: LSPOffloadStrategy(update="scaled"),
    "zero_offload, speculative": lambda: ZeroOffloadStrategy(speculative=True),
    # The embeddings and head off the dense host path (the model's tied embedding takes the head's setting).
    "lsp_offload, host/host": lambda: LSPOffloadStrategy(projectors="random", embeddings="host", head="host"),
    "lsp_offload, sparse/projected": lambda: LSPOffloadStrategy(projectors="random", embeddings="sparse",
                                                                head="projected"),
    "lsp_offload, frozen/frozen": lambda: LSPOffloadStrategy(projectors="random", embeddings="frozen",
                                                             head="frozen"),
}


def device_bytes(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, float]:
    """What training keeps on the device beside the weights and the activations the model saves anyway: for the
    offload strategies the engine's own figures (persistent: projectors, update ring, the scaled rule's ``P``;
    per step: the dense gradients, ``S``, full gradients held until their scales return); for plain AdamW its two
    moments and its gradients, all on the device. Activations are not counted: ``update="projected"`` keeps ``B Xᵀ``
    (``offload/device_saved_projection_bytes``) where the others keep the projected layers' inputs ``X``."""
    optimizer = getattr(trainer.strategy, "offload_optimizer", None)
    trained = {id(p): p.numel() * p.element_size() for p in module.parameters() if p.requires_grad}
    if optimizer is None:
        return {"persistent": 2.0 * sum(trained.values()), "per step": float(sum(trained.values()))}
    last = optimizer.telemetry.last
    # Gradients that fill .grad on the device until they are sent: every trained tensor but the projected weights
    # (never a .grad) and the scaled ones (counted as held).
    compressed = {id(layer.weight) for layer in optimizer.projected_layers}
    compressed |= {id(slot.param) for slot in optimizer.slots if isinstance(slot, ScaledSlot)}
    dense_grads = sum(size for key, size in trained.items() if key not in compressed)
    return {"persistent": float(sum(optimizer.telemetry.device_persistent_bytes.values())),
            "per step": dense_grads + last.device_compressed_grad_bytes + last.device_held_gradient_bytes}


def measure(name: str, precision: str, steps: int, warmup: int, vocab: int, hidden: int,
            untied: bool = False) -> tuple[float, dict[str, float], dict[str, float]]:
    """Median steady step seconds of one configuration, the median seconds of each engine phase, and its device
    bytes (:func:`device_bytes`)."""
    generator = seed_everything(0)
    model = tiny_llama(vocab_size=vocab, hidden=hidden, intermediate=hidden * 11 // 4, heads=8, kv_heads=4, layers=4,
                       tie_word_embeddings=not untied)
    tokens = torch.randint(0, vocab, (8 * steps, 128), generator=generator)
    loader = DataLoader(TensorDataset(tokens), batch_size=8,
                        collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows]),
                                                 "labels": torch.stack([r[0] for r in rows])})
    clock, phases = StepClock(), PhaseReader(warmup)
    # Plain training with torch's fused AdamW, the baseline a user would otherwise run (the offload strategies step
    # a fused Adam on the host whatever the flag).
    module = CausalLMModule(model, lr=1e-4, fused=True if name.startswith("plain") else None)
    trainer = pl.Trainer(strategy=CONFIGS[name](), accelerator="cpu", devices=1, precision=precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock, phases])
    trainer.fit(module, train_dataloaders=loader)
    return spread(steady(clock.seconds, warmup)).median, phases.medians(), device_bytes(trainer, module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--untied", action="store_true", help="an LM head of its own (the default ties it)")
    add_standard_arguments(parser, repeats=3, warmup=4, trees=True)
    args = parser.parse_args()
    if "plain fused AdamW" not in args.configs:
        parser.error("--configs must include 'plain fused AdamW': every figure is a ratio to it.")
    if begin_run(args, __file__) is None:
        return
    memory: dict[str, dict[str, float]] = {}

    def run(name: str, repeat: int) -> tuple[float, dict[str, float]]:
        seconds, phases, memory[name] = measure(name, args.precision, args.steps, args.warmup, args.vocab,
                                                args.hidden, args.untied)
        return seconds, phases

    def progress(name: str, repeat: int, result: tuple[float, dict[str, float]]) -> None:
        print(f"[repeat {repeat}] {name}: {result[0] * 1e3:.1f} ms/step", flush=True)

    runs = alternate(args.configs, args.repeats, run, progress)
    results = {name: [seconds for seconds, _ in values] for name, values in runs.items()}
    phase_runs = {name: [phases for _, phases in values] for name, values in runs.items()}
    medians = {name: spread(values).median for name, values in results.items()}
    against = ratios(medians, "plain fused AdamW")
    print(f"\nsmall LLaMA (hidden {args.hidden}, 4 layers, vocab {args.vocab}, {'untied' if args.untied else 'tied'} "
          f"head), 8×128 tokens, {args.precision}, {args.repeats} repeats\n")
    print(markdown_table(
        ["configuration", "ms / step (median)", "× plain fused AdamW",
         "device MiB kept beside the weights: persistent, per step"],
        [[name, f"{medians[name] * 1e3:.1f}", f"{against[name]:.2f}",
          f"{memory[name]['persistent'] / 2**20:.1f}, {memory[name]['per step'] / 2**20:.1f}"] for name in results]))
    print_phases(results, phase_runs, medians["plain fused AdamW"])
    write_json(args.json, {"args": vars(args), "step_seconds": results, "phases": phase_runs, "device_bytes": memory})


def print_phases(results: dict[str, list[float]], phase_runs: dict[str, list[dict[str, float]]],
                 baseline: float) -> None:
    """Where each offload configuration's step goes: the engine's phases (median over repeats of the per-step
    medians), and the rest of the step (the model's forward and backward, Lightning), against plain AdamW's step."""
    offloaded = [name for name, runs in phase_runs.items() if runs and runs[0]]
    if not offloaded:
        return
    print("\nWhere a step's time goes, ms per step (engine phases; 'rest' = step − phases, the model's forward and "
          "backward and Lightning's loop, to compare with plain AdamW's whole step):\n")
    rows = []
    for name in offloaded:
        per_phase = {phase: spread(run[phase] for run in phase_runs[name]).median for phase in PHASES}
        step = spread(results[name]).median
        rows.append([name, *(f"{per_phase[phase] * 1e3:.1f}" for phase in PHASES),
                     f"{(step - sum(per_phase.values())) * 1e3:.1f}", f"{step * 1e3:.1f}"])
    rows.append(["plain fused AdamW", *("—" for _ in PHASES), f"{baseline * 1e3:.1f}", f"{baseline * 1e3:.1f}"])
    print(markdown_table(["configuration", *PHASES, "rest", "step"], rows))


if __name__ == "__main__":
    main()
