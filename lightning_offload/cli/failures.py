"""What a failed run prints and leaves behind: one paragraph on the terminal, the traceback in the run's log file,
and no empty run directory for a run refused at its settings."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

#: What Hydra writes into a run directory before the run starts: a directory holding only these has no results.
_HYDRA_FILES = {".hydra", "train.log"}


def error_paragraph(error: BaseException) -> str:
    """The message a failed run prints: the error's own text (Hydra's instantiation wrapper unwrapped), one
    paragraph, without the traceback."""
    from hydra.errors import InstantiationException

    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__  # "Error in call to target ...": the cause is what the user has to fix
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text}"


def log_to_files(log: logging.Logger, message: str, error: BaseException) -> str | None:
    """Writes ``message`` with the traceback to the log files only (the run's train.log); returns the first one's
    path. The terminal gets one paragraph instead."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None,
                            (type(error), error, error.__traceback__))
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for handler in files:
        handler.handle(record)
    return files[0].baseFilename if files else None


def remove_fresh_run_dir(folder: Path) -> None:
    """Removes the run directory Hydra created for a run refused at its settings, if it holds nothing else."""
    if folder.is_dir() and {p.name for p in folder.iterdir()} <= _HYDRA_FILES:
        for handler in logging.getLogger().handlers:  # train.log is open in Hydra's file handler
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == folder:
                handler.close()
        shutil.rmtree(folder, ignore_errors=True)
