"""How long ``lightning_offload.plan(..., hardware=None)`` takes on this machine from a fresh cache (issue 64 item 2):
the native kernels built, the machine calibrated and every distinct layer's products timed, for a real model's
config on the meta device (Qwen2.5-1.5B: a 152K-vocabulary tied head, projected by default), and again with the
cache warm. Each round runs in a fresh subprocess with an empty cache, under an address-space cap (``ulimit -v``) so
that a plan needing the memory of the model it plans fails instead of swapping; the median of ``--rounds`` is
printed with the machine.

    python scripts/benchmark_plan_time.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

from harness import machine_line

PLAN = textwrap.dedent("""
    import resource, time
    cap = {cap_gib} * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch, transformers, lightning_offload
    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                      num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    for label in ("fresh", "warm"):
        start = time.perf_counter()
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        plan = lightning_offload.plan(model, "lsp_offload", batch_size=4, seq_len=512, device_memory="24GiB",
                                      precision="bf16-true")
        print(label, time.perf_counter() - start, plan.step.step)
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-gib", type=int, default=8, help="address-space cap of each round's process")
    args = parser.parse_args()
    fresh, warm = [], []
    for round_number in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            done = subprocess.run([sys.executable, "-c", PLAN.format(cap_gib=args.cap_gib)], capture_output=True,
                                  text=True, env={**os.environ, "LIGHTNING_OFFLOAD_CACHE": cache}, check=True)
        figures = dict(line.split(maxsplit=1) for line in done.stdout.splitlines() if line.split()[0] in
                       ("fresh", "warm"))
        fresh.append(float(figures["fresh"].split()[0]))
        warm.append(float(figures["warm"].split()[0]))
        print(f"round {round_number + 1}: fresh cache {fresh[-1]:.1f} s, warm {warm[-1]:.2f} s "
              f"(predicted step {float(figures['fresh'].split()[1]):.2f} s)")
    print(f"Qwen2.5-1.5B on the meta device, lsp_offload, bf16-true 4x512, hardware=None, under a {args.cap_gib} GiB "
          f"address-space cap: fresh cache median {statistics.median(fresh):.1f} s (of {args.rounds}), warm "
          f"{statistics.median(warm):.2f} s; {machine_line()}")


if __name__ == "__main__":
    main()
