"""A checkpoint resumed under another strategy: each case says what it is and what to do; weights-only resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_configs import compose_cfg
from tiny_modules import (TinyCausalLM, TinyClassifier, classification_data, params_of, tiny_hf_model, token_data,
                          trainer)

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


@pytest.mark.parametrize("written,resumed,names", [("lsp", "zero", ("lsp_offload", "zero_offload")),
                                                    ("zero", "lsp", ("zero_offload", "lsp_offload"))])
def test_a_checkpoint_of_the_other_offload_strategy_is_refused_before_anything_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, resumed: str, names: tuple[str, str]) -> None:
    checkpoint, _ = _checkpoint(tmp_path, written)
    import lightning_offload.cli.train as cli_train

    built = []
    monkeypatch.setattr(cli_train, "build_trainer", lambda *args, **kwargs: built.append(1))
    with pytest.raises(SettingsError, match=rf"written by {names[0]}.*this run trains with {names[1]}.*"
                                            r"weights_from=<path> instead of ckpt_path=<path>"):
        train(compose_cfg([*TINY, f"offload={resumed}", f"ckpt_path={checkpoint}"], tmp_path / "resumed"))
    assert not built
    monkeypatch.undo()
    _, objects = train(compose_cfg([*TINY, f"offload={resumed}", f"weights_from={checkpoint}", "trainer.max_steps=1"],
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


def _resume_plain(module: TinyClassifier, checkpoint: Path, steps: int) -> TinyClassifier:
    trainer("auto", max_steps=steps).fit(module, classification_data(), ckpt_path=checkpoint)
    return module


def test_a_zero_offload_checkpoint_converted_to_plain_adamw_continues_as_the_uninterrupted_run(tmp_path: Path) -> None:
    from lightning_offload import to_plain_adamw_checkpoint

    run = trainer(ZeroOffloadStrategy(), max_steps=3)
    run.fit(TinyClassifier(), classification_data())
    run.save_checkpoint(tmp_path / "offload.ckpt")
    report = to_plain_adamw_checkpoint(tmp_path / "offload.ckpt", TinyClassifier(), tmp_path / "plain.ckpt")
    assert sorted(report.exact) == sorted(n for n, _ in TinyClassifier().named_parameters()) and not report.restarted
    continued = _resume_plain(TinyClassifier(), tmp_path / "plain.ckpt", steps=6)
    # The reference: plain AdamW for 3 steps, checkpointed and resumed the same way (the tiny loader restarts its
    # epoch on resume either way), so the only difference left is who held the optimizer state for the first 3.
    reference = trainer("auto", max_steps=3)
    reference.fit(TinyClassifier(), classification_data())
    reference.save_checkpoint(tmp_path / "reference.ckpt")
    uninterrupted = _resume_plain(TinyClassifier(), tmp_path / "reference.ckpt", steps=6)
    for name, value in params_of(continued).items():  # zero_offload's fused host Adam against torch's for-loop one
        torch.testing.assert_close(value, params_of(uninterrupted)[name], msg=name)


def test_the_device_adams_moments_convert_by_name_beside_a_frozen_embedding(tmp_path: Path) -> None:
    """The vectors' moments (stepped on the device) carry over exactly, matched by the names the checkpoint keeps,
    though a frozen embedding, also outside the host slots, is a trained parameter of the converted optimizer."""
    from lightning_offload import to_plain_adamw_checkpoint

    run = trainer(ZeroOffloadStrategy(embeddings="frozen"), max_steps=2)
    run.fit(TinyCausalLM(tiny_hf_model("llama")), token_data())
    run.save_checkpoint(tmp_path / "offload.ckpt")
    report = to_plain_adamw_checkpoint(tmp_path / "offload.ckpt", TinyCausalLM(tiny_hf_model("llama")),
                                       tmp_path / "plain.ckpt")
    vectors = [n for n, p in TinyCausalLM(tiny_hf_model("llama")).named_parameters() if p.dim() == 1]
    assert vectors and set(vectors) <= set(report.exact)
    assert report.restarted == []
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert all(float(plain[i]["step"]) == 2 for i in plain)


@pytest.mark.parametrize("update", [dict(density=2, projectors="random"), dict(update="scaled")],
                         ids=["projected", "scaled"])
def test_projected_weights_restart_and_are_named(update: dict, tmp_path: Path) -> None:
    """Compressed moments (of either update rule: the scaled one keeps moments of a projection only) have no full-size
    form: those weights restart, named; the rest carries over."""
    from lightning_offload import LSPOffloadStrategy, to_plain_adamw_checkpoint

    run = trainer(LSPOffloadStrategy(rank=0.5, min_dim=16, **update), max_steps=2)
    run.fit(TinyClassifier(), classification_data())
    run.save_checkpoint(tmp_path / "lsp.ckpt")
    report = to_plain_adamw_checkpoint(tmp_path / "lsp.ckpt", TinyClassifier(), tmp_path / "plain.ckpt")
    assert sorted(report.restarted) == ["body.0.weight", "body.3.weight"]
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=False)["optimizer_states"][0]
    assert len(plain["state"]) == len(list(TinyClassifier().parameters())) - 2
    assert _resume_plain(TinyClassifier(), tmp_path / "plain.ckpt", steps=4).losses  # plain Lightning trains on


def test_row_sparse_moments_caught_up_equal_dense_adamw_with_zero_gradients() -> None:
    from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings
    from lightning_offload.faces.trainer.plain_checkpoint import dense_moments_of_rows

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=generator)
    rows_adam, dense = BlockRowAdam([weight.clone()], block_rows=1), torch.nn.Parameter(weight.clone())
    adamw = torch.optim.AdamW([dense], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    for rows in ([0, 1], [1, 2], [0], [3, 4, 5], [1]):
        index = torch.tensor(rows)
        grad = torch.randn(len(rows), 4, generator=generator)
        rows_adam.step_rows(index, grad.contiguous(), RowAdamSettings(lr=1e-2, betas=(0.9, 0.99), eps=1e-8))
        dense.grad = torch.zeros_like(dense).index_copy_(0, index, grad)
        adamw.step()
    caught_up = dense_moments_of_rows(rows_adam.state_dict(), (0.9, 0.99))
    torch.testing.assert_close(caught_up["exp_avg"], adamw.state[dense]["exp_avg"])
    torch.testing.assert_close(caught_up["exp_avg_sq"], adamw.state[dense]["exp_avg_sq"])
    assert float(caught_up["step"]) == float(adamw.state[dense]["step"]) == 5
