"""How much slower ``bf16-mixed`` is than fp32 on this CPU: SmolLM2-135M forward+backward, side by side.

CPUs without bf16 instructions (AVX512-BF16, AMX) emulate bf16 matmuls, so autocast can cost more than it saves.
The two settings alternate over ``--repeats`` rounds (so machine noise hits both alike) and medians are reported.

    python scripts/benchmark_cpu_precision.py --repeats 6
"""

from __future__ import annotations

import argparse
import platform

import torch
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, seed_everything, spread, \
    time_call, write_json

from lightning_offload.models.smollm2 import load_smollm2

SETTINGS = {"32-true": False, "bf16-mixed": True}


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool) -> float:
    """Wall time of one forward+backward (gradients cleared first)."""
    model.zero_grad(set_to_none=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()

    return time_call(step)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    add_standard_arguments(parser, repeats=6, seed=0)
    args = parser.parse_args()
    machine = begin_run(args, __file__)
    if machine is None:
        return
    generator = seed_everything(args.seed)
    model = load_smollm2()[0].train()
    tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, args.block_size), generator=generator)
    for bf16 in SETTINGS.values():
        step_seconds(model, tokens, bf16)  # warm-up: first-call allocations and kernel selection
    times = alternate(list(SETTINGS), args.repeats, lambda name, _: step_seconds(model, tokens, SETTINGS[name]))
    medians = {name: spread(values) for name, values in times.items()}
    against = ratios({name: s.median for name, s in medians.items()}, "32-true")
    # The machine line says avx512f; bf16 matmuls need AVX512-BF16 or AMX, named here.
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    has_bf16 = any(f in flags for f in ("avx512_bf16", "amx_bf16"))
    print(f"SmolLM2-135M forward+backward, {args.batch_size}x{args.block_size} tokens, "
          f"bf16 instructions: {'yes' if has_bf16 else 'no'}\n")
    print(markdown_table(["precision", "median s (min–max)", "× fp32"],
                         [[name, s.cell(), f"{against[name]:.2f}x"] for name, s in medians.items()]))
    write_json(args.json, {"args": vars(args), "seconds": times})


if __name__ == "__main__":
    main()
