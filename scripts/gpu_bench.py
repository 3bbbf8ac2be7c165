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
sends, launch, host Adam, updates applied, waits, telemetry; lightning_offload/engine/figures/phases.py), the same table
the CPU step benchmark prints (scripts/benchmark_small_step.py). Then it searches the largest
LLaMA shape that trains with ``lsp_offload`` under a 24 GiB and a 4 GiB device-memory cap
(``torch.cuda.set_per_process_memory_fraction``, gradient checkpointing on). On a GPU it first runs the CUDA
versions of the pipeline, equivalence and checkpoint tests (``LIGHTNING_OFFLOAD_TEST_ACCELERATOR=cuda``).

The report is written as it goes (``--out``: the JSON, and a Markdown table beside it), so a run cut short keeps
what it measured.

``--simulated-link SPEC`` (``gbps=G[,jitter_ms=J][,seed=S]``) runs every method's engine with the CPU as the device
behind the simulated asynchronous link (lightning_offload/engine/lanes/simulated_link.py), and without a GPU runs the
test list a GPU runs first on the CPU under it: the GPU path's own schedule end to end, so that a lent device's minutes
go to measuring.

    python scripts/gpu_bench.py --out gpu_bench.json            # on a GPU machine (not yet timed in this form;
                                                                 # trim with --methods, --no-cap-search)
    python scripts/gpu_bench.py --smoke                          # tiny shape on the CPU: checks the script runs
    python scripts/gpu_bench.py --smoke --simulated-link gbps=2,jitter_ms=2   # and the GPU path's schedule, tests too
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# The harness imports neither hydra nor wandb (nor torch at import): this script stays runnable without them.
from gpu_bench_run import SHAPES, single
from harness import add_standard_arguments, begin_run, markdown_table, write_json

METHODS = ("native", "lora_device", "zero_offload", "lsp_offload", "lsp_offload_dense_ends", "lsp_offload_scaled",
           "deepspeed_offload", "torchao_offload", "meft_host_routing", "meft_device_routing")
#: Methods also measured at the batch sizes after the first (MEFT and the references only at the first: time).
BATCH_SWEEP_METHODS = ("native", "zero_offload", "lsp_offload", "deepspeed_offload")
#: Tests whose CUDA versions run before the benchmark on a GPU machine.
GPU_TESTS = ("tests/test_pipeline.py", "tests/test_strategy_equivalence.py", "tests/test_checkpoint.py",
             "tests/test_host_jobs.py", "tests/test_speculation.py", "tests/test_projected_linear.py",
             "tests/test_projector.py", "tests/test_embeddings_head.py", "tests/test_user_patterns.py",
             "tests/test_triton_projection.py", "tests/test_projection_kernels.py")


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


def _results(runs: list[tuple[str, int, bool, bool]], args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Each run's result, in the order of ``runs`` (method, batch, profile, phases), as it comes.

    On a GPU the runs go one at a time: they share the device, and each is timed. ``--smoke`` checks on a CPU that
    every run works, and a fresh interpreter's imports are most of a run's time there, so two go at once.
    """
    def result(run: tuple[str, int, bool, bool]) -> dict[str, Any]:
        method, batch, profile, phases = run
        if not _available(method):
            return {"method": method, "batch": batch, "skipped": "not installed"}
        return _run(method, args.shape, args, batch=batch, profile=profile, phases=phases)

    if not args.smoke:
        yield from map(result, runs)
        return
    with ThreadPoolExecutor(max_workers=2) as pool:  # threads only wait on their subprocesses
        yield from pool.map(result, runs)


def _gpu_tests(timeout: int, accelerator: str = "cuda") -> dict[str, Any]:
    """The CUDA versions of the pipeline, equivalence and checkpoint tests (the tests' Trainer takes its accelerator
    from ``LIGHTNING_OFFLOAD_TEST_ACCELERATOR``); with ``accelerator="cpu"``, the same tests on the CPU (under the
    simulated link the environment names)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "LIGHTNING_OFFLOAD_TEST_ACCELERATOR": accelerator}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not smollm2", *GPU_TESTS],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "summary": f"timed out after {timeout} s"}
    lines = done.stdout.strip().splitlines()
    return {"passed": done.returncode == 0, "summary": lines[-1] if lines else f"exit {done.returncode}"}


def _projection_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Per projected-layer shape, each kernel's products against the GEMMs they replace, and the kernels chosen
    (``scripts/benchmark_projection_kernels.py``, in its own process, at this run's shape and first batch)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark_projection_kernels.py")
    shape = "small" if args.smoke else args.shape if args.shape in ("llama_1b3", "llama_8b") else "llama_1b3"
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "kernels.json")
        command = [sys.executable, script, "--shape", shape, "--tokens", str(args.batches[0] * args.seq), "--json",
                   out] + (["--repeats", "1"] if args.smoke else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout} s"}
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
        with open(out) as file:
            return json.load(file)


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
    parser.add_argument("--simulated-link", default=None, metavar="SPEC",
                        help="gbps=G[,jitter_ms=J][,seed=S]: the CPU as the device behind the simulated link, for "
                             "every run (and, without a GPU, the GPU test list on the CPU under it)")
    parser.add_argument("--no-cap-search", action="store_true", help="skip the largest-shape search under caps")
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    add_standard_arguments(parser, json_aliases=("--out",))
    args = parser.parse_args(argv)
    if args.single:
        result = single(args.single, args.shape, args.steps, args.batches[0], args.seq, args.cap_gib, args.profile,
                         args.phases)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    if args.smoke:
        args.shape, args.steps, args.batches, args.seq = "tiny", 4, [2], 32
    if args.simulated_link:
        # Read by every engine's set-up, in this process and in each method's subprocess.
        os.environ["LIGHTNING_OFFLOAD_SIMULATED_LINK"] = args.simulated_link
    begin_run(args, __file__, argv)

    report: dict[str, Any] = {"shape": args.shape, "seq": args.seq, "methods": [], "largest_under_cap": {}}
    import torch

    if not args.no_gpu_tests and (torch.cuda.is_available() or args.simulated_link):
        # On the CPU the list takes about a minute under the simulated link; on a GPU the device's minutes are short.
        on_gpu = torch.cuda.is_available()
        report["gpu_tests"] = _gpu_tests(args.timeout if on_gpu else max(args.timeout, 900),
                                         "cuda" if on_gpu else "cpu")
        print(f"GPU tests: {report['gpu_tests']}", flush=True)
        _write(report, args.json)
    # Where a projected layer's device time goes, before the whole steps: a few seconds, and it explains them.
    report["projection_kernels"] = _projection_kernels(args)
    print(f"projection kernels: {report['projection_kernels']}", flush=True)
    _write(report, args.json)
    # Every method at each batch (the first batch size profiles one step of each; the rest measure time only), then
    # zero_offload and lsp_offload once more with the phase clock, which synchronizes the device at every phase
    # boundary (so the step times are taken in the runs without it).
    runs = [(method, batch, batch == args.batches[0], False) for batch in args.batches for method in args.methods
            if batch == args.batches[0] or method in BATCH_SWEEP_METHODS]
    runs += [(method, args.batches[0], False, True) for method in ("zero_offload", "lsp_offload")
             if method in args.methods]
    report["phases"] = {}
    for (method, batch, _, phases), entry in zip(runs, _results(runs, args)):
        if phases:
            report["phases"][method] = entry.get("phases_seconds_per_step", entry.get("error"))
            print(f"phases of {method}: {report['phases'][method]}", flush=True)
            _write(report, args.json)
            continue
        report["methods"].append(entry)
        native = next((m for m in report["methods"] if m.get("method") == "native" and m.get("batch") == batch
                       and "error" not in m), None)
        if native and "median_step_seconds" in entry:
            entry["x_native"] = entry["median_step_seconds"] / native["median_step_seconds"]
        print(json.dumps(entry), flush=True)
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
