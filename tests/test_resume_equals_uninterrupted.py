"""A command-line run interrupted and resumed from last.ckpt is the run it continues: weights and history."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_configs import compose_cfg

from lightning_offload.cli.train import train
from lightning_offload.reporting.run_record import read_history

# 3 batches an epoch (12 blocks or verses, batches of 4), so 7 steps cross two epoch boundaries; a checkpoint every
# 2 steps.
COMMON = ["model=tiny_llama", "trainer=cpu", "logger=none", "callbacks=checkpoint",
          "callbacks.model_checkpoint.every_n_train_steps=2", "trainer.val_check_interval=null",
          "trainer.limit_val_batches=2", "data.batch_size=4", "trainer.precision=32-true"]
DATA = {"bible_lm": ["data=bible_lm", "data.max_train_blocks=12", "data.max_val_blocks=8"],
        "bible_genre": ["data=bible_genre", "data.max_train_examples=12", "data.max_val_examples=8"]}


def _train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_history(run_dir) if r["kind"] == "train"}


# Stopped after step 5 the checkpoint is mid-epoch 1 (step 4); after step 3, mid-epoch 0 (step 2).
@pytest.mark.parametrize("data, stop_at", [("bible_lm", 5), ("bible_genre", 3)])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path, data: str, stop_at: int) -> None:
    run = [*COMMON, *DATA[data]]
    _, whole = train(compose_cfg([*run, "trainer.max_steps=7"], tmp_path / "whole"))
    train(compose_cfg([*run, f"trainer.max_steps={stop_at}"], tmp_path / "parts"))
    checkpoint = tmp_path / "parts" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=False)["global_step"] == stop_at - 1
    _, resumed = train(compose_cfg([*run, "trainer.max_steps=7", f"ckpt_path={checkpoint}"], tmp_path / "parts"))
    assert resumed["trainer"].global_step == 7
    assert _train_losses(tmp_path / "parts") == _train_losses(tmp_path / "whole")  # every step's loss, in order
    for (name, got), want in zip(resumed["module"].state_dict().items(), whole["module"].state_dict().values()):
        assert torch.equal(got, want), name
