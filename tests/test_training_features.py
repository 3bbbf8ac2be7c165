"""Precision modes, telemetry through the loggers, manual optimization, non-finite gradients."""

import csv

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_offload import LSPOffloadStrategy, NonFiniteGradientError, ZeroOffloadStrategy
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.engine.slots.row_slot import RowSlot
from tiny_modules import (
    TinyCausalLM,
    TinyClassifier,
    classification_data,
    lossless_lsp,
    params_of,
    tiny_hf_model,
    token_data,
    trainer,
)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_precisions_train(precision):
    module = TinyCausalLM(tiny_hf_model("llama"))
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)
    trainer(strategy, max_steps=30, precision=precision).fit(module, token_data())
    assert sum(module.losses[-5:]) < 0.9 * sum(module.losses[:5])
    weight_dtype = module.model.model.layers[0].mlp.up_proj.weight.dtype
    assert weight_dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    optimizer = strategy.offload_optimizer
    assert all(slot.host_param.dtype == torch.float32 for slot in optimizer.slots)
    moments = [slot.row_adam.exp_avg[0] if isinstance(slot, RowSlot)
               else slot.host_optimizer.state[slot.host_param]["exp_avg"] for slot in optimizer.slots]
    assert len(moments) == len(optimizer.slots) and all(m.dtype == torch.float32 for m in moments)


def _logged(tmp_path, strategy):
    module = TinyClassifier()
    trainer(strategy, max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1).fit(module, classification_data())
    (path,) = tmp_path.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(open(path)) if r.get("offload/bytes_device_to_host")]
    return rows


def test_telemetry_reaches_the_loggers_and_measures_the_link(tmp_path):
    lsp_rows = _logged(tmp_path / "lsp", LSPOffloadStrategy(rank=0.25, density=2, min_dim=16))
    zero_rows = _logged(tmp_path / "zero", ZeroOffloadStrategy())
    # Pipelined, a step's figures complete during the next one: the logger gets those of steps 1-3, one a step from
    # the second, and no row of zeros at the first (a chart would start at 0).
    assert len(lsp_rows) == len(zero_rows) == 3
    assert [r["step"] for r in lsp_rows] == [r["step"] for r in zero_rows] == ["1", "2", "3"]
    assert _logged(tmp_path / "unpipelined", ZeroOffloadStrategy(pipelined=False))[0]["step"] == "0"
    for key in ("bytes_device_to_host", "bytes_host_to_device", "host_optimizer_seconds", "host_state_bytes"):
        assert all(float(row[f"offload/{key}"]) > 0 for row in lsp_rows + zero_rows), key
    assert float(lsp_rows[-1]["offload/device_state_bytes"]) == 0
    # zero_offload ships every fp32 gradient of a matrix (the vectors are stepped on the device): exactly 4 bytes per
    # element each way.
    n_params = sum(p.numel() for p in TinyClassifier().parameters() if p.dim() > 1)
    assert float(zero_rows[-1]["offload/bytes_device_to_host"]) == 4 * n_params
    assert float(zero_rows[-1]["offload/bytes_host_to_device"]) == 4 * n_params
    # LSP at rank 1/4 ships the (8×4 and 6×8) compressed gradients instead of the 32×16 and 24×32 weights'.
    dense = n_params - 32 * 16 - 24 * 32
    assert float(lsp_rows[-1]["offload/bytes_device_to_host"]) == 4 * (dense + 8 * 4 + 6 * 8)


def test_telemetry_is_logged_only_at_the_steps_the_trainer_writes(tmp_path, monkeypatch):
    """Lightning sends a step's logged values to its loggers every log_every_n_steps only; the offload/* figures are
    logged at exactly those steps (logging them at the others cost ~0.4 ms a figure for nothing)."""
    import lightning.pytorch as pl

    calls = []
    original = pl.LightningModule.log_dict

    def counting(self, dictionary, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if any(key.startswith("offload/") for key in dictionary):
            calls.append(self.trainer.global_step)
        return original(self, dictionary, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log_dict", counting)
    trainer(ZeroOffloadStrategy(pipelined=False), max_steps=6, logger=CSVLogger(tmp_path), log_every_n_steps=3).fit(
        TinyClassifier(), classification_data())
    (path,) = tmp_path.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(open(path)) if r.get("offload/bytes_device_to_host")]
    assert [r["step"] for r in rows] == ["2", "5"]
    assert len(calls) == 2  # the engine's figures were handed to Lightning at those two steps only


class ManualTiny(TinyClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        return loss


def test_manual_optimization_is_supported_and_matches_plain_adamw():
    reference = ManualTiny()
    trainer("auto", max_steps=5).fit(reference, classification_data())
    offloaded = ManualTiny()
    strategy = lossless_lsp()
    trainer(strategy, max_steps=5).fit(offloaded, classification_data())
    assert isinstance(strategy.optimizers[0], OffloadOptimizer)
    for name, value in params_of(reference).items():
        torch.testing.assert_close(params_of(offloaded)[name], value)


class PoisonedStep(TinyClassifier):
    """Step 2's loss is multiplied by nan, so every gradient of that step is non-finite."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


@pytest.mark.parametrize("kind", ["lsp", "zero"])
def test_non_finite_gradients_skip_the_step_without_touching_host_state(kind):
    make = (lambda: LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)) if kind == "lsp" else ZeroOffloadStrategy
    snapshots = {}

    class Snapshot(PoisonedStep):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 2:
                self.trainer.strategy.synchronize()  # the previous step's updates may still be in flight
                snapshots["before"] = _host_state(self.trainer.strategy.offload_optimizer), params_of(self)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.trainer.strategy.synchronize()
                snapshots["after"] = _host_state(self.trainer.strategy.offload_optimizer), params_of(self)

    strategy = make()
    module = Snapshot()
    trainer(strategy, max_steps=5).fit(module, classification_data())
    (state_before, params_before), (state_after, params_after) = snapshots["before"], snapshots["after"]
    assert all(torch.equal(a, b) for a, b in zip(state_before, state_after))
    assert all(torch.equal(params_before[n], params_after[n]) for n in params_before)
    telemetry = strategy.offload_optimizer.telemetry
    assert telemetry.skipped_steps == 1 and telemetry.steps == 4
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_non_finite_gradients_can_stop_training():
    with pytest.raises(NonFiniteGradientError, match=r"optimizer step 2.*on_nonfinite='skip'"):
        trainer(LSPOffloadStrategy(min_dim=16, rank=0.5, density=2, on_nonfinite="raise"), max_steps=5).fit(
            PoisonedStep(), classification_data()
        )


def _host_state(optimizer):
    """Masters / Z and Adam moments and step counts (not the landing buffers the gradients were copied into)."""
    tensors = []
    for slot in optimizer.slots:
        tensors.append(slot.host_param.clone())
        tensors += [v.clone() for state in slot.host_optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v)]
    return tensors


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_and_accumulation_under_bf16_true(algorithm):
    module = TinyCausalLM(tiny_hf_model("gpt2"))
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)
    trainer(strategy, max_steps=12, precision="bf16-true", accumulate_grad_batches=2, gradient_clip_val=0.5,
            gradient_clip_algorithm=algorithm).fit(module, token_data(n=96))
    assert strategy.offload_optimizer.telemetry.steps == 12
    assert sum(module.losses[-6:]) < sum(module.losses[:6])
    assert all(torch.isfinite(p).all() for p in module.parameters())
