"""The command line's ``trainer.precision``: ``auto`` resolved to what the hardware computes fastest."""

from __future__ import annotations

import logging
import os
import warnings

from omegaconf import DictConfig, open_dict

from lightning_offload.setup.hardware_precision import hardware_precision, uses_cuda

log = logging.getLogger(__name__)

#: Set by the process that resolves ``trainer.precision=auto``: the ranks Lightning launches as subprocesses inherit
#: it and train in the same precision (each probing on its own could disagree and hang in the first collective).
PRECISION_ENV = "LIGHTNING_OFFLOAD_PRECISION"


def resolve_precision(cfg: DictConfig) -> str:
    """Writes the precision this run trains in into ``cfg.trainer.precision`` and returns it.

    ``auto`` (the default) becomes what the hardware computes fastest (:func:`hardware_precision`), said in one log
    line. ``16-mixed`` on a CPU becomes ``bf16-mixed``, as Lightning itself would run it, with a warning, so the
    run's records name the precision that ran.
    """
    precision = cfg.trainer.get("precision")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if precision in (None, "auto"):
        # Kept as "<accelerator>=<precision>": a later run in the same process on another accelerator probes anew.
        inherited_accelerator, _, inherited = os.environ.get(PRECISION_ENV, "").partition("=")
        if inherited and inherited_accelerator == accelerator:
            precision = inherited
        else:
            choice = hardware_precision(accelerator)
            precision = choice.precision
            os.environ[PRECISION_ENV] = f"{accelerator}={precision}"
            log.info("Precision: %s (trainer.precision=auto: %s; set trainer.precision to choose another).",
                     precision, choice.reason)
    elif str(precision) in ("16", "16-mixed") and not uses_cuda(accelerator):
        warnings.warn("trainer.precision=16-mixed on a CPU: fp16 autocast does not run there, so Lightning trains in "
                      "bf16-mixed instead; this run is recorded as bf16-mixed. Set trainer.precision=bf16-mixed (or "
                      "32-true) to choose it yourself.", UserWarning, stacklevel=2)
        precision = "bf16-mixed"
    with open_dict(cfg):
        cfg.trainer.precision = precision
    return str(precision)
