"""The planner's device figures against a GPU (issue 44 item 4; owed: no GPU has been lent since the planner was
written): for a LLaMA shape in bf16-true with gradient checkpointing, the plan's device peak against
``torch.cuda.max_memory_allocated`` (target: within 10%) and its step time against the measured median (within 30%),
for plain fused AdamW and ``lsp_offload`` (the loop face), after calibrating this machine (``calibrate(cache=False)``:
device matmuls, sparse products, pinned copies each way, host Adam).

The loop zeroes gradients after the forward and before backward, as Lightning's automatic optimization does, which
is the order the plan's peak assumes (a gradient lives until the next ``zero_grad``). Needs torch and transformers
only (no Hydra, no wandb). Prints a markdown table for docs/benchmarks.md.

    python scripts/gpu_plan_check.py                       # 1.3B shape, 4×512 (about two minutes on an H200)
    python scripts/gpu_plan_check.py --shape llama3_1b --cap-gib 4     # Llama-3.2-1B under a 4 GiB cap
    python scripts/gpu_plan_check.py --shape llama3_8b --cap-gib 24 --strategies lsp_offload   # Llama-3.1-8B
    python scripts/gpu_plan_check.py --shape tiny --device cpu --steps 2   # the code path, anywhere

The loss is the package's chunked one (``lightning_offload.causal_lm_loss``, as its task trains) unless
``--model-loss``; the offload drops crossed gradients after the step (``free_sent_gradients=True``, the Trainer's
default, which the plan assumes). ``--cap-gib`` caps the process's device memory
(``torch.cuda.set_per_process_memory_fraction``), as a smaller card would.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_offload
from lightning_offload.planning.calibration import calibrate

OLD_VOCAB = dict(vocab_size=32000, tie_word_embeddings=False)
SHAPES = {"1b3": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
                      **OLD_VOCAB),
          # Llama-3.2-1B (tied 128K head, GQA) and Llama-3.1-8B (untied 128K head, GQA).
          "llama3_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
          "llama3_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
          "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                       **OLD_VOCAB)}


def build(shape: str, device: torch.device) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def run(shape: str, strategy: str, device: torch.device, batch: int, seq: int, steps: int,
        model_loss: bool) -> tuple[float, int]:
    """Median step seconds after two warm-up steps, and the peak device bytes of the steps."""
    model = build(shape, device)
    vocab = model.config.vocab_size
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)
    optimizer = adamw if strategy == "auto" else lightning_offload.offload(model, adamw, strategy,
                                                                           free_sent_gradients=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    try:
        for step in range(2 + steps):
            ids = torch.randint(16, vocab, (batch, seq), device=device)
            sync()
            start = time.perf_counter()
            batch_of = {"input_ids": ids, "labels": ids}
            loss = model(**batch_of).loss if model_loss else lightning_offload.causal_lm_loss(model, batch_of)
            optimizer.zero_grad(set_to_none=True)  # after the forward, as Lightning does: the plan's order
            loss.backward()
            optimizer.step()
            sync()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        return statistics.median(times[2:]), peak
    finally:
        if strategy != "auto":
            optimizer.close()
        del model, optimizer, adamw
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="1b3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategies", nargs="+", default=["auto", "lsp_offload"])
    parser.add_argument("--cap-gib", type=float, default=None, help="cap the device memory (a smaller card)")
    parser.add_argument("--model-loss", action="store_true", help="the model's own loss over all the logits")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.cap_gib is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    hw = calibrate(device, torch.bfloat16, cache=False)
    print(hw)
    print(f"\n{hw.name}; torch {torch.__version__}; {args.shape} shape, bf16-true, checkpointing, "
          f"{args.batch}×{args.seq}\n")
    print("| strategy | plan peak | measured peak | error | plan s/step | measured s/step | error |")
    print("|---|---|---|---|---|---|---|")
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape]))
    memory = args.cap_gib * 2**30 if args.cap_gib is not None else hw.device_memory or 2**40
    for strategy in args.strategies:
        found = lightning_offload.plan(meta, strategy, batch_size=args.batch, seq_len=args.seq,
                                       device_memory=memory, precision="bf16-true", gradient_checkpointing=True,
                                       hardware=hw, device=device, loss="model" if args.model_loss else "chunked")
        try:
            seconds, peak = run(args.shape, strategy, device, args.batch, args.seq, args.steps, args.model_loss)
        except torch.OutOfMemoryError:
            print(f"| {strategy} | {found.device_bytes / 2**30:.2f} GiB | out of memory | | {found.step_seconds:.3f} "
                  f"| | |")
            continue
        peak_error = f"{(peak - found.device_bytes) / found.device_bytes:+.0%}" if peak else "n/a (CPU)"
        print(f"| {strategy} | {found.device_bytes / 2**30:.2f} GiB | {peak / 2**30:.2f} GiB | {peak_error} | "
              f"{found.step_seconds:.3f} | {seconds:.3f} | "
              f"{(seconds - found.step_seconds) / found.step_seconds:+.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
