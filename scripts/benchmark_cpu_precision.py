"""How much slower ``bf16-mixed`` is than fp32 on this CPU: SmolLM2-135M forward+backward, side by side.

CPUs without bf16 instructions (AVX512-BF16, AMX) emulate bf16 matmuls, so autocast can cost more than it saves.
The two settings alternate over ``--repeats`` rounds (so machine noise hits both alike) and medians are reported.

    python scripts/benchmark_cpu_precision.py --repeats 6
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lightning_offload.models.smollm2 import load_smollm2


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool) -> float:
    """Wall time of one forward+backward (gradients cleared first)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    model = load_smollm2()[0].train()
    tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, args.block_size),
                           generator=torch.Generator().manual_seed(0))
    for bf16 in (False, True):
        step_seconds(model, tokens, bf16)  # warm-up: first-call allocations and kernel selection
    times: dict[str, list[float]] = {"32-true": [], "bf16-mixed": []}
    for _ in range(args.repeats):
        times["32-true"].append(step_seconds(model, tokens, bf16=False))
        times["bf16-mixed"].append(step_seconds(model, tokens, bf16=True))
    fp32, bf16 = (statistics.median(times[k]) for k in ("32-true", "bf16-mixed"))
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    has_bf16 = any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    print(f"SmolLM2-135M forward+backward, {args.batch_size}x{args.block_size} tokens, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, bf16 instructions: {'yes' if has_bf16 else 'no'}")
    print(f"32-true     median {fp32:.2f} s")
    print(f"bf16-mixed  median {bf16:.2f} s  ({bf16 / fp32:.2f}x fp32)")


if __name__ == "__main__":
    main()
