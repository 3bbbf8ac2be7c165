"""End-to-end checks of compress → host step → expand against plain PyTorch optimizers."""

import pytest
import torch

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from tiny_modules import TinyClassifier, classification_data, lossless_lsp, params_of, trainer


STRATEGIES = {"lsp": lossless_lsp, "zero": lambda: ZeroOffloadStrategy()}
OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
    "adam_l2": lambda groups: torch.optim.Adam(groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
    "adamw_amsgrad": lambda groups: torch.optim.AdamW(groups, lr=5e-3, weight_decay=0.01, amsgrad=True),
}


def _fit(strategy, steps=6, **trainer_kwargs):
    module = TinyClassifier(**trainer_kwargs.pop("module_kwargs", {}))
    trainer(strategy, max_steps=steps, **trainer_kwargs).fit(module, classification_data())
    return module


def _assert_same_params(a, b):
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pb[name], pa[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_trajectory_equals_plain_optimizer(strategy, optimizer):
    kwargs = {"module_kwargs": {"optimizer_factory": OPTIMIZERS[optimizer]}}
    reference = _fit("auto", **kwargs)
    offloaded = _fit(STRATEGIES[strategy](), **{"module_kwargs": {"optimizer_factory": OPTIMIZERS[optimizer]}})
    _assert_same_params(reference, offloaded)
    assert offloaded.losses == pytest.approx(reference.losses, rel=1e-5)
    # A run that moved nowhere would also "match": make sure training did something.
    initial = params_of(TinyClassifier())
    assert all(not torch.equal(initial[n], p) for n, p in params_of(offloaded).items())


@pytest.mark.parametrize("algorithm, value", [("norm", 0.05), ("value", 0.002)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_clipping_matches_plain_clipping(strategy, algorithm, value):
    clip = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
    reference = _fit("auto", **clip)
    offloaded = _fit(STRATEGIES[strategy](), **clip)
    unclipped = _fit("auto")
    _assert_same_params(reference, offloaded)
    # The clip threshold is small enough to bind: clipped and unclipped runs differ.
    assert not torch.allclose(params_of(unclipped)["head.weight"], params_of(reference)["head.weight"])


@pytest.mark.parametrize("strategy", ["lsp_random", "zero"])
def test_gradient_accumulation_equals_one_large_batch(strategy):
    def make():
        if strategy == "zero":
            return ZeroOffloadStrategy()
        return LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, projectors="random")

    accumulated = TinyClassifier()
    trainer(make(), max_steps=4, accumulate_grad_batches=4).fit(accumulated, classification_data(batch_size=2))
    large = TinyClassifier()
    trainer(make(), max_steps=4).fit(large, classification_data(batch_size=8))
    _assert_same_params(large, accumulated)


def test_lr_scheduler_attached_to_the_users_optimizer_keeps_working():
    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 2 else 0.1)

    kwargs = {"module_kwargs": {"scheduler": schedule}}
    reference = _fit("auto", **kwargs)
    offloaded = _fit(lossless_lsp(), module_kwargs={"scheduler": schedule})
    _assert_same_params(reference, offloaded)
    unscheduled = _fit(lossless_lsp())
    assert not torch.allclose(params_of(unscheduled)["body.0.weight"], params_of(offloaded)["body.0.weight"])


def test_lsp_with_compression_trains_every_parameter_and_reduces_loss():
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)
    module = TinyClassifier()
    before = params_of(module)
    trainer(strategy, max_steps=20).fit(module, classification_data())
    after = params_of(module)
    assert set(strategy.offload_optimizer.projected_layers[i].name for i in range(2)) == {"body.0", "body.3"}
    assert all(not torch.equal(before[n], after[n]) for n in before), "a trainable parameter was left frozen"
    assert sum(module.losses[-8:]) / 8 < sum(module.losses[:8]) / 8
