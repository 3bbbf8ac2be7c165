"""Time of a causal LM's loss, forward and backward: the chunked loss against the model's own, side by side (CPU).

A LLaMA with SmolLM2-135M's head (hidden 576, vocabulary 49152, tied) and two blocks, so the head dominates, runs
``loss.backward()`` on 4×256 tokens, fp32, with Hugging Face's loss (``model(**batch).loss``) and with
``lightning_offload.causal_lm_loss``, alternated over ``--repeats`` rounds of ``--steps`` steps; the median of each
round's steady steps, then the median over rounds, and the ratio.

    python scripts/benchmark_lm_loss_speed.py --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch
from harness import add_standard_arguments, alternate, begin_run, markdown_table, ratios, spread, steady, write_json
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_offload import causal_lm_loss

CONFIGS = ["model's loss", "chunked loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", default="4x256", help="rows x length")
    add_standard_arguments(parser, repeats=5, warmup=1, seed=0)
    args = parser.parse_args()
    if begin_run(args, __file__) is None:
        return
    rows, length = (int(n) for n in args.tokens.split("x"))
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (rows, length))
    batch = {"input_ids": ids, "labels": ids}
    losses = {"model's loss": lambda: model(**batch).loss, "chunked loss": lambda: causal_lm_loss(model, batch)}

    def measure(name: str, round_index: int) -> float:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            losses[name]().backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return spread(steady(times, args.warmup)).median

    results = alternate(CONFIGS, args.repeats, measure,
                        lambda name, r, seconds: print(f"round {r} {name}: {seconds:.3f} s", flush=True))
    medians = {name: spread(values).median for name, values in results.items()}
    print(markdown_table(["loss", "forward + backward (s)", "ratio"],
                         [(name, f"{medians[name]:.3f}", f"{ratio:.2f}")
                          for name, ratio in ratios(medians, CONFIGS[0]).items()]))
    write_json(args.json, {"tokens": args.tokens, "rounds": results, "medians": medians})


if __name__ == "__main__":
    main()
