"""Peak memory one training step adds on a 128K-vocabulary model: the chunked loss against the model's own (CPU).

A LLaMA with Llama-3's vocabulary (128256 tokens, tied) and tiny otherwise (hidden 64, 2 layers) trains
under the package's causal-LM task, bf16-true, at 4×512 tokens. On a CPU the device is the process, so a step's
transient memory is the process's: each configuration runs in a fresh subprocess, and around its second step
(the first builds the engine's and the optimizer's state) the kernel's peak resident set is reset
(``/proc/self/clear_refs``) and read back (``VmHWM``). The figure is that peak minus the resident set at the step's
start: what the step itself adds (logits, activations, gradients, their transfers), beside what the planner
(``lightning_offload.plan``, same model and loss) counts for the same parts.

    python scripts/benchmark_lm_loss_memory.py
    python scripts/benchmark_lm_loss_memory.py --configs "lsp_offload, chunked loss" --tokens 4x512
    python scripts/benchmark_lm_loss_memory.py --hidden 512 --untied --configs "zero_offload, chunked loss" \
        "zero_offload keeping gradients, chunked loss"     # free_sent_gradients: 0.5 GiB of bf16 gradients

Configurations: plain Lightning (AdamW) and ``lsp_offload`` (the head stepped on the host, or projected), each with
``loss="model"`` (Hugging Face's loss over the full logits) and ``loss="chunked"`` (lightning_offload.causal_lm_loss).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import add_standard_arguments, begin_run, markdown_table, write_json

#: Each configuration: the strategy ("auto": plain Lightning), its settings, and the loss.
CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "plain Lightning, model's loss": ("auto", {}, "model"),
    "plain Lightning, chunked loss": ("auto", {}, "chunked"),
    "lsp_offload, model's loss": ("lsp_offload", {"projectors": "random", "head": "host"}, "model"),
    "lsp_offload, chunked loss": ("lsp_offload", {"projectors": "random", "head": "host"}, "chunked"),
    "lsp_offload head=projected, model's loss": ("lsp_offload", {"projectors": "random", "head": "projected"}, "model"),
    "lsp_offload head=projected, chunked loss": ("lsp_offload", {"projectors": "random", "head": "projected"},
                                                 "chunked"),
    # free_sent_gradients (the Trainer's default) against keeping the crossed gradients into the next step.
    "zero_offload, chunked loss": ("zero_offload", {"free_sent_gradients": True}, "chunked"),
    "zero_offload keeping gradients, chunked loss": ("zero_offload", {"free_sent_gradients": False}, "chunked"),
}
GIB = 2**30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _one(config: str, rows: int, length: int, vocab: int, hidden: int, tied: bool) -> dict[str, Any]:
    """Run ``config`` for two steps in this process; the second step's added peak, in bytes."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy, plan
    from lightning_offload.models.tiny import tiny_llama
    from lightning_offload.tasks.causal_lm import CausalLMModule

    class PeakOfSecondStep(pl.Callback):
        def __init__(self) -> None:
            self.start = self.peak = 0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if index == 1:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
                self.start = _status_kib("VmRSS")

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            if index == 1:
                self.peak = _status_kib("VmHWM")

    def build() -> torch.nn.Module:
        return tiny_llama(vocab_size=vocab, hidden=hidden, layers=2, heads=4, intermediate=2 * hidden,
                          max_positions=length, tie_word_embeddings=tied)

    name, settings, loss = CONFIGS[config]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, vocab, (2 * rows, length))
    rows_of = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]
    batches = DataLoader(rows_of, batch_size=rows)
    strategy = {"auto": lambda: "auto", "lsp_offload": lambda: LSPOffloadStrategy(**settings),
                "zero_offload": lambda: ZeroOffloadStrategy(**settings)}[name]()
    module = CausalLMModule(model, lr=1e-4, loss=loss)
    probe = PeakOfSecondStep()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true", max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[probe])
    # The planner's figure for the same parts (kept activations and the loss's transient), for the same model.
    planned = plan(build(), name, batch_size=rows, seq_len=length, device_memory="64GiB", precision="bf16-true",
                   hardware="h200", device="cpu", loss=loss, **settings)
    trainer.fit(module, train_dataloaders=batches)
    return {"config": config, "added_peak_bytes": (probe.peak - probe.start) * 1024, "peak_bytes": probe.peak * 1024,
            "planned_peak_bytes": planned.device_bytes,
            "planned_bytes": planned.device_parts["activations"] + planned.device_parts["activations_transient"],
            "logits_bf16_bytes": rows * length * vocab * 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tokens", default="4x512", help="rows x length of a micro-batch")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--untied", action="store_true", help="an untied head (its own 128K x hidden gradient)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one configuration here (the subprocess's part)
    add_standard_arguments(parser)
    args = parser.parse_args()
    rows, length = (int(n) for n in args.tokens.split("x"))
    if args.one:
        print(json.dumps(_one(args.one, rows, length, args.vocab, args.hidden, not args.untied)))
        return
    begin_run(args, __file__)
    results = []
    for config in args.configs:
        # A fresh process each: the peak of one configuration must not hide under another's.
        done = subprocess.run([sys.executable, __file__, "--one", config, "--tokens", args.tokens, "--vocab",
                               str(args.vocab), "--hidden", str(args.hidden), *(["--untied"] if args.untied else [])],
                              capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{config}: +{results[-1]['added_peak_bytes'] / GIB:.2f} GiB", flush=True)
    print(markdown_table(["configuration", "peak added by one step (GiB)", "planned: activations + transient (GiB)",
                          "the step's peak (GiB)", "planned device peak (GiB)"],
                         [(r["config"], f"{r['added_peak_bytes'] / GIB:.2f}", f"{r['planned_bytes'] / GIB:.2f}",
                           f"{r['peak_bytes'] / GIB:.3f}", f"{r['planned_peak_bytes'] / GIB:.3f}") for r in results]))
    write_json(args.json, {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "tied": not args.untied,
                           "results": results})


if __name__ == "__main__":
    main()
