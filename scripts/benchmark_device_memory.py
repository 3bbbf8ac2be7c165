"""Device bytes the LSP machinery holds per projected layer, at a LLaMA shape, without allocating the model.

The model is built on the ``meta`` device (no weight memory), the projected layers are picked by the strategy's own
rule (:func:`~lightning_offload.lsp.targets.select_projected_modules`), and for each one the package's own
:class:`~lightning_offload.lsp.projector.SparseProjector` objects are built at the layer's sizes and asked for their
bytes (:meth:`~lightning_offload.lsp.projector.SparseProjector.nbytes`, indices, values and CSR structure; a
deterministic index pattern stands in for the random draw, whose storage is the same size). Beside it, the same
layer under the storage of the previous release (int64 indices, six cached CSR index arrays and two CSR value
copies per projector, an fp32 ``S`` accumulator and an update buffer per layer), counted from that code's arrays.

    python scripts/benchmark_device_memory.py                      # 1.3B shape, rank 0.25, density 8
    python scripts/benchmark_device_memory.py --shape llama_6b7

Persistent: held between steps. The update ring (4 buffers of the largest compressed update, link dtype) is shared
by all layers; its share per layer is reported. Transient: ``S`` (fp32, released once sent) and ``B Xᵀ`` kept for
backward at ``--tokens`` tokens (in the compute dtype on CUDA) against the layer input it replaces.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from harness import add_standard_arguments, begin_run, markdown_table, write_json
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.lsp.targets import compressed_size, select_projected_modules

SHAPES = {
    "llama_1b3": dict(hidden=2048, layers=24, heads=16, intermediate=5504, vocab=32000),
    "llama_6b7": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
}
RING_BUFFERS = 4
LINK_BYTES = 2  # bf16 link


def _projector(dim_in: int, dim_out: int, density: int) -> SparseProjector:
    # Column j holds rows j, j+1, …, j+r−1 (mod d): distinct, and as many nonzeros as a random draw.
    rows = (torch.arange(dim_in).unsqueeze(1) + torch.arange(density)) % dim_out
    projector = SparseProjector(rows, torch.ones(dim_in, density), dim_out)
    projector.pattern()  # built on first use, then kept: counted
    return projector


def _previous_release_bytes(dim_in: int, dim_out: int, density: int) -> int:
    """One projector as the previous release held it: int64 indices and fp32 values, plus its CSR caches
    (``order``, ``col``, ``order_t``, ``col_t`` int64 per nonzero, ``crow``/``crow_t`` row pointers, two fp32 value
    copies)."""
    nnz = dim_in * density
    return nnz * (8 + 4) + nnz * 8 * 4 + (dim_out + 1 + dim_in + 1) * 8 + nnz * 4 * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama_1b3", choices=SHAPES)
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--density", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (4×512 by default)")
    add_standard_arguments(parser)
    args = parser.parse_args()
    begin_run(args, __file__)
    shape = SHAPES[args.shape]
    config = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], intermediate_size=shape["intermediate"],
                         vocab_size=shape["vocab"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    modules = select_projected_modules(model, min_dim=128)
    kinds: dict[tuple[int, int], list[str]] = defaultdict(list)
    for name, module in modules.items():
        kinds[tuple(module.weight.shape)].append(name.rsplit(".", 1)[-1])
    largest_update = max(compressed_size(o, args.rank) * compressed_size(i, args.rank) for o, i in kinds)
    ring_share = RING_BUFFERS * largest_update * LINK_BYTES / len(modules)

    print(f"{args.shape}: {len(modules)} projected layers, rank {args.rank}, density {args.density}, "
          f"{args.tokens} tokens per micro-batch\n")
    rows = []
    totals = {"now": 0.0, "before": 0.0, "essential": 0.0}
    for (o, i), names in kinds.items():
        d_o, d_i = compressed_size(o, args.rank), compressed_size(i, args.rank)
        proj_out, proj_in = _projector(o, d_o, args.density), _projector(i, d_i, args.density)
        essential = sum(p.indices.numel() * p.indices.element_size() + p.values.numel() * p.values.element_size()
                        for p in (proj_out, proj_in))
        now = proj_out.nbytes() + proj_in.nbytes() + ring_share
        before = (_previous_release_bytes(o, d_o, args.density) + _previous_release_bytes(i, d_i, args.density)
                  + d_o * d_i * 4 + d_o * d_i * LINK_BYTES)
        count = len(names)
        totals["now"] += now * count
        totals["before"] += before * count
        totals["essential"] += essential * count
        label = ", ".join(sorted(set(names)))
        rows.append([f"{label} ({count})", f"{o} × {i}", f"{d_o} × {d_i}", f"{essential / 1024:.0f} KiB",
                     f"{now / 1024:.0f} KiB", f"{now / essential:.2f}×", f"{before / 1024:.0f} KiB",
                     f"{d_o * d_i * 4 / 1024:.0f} KiB",
                     f"{d_i * args.tokens * 2 / 2**20:.1f} vs {i * args.tokens * 2 / 2**20:.1f} MiB"])
    print(markdown_table(["layers", "o × i", "d_o × d_i", "indices + values",
                          "persistent now (projectors + ring share)", "ratio",
                          "previous release (projectors + S + update buffer)", "S (transient)",
                          "B Xᵀ vs X (transient, bf16)"], rows))
    write_json(args.json, {"args": vars(args), "rows": rows, "totals_bytes": totals})
    gib = 2**30
    print(f"\nWhole model: persistent {totals['now'] / gib:.3f} GiB now (indices + values "
          f"{totals['essential'] / gib:.3f} GiB, {totals['now'] / totals['essential']:.2f}×) vs "
          f"{totals['before'] / gib:.3f} GiB in the previous release.")


if __name__ == "__main__":
    main()
