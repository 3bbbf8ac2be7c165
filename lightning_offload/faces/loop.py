"""The offload engine in a training loop of one's own: a plain PyTorch loop, or Hugging Face's ``Trainer``
(:mod:`lightning_offload.faces.hf`).

:func:`offload` takes the model and the user's ``torch.optim.Adam``/``AdamW`` and returns
:class:`~lightning_offload.setup.loop_optimizer.LoopOffloadOptimizer`, a ``torch.optim.Optimizer``:
``loss.backward(); opt.step(); opt.zero_grad()`` as before, an LR scheduler built on it works, and its ``state_dict``
resumes exactly.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from lightning_offload.engine.fitting.projector_fitting import ProjectorFitting
from lightning_offload.setup.engine import Placements, build_engine
from lightning_offload.setup.loop_optimizer import LOOP_REFUSED, LOOP_SETTINGS, LoopOffloadOptimizer, loop_settings
from lightning_offload.setup.settings import PRESETS, face_settings
from lightning_offload.setup.settings_docs import documents_settings

log = logging.getLogger(__name__)

#: The strategy names a loop of one's own takes (their presets: :data:`~lightning_offload.setup.settings.PRESETS`).
LOOP_STRATEGIES = ("lsp_offload", "zero_offload")


@documents_settings(exclude=LOOP_REFUSED)  # zero_offload refuses the projection ones
def offload(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "lsp_offload", *,
            device: torch.device | str | None = None, max_grad_norm: float | None = None,
            fitting: ProjectorFitting | None = None, refit_every: int = 500, accumulation_steps: int | None = 1,
            **settings: Any) -> LoopOffloadOptimizer:
    """Offload ``optimizer``'s work for ``model`` to the host, for a training loop of one's own.

    Args:
        model: the model, on its training device already.
        optimizer: a ``torch.optim.Adam`` or ``AdamW`` (or :class:`~lightning_offload.engine.rules.lion.Lion`) over
            ``model``'s parameters; its ``param_groups`` are shared (an LR scheduler built on either optimizer drives
            both).
        strategy: ``"lsp_offload"`` (projected gradients) or ``"zero_offload"`` (dense, ZeRO-Offload style).
            Default: ``"lsp_offload"``.
        device: the training device. Default: ``None`` (where ``model``'s first parameter is).
        max_grad_norm: clip every step to this global gradient norm unless ``clip_grad_norm_`` was called for it
            (Hugging Face's ``Trainer`` clips ``model.parameters()``, which misses projected gradients: set its
            ``max_grad_norm=0`` and this instead). Default: ``None`` (no clipping unless asked).
        fitting: how projector fits run. Default: ``None`` (``ProjectorFitting(seed=seed)``).
        refit_every: steps between refit checks (:attr:`LoopOffloadOptimizer.refit_due`); 0 for none.
            Default: ``500``.
        accumulation_steps: micro-batches (training forwards of ``model``) per optimizer step: the last one's
            backward sends each gradient to the host as soon as it is final, overlapping the host's work with the
            rest of backward. It must be the loop's count (Hugging Face: ``gradient_accumulation_steps``); a lower
            one is refused at the step that shows it, a higher one only loses the overlap. ``None`` sends every
            gradient at the step. Default: ``1``.
        <offload settings>

    Returns:
        The engine as a ``torch.optim.Optimizer``; call :meth:`~LoopOffloadOptimizer.close` when done.

    Raises:
        ValueError: for an unknown strategy, or a bad setting (named, with the accepted values).
        TypeError: for an optimizer no host rule takes over (:mod:`~lightning_offload.engine.rules`).

    Example::

        opt = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-4), max_grad_norm=1.0)
        for batch in loader:
            model(**batch).loss.backward()
            opt.step(); opt.zero_grad()
        opt.close()
    """
    if strategy not in LOOP_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not a loop offload; use one of {list(LOOP_STRATEGIES)} "
                         f"(meft_offload: Fabric(strategy='meft_offload') or the Trainer strategy).")
    settings_value = face_settings(strategy, settings, PRESETS[strategy], face_names=LOOP_SETTINGS,
                                   refused=LOOP_REFUSED)
    loop = loop_settings(settings_value, max_grad_norm, accumulation_steps, refit_every, fitting)
    if device is None:
        device = next(model.parameters()).device
    setup = build_engine(model, optimizer, settings_value, Placements.of(settings_value), torch.device(device),
                         strategy, log.info, lambda message: warnings.warn(message, stacklevel=3),
                         optimizer_class=LoopOffloadOptimizer, frees_sent_gradients=False)
    loop_optimizer = setup.optimizer
    assert isinstance(loop_optimizer, LoopOffloadOptimizer)
    loop_optimizer.configure_loop(setup, loop, strategy)
    return loop_optimizer
