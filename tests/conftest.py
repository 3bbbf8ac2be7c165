"""Shared pytest setup: keep wandb offline and out of the home directory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Set at import, before any test module (or Lightning) can import wandb: wandb reads these once.
_WANDB_TMP = tempfile.mkdtemp(prefix="lightning_offload_wandb_")
os.environ["WANDB_MODE"] = "offline"
for _var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ[_var] = _WANDB_TMP
atexit.register(shutil.rmtree, _WANDB_TMP, ignore_errors=True)
