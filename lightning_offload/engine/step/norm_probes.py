"""Each step's measurement of the projected layers' ``ρ = ‖S‖/‖G‖`` from the probes of its backward
(:mod:`lightning_offload.lsp.norm_probe`): called once per taken step, after the step's global norm and before its
compressed gradients are released, by :class:`~lightning_offload.engine.step.orchestrator.StepOrchestrator`.

With data parallelism ``S`` is reduced to its owner (the mean over ranks) and ``G z`` exists per rank: one all-reduce
of every probed layer's ``G z`` and of ``‖S‖²`` (each owner's, zeros elsewhere) gives every rank the same figures of
the reduced gradient, so every rank keeps the same ``ρ``, as the checkpoint rank 0 writes must.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.slots.slot import Clip, Slot
from lightning_offload.lsp.norm_probe import pooled_ratio


@torch.no_grad()
def measure_norm_ratios(slots: Sequence[Slot], ranks: RankShards | None, clip: Clip) -> None:
    """Add this step's ``‖S‖²`` and ``‖G z‖²/m`` to each probed layer's averages, replace the ``ρ`` of every layer
    measured long enough by the averages' ratio, and say whether the next step probes (after a step clipped by norm,
    and at a sparser cadence without: :data:`~lightning_offload.lsp.norm_probe.UNCLIPPED_EVERY`).

    Args:
        slots: the engine's slots (projected ones are measured).
        ranks: the ranks of data parallelism, or ``None``.
        clip: the clipping this step asked for (before it was found to be a no-op).
    """
    projected = [slot for slot in slots if slot.layer is not None]
    probed = [slot for slot in projected if slot.layer.has_grad and slot.layer.norm_probe.sketch is not None]
    if probed:
        _record(probed, ranks)
        ready = [slot.layer for slot in probed if slot.layer.norm_probe.ready()]
        if ready:
            # One read of the device for every layer (the step has just read its norm from there anyway).
            for layer, sums in zip(ready, torch.stack([layer.norm_probe.sums for layer in ready]).tolist()):
                ratio = pooled_ratio(sums)
                if ratio > 0:  # nan (no usable gradient yet) keeps the ρ in use
                    layer.norm_ratio = ratio
    clipped_by_norm = clip is not None and clip[0] == "norm"
    for slot in projected:
        slot.layer.norm_probe.next_step(clipped_by_norm)


def _record(probed: list[Slot], ranks: RankShards | None) -> None:
    """Add ``[‖S‖², ‖G z‖²/m]`` of the step to each probed layer's averages (no host read)."""
    sketches = [slot.layer.norm_probe.sketch for slot in probed]
    if ranks is None:
        squares = torch.stack(torch._foreach_norm([slot.layer.grad_buffer for slot in probed])).square()
    else:
        # Owners hold the reduced S; the other ranks' S is their own share, which does not count.
        owned = [slot.layer.grad_buffer.square().sum() if slot.owned else slot.layer.grad_buffer.new_zeros(())
                 for slot in probed]
        vector = torch.cat([torch.stack(owned), *[sketch.reshape(-1) for sketch in sketches]])
        ranks.all_reduce_(vector)
        squares = vector[:len(probed)]
        parts = vector[len(probed):].split([sketch.numel() for sketch in sketches])
        sketches = [part.view_as(sketch).div_(ranks.world) for part, sketch in zip(parts, sketches)]
    # Every sketch has the m columns its probes were drawn with (one setting for all layers).
    probed_squares = torch.stack(torch._foreach_norm(sketches)).square().div_(sketches[0].shape[1])
    figures: Tensor = torch.stack([squares, probed_squares], dim=1)
    for slot, row in zip(probed, figures.unbind(0)):
        slot.layer.norm_probe.record(row)
