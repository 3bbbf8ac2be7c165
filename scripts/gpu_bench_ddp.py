"""Prepared multi-GPU benchmark: ``lsp_offload_ddp`` and ``zero_offload_ddp`` against plain DDP with AdamW.

For a LLaMA shape (random init, bf16-true, untied embeddings, synthetic tokens) on ``--devices`` GPUs of this node
(Lightning's launcher starts one process per GPU; NCCL), each method runs in its own launch (a crash or an
out-of-memory cannot poison the next) and rank 0 reports: the median steady step seconds, peak device memory, bytes
between ranks per step (the strategy's ``offload/bytes_between_ranks``; computed for plain DDP: every gradient once,
all-reduced), host Adam seconds per step and host state per rank, and the step split by the offload timeline. The
JSON report is rewritten after every method, so a run cut short keeps what it measured.

    python scripts/gpu_bench_ddp.py --devices 8 --out gpu_bench_ddp.json      # on a multi-GPU machine (not run yet)
    python scripts/gpu_bench_ddp.py --smoke                                     # 2 CPU processes, tiny shape (tested)

Several nodes: run the same command on each with Lightning's usual environment (``MASTER_ADDR``, ``NODE_RANK``, …)
and ``--nodes M``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import add_standard_arguments, begin_run, spread, steady, write_json

SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=256),
    "llama_1b3": dict(hidden=2048, layers=24, heads=16, intermediate=5504, vocab=32000),
    "llama_6b7": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
}
METHODS = ("ddp", "zero_offload_ddp", "lsp_offload_ddp")


def _single(method: str, args: argparse.Namespace) -> None:
    """One method's run, in the processes Lightning's launcher starts; rank 0 writes ``args.result``."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightning_offload  # noqa: F401  (registers the strategy names)
    from benchmark_run import StepClock

    cuda = torch.cuda.is_available() and not args.smoke
    torch.set_num_threads(1 if args.smoke else max(1, (os.cpu_count() or 2) // args.devices))
    s = SHAPES[args.shape]
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["heads"], max_position_embeddings=max(args.seq, 64),
                         tie_word_embeddings=False)

    class Tokens(Dataset):
        """Random token sequences, the same on every rank for the same index."""

        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.randint(0, s["vocab"], (args.seq,), generator=torch.Generator().manual_seed(index))

    class Synthetic(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
            if args.checkpointing:
                self.model.gradient_checkpointing_enable()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.01, fused=cuda or None)

    if method == "ddp":
        strategy: Any = "ddp"
    else:
        from lightning_offload import LSPOffloadDDPStrategy, ZeroOffloadDDPStrategy

        settings = dict(link_dtype="bf16", process_group_backend="nccl" if cuda else "gloo")
        # The tiny shape's layers are narrower than the default min_dim=128: projected all the same.
        lsp = dict(projectors="random", min_dim=32 if args.smoke else 128)
        strategy = (LSPOffloadDDPStrategy(**lsp, **settings) if method == "lsp_offload_ddp"
                    else ZeroOffloadDDPStrategy(**settings))
    module, clock = Synthetic(), StepClock()
    trainer = pl.Trainer(accelerator="cuda" if cuda else "cpu", devices=args.devices, num_nodes=args.nodes,
                         strategy=strategy, precision="bf16-true", max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[clock])
    trainer.fit(module, DataLoader(Tokens(), batch_size=args.batch))
    if not trainer.is_global_zero:
        return
    optimizer = getattr(trainer.strategy, "offload_optimizer", None)
    parameters = sum(p.numel() for p in module.parameters())
    result: dict[str, Any] = {
        "method": method, "ranks": trainer.world_size, "shape": args.shape, "batch_per_rank": args.batch,
        "seq": args.seq, "median_step_seconds": spread(steady(clock.seconds, 2)).median, "parameters": parameters,
        "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    if optimizer is not None:
        telemetry = optimizer.telemetry
        result.update({
            "bytes_between_ranks_per_step": telemetry.last.bytes_between_ranks,
            "host_optimizer_seconds_per_step": telemetry.last.host_optimizer_seconds,
            "host_state_bytes_rank0": telemetry.host_state_bytes,
            "step_split_seconds": {lane: telemetry.last_timeline.busy(lane)
                                   for lane in ("device", "device_wait", "link_to_host", "host", "link_to_device")}
            if telemetry.last_timeline is not None else {},
        })
    else:
        # Plain DDP all-reduces every gradient once (bf16 here, the parameters' dtype): two passes in this count.
        result["bytes_between_ranks_per_step"] = float(parameters * 2 * 2)
    Path(args.result).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 2 CPU processes (gloo), 3 steps")
    parser.add_argument("--shape", default="llama_1b3", choices=SHAPES)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (larger shapes)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per method")
    add_standard_arguments(parser, json_aliases=("--out",))
    parser.add_argument("--single", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.devices, args.nodes, args.steps, args.seq, args.batch = "tiny", 2, 1, 3, 32, 2
    if args.single is not None:
        _single(args.single, args)
        return {}
    begin_run(args, __file__, argv)
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("single", "result")},
                              "methods": []}
    for method in args.methods:
        result_file = Path(f".gpu_bench_ddp_{method}_{os.getpid()}.json").resolve()
        command = [sys.executable, str(Path(__file__).resolve()), "--single", method, "--result", str(result_file),
                   "--shape", args.shape, "--devices", str(args.devices), "--nodes", str(args.nodes), "--steps",
                   str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
        command += ["--smoke"] if args.smoke else []
        command += ["--checkpointing"] if args.checkpointing else []
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            if done.returncode != 0 or not result_file.exists():
                entry: dict[str, Any] = {"method": method, "error": done.stderr[-3000:]}
            else:
                entry = json.loads(result_file.read_text())
        except subprocess.TimeoutExpired:
            entry = {"method": method, "error": f"timed out after {args.timeout} s"}
        finally:
            result_file.unlink(missing_ok=True)
        report["methods"].append(entry)
        print(json.dumps(entry)[:400], flush=True)
        write_json(args.json, report)  # after every method: a run cut short keeps what it measured
    return report


if __name__ == "__main__":
    main()
