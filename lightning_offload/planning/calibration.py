"""The machine's speeds a step-time prediction needs, measured in about a second (:func:`calibrate`) and kept per
machine under the cache root, or taken from a named hardware profile (:data:`PROFILES`).

Measured: the device's matmul rate in the compute dtype, the host's fused Adam per element and per call (the
engine's host step is one ``torch.optim.Adam(fused=True)`` per tensor), the host's memory bandwidth (memcpy: the CPU
device's "link" and its elementwise passes), and on CUDA the pinned copies each way and the device's own memory
bandwidth. The projected layers' products are not a rate here: a plan times them per shape by the kernels a run
chooses (:mod:`~lightning_offload.planning.projection_time`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lightning_offload.cache import cache_root
from lightning_offload.engine.lanes.simulated_link import LinkSpec, spec_from_environment
from lightning_offload.engine.lanes.thread_split import ThreadSplit

log = logging.getLogger(__name__)

#: Bump when what is measured changes: older cached calibrations are then measured anew.
CALIBRATION_VERSION = 3


@dataclass(frozen=True)
class Hardware:
    """Speeds of one machine (seconds are per unit of work).

    Attributes:
        name: the machine, in words (the CPU, the GPU, torch's version).
        device: ``"cpu"`` or ``"cuda"``: whether host and device share the cores (no overlap on the CPU).
        matmul_flops: device matmul FLOP/s in the compute dtype.
        adam_seconds_per_element: host fused Adam, per element.
        adam_seconds_per_call: host fused Adam, per tensor stepped (dispatch and launch).
        host_bandwidth: host memory bandwidth (bytes/s) of a copy.
        device_bandwidth: device memory bandwidth (bytes/s) of a copy (the CPU's: ``host_bandwidth``).
        link_to_host: bytes/s of a pinned device→host copy (the CPU: a memcpy).
        link_to_device: bytes/s of a pinned host→device copy.
        device_memory: bytes of device memory (0 when unknown).
        host_memory: bytes of host memory.
        seconds_per_offloaded_tensor: the engine's fixed cost per offloaded tensor and step beyond its arithmetic and
            its Adam call (hooks, the send, the slot's step and apply, Python).
        measured: whether these were measured on this machine (``False``: a named profile's assumed figures; its
            projections are then predicted at the memory floor, not timed).
        simulated_link: the CPU as the device behind the simulated asynchronous link
            (:mod:`~lightning_offload.engine.lanes.simulated_link`): the host worker on cores of its own and copies
            at ``link_to_host``/``link_to_device``, so the parts overlap as on a GPU.
    """

    name: str
    device: str
    matmul_flops: float
    adam_seconds_per_element: float
    adam_seconds_per_call: float
    host_bandwidth: float
    device_bandwidth: float
    link_to_host: float
    link_to_device: float
    device_memory: int
    host_memory: int
    seconds_per_offloaded_tensor: float = 0.0
    measured: bool = True
    simulated_link: bool = False

    @property
    def overlaps(self) -> bool:
        """Whether host work and copies overlap the device's (a GPU, or the simulated link), or add to it (the CPU
        as the device, its host jobs inline)."""
        return self.device != "cpu" or self.simulated_link


_GIB = 2**30

# The rate a named profile's matmuls are assumed to run at is an achieved one, not the chip's peak: the cost model
# divides every FLOP of a step by it and models nothing else of the model's own work (norms, activations, softmax,
# the loss, kernel launches, Python), so the rate has to carry those too. The one GPU calibration there is, the
# H200 run of 2026-11-30 (docs/benchmarks.md, "GPU: the last measurement"): LLaMA 1.3B shape (hidden 2048, 24
# layers, MLP 5504, vocabulary 32000 untied), bf16-true, 4×512 tokens, no checkpointing, the model's own loss,
# native fused AdamW: 0.101 s a step. The cost model counts that step's matmuls (T = 2048 tokens, M = 1,279,787,008
# Linear weight elements: 24 × (4·2048² + 3·2048·5504) + 32000·2048):
#   forward 2·T·M = 5.242e12, input gradients as much, weight gradients as much: 3 × 5.242e12 = 15.726e12
#   attention 4·T·s·h per block forward (s = 512, h = 2048, 24 blocks) = 0.206e12, twice that backward: 0.618e12
#   in all 16.344e12 FLOP; 16.344e12 / 0.101 s = 161.8e12 FLOP/s; / 989e12 (the H200's dense bf16 peak) = 16.4% MFU.
# (tests/test_planner_profiles.py holds NATIVE_1B3_FLOPS to the cost model's own count of that step.)
#: Matmul FLOPs the cost model counts for the H200 run's native 1.3B step at 4×512 (see above).
NATIVE_1B3_FLOPS = 16.344e12
#: That run's measured native step (seconds): one H200, 2026-11-30.
NATIVE_1B3_SECONDS = 0.101
#: The H200's dense bf16 tensor-core peak (NVIDIA's data sheet, without sparsity).
H200_PEAK_FLOPS = 989e12
#: The model FLOPs utilisation that run achieved (~0.164): what each profile assumes of its own peak. A larger model's
#: wider matmuls usually run nearer peak, so for 7–8B shapes this errs on the slow side; a GPU run will tell (owed).
ACHIEVED_MFU = NATIVE_1B3_FLOPS / NATIVE_1B3_SECONDS / H200_PEAK_FLOPS
#: Each profile's dense bf16 peak (FP32 accumulation, as torch's bf16 matmuls run): the H200's data sheet; the RTX
#: 4090's 165.2 TFLOP/s (Ada's whitepaper, GeForce rate with FP32 accumulate); the 4 GiB laptop GPU taken as an RTX
#: 3050 Ti Laptop (GA107, 80 tensor cores × 128 FLOP a clock with FP32 accumulation × 1.695 GHz boost = 17.4e12;
#: its 128-bit GDDR6 gives the profile's 190 GB/s).
PEAK_FLOPS = {"h200": H200_PEAK_FLOPS, "rtx4090": 165.2e12, "laptop-4gb": 17.4e12}


def _profile(key: str, label: str, memory_note: str, **figures: float) -> Hardware:
    """A named profile whose matmul rate is :data:`ACHIEVED_MFU` of its peak, said in its name (the plan's table)."""
    peak = PEAK_FLOPS[key]
    rate = ACHIEVED_MFU * peak
    name = (f"{label} (assumed: {rate / 1e12:.3g} TFLOP/s = {ACHIEVED_MFU:.1%} of its {peak / 1e12:.3g} TFLOP/s bf16 "
            f"peak, the MFU of the H200 run of 2026-11-30; {memory_note})")
    return Hardware(name, "cuda", rate, measured=False, **figures)


#: Named hardware, assumed (not measured): plan for a machine you do not have. Matmul rates are :data:`ACHIEVED_MFU`
#: of each chip's dense bf16 peak (:data:`PEAK_FLOPS`), links what pinned copies reach on their PCIe generation,
#: host Adam ~4× this project's 2-core figure for a 16-core host, the engine's fixed cost per tensor a guess.
PROFILES: dict[str, Hardware] = {
    "h200": _profile("h200", "NVIDIA H200", "4.8 TB/s, PCIe 5 ~50 GB/s", adam_seconds_per_element=1.2e-10,
                     adam_seconds_per_call=20e-6, host_bandwidth=40e9, device_bandwidth=4.0e12, link_to_host=50e9,
                     link_to_device=50e9, device_memory=141 * 10**9, host_memory=1024 * _GIB,
                     seconds_per_offloaded_tensor=50e-6),
    "rtx4090": _profile("rtx4090", "RTX 4090", "1 TB/s, PCIe 4 ~25 GB/s", adam_seconds_per_element=2.5e-10,
                        adam_seconds_per_call=20e-6, host_bandwidth=25e9, device_bandwidth=0.9e12, link_to_host=25e9,
                        link_to_device=25e9, device_memory=24 * _GIB, host_memory=64 * _GIB,
                        seconds_per_offloaded_tensor=50e-6),
    "laptop-4gb": _profile("laptop-4gb", "4 GiB laptop GPU", "190 GB/s, PCIe 3 ~12 GB/s",
                           adam_seconds_per_element=5e-10, adam_seconds_per_call=30e-6, host_bandwidth=15e9,
                           device_bandwidth=0.19e12, link_to_host=12e9, link_to_device=12e9,
                           device_memory=4 * _GIB, host_memory=16 * _GIB, seconds_per_offloaded_tensor=80e-6),
}


def _best_seconds(work: Callable[[], object], repeats: int, synchronize: Callable[[], None] = lambda: None) -> float:
    """The shortest of ``repeats`` timings of ``work`` after one warm-up (the machine at its quietest)."""
    work()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _adam_rates() -> tuple[float, float]:
    """Host fused Adam seconds per element (a 4M-element tensor) and per call (a 64-element one)."""
    def stepper(numel: int) -> Callable[[], object]:
        param = torch.zeros(numel, requires_grad=True)
        param.grad = torch.full((numel,), 1e-3)
        adam = torch.optim.Adam([param], fused=True)
        return adam.step
    small = _best_seconds(stepper(64), 20)
    large = _best_seconds(stepper(1 << 22), 3)
    return max(large - small, 1e-12) / (1 << 22), small


def _offload_overhead(device: torch.device, per_call: float) -> float:
    """The engine's fixed cost per offloaded tensor and step: a stack of small projected Linears stepped by the engine
    against the same stack under one fused AdamW, the difference per layer less one Adam call (counted apart)."""
    from lightning_offload.setup.engine import Placements, build_engine  # the engine itself, as every face builds it
    from lightning_offload.setup.settings import OffloadSettings

    layers, width = 8, 128

    def stepper(offloaded: bool) -> tuple[Callable[[], object], Callable[[], None]]:
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers))).to(device)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
        inputs = torch.randn(16, width, device=device)
        settings = OffloadSettings(rank=0.25, density=4)
        setup = build_engine(model, adamw, settings, Placements.of(settings), device, "calibration", lambda m: None,
                             lambda m: None) if offloaded else None
        optimizer = setup.optimizer if setup is not None else adamw

        def step() -> None:
            def closure() -> torch.Tensor:
                loss = model(inputs).square().mean()
                loss.backward()
                return loss
            optimizer.step(closure)
            optimizer.zero_grad(set_to_none=True)
        return step, (setup.release if setup is not None else (lambda: None))

    timings = []
    for offloaded in (False, True):
        step, release = stepper(offloaded)
        try:
            timings.append(_best_seconds(step, 5, _sync(device)))
        finally:
            release()
    return max(0.0, (timings[1] - timings[0]) / layers - per_call)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure(device: torch.device, dtype: torch.dtype) -> Hardware:
    """Measure this machine's speeds on ``device`` in ``dtype`` (about a second on a CPU)."""
    sync = _sync(device)
    n = 1024 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    matmul = 2 * n**3 / _best_seconds(lambda: a @ b, 3, sync)
    per_element, per_call = _adam_rates()
    source, target = torch.randn(1 << 24), torch.empty(1 << 24)
    host_bandwidth = 2 * source.nbytes / _best_seconds(lambda: target.copy_(source), 3)
    overhead = _offload_overhead(device, per_call)
    name = _cpu_name()
    if device.type != "cuda":
        return Hardware(name, "cpu", matmul, per_element, per_call, host_bandwidth, host_bandwidth,
                        host_bandwidth, host_bandwidth, 0, host_memory(), overhead)
    pinned = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(1 << 26, dtype=torch.uint8, device=device)
    to_device = pinned.nbytes / _best_seconds(lambda: on_device.copy_(pinned, non_blocking=True), 3, sync)
    to_host = pinned.nbytes / _best_seconds(lambda: pinned.copy_(on_device, non_blocking=True), 3, sync)
    other = torch.empty_like(on_device)
    device_bandwidth = 2 * on_device.nbytes / _best_seconds(lambda: other.copy_(on_device), 3, sync)
    gpu = torch.cuda.get_device_properties(device)
    return Hardware(f"{gpu.name}; host {name}", "cuda", matmul, per_element, per_call, host_bandwidth,
                    device_bandwidth, to_host, to_device, gpu.total_memory, host_memory(), overhead)


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), cores and torch's version."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}"


def host_memory() -> int:
    """This machine's memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


#: Figures of two measurements that differ by more than this factor disagree: the machine was busy during one.
AGREEMENT = 1.5
#: Measurements taken, at most, to find two that agree.
MEASUREMENTS = 3
# Each figure of a Hardware a measurement sets, with whether larger is faster and the smallest value told apart
# (the engine's overhead per tensor may measure as 0: below a microsecond, two figures agree).
_FIGURES = {"matmul_flops": (True, 1.0), "adam_seconds_per_element": (False, 1e-15),
            "adam_seconds_per_call": (False, 1e-9), "host_bandwidth": (True, 1.0), "device_bandwidth": (True, 1.0),
            "link_to_host": (True, 1.0), "link_to_device": (True, 1.0), "seconds_per_offloaded_tensor": (False, 1e-6)}


def _agree(first: Hardware, second: Hardware) -> bool:
    """Whether every figure of two measurements lies within :data:`AGREEMENT` of the other's."""
    for name, (_, floor) in _FIGURES.items():
        a, b = max(getattr(first, name), floor), max(getattr(second, name), floor)
        if max(a, b) > AGREEMENT * min(a, b):
            return False
    return True


def _fastest(measured: list[Hardware]) -> Hardware:
    """Each figure at its fastest over ``measured`` (each is already the best of its repeats: the quietest)."""
    best = {name: (max if larger else min)(getattr(h, name) for h in measured)
            for name, (larger, _) in _FIGURES.items()}
    return replace(measured[0], **best)


def measure_agreed(device: torch.device, dtype: torch.dtype) -> tuple[Hardware, bool]:
    """Measure until two measurements agree (at most :data:`MEASUREMENTS`); the figures of the agreeing pair at their
    fastest, and whether two agreed (``False``: the machine stayed busy; the fastest of all, not to be kept)."""
    taken = [measure(device, dtype)]
    while len(taken) < MEASUREMENTS:
        taken.append(measure(device, dtype))
        agreeing = [h for h in taken[:-1] if _agree(h, taken[-1])]
        if agreeing:
            return _fastest([agreeing[0], taken[-1]]), True
    return _fastest(taken), False


def calibrate(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
              cache: bool = True) -> Hardware:
    """This machine's speeds on ``device`` (``None``: CUDA when present, else the CPU) in ``dtype``: measured until
    two measurements agree (a busy machine's one-off figures are not kept for good) and kept in
    ``<cache root>/planning/`` per machine, device, dtype and thread count. Where none agree, the fastest figures
    serve this call and nothing is kept (said in the log).

    Args:
        device: the training device.
        dtype: the compute dtype (matmuls are measured in it).
        cache: read and write the cached figures (``False``: measure now, keep nothing).
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    key = f"{_cpu_name()}|{device.type}|{dtype}|v{CALIBRATION_VERSION}"
    if device.type == "cuda":
        key += f"|{torch.cuda.get_device_name(device)}"
    path = cache_root() / "planning" / "calibration.json"
    stored: dict[str, dict] = {}
    if cache and path.is_file():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}  # an unreadable cache is measured anew
        if key in stored:
            return Hardware(**stored[key])
    hardware, agreed = measure_agreed(device, dtype)
    if not agreed:
        log.warning("The planner's calibration of this machine disagreed with itself over %d measurements (the "
                    "machine is busy): its fastest figures serve this plan, and it is measured again next time.",
                    MEASUREMENTS)
    if cache and agreed:
        stored[key] = asdict(hardware)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(stored, indent=1))
        partial.replace(path)
    return hardware


def simulated_machine(spec: LinkSpec, dtype: torch.dtype = torch.float32, split: ThreadSplit | None = None,
                      cache: bool = True) -> Hardware:
    """This CPU as the engine runs it behind the simulated link ``spec``: the device's matmuls and the engine's cost
    per tensor measured at the device's threads, the host's Adam at the host worker's, the link at ``spec``'s
    bandwidth each way, and the parts overlapping (:attr:`Hardware.overlaps`).

    Args:
        spec: the simulated link.
        dtype: the compute dtype.
        split: the cores of the device and of the host (default: :meth:`ThreadSplit.halves`, as the engine splits).
        cache: read and write the calibrations kept per thread count.
    """
    split = split if split is not None else ThreadSplit.halves()
    device_threads, host_threads = (len(split.device_cpus), len(split.host_cpus)) if split is not None else (1, 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(device_threads)
        device = calibrate("cpu", dtype, cache)
        torch.set_num_threads(host_threads)
        host = calibrate("cpu", dtype, cache)
    finally:
        torch.set_num_threads(threads)
    return replace(device, name=f"{device.name}; device on {device_threads} thread(s), host Adam on {host_threads}, "
                                f"behind a simulated link of {spec.describe()}",
                   adam_seconds_per_element=host.adam_seconds_per_element,
                   adam_seconds_per_call=host.adam_seconds_per_call, link_to_host=spec.gbps * 1e9,
                   link_to_device=spec.gbps * 1e9, simulated_link=True)


def hardware(profile: str | Hardware | None, device: torch.device | str | None, dtype: torch.dtype) -> Hardware:
    """The hardware a plan predicts for: a :class:`Hardware`, a name in :data:`PROFILES`, or ``None`` (this machine,
    calibrated).

    Raises:
        ValueError: for an unknown profile name, naming the known ones.
    """
    if isinstance(profile, Hardware):
        return profile
    if profile is None:
        spec = spec_from_environment()
        if spec is not None and torch.device(device if device is not None else "cpu").type == "cpu" \
                and not torch.cuda.is_available():
            return simulated_machine(spec, dtype)  # what the engine sets up on this machine now
        return calibrate(device, dtype)
    if profile not in PROFILES:
        raise ValueError(f"hardware={profile!r} is not a known profile; use one of {sorted(PROFILES)}, a Hardware "
                         f"value, or None to calibrate this machine.")
    return PROFILES[profile]
