"""Shared pytest setup: keep wandb offline and out of the home directory, and torch's thread count as each test
found it."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

# Set at import, before any test module (or Lightning) can import wandb: wandb reads these once.
_WANDB_TMP = tempfile.mkdtemp(prefix="lightning_offload_wandb_")
os.environ["WANDB_MODE"] = "offline"
for _var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ[_var] = _WANDB_TMP
atexit.register(shutil.rmtree, _WANDB_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A test that sets torch's thread count (to match a subprocess's arithmetic, or to time one thread) leaves it as
    it found it: the tests after it would otherwise run, and be timed, with a team of another size."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
