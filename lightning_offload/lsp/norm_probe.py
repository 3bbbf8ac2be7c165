"""Keeping each projected layer's ``ρ = ‖S‖/‖G‖`` true while training goes on, from the step's own backward.

Gradient clipping estimates a projected weight's full-gradient norm as ``‖S‖/ρ``
(:mod:`lightning_offload.lsp.norm_ratio`). A ``ρ`` measured once, at a fit (or taken as 1 for a random draw), goes
stale: Adam moves the weight only inside the projectors' subspace, which changes how much of each new gradient the
subspace holds, so a ``max_grad_norm`` tuned on AdamW would clip too late or too early.

So the norm of ``G = Δᵀ X`` is measured from the steps' backward, without forming ``G``: a layer draws ``m``
Rademacher probes ``z`` (``i × m``, ``±1``), forward keeps ``X z`` beside ``B X`` and backward forms
``G z = Δᵀ (X z)`` (``o × m``); ``E‖G z‖²/m = ‖G‖²`` for any ``G``, since the probes are independent of the gradient,
which a fixed projector is not. The probes are drawn afresh every step from a generator seeded by the layer's name and
its count of measured steps (every rank, and a resumed run, draws the same ones), and stay the same for every
micro-batch of a step, so ``G z`` accumulates exactly as ``S`` does. Each layer keeps decaying averages of ``‖S‖²``
and ``‖G z‖²/m`` (a step's weight falls by ``1 − 1/16`` per later step); from the 16th measured step on, their ratio's
root replaces ``ρ``. A ratio of averages, because one step's ``‖G z‖²/m`` is noisy and dividing by it biases low; a
short average, because ``ρ`` keeps moving and lag costs more than noise; first used after 16 steps, so the 4-step
golden runs keep the results of unprobed runs bit for bit. The probes run at every step while clipping by norm is in
use and at every :data:`UNCLIPPED_EVERY`-th step otherwise (``grad_norm()`` is what users log and pick
``max_grad_norm`` from). Exact isometries (signed permutations) keep every norm: ``ρ = 1``, nothing is probed.
Probing changes no result: the probes have a generator of their own and only ``ρ`` reads them. The measurements
behind each choice: docs/benchmarks/2026-12-03.md and 2026-12-06.md (the clipping norm).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import Tensor

from lightning_offload.lsp.projector import SparseProjector

#: Probes per layer and step (``m``); 0 turns the measurement off (the drifting ``ρ`` of the fit, or 1).
PROBES = 8
#: The averages' span in measured steps (a step's weight decays by ``1 − 1/WINDOW_STEPS`` per later step), and the
#: measured steps before they first replace ``ρ``: longer than the 4-step golden runs, short against the drift.
WINDOW_STEPS = 16
#: Without clipping by norm, the probes run at every this many-th step (see the module's docstring).
UNCLIPPED_EVERY = 4


def is_isometry(projector: SparseProjector) -> bool:
    """Whether ``projector`` is a signed permutation: square, one ``±1`` per column, every row hit once (it keeps
    every norm exactly)."""
    if projector.dim_out != projector.dim_in or projector.nnz_per_column != 1:
        return False
    rows = projector.indices.reshape(-1).long()
    return bool((projector.values.detach().abs() == 1).all()) and bool(
        (torch.bincount(rows, minlength=projector.dim_out) == 1).all())


class NormProbe:
    """One projected layer's probes for the current step and its averages of ``‖S‖²`` and ``‖G‖²``.

    Args:
        name: the layer's name, which seeds its probes (the same on every rank and in a resumed run).
    """

    def __init__(self, name: str) -> None:
        self._seed = zlib.crc32(name.encode())
        #: Whether this step's forwards keep ``X z``: set after each step from whether it was clipped by norm.
        self.active = False
        #: Whether the layer is measured at all (``False`` for exact isometries; set with the projectors).
        self.measured = True
        #: Steps measured so far: the next probes are drawn from it.
        self.draws = 0
        #: Steps taken so far (measured or not): the unclipped cadence counts them.
        self.steps = 0
        self._probe: Tensor | None = None
        #: ``G z`` accumulated over the current step's backwards (``o × m``, fp32), or ``None``.
        self.sketch: Tensor | None = None
        #: ``[‖S‖², ‖G z‖²/m]`` summed over the measured steps, each step's weight decaying by ``1 − 1/WINDOW_STEPS``
        #: per later step (fp32, on the device: no read per step), or ``None``. Their ratio is the ratio of averages.
        self.sums: Tensor | None = None
        #: Steps in :attr:`sums` (measured since the projectors were installed).
        self.window_steps = 0

    # ------------------------------------------------------------------------------------------------ one step
    # Run eagerly under torch.compile: the draw is seeded by the count of measured steps, which a traced graph would
    # take as a constant and so recompile at every measured step.
    @torch.compiler.disable
    def probe(self, in_features: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """This step's probes ``z`` (``i × m``, ``±1`` in ``dtype``): drawn at the step's first forward, then kept
        until the step is measured, so every micro-batch (and a checkpointed layer's recomputation) uses the same."""
        if self._probe is None or self._probe.device != device or self._probe.shape[0] != in_features:
            generator = torch.Generator(device=device)
            generator.manual_seed((self._seed * 1_000_003 + self.draws) % (1 << 62))
            signs = torch.randint(0, 2, (in_features, PROBES), generator=generator, device=device)
            self._probe = signs.float().mul_(2).sub_(1)
        return self._probe.to(dtype)

    def add(self, sketch: Tensor) -> None:
        """Add one backward's ``G z`` (fp32)."""
        self.sketch = sketch if self.sketch is None else self.sketch.add_(sketch)

    def clear_step(self) -> None:
        """Forget the current step's ``G z`` (its ``S`` was released unmeasured: a skipped step)."""
        self.sketch = None

    def next_step(self, clipped_by_norm: bool) -> None:
        """The step was taken, measured or not: the next one draws new probes, and probes after a step clipped by norm
        and at every :data:`UNCLIPPED_EVERY`-th step."""
        if self._probe is not None or self.sketch is not None:
            self.draws += 1
        self._probe, self.sketch = None, None
        self.steps += 1
        wanted = clipped_by_norm or self.steps % UNCLIPPED_EVERY == 0
        self.active = wanted and self.measured and PROBES > 0

    # ------------------------------------------------------------------------------------------------ the average
    def record(self, figures: Tensor) -> None:
        """Add one step's ``[‖S‖², ‖G z‖²/m]`` to :attr:`sums`, the older steps' weight decayed."""
        if self.sums is None:
            self.sums = figures.clone()
        else:
            self.sums.mul_(1.0 - 1.0 / WINDOW_STEPS).add_(figures)
        self.window_steps += 1

    def ready(self) -> bool:
        """Whether enough steps were measured (:data:`WINDOW_STEPS`) for the averages to replace ``ρ``."""
        return self.window_steps >= WINDOW_STEPS

    def reset_window(self) -> None:
        """Start the averages afresh (new projectors: the old averages measured other ones)."""
        self.sums, self.window_steps = None, 0

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only (fp32 sums are exact as Python floats; a checkpoint's tensors stay what they were): what
        a resumed run needs to measure on as the uninterrupted one does."""
        return {"active": self.active, "draws": self.draws, "steps": self.steps, "window_steps": self.window_steps,
                "sums": None if self.sums is None else self.sums.tolist()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict` output."""
        self.active = bool(state["active"]) and self.measured and PROBES > 0
        self.draws = int(state["draws"])
        self.steps = int(state["steps"])
        self.window_steps = int(state["window_steps"])
        sums = state["sums"]
        self.sums = None if sums is None else torch.tensor(sums, dtype=torch.float32, device=device)
        self._probe, self.sketch = None, None


def pooled_ratio(sums: list[float]) -> float:
    """``ρ`` of :attr:`NormProbe.sums`, ``√(avg ‖S‖² / avg ‖G z‖²/m)``; ``nan`` unless positive and finite."""
    squares, probed = sums[0], sums[1]
    ratio = math.sqrt(squares / probed) if probed > 0 and squares > 0 else math.nan
    return ratio if math.isfinite(ratio) else math.nan
