"""Which kernel runs each product: measured on the user's own device, once per distinct product, and kept.

A projected layer's three products (:mod:`.candidates`) have several kernels whose speeds depend on the device, the
shape and the layout (on one 2-core CPU the fastest changed with the width: docs/benchmarks/2026-12-04.md). So
the kernel of each distinct product — (which product, its sizes, the input's dtype, the device) — is chosen by
timing every kernel that applies on the first call, on that call's own operands (a copy of the weight for the
in-place update, and a generator of its own, so that timing changes neither the weight nor the layer's rounding).
The choice is logged once and kept: in the process, and on disk per machine (``<cache root>/kernels/``), so a later
run on the same machine starts with it. ``kernels=`` forces one kernel (where it cannot run here, torch's CSR
product is used and a warning says so); ``"auto"`` (the default) never uses a kernel it has not timed here, but
for a product whose trial cannot fit in memory.

A trial must not exhaust the machine: a kernel whose own working set (the ``dense`` kernel's projector, 23 GB for a
projected 152K head) exceeds a share of the device's free memory (:mod:`.memory_budget`) is neither tried nor used,
and the choice records why. Where not even the trial's copy of an updated weight fits, the product runs untimed on
the first of :data:`UNTIMED_ORDER` that runs here, said in a warning.

Kernels agree within fp32 summation-order rounding (bf16 weights: within their stochastic rounding), so a choice
changes results only at that level; a run that must repeat bit for bit on another machine forces one kernel.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_offload.cache import cache_root
from lightning_offload.lsp.kernels.build import cpu_features
from lightning_offload.lsp.kernels.candidates import KERNELS, ProjectionKernel
from lightning_offload.lsp.kernels.memory_budget import TRIAL_SHARE, trial_budget_bytes
from lightning_offload.lsp.projector import SparseProjector

log = logging.getLogger("lightning_offload")

#: What ``kernels=`` takes: ``"auto"`` (timed here) or one kernel's name.
KERNEL_POLICIES = ("auto", *KERNELS)
#: Timed calls of each kernel per product, interleaved round by round so that machine noise hits each alike.
_ROUNDS = 3
#: Bump when the kernels change: choices kept on disk for older kernels are timed anew (2: each kept with its time).
_CHOICES_VERSION = 2
#: The kernel a product runs on when not even its trial fits in memory (the trial copies an updated weight): the
#: first of these that runs here, none of which allocates a working set of its own.
UNTIMED_ORDER = ("native", "triton", "csr")


@dataclass
class Choice:
    """The kernel chosen for one product and what the timing saw.

    Attributes:
        kernel: the chosen kernel's name.
        milliseconds: each timed kernel's milliseconds (the fastest of its rounds); read from disk, the chosen
            kernel's alone; empty when forced, unless the selector measures forced kernels.
        how: ``"timed"``, ``"cached"`` (read from this machine's choices), ``"forced"``, ``"rank 0's"`` (under
            data parallelism, an update's kernel as rank 0 chose it) or ``"untimed"`` (no trial fits the memory
            budget: the first of :data:`UNTIMED_ORDER` that runs here).
        not_tried: kernels left out because their working set exceeds the memory budget, each with why.
    """

    kernel: str
    milliseconds: dict[str, float] = field(default_factory=dict)
    how: str = "timed"
    not_tried: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryBudget:
    """What one product's kernel trial may allocate (:mod:`.memory_budget`).

    Attributes:
        bytes: the budget: a share of the device's free memory.
        trial: bytes the trial itself allocates for any kernel (the update's copy of the weight).
        working: each kernel's own working set for this product (a dense projector).
    """

    bytes: int
    trial: int
    working: Callable[[ProjectionKernel], int]

    def why(self, kernel: ProjectionKernel) -> str:
        """Why ``kernel`` is not tried, in words."""
        return (f"needs {_gib(self.working(kernel) + self.trial)} of the {_gib(self.bytes)} this device can spare "
                f"({TRIAL_SHARE:.0%} of its free memory)")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def validate_policy(policy: str) -> str:
    """``policy`` when it names a kernel policy.

    Raises:
        ValueError: naming the bad value and the valid ones.
    """
    if policy not in KERNEL_POLICIES:
        raise ValueError(f"kernels={policy!r} is not a kernel policy; use one of {', '.join(KERNEL_POLICIES)} "
                         f"('auto' times each kernel on this device and uses the fastest).")
    return policy


class KernelSelector:
    """The kernels of one engine's projected layers: each distinct product's kernel, chosen on its first call.

    Args:
        policy: ``"auto"`` or a kernel's name (:data:`KERNEL_POLICIES`).
        persist: read and write this machine's choices on disk (``False``: time in this process only).
        measure: time a forced kernel too (the planner's use: it predicts a run's projections from these times).

    Example::

        selector = KernelSelector("auto")
        y = selector.compress_tokens(projector, x)   # the first call of this shape times csr, dense and native
        selector.choices                              # {'compress_tokens n=1024 d=256 r=8 T=1024 float32 cpu': ...}
    """

    def __init__(self, policy: str = "auto", persist: bool = True, measure: bool = False) -> None:
        self.policy = validate_policy(policy)
        self.persist = persist
        self.measure = measure
        self.choices: dict[str, Choice] = {}
        #: Distinct products per chosen kernel (a live figure the engine's telemetry logs as
        #: ``offload/kernel_products/<kernel>``).
        self.products: dict[str, int] = {}
        #: Under data parallelism, rank 0's choice handed to every rank (set by the engine's set-up): each rank applies
        #: the same update to its replica, and only the same kernel rounds it alike on every rank.
        self.agree: Callable[[str], str] | None = None
        # Each product's kernel by its sizes as a tuple: a step looks one up per product and layer, and the key's
        # text (what the choices and the log show) is built only for a product not chosen yet.
        self._kernels: dict[tuple, ProjectionKernel] = {}

    # ------------------------------------------------------------------------------------------- the products
    def compress_tokens(self, projector: SparseProjector, x: Tensor) -> Tensor:
        """``P · xᵀ`` (``d × T``) by the kernel chosen for this product."""
        sizes = dict(n=projector.dim_in, d=projector.dim_out, r=projector.nnz_per_column, T=x.shape[0])
        kernel = self._kernel("compress_tokens", sizes, x, lambda k: k.compress_tokens(projector, x), projector)
        return kernel.compress_tokens(projector, x)

    def expand_columns(self, projector: SparseProjector, matrix: Tensor) -> Tensor:
        """``matrix · P`` (``k × n`` fp32) by the kernel chosen for this product."""
        sizes = dict(n=projector.dim_in, d=projector.dim_out, r=projector.nnz_per_column, k=matrix.shape[0])
        kernel = self._kernel("expand_columns", sizes, matrix, lambda k: k.expand_columns(projector, matrix),
                              projector)
        return kernel.expand_columns(projector, matrix)

    def update_rows_(self, weight: Tensor, projector: SparseProjector, half: Tensor, decay: float,
                     generator: torch.Generator | None) -> None:
        """``weight ← weight·decay + Pᵀ·half`` in place by the kernel chosen for this product."""
        sizes = dict(rows=weight.shape[0], cols=weight.shape[1], d=projector.dim_out, r=projector.nnz_per_column)

        def timed(kernel: ProjectionKernel) -> None:
            # On a copy, with a generator of its own: timing must leave the weight and the layer's rounding alone.
            scratch = weight.detach().clone()
            own = torch.Generator(device=weight.device).manual_seed(0)
            kernel.update_rows_(scratch, projector, half, decay, own)

        # The trial's own copy of the weight counts against the memory budget of every candidate.
        self._kernel("update_rows", sizes, weight, timed, projector,
                     trial_bytes=weight.numel() * weight.element_size()).update_rows_(weight, projector, half, decay,
                                                                                      generator)

    # --------------------------------------------------------------------------------------------- choosing
    def _kernel(self, product: str, sizes: dict[str, int], operand: Tensor, call: Callable[[ProjectionKernel], Any],
                projector: SparseProjector, trial_bytes: int = 0) -> ProjectionKernel:
        device = operand.device
        shape = (product, *sizes.values(), operand.dtype, device)
        kernel = self._kernels.get(shape)
        if kernel is None:
            key = _key(product, device, operand.dtype, **sizes)
            budget = MemoryBudget(trial_budget_bytes(device), trial_bytes,
                                  lambda k: k.working_bytes(product, projector, operand))
            choice = self._choose(key, device, operand.dtype, call, budget)
            if self.agree is not None and not key.startswith("compress_tokens"):
                # Compressed gradients are summed between ranks whatever rounds them; an update must round alike.
                choice = Choice(self.agree(choice.kernel), choice.milliseconds, "rank 0's")
                if not KERNELS[choice.kernel].applies(device) or not KERNELS[choice.kernel].takes(operand.dtype):
                    raise RuntimeError(f"Rank 0 applies {key} with the {choice.kernel!r} kernel, which cannot run on "
                                       f"this rank's {device}; every rank must round an update alike. Pass "
                                       f"kernels='csr' (runs everywhere) to the strategy.")
            self.choices[key] = choice
            self.products[choice.kernel] = self.products.get(choice.kernel, 0) + 1
            kernel = self._kernels[shape] = KERNELS[choice.kernel]
            if choice.kernel != "csr":
                # Timing the CSR kernel built CSR forms of the projector that only it reads: not kept for nothing
                # (a product of this projector that runs on csr builds them again, once).
                projector.release_products()
        return kernel

    def _choose(self, key: str, device: torch.device, dtype: torch.dtype,
                call: Callable[[ProjectionKernel], Any], budget: MemoryBudget) -> Choice:
        if self.policy != "auto":
            forced = KERNELS[self.policy]
            if not forced.applies(device):
                warnings.warn(f"kernels={self.policy!r} cannot run on {device} here (see the log for why); the "
                              f"projections use torch's CSR kernels ('csr') instead.", stacklevel=4)
                self.policy = "csr"
                return Choice("csr", how="forced")
            if not forced.takes(dtype):
                # Only this product's dtype is refused: products of the dtypes it takes keep the forced kernel.
                warnings.warn(f"kernels={self.policy!r} does not take {dtype} operands ({key}); that product uses "
                              f"torch's CSR kernels ('csr').", stacklevel=4)
                return Choice("csr", how="forced")
            if budget.working(forced) > budget.bytes:
                # Its use, not only its trial, would take that memory at every step.
                warnings.warn(f"kernels={self.policy!r} would allocate {_gib(budget.working(forced))} for {key}, "
                              f"over the {_gib(budget.bytes)} this device can spare ({TRIAL_SHARE:.0%} of its free "
                              f"memory); that product uses torch's CSR kernels ('csr').", stacklevel=4)
                return Choice("csr", how="forced", not_tried={forced.name: budget.why(forced)})
            timed = _time_kernels([forced], device, call).milliseconds if self.measure else {}
            return Choice(forced.name, timed, how="forced")
        usable = [k for k in KERNELS.values() if k.applies(device) and k.takes(dtype)]
        not_tried = {k.name: budget.why(k) for k in usable if budget.working(k) > budget.bytes}
        fitting = [k for k in usable if k.name not in not_tried]
        stored = _stored_choices().get(key) if self.persist else None
        if stored is not None and stored.get("kernel") in {k.name for k in fitting}:
            return Choice(stored["kernel"], {stored["kernel"]: stored["ms"]}, how="cached", not_tried=not_tried)
        trials = [k for k in fitting if budget.working(k) + budget.trial <= budget.bytes]
        if not trials:
            # Not even the trial's copy fits: no timing, a kernel that allocates nothing of its own.
            kernel = next((KERNELS[name] for name in UNTIMED_ORDER if KERNELS[name] in fitting), KERNELS["csr"])
            log.warning("lightning_offload kernels: %s -> %s, untimed: a trial would copy %s, over the %s this device "
                        "can spare", key, kernel.name, _gib(budget.trial), _gib(budget.bytes))
            return Choice(kernel.name, how="untimed", not_tried={k.name: budget.why(k) for k in usable})
        not_tried.update({k.name: budget.why(k) for k in fitting if k not in trials})
        choice = _time_kernels(trials, device, call)
        choice.not_tried = not_tried
        log.info("lightning_offload kernels: %s -> %s (%s)%s", key, choice.kernel,
                 ", ".join(f"{name} {ms:.3f} ms" for name, ms in choice.milliseconds.items()),
                 "".join(f"; {name} not tried: {why}" for name, why in not_tried.items()))
        if self.persist:
            _store_choice(key, choice.kernel, choice.milliseconds[choice.kernel])
        return choice

    def summary(self) -> dict[str, str]:
        """Each product's chosen kernel (its key to the kernel's name), for the run's record."""
        return {key: choice.kernel for key, choice in self.choices.items()}

    def milliseconds(self, key: str) -> float | None:
        """The time of the kernel chosen for the product ``key`` as timed on this device (here or in an earlier run
        kept on disk); ``None`` when it was forced unmeasured or is not chosen yet."""
        choice = self.choices.get(key)
        return None if choice is None else choice.milliseconds.get(choice.kernel)


def kernel_choices(layers: Iterable[Any]) -> dict[str, str]:
    """The chosen kernel of every distinct product of ``layers`` (projected weights; others are skipped), by product:
    what a run's summary records as ``kernels``."""
    chosen: dict[str, str] = {}
    for layer in layers:
        selector = getattr(layer, "kernels", None)
        if isinstance(selector, KernelSelector):
            chosen.update(selector.summary())
    return dict(sorted(chosen.items()))


def _key(product: str, device: torch.device, dtype: torch.dtype, **sizes: int) -> str:
    shape = " ".join(f"{name}={value}" for name, value in sizes.items())
    return f"{product} {shape} {str(dtype).removeprefix('torch.')} {device.type}"


def _time_kernels(kernels: list[ProjectionKernel], device: torch.device,
                  call: Callable[[ProjectionKernel], Any]) -> Choice:
    """The fastest of ``kernels`` on ``call`` (median of :data:`_ROUNDS` interleaved calls after one warm-up each); a
    kernel that raises is left out, and said."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    working = []
    for kernel in kernels:
        try:
            call(kernel)  # warm-up: first-call costs (a build, a compile, caches) are not the kernel's speed
            working.append(kernel)
        except (RuntimeError, MemoryError, ValueError) as error:
            log.warning("The projection kernel %r failed on %s (%s); it is not used.", kernel.name, device, error)
    times: dict[str, list[float]] = {kernel.name: [] for kernel in working}
    for _ in range(_ROUNDS):
        for kernel in working:
            synchronize()
            start = time.perf_counter()
            call(kernel)
            synchronize()  # a CUDA launch returns before the kernel ran
            times[kernel.name].append(time.perf_counter() - start)
    # The fastest of the rounds: on a shared machine interference only ever adds time.
    medians = {name: min(seconds) * 1e3 for name, seconds in times.items()}
    # Ties go to the earlier kernel of KERNELS (torch's own first).
    best = min(medians, key=lambda name: (medians[name], list(KERNELS).index(name)))
    return Choice(best, medians)


# ---------------------------------------------------------------------------------------- this machine's choices
def _machine() -> str:
    """What the choices kept on disk are keyed by: the CPU, its instructions, torch's threads and version, the GPU,
    and the kernels' own sources (a changed kernel is timed anew)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    features = hashlib.sha256(cpu_features().encode()).hexdigest()[:16]
    return (f"cpu={features} threads={torch.get_num_threads()} torch={torch.__version__} gpu={gpu} "
            f"kernels={_kernel_sources()} v{_CHOICES_VERSION}")


@functools.lru_cache(maxsize=1)
def _kernel_sources() -> str:
    """A digest of the files that define the kernels (the candidates, the C kernels and their loader, the Triton
    kernels): a change elsewhere, this module's included, keeps the choices."""
    folder = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([folder / "candidates.py", folder / "native.py", folder / "triton_projection.py",
                        *(folder / "native").glob("*.c")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _choices_path() -> Path:
    return cache_root() / "kernels" / "choices.json"


_MEMORY: dict[str, dict[str, dict[str, Any]]] = {}


def _stored_choices() -> dict[str, dict[str, Any]]:
    """This machine's kept choices, each ``{"kernel": name, "ms": its time}`` (read once per process; an unreadable
    file is no choices)."""
    machine = _machine()
    if machine not in _MEMORY:
        try:
            stored = json.loads(_choices_path().read_text())
        except (OSError, ValueError):
            stored = {}
        mine = stored.get(machine, {}) if isinstance(stored, dict) else {}
        _MEMORY[machine] = {key: value for key, value in mine.items()
                            if isinstance(value, dict) and isinstance(value.get("ms"), (int, float))}
    return _MEMORY[machine]


def _store_choice(key: str, kernel: str, milliseconds: float) -> None:
    """Adds one choice and its time to this machine's on disk (written whole to a temporary file, then renamed into
    place)."""
    choices = _stored_choices()
    choices[key] = {"kernel": kernel, "ms": milliseconds}
    path = _choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            everything = json.loads(path.read_text())
        except (OSError, ValueError):
            everything = {}
        everything = everything if isinstance(everything, dict) else {}
        everything[_machine()] = {**everything.get(_machine(), {}), key: choices[key]}
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(everything, indent=1, sort_keys=True))
        os.replace(scratch, path)
    except OSError as error:  # a read-only cache still trains; the next run times again
        log.info("The kernel choices could not be kept in %s (%s).", path, error)
