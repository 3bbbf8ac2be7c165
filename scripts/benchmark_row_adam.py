"""Host nanoseconds per element of the engine's row Adam against torch's fused AdamW on the same number of elements.

One process, interleaved repeats, medians, two tables of
:class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`:

* a row-sparse embedding's step, ``--rows`` of an ``--height × --width`` matrix of one-row blocks: gathered
  (``step_rows``: the touched rows read into preallocated workspaces, their moments caught up, one kernel call,
  scattered back; the path the engine takes for an embedding) and, beside it, in place (``step``: one slice per row);
* MEFT's adapter rows, in place, on one adapter (keys and values, ``--neurons × --width``
  each, blocks of ``--neurons / --experts`` rows, ``--fill`` of each block's rows with a gradient), ``--blocks`` blocks
  per step: the whole row step as ``meft_offload`` runs it (zeroing the stepped blocks' idle rows, the gradient norm
  over the stepped blocks, the fused Adam kernel on the slices with the moments' catch-up folded in; the touched rows'
  sums are overwritten by the next step's first gradient, never zeroed), with the same blocks at every step and with
  blocks drawn at random per step (most of them caught up over a gap);

each against ``torch.optim.AdamW(fused=True)`` stepping dense tensors of the same element count (the floor: one fused
pass, no gather, no norm, no zeroing).

    python scripts/benchmark_row_adam.py                   # 2048 of 32000 rows × 2048; MEFT at the 1.3B shape
    python scripts/benchmark_row_adam.py --only meft --neurons 16384 --width 576 --experts 128 --blocks 40 --fill 0.65
    python scripts/benchmark_row_adam.py --threads 1       # on a busy machine: no waits at thread barriers
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, seed_everything, spread, \
    time_steps, write_json

from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings

SETTINGS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


#: Rounds of alternation: each row's median over ``--repeats`` calls is taken once per round.
ROUNDS = 3


def _time(step: Callable[[int], None], repeats: int) -> float:
    # The first call sizes workspaces and creates state: not timed.
    return spread(time_steps(step, repeats, warmup=1)).median


def _fused_floor(rows: int, width: int, matrices: int, generator: torch.Generator) -> Callable[[int], None]:
    dense = [torch.randn(rows, width, generator=generator, requires_grad=True) for _ in range(matrices)]
    grads = [[torch.randn(rows, width, generator=generator) for _ in range(matrices)] for _ in range(2)]
    fused = torch.optim.AdamW(dense, **SETTINGS, fused=True)

    def step(i: int) -> None:
        for p, g in zip(dense, grads[i % 2]):
            p.grad = g
        fused.step()

    return step


def _table(results: dict[str, list[float]], elements: int, floor_name: str) -> None:
    seconds = {name: spread(values).median for name, values in results.items()}
    against = ratios(seconds, floor_name)  # the same element count: the ratio per element is the ratio per step
    print(markdown_table(["optimizer", "ms / step", "ns / element", "× fused AdamW"],
                         [[name, f"{value * 1e3:.1f}", f"{value / elements * 1e9:.2f}", f"{against[name]:.2f}"]
                          for name, value in seconds.items()]))


def embedding_table(args: argparse.Namespace, generator: torch.Generator) -> dict[str, list[float]]:
    """The row Adam on the touched rows of an embedding, gathered and in place, against fused AdamW on as many
    elements."""
    elements = args.rows * args.width
    row_sets = [torch.randperm(args.height, generator=generator)[:args.rows].sort().values for _ in range(4)]
    grads = [torch.randn(args.rows, args.width, generator=generator) for _ in range(4)]
    row_adam = BlockRowAdam([torch.randn(args.height, args.width, generator=generator)], 1)

    def gathered(i: int) -> None:
        row_adam.step_rows(row_sets[i % 4], grads[i % 4].clone(), RowAdamSettings(**SETTINGS))

    # The same rows stepped in place, as MEFT's blocks are: the rows' gradients scattered into a full-size
    # accumulator first, as that path steps them in place there.
    block_adam = BlockRowAdam([torch.randn(args.height, args.width, generator=generator)], 1)
    accumulator = torch.zeros(args.height, args.width)
    masks = [torch.zeros(args.height, dtype=torch.bool).index_fill_(0, rows, True) for rows in row_sets]

    def block_row(i: int) -> None:
        accumulator.index_copy_(0, row_sets[i % 4], grads[i % 4])
        block_adam.step(block_adam.blocks_of(masks[i % 4]), [accumulator], RowAdamSettings(**SETTINGS),
                        zero_grads=False)

    steps = {"torch AdamW (fused), dense": _fused_floor(args.rows, args.width, 1, generator),
             "BlockRowAdam.step_rows, gathered (the embedding's path)": gathered,
             "BlockRowAdam.step, in place, one slice per row": block_row}
    results = alternate(list(steps), ROUNDS, lambda name, _: _time(steps[name], args.repeats))
    print(f"\nEmbedding: {args.rows} of {args.height} rows × {args.width} ({elements / 1e6:.1f}M elements per step)\n")
    _table(results, elements, "torch AdamW (fused), dense")
    return results


def meft_table(args: argparse.Namespace, generator: torch.Generator) -> dict[str, list[float]]:
    """BlockRowAdam's whole row step on one adapter against fused AdamW on the stepped element count."""
    block_rows = args.neurons // args.experts
    elements = 2 * args.blocks * block_rows * args.width  # keys and values
    params = [torch.randn(args.neurons, args.width, generator=generator) for _ in range(2)]
    accumulators = [torch.zeros(args.neurons, args.width) for _ in range(2)]
    optimizer = BlockRowAdam(params, block_rows)
    settings = RowAdamSettings(**SETTINGS)
    fixed = torch.randperm(args.experts, generator=generator)[:args.blocks].sort().values
    drawn = [torch.randperm(args.experts, generator=generator)[:args.blocks].sort().values for _ in range(8)]
    noise = torch.randn(block_rows, args.width, generator=generator)

    touched_rows = max(1, round(args.fill * block_rows))
    stale = torch.randn(block_rows - touched_rows, args.width, generator=generator)

    def row_step(blocks: torch.Tensor) -> tuple[float, float, float]:
        # Not timed: the step's gradients arriving (copied into the touched rows, as the step's first gradient is),
        # and the idle rows of each block holding a consumed step's sum.
        idle = []
        for accumulator in accumulators:
            for block in blocks.tolist():
                start = block * block_rows
                accumulator[start:start + touched_rows].copy_(noise[:touched_rows])
                accumulator[start + touched_rows:start + block_rows].copy_(stale)
                idle.append(torch.arange(start + touched_rows, start + block_rows))
        idle_rows = torch.cat(idle[:len(idle) // 2])
        # As meft_offload does: zero the idle rows, read the norm (the finite check and clipping), step in place.
        start = time.perf_counter()
        for accumulator in accumulators:
            accumulator.index_fill_(0, idle_rows, 0.0)
        zeroed = time.perf_counter()
        norm = optimizer.grad_norm_squares(accumulators, blocks).sqrt()
        normed = time.perf_counter()
        optimizer.step(blocks, accumulators, settings, ("norm", min(1.0, 1.0 / float(norm))), zero_grads=False)
        return zeroed - start, normed - zeroed, time.perf_counter() - normed

    def timed(choose: Callable[[int], torch.Tensor], part: int | None) -> Callable[[], float]:
        def run() -> float:
            seconds = [row_step(choose(i)) for i in range(args.repeats)][1:]
            return spread(sum(s) if part is None else s[part] for s in seconds).median
        return run

    floor = _fused_floor(args.blocks * block_rows, args.width, 2, generator)
    same, drawn_per_step = (lambda i: fixed), (lambda i: drawn[i % len(drawn)])
    runs = {"torch AdamW (fused), dense": lambda: _time(floor, args.repeats),
            "BlockRowAdam, the same blocks every step: all": timed(same, None),
            "BlockRowAdam, blocks drawn per step (caught up over gaps): all": timed(drawn_per_step, None),
            "– zeroing the idle rows": timed(drawn_per_step, 0),
            "– the gradient norm (without accumulation: summed as the gradients land, in backward)":
                timed(drawn_per_step, 1),
            "– the step (catch-up, fused Adam)": timed(drawn_per_step, 2)}
    results = alternate(list(runs), ROUNDS, lambda name, _: runs[name]())
    print(f"\nMEFT adapter: {args.blocks} of {args.experts} blocks of {block_rows} rows × {args.width} "
          f"({touched_rows} of them with a gradient), keys and values ({elements / 1e6:.1f}M elements per step; "
          f"zeroing idle rows, norm, catch-up and Adam timed)\n")
    _table(results, elements, "torch AdamW (fused), dense")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=32000)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--neurons", type=int, default=8192, help="MEFT adapter rows (keys and values each)")
    parser.add_argument("--experts", type=int, default=64, help="MEFT experts: blocks of neurons/experts rows")
    parser.add_argument("--blocks", type=int, default=16, help="MEFT blocks stepped per step (4 sequences × 4)")
    parser.add_argument("--fill", type=float, default=1.0,
                        help="share of a stepped block's rows with a gradient (the rest idle: zeroed, then stepped)")
    parser.add_argument("--repeats", type=int, default=12, help="calls timed per figure (the first not counted)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--only", choices=("embedding", "meft"), default=None, help="run one table")
    add_standard_arguments(parser, seed=0, trees=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if begin_run(args, __file__) is None:
        return
    generator = seed_everything(args.seed)
    results = {}
    if args.only != "meft":
        results["embedding"] = embedding_table(args, generator)
    if args.only != "embedding":
        results["meft"] = meft_table(args, generator)
    write_json(args.json, {"args": vars(args), "seconds": results})


if __name__ == "__main__":
    main()
