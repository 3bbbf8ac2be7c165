"""Per projected-layer shape: the device time of LSP's products against the weight-gradient GEMM they replace.

For each distinct Linear shape of a LLaMA-style model (q/o, k/v, gate/up, down), at ``--tokens`` tokens, in the
model's compute dtype, on the device (CUDA when present, else the CPU), every kernel that applies
(lsp/kernels/candidates.py) is timed on the three products, beside the GEMMs of native training timed in the same
process:

* ``forward``: ``B Xᵀ`` (the forward's projection), against the layer's forward GEMM ``X Wᵀ``;
* ``backward``: ``A Δᵀ`` plus the small ``S = (A Δᵀ)(B Xᵀ)ᵀ`` GEMM, against the weight-gradient GEMM ``Δᵀ X`` that a
  projected layer no longer forms;
* ``update``: ``W ← W·decay + Aᵀ U B`` (the small side and the pass over ``W``), against what native training does to
  ``W`` at its step (fused AdamW on the device; on the CPU device the host Adam is not the device's work).

It also reports the kernel the selection (lsp/kernels/selection.py) chooses for each product. ``scripts/gpu_bench.py``
runs it first on a GPU, so that one short run says where a projected layer's device time goes.

    python scripts/benchmark_projection_kernels.py                       # hidden 1024, 1024 tokens, on this device
    python scripts/benchmark_projection_kernels.py --shape llama_1b3 --tokens 2048 --dtype bf16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from harness import add_standard_arguments, begin_run, markdown_table, synchronize, write_json

from lightning_offload.lsp.kernels.candidates import KERNELS
from lightning_offload.lsp.kernels.selection import KernelSelector
from lightning_offload.lsp.projector import SparseProjector

#: hidden, intermediate, key/value heads' share of the hidden size (GQA), of the shapes measured.
SHAPES = {"small": (256, 704, 0.5), "hidden1024": (1024, 2816, 0.5), "llama_1b3": (2048, 5504, 1.0),
          "llama_8b": (4096, 14336, 0.25)}


def _best(work: Callable[[], Any], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up, in milliseconds (interference only adds time)."""
    work()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each distinct projected Linear of a LLaMA-style layer."""
    hidden, intermediate, kv_share = SHAPES[shape]
    return {"q/o": (hidden, hidden), "k/v": (int(hidden * kv_share), hidden), "gate/up": (intermediate, hidden),
            "down": (hidden, intermediate)}


def measure_layer(out_features: int, in_features: int, tokens: int, rank: float, density: int, dtype: torch.dtype,
                  device: torch.device, repeats: int) -> dict[str, Any]:
    """One layer shape's times (ms): native GEMMs, and each kernel's products."""
    generator = torch.Generator().manual_seed(0)
    d_out, d_in = max(density, round(out_features * rank)), max(density, round(in_features * rank))
    proj_out = SparseProjector.random(out_features, d_out, density, generator=generator, device=device)
    proj_in = SparseProjector.random(in_features, d_in, density, generator=generator, device=device)
    x = torch.randn(tokens, in_features, device=device).to(dtype)
    grad_out = torch.randn(tokens, out_features, device=device).to(dtype)
    weight = (torch.randn(out_features, in_features, device=device) * 0.02).to(dtype)
    update = torch.randn(d_out, d_in, device=device) * 1e-4
    row = {"shape": f"{out_features}×{in_features}", "compressed": f"{d_out}×{d_in}",
           "forward GEMM": _best(lambda: x @ weight.t(), repeats),
           "weight-gradient GEMM": _best(lambda: grad_out.t() @ x, repeats)}
    x_proj = proj_in.compress_rows(x.t()).float()
    for name, kernel in KERNELS.items():
        if not kernel.applies(device):
            continue
        scratch = weight.clone()
        rounding = torch.Generator(device=device).manual_seed(1)
        row[f"{name}: forward"] = _best(lambda: kernel.compress_tokens(proj_in, x), repeats)
        row[f"{name}: backward"] = _best(lambda: kernel.compress_tokens(proj_out, grad_out).float() @ x_proj.t(),
                                         repeats)
        row[f"{name}: update"] = _best(lambda: kernel.update_rows_(
            scratch, proj_out, kernel.expand_columns(proj_in, update), 0.999, rounding), repeats)
    # What the selection picks for each product (a selector per product: their keys coincide where out = in).
    forward, backward, apply = (KernelSelector("auto", persist=False) for _ in range(3))
    forward.compress_tokens(proj_in, x)
    backward.compress_tokens(proj_out, grad_out)
    apply.update_rows_(weight.clone(), proj_out, apply.expand_columns(proj_in, update), 0.999, None)
    row["chosen"] = {part: "/".join(selector.summary().values())
                     for part, selector in (("forward", forward), ("backward", backward), ("update", apply))}
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="hidden1024", choices=SHAPES)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rank", type=float, default=0.25)
    parser.add_argument("--density", type=int, default=8)
    parser.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                        help="default: bf16 on CUDA, fp32 on the CPU")
    add_standard_arguments(parser, repeats=5)
    args = parser.parse_args(argv)
    if begin_run(args, __file__, argv) is None:
        return {}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    rows = []
    for layer, (out_features, in_features) in layer_shapes(args.shape).items():
        row = measure_layer(out_features, in_features, args.tokens, args.rank, args.density, dtype, device,
                            args.repeats)
        rows.append({"layer": layer, **row})
        print(f"{layer}: {row}", flush=True)
    kernels = [name for name in KERNELS if f"{name}: forward" in rows[0]]
    print(f"\n{args.shape}, {args.tokens} tokens, {dtype_name}, rank {args.rank}, density {args.density}, "
          f"{device.type}; ms, fastest of {args.repeats}\n")
    header = ["layer", "W", "S", "forward GEMM", "weight-gradient GEMM"]
    header += [f"{name}: {part}" for name in kernels for part in ("forward", "backward", "update")]
    print(markdown_table(header + ["chosen (forward, backward, update)"], [
        [row["layer"], row["shape"], row["compressed"], *(f"{row[key]:.3f}" for key in header[3:]),
         ", ".join(row["chosen"].values())] for row in rows]))
    report = {"args": vars(args), "device": device.type, "dtype": dtype_name, "layers": rows}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
