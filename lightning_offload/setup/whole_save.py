"""Checkpoints written whole: to a file beside the target first, then renamed, so an interrupted save never leaves a
half-written checkpoint where the old one was (every face's save goes through here)."""

from __future__ import annotations

import os
from collections.abc import Callable

def save_whole(path: str | os.PathLike[str], write: Callable[[str | os.PathLike[str]], None]) -> None:
    """``write(target)`` a checkpoint to ``path`` beside it first, then renamed: an interrupted save never leaves a
    half-written checkpoint (remote paths, ``"://"``, are written directly)."""
    if "://" in str(path):
        write(path)
        return
    partial = f"{path}.partial"
    try:
        write(partial)
        os.replace(partial, str(path))
    finally:
        if os.path.exists(partial):
            os.remove(partial)
