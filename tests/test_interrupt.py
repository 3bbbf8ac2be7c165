"""Ctrl-C in a command-line run: the step in progress finishes, last.ckpt is saved there, the run ends without another
validation, the summary says so and gives the command that resumes; a second Ctrl-C aborts at once."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_configs import compose_cfg

from lightning_offload.cli.train import train
from lightning_offload.reporting.run_record import read_history, read_summary

TINY = ["model=tiny_llama", "trainer=cpu", "logger=none", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2", "data.max_val_blocks=8"]


class CtrlC(pl.Callback):
    """Presses Ctrl-C (sends SIGINT to this process) ``times`` times while optimizer step ``at_step + 1`` runs, or,
    with ``in_validation``, during the first batch of the fit's validation after step ``at_step``."""

    def __init__(self, at_step: int, times: int = 1, in_validation: bool = False) -> None:
        self.at_step, self.times, self.in_validation, self.sent = at_step, times, in_validation, False

    def _press(self, trainer: pl.Trainer) -> None:
        if trainer.global_step == self.at_step and not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.in_validation:
            self._press(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.in_validation and trainer.state.fn == "fit":
            self._press(trainer)


class Batches(pl.Callback):
    """Counts the fit's batches, and the validation batches that run once the fit was told to stop."""

    def __init__(self) -> None:
        self.train, self.validation, self.validation_after_stop = 0, 0, 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.train += 1

    def on_validation_batch_start(self, trainer, *args) -> None:
        if trainer.state.fn == "fit":
            self.validation += 1
            self.validation_after_stop += trainer.should_stop


def _ctrl_c(at_step: int, times: int = 1, in_validation: bool = False) -> list[str]:
    return [f"+callbacks.ctrl_c._target_={__name__}.CtrlC", f"+callbacks.ctrl_c.at_step={at_step}",
            f"+callbacks.ctrl_c.times={times}", f"+callbacks.ctrl_c.in_validation={in_validation}",
            f"+callbacks.batches._target_={__name__}.Batches"]


def _without_test_callbacks(resume_command: str) -> list[str]:
    """The overrides of a printed resume command, the test's own callbacks left out."""
    return [w for w in shlex.split(resume_command)[1:] if not w.startswith(("+callbacks.ctrl_c", "+callbacks.batches"))]


def _batches(objects: dict) -> Batches:
    return next(c for c in objects["callbacks"] if isinstance(c, Batches))


def _val_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_history(run_dir) if r["kind"] == "val"]


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_the_resume_command(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # Python's own, or SIG_IGN in a process started in the background
    _, objects = train(compose_cfg([*TINY, *_ctrl_c(at_step=1)], run_dir))
    out = capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before  # the handler that was there is back

    summary = read_summary(run_dir)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert objects["trainer"].global_step == 2  # step 2 was under way: it finished, and nothing after it ran
    assert summary["interrupted"] is True and summary["steps"] == 2 and summary["checkpoint"] == str(checkpoint)
    assert checkpoint.is_file()
    # No validation after the stop (Lightning's own, when a fit stops early, took minutes on a CPU), nor an evaluation
    # by the command: the history has the one before training only, and the summary no loss after.
    assert _batches(objects).validation == 0
    assert _val_steps(run_dir) == [0] and summary["loss_after"] is None
    assert objects["trainer"].limit_val_batches == 2  # turned off for the stop only
    assert f"interrupted         Ctrl-C: stopped after step 2; checkpoint {checkpoint}" in out
    assert out.rstrip().endswith(f"resume with         {summary['resume_command']}")

    # The printed command resumes the run in its own directory (the test's Ctrl-C callback left out).
    words = shlex.split(summary["resume_command"])
    assert words[0] == "lightning-offload-train" and words[-1] == f"ckpt_path={checkpoint}"
    overrides = _without_test_callbacks(summary["resume_command"])
    assert set(TINY) <= set(overrides)
    _, resumed = train(compose_cfg(overrides, run_dir))
    assert resumed["trainer"].global_step == 6 and not resumed["summary"].get("interrupted")
    assert read_summary(run_dir)["steps_this_run"] == 4
    assert _val_steps(run_dir) == [0, 3, 6]


def test_a_stop_where_a_validation_is_due_skips_it(tmp_path: Path) -> None:
    # Ctrl-C during step 3, after which the schedule (every 3 batches) validates: the run stops without it.
    run_dir = tmp_path / "run"
    _, objects = train(compose_cfg([*TINY, *_ctrl_c(at_step=2)], run_dir))
    assert objects["trainer"].global_step == 3 and read_summary(run_dir)["interrupted"] is True
    assert _batches(objects).validation_after_stop == 0 and _val_steps(run_dir) == [0]


def test_ctrl_c_during_a_validation_stops_after_it_and_resumes_exactly(tmp_path: Path) -> None:
    # fp32: the resumed run's losses and weights are compared bit for bit with the uninterrupted run's.
    run = [*TINY, "trainer.precision=32-true"]
    _, whole = train(compose_cfg(run, tmp_path / "whole"))

    run_dir = tmp_path / "run"
    _, objects = train(compose_cfg([*run, *_ctrl_c(at_step=3, in_validation=True)], run_dir))
    summary = read_summary(run_dir)
    # The validation after step 3 finished (all its batches: its metrics are whole), and the run stopped right
    # there: no step 4, no second validation.
    assert objects["trainer"].global_step == 3 and _batches(objects).train == 3
    assert _batches(objects).validation == 2 and _batches(objects).validation_after_stop == 0
    assert summary["interrupted"] is True and summary["steps"] == 3
    history = read_history(run_dir)
    assert _val_steps(run_dir) == [0, 3] and summary["loss_after"] == history[-1]["val/loss"]
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 3

    _, resumed = train(compose_cfg(_without_test_callbacks(summary["resume_command"]), run_dir))
    assert resumed["trainer"].global_step == 6 and _val_steps(run_dir) == [0, 3, 6]
    losses = {r["step"]: r["train/loss"] for r in read_history(run_dir) if r["kind"] == "train"}
    assert losses == {r["step"]: r["train/loss"] for r in read_history(tmp_path / "whole") if r["kind"] == "train"}
    for (name, got), want in zip(resumed["module"].state_dict().items(), whole["module"].state_dict().values()):
        assert torch.equal(got, want), name


def test_ctrl_c_during_a_validation_within_an_accumulated_step_stops_at_the_step_end(tmp_path: Path) -> None:
    # Two micro-batches a step, a validation every 3 micro-batches: the first falls inside step 2. Stopping there
    # would lose the accumulated gradient; the run stops when step 2 completes, without validating again.
    run_dir = tmp_path / "run"
    _, objects = train(compose_cfg([*TINY, "trainer.accumulate_grad_batches=2",
                                    *_ctrl_c(at_step=1, in_validation=True)], run_dir))
    assert objects["trainer"].global_step == 2 and _batches(objects).train == 4
    assert _batches(objects).validation == 2 and _batches(objects).validation_after_stop == 0
    assert read_summary(run_dir)["interrupted"] is True
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2


def test_ctrl_c_during_the_last_validation_lets_the_run_complete(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _, objects = train(compose_cfg([*TINY, *_ctrl_c(at_step=6, in_validation=True)], run_dir))
    summary = read_summary(run_dir)
    assert objects["trainer"].global_step == 6 and _batches(objects).validation == 4
    assert not summary.get("interrupted") and "resume_command" not in summary
    assert not (run_dir / "checkpoints" / "last.ckpt").exists() and _val_steps(run_dir) == [0, 3, 6]


@pytest.mark.parametrize("started_in_background", [False, True])
def test_a_second_ctrl_c_aborts_without_a_checkpoint(tmp_path: Path, started_in_background: bool) -> None:
    run_dir = tmp_path / "run"
    # A shell starts a background job (`cmd &`, nohup) with SIGINT ignored: the second press must abort there too.
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if started_in_background else signal.default_int_handler)
    try:
        with pytest.raises(SystemExit):  # Lightning's answer to a KeyboardInterrupt
            train(compose_cfg([*TINY, *_ctrl_c(at_step=1, times=2)], run_dir))
        assert not (run_dir / "checkpoints" / "last.ckpt").exists()
        # Lightning ignores SIGINT while it shuts down; the handler from before the run is back all the same.
        assert signal.getsignal(signal.SIGINT) is (signal.SIG_IGN if started_in_background
                                                   else signal.default_int_handler)
    finally:
        signal.signal(signal.SIGINT, before)
