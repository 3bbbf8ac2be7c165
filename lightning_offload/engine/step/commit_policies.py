"""The commit policies an engine can run, by name, and the one a run's settings choose."""

from __future__ import annotations

from lightning_offload.engine.lanes.worker import HostWorker
from lightning_offload.engine.step.commit import CommitAfterNorm
from lightning_offload.engine.step.speculation import SpeculativeCommit

#: Each policy by name (:mod:`~lightning_offload.engine.step.commit` says what one is; a new one goes here too).
COMMIT_POLICIES: dict[str, type[CommitAfterNorm]] = {"after_norm": CommitAfterNorm, "speculative": SpeculativeCommit}


def commit_policy(speculative: bool, worker: HostWorker) -> CommitAfterNorm:
    """When the engine's host steps run and commit: speculated during backward, or after the step's norm.

    Args:
        speculative: start host steps during backward.
        worker: the host worker the jobs run on.
    """
    return COMMIT_POLICIES["speculative" if speculative else "after_norm"](worker)
