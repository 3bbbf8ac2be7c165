"""Ctrl-C in a command-line run: the step in progress finishes, last.ckpt is saved there, the summary says so and
gives the command that resumes; a second Ctrl-C aborts at once."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
from test_configs import compose_cfg

from lightning_offload.cli.train import train
from lightning_offload.reporting.run_record import read_history, read_summary

TINY = ["model=tiny_llama", "trainer=cpu", "logger=none", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2", "data.max_val_blocks=8"]


class CtrlC(pl.Callback):
    """Presses Ctrl-C (sends SIGINT to this process) ``times`` times while optimizer step ``at_step + 1`` runs."""

    def __init__(self, at_step: int, times: int = 1) -> None:
        self.at_step, self.times, self.sent = at_step, times, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


def _ctrl_c(at_step: int, times: int = 1) -> list[str]:
    return [f"+callbacks.ctrl_c._target_={__name__}.CtrlC", f"+callbacks.ctrl_c.at_step={at_step}",
            f"+callbacks.ctrl_c.times={times}"]


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
    # Lightning validates once when a fit stops early; the summary reports that evaluation, at the step it stopped.
    history = read_history(run_dir)
    assert summary["loss_after"] == [r for r in history if r["kind"] == "val"][-1]["val/loss"]
    assert [r["step"] for r in history if r["kind"] == "val"] == [0, 2]
    assert f"interrupted         Ctrl-C: stopped after step 2; checkpoint {checkpoint}" in out
    assert f"resume with         {summary['resume_command']}" in out

    # The printed command resumes the run in its own directory (the test's Ctrl-C callback left out).
    words = shlex.split(summary["resume_command"])
    assert words[0] == "lightning-offload-train" and words[-1] == f"ckpt_path={checkpoint}"
    overrides = [w for w in words[1:] if not w.startswith("+callbacks.ctrl_c")]
    assert set(TINY) <= set(overrides)
    _, resumed = train(compose_cfg(overrides, run_dir))
    assert resumed["trainer"].global_step == 6 and not resumed["summary"].get("interrupted")
    assert read_summary(run_dir)["steps_this_run"] == 4
    assert [r["step"] for r in read_history(run_dir) if r["kind"] == "val"] == [0, 2, 3, 6]


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
