"""Host nanoseconds per element of the row-sparse Adams against torch's fused AdamW on the same number of elements.

One process, interleaved repeats, medians: :class:`~lightning_offload.row_adam.HostRowAdam` (the row-sparse
embedding's Adam: gathers the touched rows into preallocated workspaces, catches their moments up, steps, scatters)
and MEFT's :class:`~lightning_offload.meft.lazy_adam.LazyRowAdam` (keys and values, per-row step counts) on ``--rows``
of an ``--height × --width`` fp32 matrix, and ``torch.optim.AdamW(fused=True)`` stepping a dense tensor of the same
element count (the floor: one fused pass, no gather).

    python scripts/benchmark_row_adam.py                          # 2048 of 32000 rows of width 2048 (1.3B embedding)
    python scripts/benchmark_row_adam.py --height 16384 --width 576 --rows 1600
    python scripts/benchmark_row_adam.py --threads 1                # on a busy machine: no waits at thread barriers
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lightning_offload.meft.lazy_adam import LazyAdamSettings, LazyRowAdam
from lightning_offload.row_adam import HostRowAdam

SETTINGS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _time(step: Callable[[int], None], repeats: int) -> float:
    seconds = []
    for i in range(repeats):
        start = time.perf_counter()
        step(i)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])  # the first call sizes workspaces and creates state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=32000)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    elements = args.rows * args.width
    row_sets = [torch.randperm(args.height, generator=generator)[:args.rows].sort().values for _ in range(4)]
    grads = [torch.randn(args.rows, args.width, generator=generator) for _ in range(4)]

    row_adam = HostRowAdam(torch.randn(args.height, args.width, generator=generator))

    def host_row(i: int) -> None:
        row_adam.step(row_sets[i % 4], grads[i % 4].clone(), **SETTINGS)

    lazy = LazyRowAdam([torch.randn(args.height, args.width, generator=generator)])
    lazy_settings = LazyAdamSettings(**SETTINGS)

    def lazy_row(i: int) -> None:
        lazy.step(row_sets[i % 4], [grads[i % 4]], lazy_settings)

    dense = torch.randn(args.rows, args.width, generator=generator, requires_grad=True)
    fused = torch.optim.AdamW([dense], **SETTINGS, fused=True)

    def fused_dense(i: int) -> None:
        dense.grad = grads[i % 4]
        fused.step()

    results: dict[str, list[float]] = {"torch AdamW (fused), dense": [], "HostRowAdam": [], "LazyRowAdam (MEFT)": []}
    for _ in range(3):  # interleaved, so load on the machine hits all three alike
        results["torch AdamW (fused), dense"].append(_time(fused_dense, args.repeats))
        results["HostRowAdam"].append(_time(host_row, args.repeats))
        results["LazyRowAdam (MEFT)"].append(_time(lazy_row, args.repeats))
    floor = statistics.median(results["torch AdamW (fused), dense"])
    print(f"{args.rows} of {args.height} rows × {args.width} ({elements / 1e6:.1f}M elements per step), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| optimizer | ms / step | ns / element | × fused AdamW |\n|---|---|---|---|")
    for name, values in results.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / elements * 1e9:.2f} | {seconds / floor:.2f} |")


if __name__ == "__main__":
    main()
