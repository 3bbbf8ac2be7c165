"""MEFT's whole host row step per training step against torch's fused AdamW stepping as many elements (CPU).

What is timed is everything the host does for the adapter rows in a step: the row gradients landing as backward hands
them over (kept, or summed into the host accumulators, with their squared norm), the touched blocks found and each
block's gradient prepared (rows no gradient reached zeroed), the rows' norm, the block Adam step, the stepped keys'
routing copy refreshed and the step's gradients forgotten: the time spent in the engine's entry points to that work
(:data:`ENTRY_POINTS`, a call inside another counted once), so an earlier tree is timed on the same boundary. Beside it
is ``meft/host_optimizer_seconds``, the telemetry the issue quoted (which, since this benchmark, counts the main
thread's preparing of the blocks too). Each training step of a real model under ``meft_offload`` (``pipelined=False``,
so that a step's row updates finish inside it) is followed, in the same process, by ``torch.optim.AdamW(fused=True)``
stepping one dense tensor with as many elements as the rows the step stepped (``meft/rows_stepped`` times the hidden
size, keys and values): once, as a training loop steps it (after a training step, its state as far from the caches as
the rows'), then ``--fused-repeats`` times in a row (in the caches: its best case). Medians and ranges over the steps
after the first ``--skip`` (warm-up: state allocated, workspaces sized). On the CPU device the engine runs host jobs
inline, in the training thread, so ``--cpu-clock`` can time in that thread's CPU time: on a machine shared with other
work it leaves out the time they held the core.

Shapes (``--shape``):

* ``tiny``: a tiny LLaMA (hidden 128, 2 layers), ``MEFTConfig()``'s defaults (16384 neurons in 128 experts of 128,
  4 experts per sequence), 4×512 random tokens: about 0.9M elements stepped per step.
* ``1.3b``: the adapters of ``scripts/gpu_bench.py``'s 1.3B shape (hidden 2048; 8192 neurons, 64 experts of 128, top
  16, 4 experts per sequence and token) beside the FFNs of a LLaMA with that hidden size but ``--layers`` layers (1 by
  default) and a small FFN and vocabulary (the base model's compute is not what is measured): about 8M elements
  stepped per adapter and step, as in each of the 24 layers of the real model.

``--sections`` also prints where the row step's time goes (the clock around the functions on the row path; nested
sections count in both).

    python scripts/benchmark_meft_row_step.py --shape tiny --steps 14
    python scripts/benchmark_meft_row_step.py --shape tiny --threads 1 --cpu-clock --sections
    python scripts/benchmark_meft_row_step.py --shape 1.3b --steps 8 --threads 1 --cpu-clock
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from harness import add_standard_arguments, begin_run, markdown_table, spread, write_json
from torch.utils.data import DataLoader

import lightning_offload  # noqa: F401  (registers meft_offload)
from lightning_offload import MEFTConfig, MEFTOffloadStrategy, inject_meft
from lightning_offload.engine.rows.native_row_adam import native_row_adam
from lightning_offload.models import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule

#: Per shape: the LLaMA (hidden, heads, FFN width) and the adapters' settings.
SHAPES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "tiny": (dict(hidden=128, heads=4, intermediate=256), {}),
    "1.3b": (dict(hidden=2048, heads=16, intermediate=256),
             dict(num_neurons=8192, top_k=16, num_experts=64, experts_per_token=4)),
}
#: The clock of every timing here: wall time, or with ``--cpu-clock`` this thread's CPU time (on the CPU device the
#: engine runs host jobs inline, in this thread), which leaves out the time other processes held the core.
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def now() -> float:
    return CLOCK[0]()


#: Where the host's work on the rows begins in a step (the functions the engine calls): the gradient landing on the
#: worker, the step's blocks, norm and preparation on the main thread, the row Adam step on the worker. Each is
#: (module, class, function).
ENTRY_POINTS = (
    ("lightning_offload.engine.rows.row_gradients", "RowGradients", "_add_rows"),
    ("lightning_offload.engine.rows.row_gradients", "RowGradients", "step_blocks"),
    ("lightning_offload.engine.rows.row_gradients", "RowGradients", "norm"),
    ("lightning_offload.engine.slots.row_blocks_slot", "RowBlocksSlot", "settings"),
    ("lightning_offload.engine.slots.row_blocks_slot", "RowBlocksSlot", "prepare"),
    ("lightning_offload.engine.slots.row_blocks_slot", "RowBlocksSlot", "host_step"),
)
#: The row path's functions timed by ``--sections``: the entry points and what they call.
SECTIONS = ENTRY_POINTS + (
    ("lightning_offload.engine.slots.row_blocks_slot", "RowBlocksSlot", "touched_blocks"),
    ("lightning_offload.engine.slots.row_blocks_slot", "RowBlocksSlot", "forget"),
    ("lightning_offload.engine.rows.block_row_adam", "BlockRowAdam", "step"),
    ("lightning_offload.engine.rows.block_row_adam", "BlockRowAdam", "_decayed_scales"),
    ("lightning_offload.engine.rows.row_landing", "RowLanding", "land"),
    ("lightning_offload.engine.rows.row_landing", "RowLanding", "block_gradients"),
    ("lightning_offload.meft.adapter", "MEFTAdapter", "refresh_routing_keys"),
    ("lightning_offload.meft.attached", "AttachedAdapters", "step_figures"),
)


def install(points: tuple[tuple[str, str, str], ...], wrap: Callable[[Callable[..., Any], str], Any]) -> None:
    """Replace each of ``points`` by ``wrap(function, "Class.function")``; those missing from the tree under test
    (an earlier one) are left out."""
    for module_name, owner_name, name in points:
        owner = getattr(importlib.import_module(module_name), owner_name)
        if hasattr(owner, name):
            setattr(owner, name, wrap(getattr(owner, name), f"{owner_name}.{name}"))


class RowClock:
    """Seconds spent in :data:`ENTRY_POINTS` (a call inside another counted once): everything the host does for the
    rows, measured the same way in any tree."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = threading.local()
        self._lock = threading.Lock()

    def install(self) -> None:
        install(ENTRY_POINTS, self._wrap)

    def _wrap(self, function: Callable[..., Any], label: str = "") -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            self._depth.value = depth + 1
            start = now()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth.value = depth
                if depth == 0:
                    with self._lock:
                        self.seconds += now() - start

        return timed

    def take(self) -> float:
        with self._lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


class Sections:
    """Seconds and calls per function of :data:`SECTIONS` (wrapped in place; nested sections count in both)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def install(self) -> None:
        install(SECTIONS, self._wrap)

    def _wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = now()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += now() - start
                self.calls[label] += 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def print(self, steps: int) -> None:
        print()
        print(markdown_table(["function", "ms / step", "calls / step"],
                             [[f"`{label}`", f"{seconds / steps * 1e3:.3f}", f"{self.calls[label] / steps:.1f}"]
                              for label, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])]))


class FusedFloor:
    """``torch.optim.AdamW(fused=True)`` on one dense tensor per element count (made and stepped once when first
    asked for, so the timed steps find their state).

    Timed once right after each training step, as a training loop steps it once per step (its state as far from the
    caches as the row step's), and then ``repeats`` times more in a row (its state in the caches: the best case).
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.optimizers: dict[int, torch.optim.Optimizer] = {}

    def seconds(self, elements: int, repeats: int) -> tuple[float, float]:
        """(the step after a training step, the median of ``repeats`` more) in seconds."""
        optimizer = self.optimizers.get(elements)
        if optimizer is None:
            param = torch.randn(elements, requires_grad=True)
            param.grad = torch.randn(elements)
            optimizer = self.optimizers[elements] = torch.optim.AdamW([param], **self.settings, fused=True)
            optimizer.step()
        times = []
        for _ in range(1 + repeats):
            start = now()
            optimizer.step()
            times.append(now() - start)
        return times[0], spread(times[1:]).median


class SideBySide(pl.Callback):
    """After each training step: the row step's host seconds and rows stepped, then fused AdamW on as many elements."""

    leaves_weights_alone = True  # reads figures only: the strategy keeps its own step order

    def __init__(self, strategy: MEFTOffloadStrategy, hidden: int, floor: FusedFloor, repeats: int, skip: int,
                 clock: RowClock, sections: Sections | None) -> None:
        self.strategy, self.hidden, self.floor, self.repeats, self.skip = strategy, hidden, floor, repeats, skip
        self.clock, self.sections = clock, sections
        # Per step: row seconds (the row-path clock), elements stepped, fused AdamW seconds after the step and in a
        # row, and the telemetry's meft/host_optimizer_seconds.
        self.rows: list[tuple[float, int, float, float, float]] = []

    def on_train_batch_end(self, *args: Any) -> None:
        figures = self.strategy.figures_at_step_end()
        elements = int(figures["meft/rows_stepped"]) * self.hidden * 2  # keys and values
        row_seconds = self.clock.take()
        self.rows.append((row_seconds, elements, *self.floor.seconds(elements, self.repeats),
                          figures["meft/host_optimizer_seconds"]))
        if self.sections is not None and len(self.rows) == self.skip:
            self.sections.reset()  # the sections count the measured steps only

    def measured(self) -> list[tuple[float, int, float, float, float]]:
        return self.rows[self.skip:]


def batches(count: int, batch: int, length: int) -> list[dict[str, torch.Tensor]]:
    """Random byte-token batches, every token real."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(1, 256, (batch, length), generator=generator)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def run(args: argparse.Namespace) -> list[tuple[float, int, float, float, float]]:
    """Trains ``args.steps`` steps of ``args.shape``; returns the measured steps' (row seconds, elements, fused
    seconds after the step, fused seconds in a row, the telemetry's row seconds)."""
    model_shape, adapter_settings = SHAPES[args.shape]
    layers = args.layers if args.layers is not None else (2 if args.shape == "tiny" else 1)
    model = tiny_llama(hidden=model_shape["hidden"], layers=layers, heads=model_shape["heads"],
                       intermediate=model_shape["intermediate"], max_positions=args.length)
    inject_meft(model, MEFTConfig(**adapter_settings))
    sections = Sections() if args.sections else None
    if sections is not None:
        sections.install()
    clock = RowClock()
    clock.install()
    strategy = MEFTOffloadStrategy(device="cpu", pipelined=args.pipelined)
    settings = dict(lr=1e-3, weight_decay=0.01)
    side = SideBySide(strategy, model_shape["hidden"], FusedFloor(settings), args.fused_repeats, args.skip, clock,
                      sections)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[side])
    module = CausalLMModule(model, **settings)
    trainer.fit(module, train_dataloaders=DataLoader(batches(args.steps, args.batch, args.length), batch_size=None))
    if sections is not None:
        sections.print(len(side.measured()))
    return side.measured()


def report(measured: list[tuple[float, int, float, float, float]]) -> None:
    """Medians and ranges of the row step, the fused floor and their ratio over the measured steps."""
    rows = [m[0] for m in measured]
    elements = spread(m[1] for m in measured).median
    after, cached = [m[2] for m in measured], [m[3] for m in measured]
    print(f"\n{len(measured)} steps measured, {elements / 1e6:.2f}M elements stepped per step (median)\n")
    # Ratios step by step (the row step over the fused step measured right after it), then their median and range.
    print(markdown_table(
        ["host row step, ms", "fused AdamW after the step, ms", "×", "fused AdamW in a row (cached), ms", "×"],
        [[spread(rows).cell(1e3, 2), spread(after).cell(1e3, 2), spread(r / f for r, f in zip(rows, after)).cell(1, 1),
          spread(cached).cell(1e3, 2), spread(r / f for r, f in zip(rows, cached)).cell(1, 1)]]))
    print(f"\nmeft/host_optimizer_seconds (the telemetry): {spread(m[4] for m in measured).cell(1e3, 2)} ms")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="LLaMA layers, one adapter each (tiny: 2, 1.3b: 1)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=14, help="training steps, the first --skip not measured")
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--fused-repeats", type=int, default=3,
                        help="fused AdamW steps timed in a row after the first one after each training step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sections", action="store_true", help="print where the row step's time goes")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time in this thread's CPU time (host jobs run in it on the CPU device): leaves out the "
                             "time other processes held the core on a shared machine (needs --threads 1)")
    parser.add_argument("--pipelined", action="store_true",
                        help="meft_offload's default: a step's row updates overlap the next forward (and its figure "
                             "holds the previous step's updates, stretched by sharing the cores with that forward)")
    add_standard_arguments(parser, trees=True)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_clock:
        if torch.get_num_threads() != 1:
            raise SystemExit("--cpu-clock counts this thread only: run it with --threads 1.")
        CLOCK[0] = time.thread_time
    if begin_run(args, __file__) is None:
        return
    kernel = native_row_adam()  # which row kernel the run measures (LIGHTNING_OFFLOAD_NATIVE=0: torch's)
    print(f"{args.shape}: row kernel: "
          f"{'native (' + str(kernel.path) + ')' if kernel is not None else 'torch fused (assembled blocks)'}")
    measured = run(args)
    report(measured)
    write_json(args.json, {"args": vars(args), "kernel": str(kernel.path) if kernel is not None else None,
                           "steps": [dict(zip(("row_seconds", "elements", "fused_after_seconds",
                                               "fused_cached_seconds", "telemetry_row_seconds"), m))
                                     for m in measured]})


if __name__ == "__main__":
    main()
