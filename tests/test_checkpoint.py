"""Resume through Lightning's ckpt_path reproduces the uninterrupted run; optimizer state stays on the host."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_offload import LSPOffloadStrategy, ProjectorRefit, ZeroOffloadStrategy
from tiny_modules import TinyClassifier, classification_data, params_of, trainer

# 24 samples in batches of 8: three steps per epoch, so the interruption falls on an epoch boundary.
DATA = dict(n=24, batch_size=8)


def _strategy(kind):
    if kind == "zero":
        return ZeroOffloadStrategy()
    return LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, seed=3,
                              projectors="learned" if kind == "lsp_learned" else "random")


def _callbacks(kind):
    # Learned projectors refit every 2 steps whatever their error: steps 2, 4, 6 and 8 straddle the resume at 3.
    return [ProjectorRefit(refit_every=2, threshold=0.0, num_samples=2, max_iters=4)] if kind == "lsp_learned" else []


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("kind", ["lsp", "lsp_learned", "zero"])
def test_resume_reproduces_the_uninterrupted_run(kind, precision, tmp_path):
    # The uninterrupted run writes a checkpoint every 3 steps (an epoch boundary: Lightning itself does not
    # fast-forward a plain DataLoader when resuming mid-epoch).
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    straight = TinyClassifier()
    refit = _callbacks(kind)
    trainer(_strategy(kind), max_steps=9, precision=precision, enable_checkpointing=True,
            callbacks=[saver, *refit]).fit(straight, classification_data(**DATA))
    (path,) = tmp_path.glob("*step=3.ckpt")

    resumed = TinyClassifier(seed=7)  # different init: everything must come from the checkpoint
    strategy = _strategy(kind)
    resumed_refit = _callbacks(kind)
    trainer(strategy, max_steps=9, precision=precision, callbacks=resumed_refit).fit(
        resumed, classification_data(**DATA), ckpt_path=path)

    a, b = params_of(straight), params_of(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    assert strategy.offload_optimizer.telemetry.steps == 9
    if kind == "lsp_learned":
        # The initial fit ran once, before step 0; the resumed run refit at 4, 6 and 8 as the straight one did.
        assert [r.step for r in refit[0].history] == [0, 2, 4, 6, 8]
        assert [r.step for r in resumed_refit[0].history] == [4, 6, 8]
        assert resumed_refit[0].fits_done == 5
    else:
        assert resumed.losses == straight.losses[3:]


def test_checkpoint_holds_projectors_moments_and_step_counts(tmp_path):
    module = TinyClassifier()
    strategy = _strategy("lsp")
    fit = trainer(strategy, max_steps=2)
    fit.fit(module, classification_data(**DATA))
    fit.save_checkpoint(tmp_path / "c.ckpt")
    state = torch.load(tmp_path / "c.ckpt", weights_only=False)["optimizer_states"][0]
    assert set(state["projectors"]) == {"body.0", "body.3"}
    layer = strategy.projected_layers["body.0"]
    assert torch.equal(state["projectors"]["body.0"]["in"]["indices"], layer.proj_in.indices.cpu())
    # Forward order, named by module (projected) or parameter (dense); the vectors (biases, the LayerNorm's weight) are
    # stepped on the device (vectors="device"), their state in the device Adam's part, in their group's order.
    assert state["slots"] == ["body.0", "body.3", "head.weight"]
    moments = dict(zip(state["slots"], [s["state"][0] for s in state["host_adam"]]))
    assert all(float(m["step"]) == 2 for m in moments.values())
    vectors = [p for p in module.configure_optimizers().param_groups[1]["params"]]
    assert [p.dim() for p in vectors] == [1] * 5
    device_moments = [entry["state"][0] for entry in state["device_adam"]["adam"]]
    assert [tuple(m["exp_avg"].shape) for m in device_moments] == [tuple(p.shape) for p in vectors]
    assert all(float(m["step"]) == 2 and m["exp_avg"].abs().sum() > 0 for m in device_moments)
    assert tuple(moments["body.0"]["exp_avg"].shape) == layer.compressed_shape
    assert tuple(moments["body.3"]["exp_avg"].shape) == strategy.projected_layers["body.3"].compressed_shape
    assert list(torch.load(tmp_path / "c.ckpt", weights_only=False)["state_dict"]) == \
        list(TinyClassifier().state_dict())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_optimizer_state_lives_on_the_host_only_also_after_restore(device, tmp_path):
    def check(strategy, module):
        optimizer = strategy.offload_optimizer
        assert len(optimizer.state) == 0 and len(optimizer.wrapped.state) == 0
        assert optimizer.device_state_bytes() == 0
        params = {p.data_ptr() for p in module.parameters()}
        for tensor in optimizer.state_tensors():
            assert tensor.device.type == "cpu"
            assert tensor.data_ptr() not in params  # a real host copy, not an alias of the model's storage
        assert optimizer.host_state_bytes() > 0

    accelerator = "gpu" if device == "cuda" else "cpu"
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)
    module = TinyClassifier()
    fit = trainer(strategy, max_steps=3, accelerator=accelerator)
    fit.fit(module, classification_data(**DATA))
    check(strategy, module)
    fit.save_checkpoint(tmp_path / "c.ckpt")
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)
    module = TinyClassifier()
    trainer(strategy, max_steps=4, accelerator=accelerator).fit(module, classification_data(**DATA),
                                                                ckpt_path=tmp_path / "c.ckpt")
    check(strategy, module)


def test_a_failed_save_leaves_no_checkpoint_file(tmp_path):
    module = TinyClassifier()
    strategy = _strategy("lsp")
    fit = trainer(strategy, max_steps=1)
    fit.fit(module, classification_data(**DATA))

    def broken_save(checkpoint, path, storage_options=None):
        with open(path, "wb") as handle:
            handle.write(b"half a checkpoint")
        raise OSError("disk full")

    strategy.checkpoint_io.save_checkpoint = broken_save
    with pytest.raises(OSError, match="disk full"):
        fit.save_checkpoint(tmp_path / "c.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_resuming_with_different_projection_settings_is_refused(tmp_path):
    module = TinyClassifier()
    fit = trainer(_strategy("lsp"), max_steps=1)
    fit.fit(module, classification_data(**DATA))
    fit.save_checkpoint(tmp_path / "c.ckpt")
    other = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, exclude_modules=["body.3"])
    with pytest.raises(ValueError, match="resume with the same model"):
        trainer(other, max_steps=2).fit(TinyClassifier(), classification_data(**DATA), ckpt_path=tmp_path / "c.ckpt")
