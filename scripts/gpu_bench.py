"""One prepared GPU benchmark: offloaded vs native training of a LLaMA-architecture model in bf16.

For a ~1.3B LLaMA shape (random init) it measures, each method in its own subprocess (so an out-of-memory or a
crash cannot poison the next): plain AdamW on the device ("native"), ``zero_offload``, ``lsp_offload``, and where
installed DeepSpeed ZeRO-Offload (``deepspeed_stage_2_offload``, pinned memory, its CPU Adam) and torchao's
``CPUOffloadOptimizer`` — median step time, peak device memory, link bytes per step — and MEFT (``meft_offload``,
base frozen, adapters of ``MEFT_NEURONS`` neurons per FFN) with routing on the host and on the device, which adds the
share of adapter rows moved per step and the host time of the row updates. Then it searches the largest
LLaMA shape that trains with ``lsp_offload`` under a 24 GiB and a 4 GiB device-memory cap
(``torch.cuda.set_per_process_memory_fraction``).

    python scripts/gpu_bench.py --out gpu_bench.json            # on a GPU machine (~10 minutes)
    python scripts/gpu_bench.py --smoke                          # tiny shape on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, intermediate (LLaMA-style MLP), vocabulary
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=256),
    "llama_1b3": dict(hidden=2048, layers=24, heads=16, intermediate=5504, vocab=32000),
    "llama_2b7": dict(hidden=2560, layers=32, heads=20, intermediate=6912, vocab=32000),
    "llama_6b7": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
    "llama_13b": dict(hidden=5120, layers=40, heads=40, intermediate=13824, vocab=32000),
}
METHODS = ("native", "zero_offload", "lsp_offload", "deepspeed_offload", "torchao_offload", "meft_host_routing",
           "meft_device_routing")
# MEFT adapter sizes per shape: (neurons, top_k, experts, experts per token).
MEFT_NEURONS: dict[str, tuple[int, int, int, int]] = {"tiny": (256, 8, 16, 4)}
MEFT_DEFAULT = (8192, 16, 64, 8)


def _single(method: str, shape: str, steps: int, batch: int, seq: int, cap_gib: float | None) -> dict[str, Any]:
    """Train ``steps`` steps of one method on one shape in this process; return its measurements."""
    import lightning.pytorch as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightning_offload

    cuda = torch.cuda.is_available()
    if cap_gib is not None and cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    s = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
        max_position_embeddings=max(seq, 64), tie_word_embeddings=False,
    )

    class Synthetic(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("cuda" if cuda else "cpu"):
                self.model = LlamaForCausalLM(config).to(torch.bfloat16)
            if cap_gib is not None:
                # Under a memory cap the question is whether the shape fits at all: recompute activations.
                self.model.gradient_checkpointing_enable()
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = torch.randint(0, s["vocab"], (batch_size, seq), device=self.device)
            return self.model(input_ids=ids, labels=ids).loss

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(steps), batch_size=1)

        def configure_optimizers(self) -> Any:
            trainable = [p for p in self.parameters() if p.requires_grad]  # MEFT: the routers only
            if method == "torchao_offload":
                from torchao.optim import CPUOffloadOptimizer

                return CPUOffloadOptimizer(trainable, torch.optim.AdamW, fused=True, lr=1e-5)
            if method == "deepspeed_offload":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(trainable, lr=1e-5)
            return torch.optim.AdamW(trainable, lr=1e-5, fused=True)

    batch_size = batch
    module = Synthetic()
    strategy: Any = {"native": "auto", "torchao_offload": "auto"}.get(method)
    if method.startswith("meft"):
        neurons, top_k, experts, per_token = MEFT_NEURONS.get(shape, MEFT_DEFAULT)
        lightning_offload.inject_meft(module.model, lightning_offload.MEFTConfig(
            num_neurons=neurons, top_k=top_k, num_experts=experts, experts_per_token=per_token,
            routing="host" if method == "meft_host_routing" else "device"))
        strategy = lightning_offload.MEFTOffloadStrategy(link_dtype="bf16")
    if method == "zero_offload":
        strategy = lightning_offload.ZeroOffloadStrategy(link_dtype="bf16")
    elif method == "lsp_offload":
        strategy = lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min(128, s["hidden"]))
    elif method == "deepspeed_offload":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=2, offload_optimizer=True, pin_memory=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="auto", devices=1, precision="bf16-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    telemetry = getattr(getattr(trainer.strategy, "offload_optimizer", None), "telemetry", None)
    params = sum(p.numel() for p in module.parameters())
    meft: dict[str, Any] = {}
    if method.startswith("meft"):
        rows = trainer.strategy.last_metrics
        total_rows = sum(a.config.num_neurons for a in trainer.strategy.adapters)
        meft = {
            "meft_rows_share_per_step": rows["meft/rows_moved"] / total_rows,
            "meft_link_bytes_per_step": rows["meft/bytes_host_to_device"] + rows["meft/bytes_device_to_host"],
            "meft_host_seconds_per_step": rows["meft/host_optimizer_seconds"],
            "meft_adapter_device_bytes": rows["meft/adapter_device_bytes"],
        }
    return {
        "method": method,
        "shape": shape,
        "parameters": params,
        "median_step_seconds": statistics.median(module.times[2:] or module.times),
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "link_bytes_per_step": (
            telemetry.last.bytes_device_to_host + telemetry.last.bytes_host_to_device if telemetry is not None
            else (4 * params if method.endswith("_offload") else 0)  # bf16 gradient out + bf16 params back
        ),
        "link_bytes_measured": telemetry is not None,
        **meft,
    }


def _run(method: str, shape: str, args: argparse.Namespace, cap_gib: float | None = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--single", method, "--shape", shape, "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq)]
    if cap_gib is not None:
        command += ["--cap-gib", str(cap_gib)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"method": method, "shape": shape, "error": " | ".join(tail) or f"exit {done.returncode}"}


def _available(method: str) -> bool:
    module = {"deepspeed_offload": "deepspeed", "torchao_offload": "torchao"}.get(method)
    if module is None:
        return True
    try:
        __import__(module)
        return True
    except Exception:  # noqa: BLE001 - any import failure means "not installable here"
        return False


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape, CPU allowed, no memory-cap search")
    parser.add_argument("--shape", default="llama_1b3", choices=SHAPES)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--single", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.single:
        result = _single(args.single, args.shape, args.steps, args.batch, args.seq, args.cap_gib)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    if args.smoke:
        args.shape, args.steps, args.batch, args.seq = "tiny", 4, 2, 32

    report: dict[str, Any] = {"shape": args.shape, "methods": [], "largest_under_cap": {}}
    for method in METHODS:
        if not _available(method):
            report["methods"].append({"method": method, "skipped": "not installed"})
            continue
        report["methods"].append(_run(method, args.shape, args))
        print(json.dumps(report["methods"][-1]), flush=True)
    if not args.smoke:
        for cap in (24.0, 4.0):
            largest = None
            for shape in ("llama_1b3", "llama_2b7", "llama_6b7", "llama_13b"):
                result = _run("lsp_offload", shape, argparse.Namespace(**{**vars(args), "steps": 3}), cap_gib=cap)
                if "error" in result:
                    break
                largest = result
            report["largest_under_cap"][f"{cap:g}GiB"] = largest
            print(f"largest under {cap:g} GiB: {largest and largest['shape']}", flush=True)
    native = next((m for m in report["methods"] if m.get("method") == "native" and "error" not in m), None)
    for entry in report["methods"]:
        if native and "median_step_seconds" in entry:
            entry["x_native"] = entry["median_step_seconds"] / native["median_step_seconds"]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
