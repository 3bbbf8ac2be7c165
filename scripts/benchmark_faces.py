"""Step time of the offload in each face (a plain loop, Fabric, the Trainer), each against the same face with plain
fused AdamW, side by side in one process: the cost a face adds is its ratio's difference from the others'.

Each run trains ``--steps`` optimizer steps (two micro-batches each, norm clipping) of a small LLaMA on synthetic
tokens; the first ``--warmup`` steps are not timed. Rounds alternate the runs (so load on the machine hits all alike)
and the table gives the median over rounds of the median step time, and its ratio to the face's AdamW run.

    python scripts/benchmark_faces.py                       # lsp_offload, random projectors, rank 0.25
    python scripts/benchmark_faces.py --strategy zero_offload --rounds 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, spread, steady, \
    time_steps, write_json
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import lightning_offload
from lightning_offload import FabricOffload, FabricZeroOffload
from lightning_offload.models.tiny import tiny_llama

VOCAB = 512


def _model() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, hidden=256, intermediate=768, layers=4, heads=8, seed=0)


def _batches(steps: int, batch: int, length: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (batch, length), generator=generator) for _ in range(2 * steps)]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)


def _train(args: argparse.Namespace, model: torch.nn.Module, optimizer: Any, backward: Callable[[Any], None],
           clip: Callable[[], None], close: bool) -> float:
    """Times ``args.steps`` steps of two micro-batches each; closes an offload optimizer after."""
    batches = _batches(args.steps, args.batch, args.length)

    def step(i: int) -> None:
        for ids in batches[2 * i:2 * i + 2]:
            backward(_loss(model, ids) / 2)
        clip()
        optimizer.step()
        optimizer.zero_grad()

    try:
        return spread(time_steps(step, args.steps, args.warmup)).median
    finally:
        if close:
            optimizer.close()


def plain_loop(args: argparse.Namespace, offloaded: bool) -> float:
    model = _model()
    if offloaded:  # clipped inside each step (max_grad_norm)
        optimizer = lightning_offload.offload(model, _adamw(model), args.strategy, accumulation_steps=2,
                                              max_grad_norm=1.0, **_settings(args))
        return _train(args, model, optimizer, lambda loss: loss.backward(), lambda: None, close=True)
    return _train(args, model, _adamw(model), lambda loss: loss.backward(),
                  lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), close=False)


def fabric_loop(args: argparse.Namespace, offloaded: bool) -> float:
    face = FabricOffload if args.strategy == "lsp_offload" else FabricZeroOffload
    strategy = face(accumulation_steps=2, **_settings(args)) if offloaded else "auto"
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    model = _model()
    model, optimizer = fabric.setup(model, _adamw(model))
    return _train(args, model, optimizer, fabric.backward,
                  lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0), close=offloaded)


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _model()

    def training_step(self, batch: tuple[torch.Tensor], index: int) -> torch.Tensor:
        return _loss(self.model, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _adamw(self)


class _StepClock(pl.Callback):
    """The time at which each optimizer step's last micro-batch ended (the step counter moved)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.times.append(time.perf_counter())


def trainer_loop(args: argparse.Namespace, offloaded: bool) -> float:
    batches = _batches(args.steps, args.batch, args.length)
    clock = _StepClock()
    strategy: Any = "auto"
    if offloaded:
        cls = lightning_offload.LSPOffloadStrategy if args.strategy == "lsp_offload" else \
            lightning_offload.ZeroOffloadStrategy
        strategy = cls(**_settings(args))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps,
                         accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
    trainer.fit(_Module(), DataLoader(TensorDataset(torch.cat(batches)), batch_size=args.batch))
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return spread(steady(steps, args.warmup)).median


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.strategy == "zero_offload":
        return {}
    return {"rank": args.rank, "min_dim": 128, "projectors": "random"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["lsp_offload", "zero_offload"], default="lsp_offload")
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    add_standard_arguments(parser, repeats=3, warmup=2, repeats_aliases=("--rounds",))
    args = parser.parse_args()
    if begin_run(args, __file__) is None:
        return
    faces = {"plain loop": plain_loop, "Fabric": fabric_loop, "Trainer": trainer_loop}
    configs = [(face, offloaded) for face in faces for offloaded in (False, True)]
    results = alternate(configs, args.repeats, lambda config, _: faces[config[0]](args, config[1]))
    print(f"\n{args.strategy}, {args.repeats} rounds\n")
    rows = []
    for face in faces:
        # Each face against its own AdamW run: the ratio's difference between faces is what a face adds.
        medians = {offloaded: spread(results[(face, offloaded)]).median for offloaded in (False, True)}
        rows.append([face, f"{medians[False]:.3f}", f"{medians[True]:.3f}", f"{ratios(medians, False)[True]:.2f}"])
    print(markdown_table(["face", "AdamW s / step", "offload s / step", "offload / AdamW"], rows))
    write_json(args.json, {"args": vars(args), "seconds": {f"{face}|{'offload' if off else 'AdamW'}": values
                                                           for (face, off), values in results.items()}})


if __name__ == "__main__":
    main()
