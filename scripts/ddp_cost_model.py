"""On paper: bytes between GPUs and host work per node for plain DDP, ``zero_offload_ddp`` and ``lsp_offload_ddp``.

A model of one optimizer step at 8 GPUs per node × 1–4 nodes, for the 1.3B and 6.7B LLaMA shapes (untied, bf16
parameters, ``link_dtype="bf16"``, ``rank=0.25``, embeddings and head on the host: the DDP strategies' defaults). The
tensors and their sizes come from the model itself (built on the ``meta`` device, projected layers picked by the
strategy's own rule: :mod:`benchmark_host_elements`); what is assumed is stated by the flags:

* **Payload** is counted as ``offload/bytes_between_ranks`` counts it: an all-reduce as two passes (a reduce and a
  broadcast). Plain DDP all-reduces every bf16 gradient: ``2 × 2`` bytes per parameter. The offload strategies
  reduce each gradient (``S`` for a projected weight) to its owner and broadcast the update (``U``, or a dense
  parameter's new bf16 value): one pass each.
* **Collectives** are bandwidth-bound and hierarchical, as NCCL runs them across nodes: per pass, a ring over the
  node's 8 GPUs moves ``7/8`` of the payload per GPU at ``--intra-gbs``, then each node's network (``--inter-gbps``)
  carries ``(M−1)/M`` of the payload between the ``M`` nodes; the two phases are added (no overlap assumed).
* **Host work**: the host Adam's elements are sharded over all ranks, so a node steps ``1/M`` of them. Fused CPU
  AdamW is memory-bound: ~28 bytes per element (read parameter, gradient and both moments in fp32, write three
  back), at ``--host-gbs`` of effective memory bandwidth per node.

Compute time is not modelled: what is shown is what each method adds to a step, to be compared with the step's
own device time (0.10 s for the 1.3B shape at 4×512 on one H200, measured: docs/benchmarks.md, "GPU: the last
measurement").

    python scripts/ddp_cost_model.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from benchmark_host_elements import meta_model, per_step  # noqa: E402
from harness import add_standard_arguments, begin_run, markdown_table, write_json  # noqa: E402

#: fp32 parameter, gradient and two moments read, three written: bytes of memory traffic per fused AdamW element.
ADAM_BYTES_PER_ELEMENT = 28
GPUS_PER_NODE = 8


def wire_seconds(payload: float, nodes: int, intra_gbs: float, inter_gbps: float) -> float:
    """Seconds to move ``payload`` bytes (counted in passes) between 8 GPUs per node over ``nodes`` nodes."""
    within = (GPUS_PER_NODE - 1) / GPUS_PER_NODE * payload / (intra_gbs * 1e9)
    between = (nodes - 1) / nodes * payload / (inter_gbps / 8 * 1e9)
    return within + between


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["llama_1b3", "llama_6b7"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=4 * 512, help="tokens per rank per step")
    parser.add_argument("--intra-gbs", type=float, nargs="+", default=[25.0, 150.0],
                        help="GB/s per GPU within a node (PCIe peer; NVLink)")
    parser.add_argument("--inter-gbps", type=float, nargs="+", default=[100.0, 400.0],
                        help="Gb/s of network per node, shared by its 8 GPUs")
    parser.add_argument("--host-gbs", type=float, default=100.0, help="host memory bandwidth per node, GB/s")
    add_standard_arguments(parser)
    args = parser.parse_args()
    begin_run(args, __file__)
    rows = []
    for shape in args.shapes:
        model = meta_model(shape)
        parameters = sum(p.numel() for p in model.parameters())
        lsp = per_step(model, "host", "host", args.tokens, 0.25)
        zero = {"host_elements": float(parameters), "to_host": 2.0 * parameters, "to_device": 2.0 * parameters}
        methods = {
            "plain DDP": (4.0 * parameters, 0.0),
            "zero_offload_ddp": (zero["to_host"] + zero["to_device"], zero["host_elements"]),
            "lsp_offload_ddp": (lsp["to_host"] + lsp["to_device"], lsp["host_elements"]),
        }
        for nodes in args.nodes:
            for method, (payload, host_elements) in methods.items():
                times = [wire_seconds(payload, nodes, intra, inter)
                         for intra, inter in zip(args.intra_gbs, args.inter_gbps)]
                per_node = host_elements / nodes
                host_seconds = per_node * ADAM_BYTES_PER_ELEMENT / (args.host_gbs * 1e9)
                rows.append([shape, f"{nodes} × {GPUS_PER_NODE}", method, f"{payload / 2**20:,.0f}",
                             f"{times[0]:.3f}; {times[1]:.3f}", f"{per_node / 1e6:,.0f}", f"{host_seconds:.3f}"])
    header = ["shape", "nodes × GPUs", "method", "MiB between ranks / step (payload)",
              "wire s / step (slow net; fast net)", "host Adam elements / node (M)", "host Adam s / node"]
    print(markdown_table(header, rows))
    write_json(args.json, {"args": vars(args), "rows": [dict(zip(header, row)) for row in rows]})
    print(f"\nSlow: {args.intra_gbs[0]:g} GB/s per GPU in a node, {args.inter_gbps[0]:g} Gb/s per node; fast: "
          f"{args.intra_gbs[1]:g} GB/s, {args.inter_gbps[1]:g} Gb/s. Host: {args.host_gbs:g} GB/s per node, "
          f"{ADAM_BYTES_PER_ELEMENT} B per Adam element; {args.tokens} tokens per rank.")


if __name__ == "__main__":
    main()
