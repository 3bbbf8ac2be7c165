"""The step-time cost model: device compute, link, host Adam and the part that cannot overlap, from a run's inventory
and the machine's speeds.

- **Device compute.** Matmuls: ``2·T`` FLOPs per weight element forward, as much again for the input gradients, and
  for each weight whose gradient autograd forms (dense, device, scaled) as much again for it; attention
  ``4·T·s·h`` per block forward and twice that backward. A projected weight's gradient GEMM is replaced by the
  products of ``lsp/linear.py`` (``B Xᵀ`` in forward, ``A Δᵀ`` in backward, then a ``d_o × d_i`` GEMM), and its
  update is expanded and added on the device: the products' time comes timed per shape by the kernels a run chooses
  (:mod:`~lightning_offload.planning.projection_time`), the GEMM's from its FLOPs.
  Gradient checkpointing runs the blocks' forward twice. A plain run adds its device AdamW. The FLOPs run at the
  hardware's ``matmul_flops``: measured on this machine, or for a named profile an achieved rate (the chip's peak
  times the MFU the H200 run of 2026-11-30 reached, :data:`~lightning_offload.planning.calibration.ACHIEVED_MFU`),
  because the model's elementwise work, its loss and its launches are not counted apart.
- **Link.** Bytes each way over the calibrated pinned-copy bandwidth (on the CPU, memcpy).
- **Host.** One fused Adam call per tensor (per-call cost) plus its elements; row-sparse embeddings' rows at twice the
  per-element cost (gathered, caught up, scattered), MEFT's rows likewise (both factors assumed, not measured).
- **Overlap.** On the CPU the "device" and the host share the cores and the engine runs host jobs inline, so the parts
  add. On a GPU (and on the CPU behind the simulated link, the host on cores of its own) the layer-wise pipeline
  overlaps them: speculative host steps (the GPU default) start during backward,
  so a step takes the longest of the device's compute and the forward followed by the link's or the host's work, plus a
  tail (the largest tensor's host step and copies, the embedding's that arrives last and is needed first:
  docs/design.md, "The layer-wise pipeline"); without speculation the host and link work overlap the next forward
  only.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_offload.planning.calibration import Hardware
from lightning_offload.planning.inventory import Entry, Inventory

#: Host Adam work per element of a gathered row step relative to the fused kernel on a whole tensor.
ROW_STEP_FACTOR = 2.0
#: MEFT's block row Adam per element relative to fused Adam on a whole tensor. Assumed, not measured here: the lazy row
#: Adam measured 25–30× on the H200 host (docs/benchmarks/2026-11-30.md); the block Adam since steps whole blocks in
#: place, in one pass.
MEFT_ROW_FACTOR = 2.0
#: Bytes a device AdamW reads and writes per element (weight, gradient, two moments; in and out where written).
DEVICE_ADAM_BYTES = 28


@dataclass(frozen=True)
class Workload:
    """The shape of one step's device work.

    Attributes:
        tokens: tokens per step (batch × sequence length).
        seq_len: tokens per sequence (attention's quadratic term).
        hidden: the model's hidden size.
        blocks: transformer blocks.
        matmul_elements: elements of every Linear/Conv1D weight (the head included).
        formed_elements: elements of the Linear/Conv1D weights whose full gradient autograd forms (trained and not
            projected: the weight-gradient GEMM runs for them).
        checkpointing: gradient checkpointing on.
        recomputed_elements: elements of the weights whose forward product runs again in backward (the output head
            under the chunked loss, which recomputes each chunk's logits).
    """

    tokens: int
    seq_len: int
    hidden: int
    blocks: int
    matmul_elements: int
    formed_elements: int
    checkpointing: bool
    recomputed_elements: int = 0


@dataclass(frozen=True)
class StepTime:
    """A predicted step and its parts (seconds).

    Attributes:
        device: device compute (forward, backward, projections, updates applied; a plain run's AdamW).
        link: copies over the link, both directions.
        host: host Adam.
        exposed: what does not overlap the device's compute (the step minus ``device``).
        step: the predicted step.
        flops: the matmul FLOPs ``device`` counts (:func:`device_flops`); over the hardware's ``matmul_flops`` they
            are its matmul part.
    """

    device: float
    link: float
    host: float
    exposed: float
    step: float
    flops: float = 0.0


def forward_flops(work: Workload) -> float:
    """Matmul FLOPs of one forward: ``2·T`` per weight element and attention's ``4·T·s·h`` per block."""
    return 2 * work.tokens * work.matmul_elements + 4 * work.tokens * work.seq_len * work.hidden * work.blocks


def device_flops(found: Inventory, work: Workload) -> float:
    """Matmul FLOPs of a step on the device: the forward (twice under checkpointing), the input gradients (attention
    twice its forward), the weight gradients autograd forms, a projected head's recomputed logits and each projected
    weight's ``S`` GEMM.

    Args:
        found: the run's inventory (its projected weights).
        work: the step's shape.
    """
    attention = 4 * work.tokens * work.seq_len * work.hidden * work.blocks
    forward = forward_flops(work)
    flops = forward + (2 * work.tokens * work.matmul_elements + 2 * attention) + 2 * work.tokens * work.formed_elements
    if work.checkpointing:
        flops += forward
    flops += 2 * work.tokens * work.recomputed_elements
    flops += sum(2 * work.tokens * e.host_numel for e in found.of("projected"))  # S = (AΔᵀ)(BXᵀ)ᵀ
    return float(flops)


def device_seconds(found: Inventory, work: Workload, hw: Hardware, plain: bool,
                   projections: float) -> tuple[float, float]:
    """Device compute of a step: ``(total, forward)`` seconds (``projections``: the projected weights' products,
    :func:`~lightning_offload.planning.projection_time.projection_seconds`). The matmuls run at ``hw.matmul_flops``,
    which for a named profile is an achieved rate (its peak times a measured MFU), since nothing else of the model's
    own work is counted."""
    seconds = device_flops(found, work) / hw.matmul_flops + projections
    # A scaled weight's update: one pass over the weight (read it, the update, write it).
    seconds += sum(3 * e.numel * e.itemsize for e in found.of("scaled")) / hw.device_bandwidth
    if not plain:  # the engine's fixed cost per offloaded tensor (hooks, sends, the slot's step, Python)
        seconds += len(found.of("projected", "scaled", "dense", "rows")) * hw.seconds_per_offloaded_tensor
    if plain or found.of("device"):
        stepped = found.entries if plain else found.of("device")
        elements = sum(e.numel for e in stepped)
        if hw.device == "cpu":  # torch's fused AdamW on the CPU is the host's kernel
            calls = 1 if plain else len(stepped)  # a plain run's fused AdamW steps its whole group in one call
            seconds += calls * hw.adam_seconds_per_call + elements * hw.adam_seconds_per_element
        else:
            seconds += elements * DEVICE_ADAM_BYTES / hw.device_bandwidth
    return seconds, forward_flops(work) / hw.matmul_flops


def host_seconds(entries: list[Entry], hw: Hardware, rows_touched: int,
                 meft_row_elements: int = 0) -> tuple[float, float]:
    """Host Adam of a step: ``(total, largest single tensor)`` seconds (``rows_touched``: a row-sparse embedding's
    rows per step; ``meft_row_elements``: MEFT's row elements stepped)."""
    def one(entry: Entry) -> float:
        elements = entry.host_numel if entry.kind != "rows" else \
            min(rows_touched, entry.shape[0]) * entry.shape[1] * ROW_STEP_FACTOR
        return hw.adam_seconds_per_call + elements * hw.adam_seconds_per_element
    times = [one(e) for e in entries if e.kind in ("dense", "projected", "scaled", "rows")]
    meft = meft_row_elements * MEFT_ROW_FACTOR * hw.adam_seconds_per_element
    return sum(times) + meft, max(times, default=0.0)


def step_time(device: float, forward: float, host: float, largest_host: float, to_host: int, to_device: int,
              largest_link: int, hw: Hardware, plain: bool, speculative: bool, flops: float = 0.0,
              pipelined: bool = True, held_back: int = 0) -> StepTime:
    """Combine the parts into a step (see the module docstring for the overlap rules; ``flops``: the matmul FLOPs
    ``device`` counts, kept with the step; ``pipelined=False``: every update applied inside the step;
    ``held_back``: bytes of ``to_device`` a speculative step holds back until the step's decision, the dense values,
    which cross during the next forward)."""
    if plain:
        return StepTime(device, 0.0, 0.0, 0.0, device, flops)
    if not hw.overlaps:
        link = (to_host + to_device) / hw.host_bandwidth
        return StepTime(device, link, host, link + host, device + link + host, flops)
    link = max(to_host / hw.link_to_host, to_device / hw.link_to_device)
    tail = largest_host + largest_link / hw.link_to_host + largest_link / hw.link_to_device
    if not pipelined:
        # Gradients still cross during backward; the host steps start after it, each update crossing back as its
        # step ends, and the step returns once every update is applied: the host's work or the copies back, whichever
        # is longer, lies on the step, and what of the copies to the host backward did not hide.
        backward = device - forward
        step = device + max(0.0, to_host / hw.link_to_host - backward) + max(host, to_device / hw.link_to_device) \
            + tail
        return StepTime(device, link, host, step - device, step, flops)
    if speculative:
        # Host steps and copies start as each gradient lands, so during backward: the copies to the host cannot begin
        # before the forward has run, and whichever of them, the host's work or the device's own lasts longest sets
        # the step, plus the tail of the first layer's gradient, produced last and needed first.
        # Dense values wait for the decision (they are written into the weights): they cross during the next forward.
        late = max(0.0, held_back / hw.link_to_device - forward)
        step = max(device + late, forward + link, forward + host) + tail
    else:  # host work starts after backward; it overlaps the next forward only
        step = device + max(0.0, host + link - forward) + tail
    return StepTime(device, link, host, step - device, step, flops)
