"""The layer-wise schedule's overlap, measured without a GPU (issue 65 item 4): the GPU path's own code with the CPU as
the device behind the simulated asynchronous link (lightning_offload/engine/lanes/simulated_link.py), the device on one
core and the host worker on the other.

A LLaMA of 16 layers trains a few steps in a plain loop (``lightning_offload.offload``) under each configuration:

- ``instant``: pipelined with speculation behind a link of unbounded bandwidth: the device's own work, ``T_instant``;
- ``synchronous`` (``pipelined=False, speculative=False``), ``pipelined`` (``speculative=False``) and
  ``speculative`` (pipelined with speculation, the GPU default) behind a link whose bandwidth makes each direction's
  time per step ``--shares`` of ``T_instant`` (the busier direction's bytes over ``share · T_instant``),

for ``lsp_offload`` and ``zero_offload``, alternated round by round (``--repeats``), each figure the median of its
steady steps, then of the rounds. Beside each: the timeline's lanes per step (device, device waiting, link each way,
host, host waiting), the share of link and host time hidden, ``(T_sync − T) / (T_sync − T_instant)``, the bound
``max(device, link each way, host)``, and the planner's prediction for this simulated machine
(:func:`~lightning_offload.planning.calibration.simulated_machine`: the device's matmuls and the host's Adam measured
on their own threads, the link at the set bandwidth) with its "not overlapped" part. The planner's ratios for the GPUs
the method is for (an RTX 4090 on PCIe 4 with Llama-3.1-8B, the 4 GiB laptop profile with the 1.3B shape) are printed
beside, at the share of the device step their link time takes there.

    python scripts/benchmark_schedule.py --repeats 3
    python scripts/benchmark_schedule.py --kinds lsp_offload --shares 0.5 --repeats 1 --steps 4   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

import lightning_offload
from harness import add_standard_arguments, alternate, begin_run, markdown_table, write_json
from lightning_offload.engine.figures.timeline import LANES
from lightning_offload.engine.lanes.simulated_link import ENVIRONMENT_VARIABLE, LinkSpec
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.planning.calibration import Hardware, simulated_machine
from lightning_offload.planning.plan import plan

#: The configurations measured at each share (``instant`` once per kind).
MODES = ("synchronous", "pipelined", "speculative")
#: A link this fast takes no measurable time: the device's own step.
INSTANT_GBPS = 1e9
BATCH, SEQ = 2, 128


def model() -> torch.nn.Module:
    """The LLaMA measured: 16 layers (one layer's round trip a small share of the step), hidden 256 (compressed
    updates of 64 × 64 and 64 × 176), a 256-token vocabulary (embedding and head small beside the layers)."""
    return tiny_llama(vocab_size=256, hidden=256, intermediate=704, heads=8, kv_heads=4, layers=16, seed=0,
                      tie_word_embeddings=False)


@contextlib.contextmanager
def simulated(spec: str) -> Iterator[None]:
    """Engines set up in the block are behind the simulated link ``spec``."""
    saved = os.environ.get(ENVIRONMENT_VARIABLE)
    os.environ[ENVIRONMENT_VARIABLE] = spec
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENVIRONMENT_VARIABLE)
        else:
            os.environ[ENVIRONMENT_VARIABLE] = saved


def run(kind: str, mode: str, gbps: float, steps: int, warmup: int) -> dict[str, Any]:
    """One run: the steady steps' median seconds, its lanes' median busy seconds per step, the bytes each way."""
    # The synchronous schedule is every host step after backward and every update applied inside the step.
    settings: dict[str, Any] = {"pipelined": mode != "synchronous", "speculative": mode in ("speculative", "instant")}
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (BATCH, SEQ), generator=generator) for _ in range(steps)]
    with simulated(f"gbps={gbps:.9g}"):
        network = model()
        optimizer = lightning_offload.offload(network, torch.optim.AdamW(network.parameters(), lr=1e-3), kind,
                                              max_grad_norm=1e6, **settings)
        seconds, lanes, sent = [], [], []
        try:
            for ids in batches:
                start = time.perf_counter()
                network(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                seconds.append(time.perf_counter() - start)
                telemetry = optimizer.telemetry
                if telemetry.last_timeline is not None:
                    lanes.append({lane: telemetry.last_timeline.busy(lane) for lane in LANES})
                    sent.append((telemetry.last.bytes_device_to_host, telemetry.last.bytes_host_to_device))
        finally:
            optimizer.close()
    steady_lanes = lanes[warmup:] or lanes
    return {"seconds": statistics.median(seconds[warmup:] or seconds),
            "lanes": {lane: statistics.median(step[lane] for step in steady_lanes) for lane in LANES},
            "bytes": sent[-1]}


def planned(kind: str, hardware: Hardware, speculative: bool, pipelined: bool) -> dict[str, float]:
    """The planner's step on ``hardware`` (fp32, the same model and batch)."""
    with torch.device("meta"):
        network = model()
    found = plan(network, kind, batch_size=BATCH, seq_len=SEQ, device_memory="24GiB", precision="32-true",
                 hardware=hardware, device="cpu", loss="model", speculative=speculative, pipelined=pipelined)
    return {"step": found.step.step, "exposed": found.step.exposed, "device": found.step.device,
            "link": found.step.link, "host": found.step.host,
            "matmul_seconds": found.step.flops / hardware.matmul_flops}


def fed_machine(kind: str, device_step: float) -> Hardware:
    """This simulated machine as the planner is fed it: calibrated on the device's and the host's threads
    (:func:`simulated_machine`), with the device's matmul rate the one this model achieves there (its step at an
    instant link), as the GPU profiles take an achieved MFU: the planner does not count a CPU model's elementwise
    work and Python, which at this width are half of its step."""
    calibrated = simulated_machine(LinkSpec(INSTANT_GBPS))
    instant = planned(kind, calibrated, True, True)
    other = instant["device"] - instant["matmul_seconds"]  # the projections and the engine's work per tensor
    rate = calibrated.matmul_flops * instant["matmul_seconds"] / max(device_step - other, 1e-9)
    return replace(calibrated, matmul_flops=rate)


def gpu_shares() -> list[str]:
    """The planner's link time as a share of the device step, and its predicted ratio to that step, on the GPUs the
    method is for (lsp_offload's defaults, bf16-true, 4×512)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    lines = []
    shapes = {"Llama-3.1-8B on an RTX 4090 (PCIe 4)": (LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8), "rtx4090", True),
        "1.3B LLaMA shape on the 4 GiB laptop profile": (LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16),
            "laptop-4gb", True)}
    for label, (config, profile, checkpointing) in shapes.items():
        with torch.device("meta"):
            network = LlamaForCausalLM(config)
        found = plan(network, "lsp_offload", batch_size=4, seq_len=512, device_memory="24GiB",
                     precision="bf16-true", hardware=profile, gradient_checkpointing=checkpointing)
        step = found.step
        lines.append(f"{label}: link {step.link / step.device:.0%} of the device step, host "
                     f"{step.host / step.device:.0%}; predicted step {step.step / step.device:.2f}x the device's "
                     f"({step.step:.3f} s)")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["lsp_offload", "zero_offload"],
                        choices=["lsp_offload", "zero_offload"])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0],
                        help="each direction's link time per step, as a share of the device's own step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's predictions")
    add_standard_arguments(parser, repeats=3, warmup=3)
    args = parser.parse_args(argv)
    if begin_run(args, __file__, argv) is None:
        return {}
    # An empty cache: the kernels the engine chooses and the products the planner times are timed in this run, as the
    # rest of it is (kept timings from a busier moment would be read as this machine's).
    scratch = tempfile.TemporaryDirectory()
    os.environ["LIGHTNING_OFFLOAD_CACHE"] = scratch.name
    threads = torch.get_num_threads()
    report: dict[str, Any] = {"kinds": {}}
    for kind in args.kinds:
        # The device's own step and the bytes a step moves, behind an instant link, set the bandwidth of each share.
        instant = run(kind, "instant", INSTANT_GBPS, args.steps, args.warmup)
        device_step, busier = instant["seconds"], max(instant["bytes"])
        bandwidth = {share: busier / (share * device_step) / 1e9 for share in args.shares}
        configs = [("instant", None)] + [(mode, share) for share in args.shares for mode in MODES]

        def measure(config: tuple[str, float | None], round_index: int) -> dict[str, Any]:
            mode, share = config
            return run(kind, mode, INSTANT_GBPS if share is None else bandwidth[share], args.steps, args.warmup)

        results = alternate(configs, args.repeats, measure)
        fed = None if args.no_plan else fed_machine(kind, instant["seconds"])
        medians = {config: statistics.median(r["seconds"] for r in runs) for config, runs in results.items()}
        lanes = {config: {lane: statistics.median(r["lanes"][lane] for r in runs) for lane in LANES}
                 for config, runs in results.items()}
        base = medians[("instant", None)]
        rows, entries = [], []
        for share in args.shares:
            sync = medians[("synchronous", share)]
            link_each = busier / (bandwidth[share] * 1e9)
            for mode in MODES:
                step = medians[(mode, share)]
                hidden = (sync - step) / (sync - base) if sync > base else float("nan")
                lane = lanes[(mode, share)]
                bound = max(base, link_each, lane["host"])
                prediction = {} if fed is None else planned(
                    kind, replace(fed, link_to_host=bandwidth[share] * 1e9, link_to_device=bandwidth[share] * 1e9),
                    mode == "speculative", mode != "synchronous")
                entries.append({"share": share, "mode": mode, "gbps": bandwidth[share], "seconds": step,
                                "x_instant": step / base, "hidden": hidden, "bound_seconds": bound,
                                "lanes": lane, "planned": prediction})
                rows.append([f"{share:.0%}", mode, f"{bandwidth[share]:.4g}", f"{step * 1e3:.1f}",
                             f"{step / base:.2f}", "—" if mode == "synchronous" else f"{hidden:.0%}",
                             f"{step / bound:.2f}",
                             " / ".join(f"{lane[name] * 1e3:.1f}" for name in LANES),
                             "—" if not prediction else f"{prediction['step'] * 1e3:.1f} "
                             f"({prediction['exposed'] * 1e3:.1f})"])
        report["kinds"][kind] = {"instant_seconds": base, "instant_lanes": lanes[("instant", None)],
                                 "bytes_each_way": instant["bytes"], "rows": entries}
        print(f"\n{kind}: T_instant {base * 1e3:.1f} ms (the device's own step); bytes per step to host "
              f"{instant['bytes'][0] / 2**20:.2f} MiB, to device {instant['bytes'][1] / 2**20:.2f} MiB")
        print(markdown_table(["link per step", "schedule", "GB/s", "ms / step", "× instant", "hidden",
                              "× max(device, link, host)", f"lanes ms: {' / '.join(LANES)}",
                              "planned ms (not overlapped)"], rows), flush=True)
        write_json(args.json, report)
    if not args.no_plan:
        report["gpu_profiles"] = gpu_shares()
        print("\nThe planner on the GPUs the schedule is for:\n" + "\n".join(report["gpu_profiles"]))
    torch.set_num_threads(threads)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
