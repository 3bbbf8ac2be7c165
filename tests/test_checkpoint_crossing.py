"""A checkpoint resumed under another strategy: each case says what it is and what to do; weights-only resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_configs import compose_cfg
from tiny_modules import TinyClassifier, classification_data, params_of, trainer

from lightning_offload import ZeroOffloadStrategy
from lightning_offload.cli.train import train
from lightning_offload.tasks.schedule import SettingsError

TINY = ["model=tiny_llama", "trainer=cpu", "logger=none", "callbacks=checkpoint",
        "callbacks.model_checkpoint.every_n_train_steps=1", "trainer.val_check_interval=null",
        "trainer.limit_val_batches=2", "data.max_val_blocks=8", "trainer.precision=32-true", "trainer.max_steps=2"]


def _checkpoint(tmp_path: Path, offload: str) -> tuple[Path, dict]:
    _, objects = train(compose_cfg([*TINY, f"offload={offload}"], tmp_path / offload))
    return tmp_path / offload / "checkpoints" / "last.ckpt", objects["summary"]


def test_a_plain_checkpoint_resumed_under_an_offload_strategy_says_to_start_from_its_weights(tmp_path: Path) -> None:
    checkpoint, plain = _checkpoint(tmp_path, "none")
    with pytest.raises(SettingsError, match=r"written without an offload strategy: its optimizer state is a plain "
                                            r"torch.optim state .* weights_from=<path> instead of ckpt_path=<path>"):
        train(compose_cfg([*TINY, "offload=zero", f"ckpt_path={checkpoint}"], tmp_path / "resumed"))
    # Weights only: the new run starts from exactly the checkpoint's weights, with a fresh optimizer.
    _, objects = train(compose_cfg([*TINY, "offload=zero", f"weights_from={checkpoint}", "trainer.max_steps=1"],
                                   tmp_path / "weights"))
    assert objects["summary"]["loss_before"] == plain["loss_after"] and objects["trainer"].global_step == 1


def test_an_offload_checkpoint_resumed_without_one_says_so(tmp_path: Path) -> None:
    checkpoint, _ = _checkpoint(tmp_path, "zero")
    with pytest.raises(SettingsError, match=r"written by a lightning_offload strategy: .* offload=none cannot load "
                                            r"into a torch.optim optimizer. Resume it with the offload strategy"):
        train(compose_cfg([*TINY, "offload=none", f"ckpt_path={checkpoint}"], tmp_path / "resumed"))
    _, objects = train(compose_cfg([*TINY, "offload=none", f"weights_from={checkpoint}", "trainer.max_steps=1"],
                                   tmp_path / "weights"))
    assert objects["trainer"].global_step == 1


def test_resume_and_weights_only_together_are_refused(tmp_path: Path) -> None:
    checkpoint, _ = _checkpoint(tmp_path, "zero")
    with pytest.raises(SettingsError, match="set one of them"):
        train(compose_cfg([*TINY, f"ckpt_path={checkpoint}", f"weights_from={checkpoint}"], tmp_path / "both"))


def test_a_plain_lightning_checkpoint_under_an_offload_strategy_from_your_own_code(tmp_path: Path) -> None:
    module = TinyClassifier()
    run = trainer("auto", max_steps=2)
    run.fit(module, classification_data())
    run.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match=r"written without an offload strategy.*module.load_state_dict"):
        trainer(ZeroOffloadStrategy(), max_steps=3).fit(TinyClassifier(), classification_data(),
                                                        ckpt_path=tmp_path / "plain.ckpt")
    # The weights-only way the message gives: the same weights, then training goes on under the offload strategy.
    fresh = TinyClassifier()
    fresh.load_state_dict(torch.load(tmp_path / "plain.ckpt", weights_only=False)["state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(params_of(fresh).values(), params_of(module).values()))
    trainer(ZeroOffloadStrategy(), max_steps=1).fit(fresh, classification_data())
