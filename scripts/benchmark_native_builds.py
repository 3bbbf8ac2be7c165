"""The CPU's projection kernels (lsp/kernels/native/projection.c) built for other instruction sets and from other
versions of the source, timed side by side on this machine: what an AVX2-only CPU's build does, before and after a
change, without such a CPU at hand.

Each build is compiled with the package's own flags plus ``-march=<arch>`` (``native`` is what the package builds),
checked by the package's load-time check (a build that fails it is reported, not timed), then its three products are
timed at a few projected-layer shapes, one thread, builds interleaved over ``--repeats``; a figure is the median of a
build's calls. The machine line says which instruction sets this CPU runs: ``-march`` values it lacks cannot run here.

    python scripts/benchmark_native_builds.py --march native haswell
    git show 4355ba9:lightning_offload/lsp/kernels/native/projection.c > /tmp/before.c
    python scripts/benchmark_native_builds.py --march native haswell --source before=/tmp/before.c
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from harness import add_standard_arguments, alternate, begin_run, markdown_table, time_steps, write_json

from lightning_offload.lsp.kernels import build, checks, native
from lightning_offload.lsp.projector import random_projector

#: (features in, features out) of the products timed: issue 55's small and hidden-1024 layers.
SHAPES = [(256, 64), (704, 176), (1024, 256), (2816, 704)]
TOKENS, COLUMNS, CALLS = 1024, 1024, 30


def compile_build(source: Path, arch: str, library: Path) -> native.NativeProjection:
    """The kernels of ``source`` built for ``-march=arch`` into ``library`` and loaded (the last ``-march`` given is
    the one used)."""
    subprocess.run([build.compiler(), *native._FLAGS, *build.NATIVE_FLAGS, f"-march={arch}", "-Wno-psabi",
                    str(source), "-o", str(library)], check=True, capture_output=True)
    return native.NativeProjection(ctypes.CDLL(str(library)), library)


def median_ms(call: Callable[[], object]) -> float:
    """Median milliseconds of ``CALLS`` calls after one untimed."""
    return statistics.median(time_steps(lambda _: call(), CALLS + 1, warmup=1)) * 1e3


def time_products(kernels: native.NativeProjection) -> dict[str, float]:
    """Milliseconds of each product at each shape (fp32, one thread)."""
    generator = torch.Generator().manual_seed(0)
    figures = {}
    for n, d in SHAPES:
        projector = random_projector(n, d, 8, generator, torch.device("cpu"))
        indices, values = projector.indices, projector.values
        x = torch.randn(TOKENS, n, generator=generator)
        weight = torch.randn(n, COLUMNS, generator=generator)
        half = torch.randn(d, COLUMNS, generator=generator) * 1e-3
        small = torch.randn(d, 256, generator=generator)
        figures[f"B Xᵀ {n}→{d}"] = median_ms(lambda: kernels.compress_tokens(indices, values, d, x, 1))
        figures[f"update {n}×{COLUMNS}"] = median_ms(lambda: kernels.update_rows_(weight, indices, values, half, 1.0,
                                                                                   None, 1))
        figures[f"expansion 256×{n}"] = median_ms(lambda: kernels.expand_columns(indices, values, d, small, 1))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", nargs="+", default=["native", "haswell"], help="-march values to build for")
    parser.add_argument("--source", nargs="*", default=[], metavar="LABEL=FILE",
                        help="other versions of projection.c to build beside the package's ('now')")
    add_standard_arguments(parser, repeats=3)
    args = parser.parse_args()
    begin_run(args, __file__)
    torch.set_num_threads(1)
    sources = {"now": native.SOURCE, **{label: Path(file) for label, file in (s.split("=", 1) for s in args.source)}}
    with tempfile.TemporaryDirectory() as folder:
        builds = {}
        for label, source in sources.items():
            for arch in args.march:
                kernels = compile_build(source, arch, Path(folder) / f"{label}-{arch}.so")
                failed = checks.check_kernels(kernels)
                if failed:
                    print(f"{label}, -march={arch}: fails the load-time check ({failed}); not timed")
                    continue
                builds[f"{label}, -march={arch}"] = kernels
        results = alternate(list(builds), args.repeats, lambda name, _: time_products(builds[name]))
    medians = {name: {product: statistics.median(run[product] for run in runs) for product in runs[0]}
               for name, runs in results.items()}
    products = list(next(iter(medians.values())))
    print(f"\nms per call, one thread, {TOKENS} tokens, median of {CALLS} calls then of {args.repeats} rounds\n")
    print(markdown_table(["product", *medians], [[product, *(f"{medians[name][product]:.3f}" for name in medians)]
                                                 for product in products]))
    write_json(args.json, {"medians": medians, "runs": results})


if __name__ == "__main__":
    main()
