"""One prepared GPU benchmark: offloaded vs native training of a LLaMA-architecture model in bf16.

For a ~1.3B LLaMA shape (random init, built directly in bf16) it measures, each method in its own subprocess (so an
out-of-memory or a crash cannot poison the next) and at each batch of ``--batches``: plain AdamW on the device
("native"), LoRA on the device (a reference point: peft, rank 16), ``zero_offload``, ``lsp_offload`` at its defaults
and with embedding and head stepped densely on the host (``lsp_offload_dense_ends``, the previous default), and where
installed DeepSpeed ZeRO-Offload (``deepspeed_stage_2_offload``, pinned memory, its CPU Adam) and torchao's
``CPUOffloadOptimizer`` (stepped under manual optimization: Lightning does not take it from
``configure_optimizers``) — median step time, peak device memory, link bytes per step each way — and MEFT
(``meft_offload``, base frozen, adapters of ``MEFT_NEURONS`` neurons per FFN) with routing on the host and on the
device, which adds the share of adapter rows moved per step and the host time of the row updates.

So that one run explains itself, each offload method also reports its step split by the strategy's timeline (device
compute, device waiting for updates, link each way, host Adam: medians of the steady steps), the host worker's page
faults per step, and one profiled step summarised by kernel class (``--profile``); and ``zero_offload`` and
``lsp_offload`` run once more with the engine's phase clock on (``phases``: forward and backward projections, hooks,
sends, launch, host Adam, updates applied, waits, telemetry; lightning_offload/engine/figures/phases.py), the same table the
CPU step benchmark prints (scripts/benchmark_small_step.py). Then it searches the largest
LLaMA shape that trains with ``lsp_offload`` under a 24 GiB and a 4 GiB device-memory cap
(``torch.cuda.set_per_process_memory_fraction``, gradient checkpointing on). On a GPU it first runs the CUDA
versions of the pipeline, equivalence and checkpoint tests (``LIGHTNING_OFFLOAD_TEST_ACCELERATOR=cuda``).

The report is written as it goes (``--out``: the JSON, and a Markdown table beside it), so a run cut short keeps
what it measured.

    python scripts/gpu_bench.py --out gpu_bench.json            # on a GPU machine (not yet timed in this form;
                                                                 # trim with --methods, --no-cap-search)
    python scripts/gpu_bench.py --smoke                          # tiny shape on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

# The harness imports neither hydra nor wandb (nor torch at import): this script stays runnable without them.
from harness import add_standard_arguments, begin_run, markdown_table, spread, steady, synchronize, write_json

SHAPES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, intermediate (LLaMA-style MLP), vocabulary
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=256),
    "llama_1b3": dict(hidden=2048, layers=24, heads=16, intermediate=5504, vocab=32000),
    "llama_2b7": dict(hidden=2560, layers=32, heads=20, intermediate=6912, vocab=32000),
    "llama_6b7": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
    "llama_13b": dict(hidden=5120, layers=40, heads=40, intermediate=13824, vocab=32000),
}
METHODS = ("native", "lora_device", "zero_offload", "lsp_offload", "lsp_offload_dense_ends", "lsp_offload_scaled",
           "deepspeed_offload", "torchao_offload", "meft_host_routing", "meft_device_routing")
#: Methods also measured at the batch sizes after the first (MEFT and the references only at the first: time).
BATCH_SWEEP_METHODS = ("native", "zero_offload", "lsp_offload", "deepspeed_offload")
#: Tests whose CUDA versions run before the benchmark on a GPU machine.
GPU_TESTS = ("tests/test_pipeline.py", "tests/test_strategy_equivalence.py", "tests/test_checkpoint.py",
             "tests/test_host_jobs.py", "tests/test_speculation.py", "tests/test_projected_linear.py",
             "tests/test_projector.py", "tests/test_embeddings_head.py", "tests/test_user_patterns.py")
# MEFT adapter sizes per shape: (neurons, top_k, experts, experts per token).
# Experts per token equal experts per sequence (MEFTConfig's default routing keeps 4 per sequence): at the 1.3B shape
# a 4×512 batch then touches at most 4 × 4 × 128 = 2048 of each adapter's 8192 rows.
MEFT_NEURONS: dict[str, tuple[int, int, int, int]] = {"tiny": (256, 8, 16, 4)}
MEFT_DEFAULT = (8192, 16, 64, 4)


def _step_split(telemetry: Any) -> dict[str, Any]:
    """Median busy seconds per timeline lane over the steady steps, and the host worker's page faults per step."""
    if telemetry is None or not telemetry.completed:
        return {}
    # The first steps include allocation and warm-up.
    steps = steady([metrics for _, metrics in telemetry.completed], 2)

    def median(key: str) -> float:
        values = [m[key] for m in steps if key in m]
        return spread(values).median if values else 0.0

    lanes = sorted({key for m in steps for key in m if key.startswith("offload/timeline/")})
    return {"step_split_seconds": {key.removeprefix("offload/timeline/"): median(key) for key in lanes},
            "host_optimizer_seconds_per_step": median("offload/host_optimizer_seconds"),
            "host_page_faults_per_step": median("offload/host_page_faults"),
            # Speculative host steps (on by default on a GPU): how much host work ran during backward, and how many
            # tensors' steps were confirmed or redone.
            "host_share_before_backward_end": median("offload/host_share_before_backward_end"),
            "speculative_steps_per_step": median("offload/speculative_steps"),
            "rolled_back_steps_per_step": median("offload/rolled_back_steps")}


class _ProfiledStep:
    """One training step under ``torch.profiler``, summarised by kernel class (device time where there is one)."""

    CLASSES = (("gemm", ("gemm", "matmul", "mm", "cutlass", "cublas", "addmm", "bmm", "linear")),
               ("sparse", ("sparse", "csr", "spmm", "sddmm", "index_add", "index_put", "gather", "scatter")),
               ("copy", ("copy", "memcpy", "to_copy")), ("adam", ("adam",)), ("attention", ("attention", "sdpa",
                                                                                         "flash")),
               ("elementwise", ("mul", "add", "div", "sub", "silu", "exp", "pow", "sqrt", "round", "clamp", "neg")))

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def record(self, profiler: Any, on_device: bool) -> None:
        for event in profiler.key_averages():
            # Self times only: an op's total includes the ops and kernels under it, which are listed themselves.
            if on_device:
                seconds = getattr(event, "self_device_time_total", None)
                if seconds is None:
                    seconds = getattr(event, "self_cuda_time_total", 0.0)
            else:
                seconds = event.self_cpu_time_total
            if seconds:
                self.events.append((event.key, float(seconds) / 1e6))

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, seconds in self.events:
            name = key.lower()
            kind = next((k for k, words in self.CLASSES if any(w in name for w in words)), "other")
            out[kind] = out.get(kind, 0.0) + seconds
        return {k: round(v, 6) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def _profile_step(trainer: Any, module: Any) -> _ProfiledStep:
    """Profiles the third training step (steady state) of ``trainer.fit``."""
    import lightning.pytorch as pl
    import torch

    profiled = _ProfiledStep()

    class Profile(pl.Callback):
        def __init__(self) -> None:
            self.profiler: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                profiled.record(self.profiler, on_device=torch.cuda.is_available())
                self.profiler = None

    trainer.callbacks.append(Profile())
    return profiled


def _single(method: str, shape: str, steps: int, batch: int, seq: int, cap_gib: float | None,
            profile_step: bool = False, phases: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps of one method on one shape in this process; return its measurements (``phases``: with
    the engine's phase clock on after two steps, which synchronizes the device at each phase boundary)."""
    import lightning.pytorch as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightning_offload
    from lightning_offload.cli.benchmark_run import PhaseReader

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
            # Built in bf16 directly: an fp32 init of a 6.7B shape alone would not fit a 24 GiB cap.
            with torch.device("cuda" if cuda else "cpu"):
                self.model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
            if method == "lora_device":
                from lightning_offload.cli.baselines import add_lora

                self.model = add_lora(self.model, rank=16, min_dim=min(128, s["hidden"]), train_others=False)
            self.manual = method == "torchao_offload"
            self.automatic_optimization = not self.manual
            self.offloaded: Any = None
            if cap_gib is not None:
                # Under a memory cap the question is whether the shape fits at all: recompute activations.
                self.model.gradient_checkpointing_enable()
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            synchronize()
            self.times.append(time.perf_counter() - self._start)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = torch.randint(0, s["vocab"], (batch_size, seq), device=self.device)
            loss = self.model(input_ids=ids, labels=ids).loss
            if self.manual:
                # torchao's optimizer is not a torch.optim.Optimizer: stepped here, outside Lightning's loop.
                self.manual_backward(loss)
                self.offloaded.step()
                self.offloaded.zero_grad()
            return loss

        def on_fit_start(self) -> None:
            if self.manual:
                from torchao.optim import CPUOffloadOptimizer

                trainable = [p for p in self.parameters() if p.requires_grad]
                self.offloaded = CPUOffloadOptimizer(trainable, torch.optim.AdamW, fused=True, lr=1e-5)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(steps), batch_size=1)

        def configure_optimizers(self) -> Any:
            trainable = [p for p in self.parameters() if p.requires_grad]  # MEFT: the routers only
            if self.manual:
                return None  # built in on_fit_start and stepped in training_step
            if method == "deepspeed_offload":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(trainable, lr=1e-5)
            return torch.optim.AdamW(trainable, lr=1e-5, fused=True)

    batch_size = batch
    module = Synthetic()
    strategy: Any = {"native": "auto", "torchao_offload": "auto", "lora_device": "auto"}.get(method)
    if method.startswith("meft"):
        neurons, top_k, experts, per_token = MEFT_NEURONS.get(shape, MEFT_DEFAULT)
        lightning_offload.inject_meft(module.model, lightning_offload.MEFTConfig(
            num_neurons=neurons, top_k=top_k, num_experts=experts, experts_per_token=per_token,
            routing="host" if method == "meft_host_routing" else "device"))
        strategy = lightning_offload.MEFTOffloadStrategy(link_dtype="bf16")
    if method == "zero_offload":
        strategy = lightning_offload.ZeroOffloadStrategy(link_dtype="bf16")
    elif method == "lsp_offload":
        # Learned projectors (the default is random since 2026-12-02): the fit's device peak is one of the figures.
        strategy = lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min(128, s["hidden"]),
                                                        projectors="learned")
    elif method == "lsp_offload_dense_ends":
        # The previous default: embedding and head stepped densely on the host (what the defaults are compared to).
        strategy = lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min(128, s["hidden"]),
                                                        projectors="learned", embeddings="host", head="host")
    elif method == "lsp_offload_scaled":
        # update="scaled" at the host bytes of rank 0.25: full-rank updates from compressed moments (its own lane: the
        # device forms each projected weight's gradient and keeps it until the step's scales return).
        strategy = lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min(128, s["hidden"]),
                                                        update="scaled")
    elif method == "deepspeed_offload":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=2, offload_optimizer=True, pin_memory=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fit_peak = _fit_peak_probe(pl, cuda)
    callbacks: list[Any] = []
    if method in ("lsp_offload", "lsp_offload_dense_ends"):
        # The learned strategy's default fit, named here so the probe after it sees the device peak the fit reached.
        callbacks = [lightning_offload.ProjectorRefit(), fit_peak]
    phase_reader = PhaseReader(warmup=2) if phases else None
    if phase_reader is not None:
        callbacks.append(phase_reader)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="auto", devices=1, precision="bf16-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    profile = _profile_step(trainer, module) if profile_step else None
    trainer.fit(module)
    telemetry = getattr(getattr(trainer.strategy, "offload_optimizer", None), "telemetry", None)
    params = sum(p.numel() for p in module.parameters())
    meft: dict[str, Any] = {}
    if method.startswith("meft"):
        rows = trainer.strategy.figures_at_step_end()
        total_rows = sum(a.config.num_neurons for a in trainer.strategy.adapters)
        meft = {
            "meft_rows_share_per_step": rows["meft/rows_moved"] / total_rows,
            # Whole blocks are stepped on the host: the touched rows plus their blocks' idle rows.
            "meft_rows_stepped_share_per_step": rows["meft/rows_stepped"] / total_rows,
            "meft_link_bytes_per_step": rows["meft/bytes_host_to_device"] + rows["meft/bytes_device_to_host"],
            "meft_routing_key_bytes_per_step": rows["meft/bytes_routing_keys_to_device"],
            "meft_host_seconds_per_step": rows["meft/host_optimizer_seconds"],
            "meft_adapter_device_bytes": rows["meft/adapter_device_bytes"],
        }
    return {
        "method": method,
        "shape": shape,
        "batch": batch,
        "seq": seq,
        "parameters": params,
        **_step_split(telemetry),
        **({"profile": profile.summary()} if profile is not None else {}),
        **({"phases_seconds_per_step": phase_reader.medians()} if phase_reader is not None else {}),
        "median_step_seconds": spread(steady(module.times, 2)).median,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "link_bytes_per_step": (
            telemetry.last.bytes_device_to_host + telemetry.last.bytes_host_to_device if telemetry is not None
            else (4 * params if method.endswith("_offload") else 0)  # bf16 gradient out + bf16 params back
        ),
        "link_bytes_to_host_per_step": telemetry.last.bytes_device_to_host if telemetry is not None else None,
        "link_bytes_to_device_per_step": telemetry.last.bytes_host_to_device if telemetry is not None else None,
        "link_bytes_measured": telemetry is not None,
        # Rows of the row-sparse embedding that crossed and were stepped (lsp_offload's default placement).
        "sparse_embedding_rows_per_step": telemetry.last.sparse_rows if telemetry is not None else None,
        # Rows of each adapter a step may touch at most (MEFT's per-sequence routing bound).
        **({"meft_row_bound_share": trainer.strategy.adapters[0].config.row_bound(batch, batch * seq)
            / trainer.strategy.adapters[0].config.num_neurons} if method.startswith("meft") else {}),
        **_device_memory(telemetry, trainer, fit_peak),
        **meft,
    }


def _fit_peak_probe(pl: Any, cuda: bool) -> Any:
    """A callback measuring the device bytes the initial projector fit added above what training had allocated
    when it set up (CUDA only). Placed after the :class:`~lightning_offload.ProjectorRefit`, its
    ``on_train_start`` runs once the fit is done."""
    import torch

    class FitPeak(pl.Callback):
        def __init__(self) -> None:
            self.baseline: int | None = None
            self.extra: int | None = None

        def setup(self, trainer: Any, module: Any, stage: str) -> None:
            if cuda:
                torch.cuda.synchronize()
                self.baseline = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if cuda and self.baseline is not None:
                self.extra = torch.cuda.max_memory_allocated() - self.baseline

    return FitPeak()


def _device_memory(telemetry: Any, trainer: Any, fit_peak: Any) -> dict[str, Any]:
    """Device bytes of the offload machinery by category: persistent, transient per step, and the fit's."""
    if telemetry is None:
        return {}
    refits = [cb for cb in trainer.callbacks if type(cb).__name__ == "ProjectorRefit"]
    initial = refits[0].history[0] if refits and refits[0].history else None
    return {
        "device_persistent_bytes": dict(telemetry.device_persistent_bytes),
        "device_transient_bytes": {
            "compressed_grads": telemetry.last.device_compressed_grad_bytes,
            "saved_projections": telemetry.last.device_saved_projection_bytes,
            "held_gradients": telemetry.last.device_held_gradient_bytes,
        },
        "fit_device_state_bytes": initial.device_fit_state_bytes if initial is not None else None,
        "fit_extra_peak_bytes": fit_peak.extra,
    }


def _run(method: str, shape: str, args: argparse.Namespace, cap_gib: float | None = None,
         batch: int | None = None, profile: bool = False, phases: bool = False) -> dict[str, Any]:
    batch = batch if batch is not None else args.batches[0]
    command = [sys.executable, __file__, "--single", method, "--shape", shape, "--steps", str(args.steps),
               "--batches", str(batch), "--seq", str(args.seq)]
    if cap_gib is not None:
        command += ["--cap-gib", str(cap_gib)]
    if profile:
        command += ["--profile"]
    if phases:
        command += ["--phases"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "shape": shape, "batch": batch, "error": f"timed out after {args.timeout} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"method": method, "shape": shape, "batch": batch, "error": " | ".join(tail) or f"exit {done.returncode}"}


def _gpu_tests(timeout: int) -> dict[str, Any]:
    """The CUDA versions of the pipeline, equivalence and checkpoint tests (the tests' Trainer takes its accelerator
    from ``LIGHTNING_OFFLOAD_TEST_ACCELERATOR``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "LIGHTNING_OFFLOAD_TEST_ACCELERATOR": "cuda"}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not smollm2", *GPU_TESTS],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "summary": f"timed out after {timeout} s"}
    lines = done.stdout.strip().splitlines()
    return {"passed": done.returncode == 0, "summary": lines[-1] if lines else f"exit {done.returncode}"}


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table (written next to the JSON)."""
    gib, mib = 2**30, 2**20

    def num(value: Any, fmt: str) -> str:
        return "–" if value is None else format(value, fmt)

    rows = []
    for m in report["methods"]:
        split = m.get("step_split_seconds", {})
        to_host, to_device = m.get("link_bytes_to_host_per_step"), m.get("link_bytes_to_device_per_step")
        link = (f"{to_host / mib:.1f}, {to_device / mib:.1f}" if to_host is not None and to_device is not None
                else num(m.get("link_bytes_per_step") and m["link_bytes_per_step"] / mib, ".1f"))
        peak = m.get("peak_device_bytes")
        rows.append([m["method"], m.get("batch", "–"), num(m.get("median_step_seconds"), ".3f"),
                     num(m.get("x_native"), ".2f"), num(peak and peak / gib, ".1f"), link,
                     f"{num(m.get('host_optimizer_seconds_per_step'), '.3f')} "
                     f"({num(m.get('host_share_before_backward_end'), '.0%')})",
                     num(split.get("device_wait_seconds"), ".3f"), num(m.get("host_page_faults_per_step"), ".0f"),
                     _memory_cell(m), m.get("error", m.get("skipped", ""))])
    table = markdown_table(
        ["method", "batch", "s / step", "× native", "peak device GiB", "link MiB / step (to host, to device)",
         "host Adam s / step (share during backward)", "device wait s / step", "host page faults / step",
         "offload device MiB: persistent (projectors + ring + scaled P), transient (S + B Xᵀ + held G), fit (state, "
         "extra peak)", "error"], rows)
    lines = [f"Shape {report['shape']}, seq {report.get('seq')}; GPU tests: "
             f"{report.get('gpu_tests', {}).get('summary', 'not run')}", "", table]
    for cap, largest in report.get("largest_under_cap", {}).items():
        lines.append(f"\nLargest shape under {cap}: {largest and largest['shape']}")
    return "\n".join(lines)


def _memory_cell(m: dict[str, Any]) -> str:
    persistent = m.get("device_persistent_bytes")
    if not persistent:
        return "–"
    mib = 2**20
    transient = m.get("device_transient_bytes", {})
    fit_state, fit_extra = m.get("fit_device_state_bytes"), m.get("fit_extra_peak_bytes")
    return (f"{persistent.get('projectors', 0) / mib:.1f} + {persistent.get('update_ring', 0) / mib:.1f} + "
            f"{persistent.get('scaled_projections', 0) / mib:.1f}; "
            f"{transient.get('compressed_grads', 0) / mib:.1f} + {transient.get('saved_projections', 0) / mib:.1f} + "
            f"{transient.get('held_gradients', 0) / mib:.1f}; "
            f"{'–' if fit_state is None else format(fit_state / mib, '.1f')}, "
            f"{'–' if fit_extra is None else format(fit_extra / mib, '.1f')}")


def _write(report: dict[str, Any], out: str | None) -> None:
    # Written after every measurement: a run cut short (time limit, crash) keeps what it measured.
    if not out:
        return
    write_json(out, report)
    with open(os.path.splitext(out)[0] + ".md", "w") as handle:
        handle.write(markdown(report) + "\n")


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
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16], help="batch sizes (sequences of --seq)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per method run (and for the GPU tests)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--no-gpu-tests", action="store_true", help="skip the CUDA tests before the benchmark")
    parser.add_argument("--no-cap-search", action="store_true", help="skip the largest-shape search under caps")
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    add_standard_arguments(parser, json_aliases=("--out",))
    args = parser.parse_args(argv)
    if args.single:
        result = _single(args.single, args.shape, args.steps, args.batches[0], args.seq, args.cap_gib, args.profile,
                         args.phases)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    if args.smoke:
        args.shape, args.steps, args.batches, args.seq = "tiny", 4, [2], 32
    begin_run(args, __file__, argv)

    report: dict[str, Any] = {"shape": args.shape, "seq": args.seq, "methods": [], "largest_under_cap": {}}
    import torch

    if torch.cuda.is_available() and not args.no_gpu_tests:
        report["gpu_tests"] = _gpu_tests(args.timeout)
        print(f"GPU tests: {report['gpu_tests']}", flush=True)
        _write(report, args.json)
    for batch in args.batches:
        for method in args.methods:
            if batch != args.batches[0] and method not in BATCH_SWEEP_METHODS:
                continue
            if not _available(method):
                report["methods"].append({"method": method, "batch": batch, "skipped": "not installed"})
                continue
            # The first batch size profiles one step of each method; the rest measure time only.
            report["methods"].append(_run(method, args.shape, args, batch=batch, profile=batch == args.batches[0]))
            native = next((m for m in report["methods"] if m.get("method") == "native" and m.get("batch") == batch
                           and "error" not in m), None)
            entry = report["methods"][-1]
            if native and "median_step_seconds" in entry:
                entry["x_native"] = entry["median_step_seconds"] / native["median_step_seconds"]
            print(json.dumps(entry), flush=True)
            _write(report, args.json)
    # Where the offload methods' steps go, phase by phase: runs of their own, since the clock synchronizes the device
    # at every phase boundary (the step times above are taken without it).
    report["phases"] = {}
    for method in ("zero_offload", "lsp_offload"):
        if method in args.methods:
            result = _run(method, args.shape, args, phases=True)
            report["phases"][method] = result.get("phases_seconds_per_step", result.get("error"))
            print(f"phases of {method}: {report['phases'][method]}", flush=True)
            _write(report, args.json)
    if not args.smoke and not args.no_cap_search:
        for cap in (24.0, 4.0):
            largest = None
            for shape in ("llama_1b3", "llama_2b7", "llama_6b7", "llama_13b"):
                result = _run("lsp_offload", shape, argparse.Namespace(**{**vars(args), "steps": 3}), cap_gib=cap,
                              batch=1 if cap < 8 else args.batches[0])
                if "error" in result:
                    break
                largest = result
            report["largest_under_cap"][f"{cap:g}GiB"] = largest
            print(f"largest under {cap:g} GiB: {largest and largest['shape']}", flush=True)
            _write(report, args.json)
    _write(report, args.json)
    return report


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
