"""The patterns users bring from their own projects, each against plain Lightning on a separate model."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_offload import ZeroOffloadStrategy
from tiny_modules import TinyClassifier, classification_data, lossless_lsp, params_of, trainer

STRATEGIES = {"lsp": lossless_lsp, "zero": lambda: ZeroOffloadStrategy()}


class PartlyFrozen(TinyClassifier):
    """The most common pattern: a few layers frozen, ``AdamW(self.parameters())`` kept as it was (here: the first
    Linear, a projectable one, and the LayerNorm's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.body[0].weight.requires_grad_(False)
        self.body[2].weight.requires_grad_(False)


def _fit(module: TinyClassifier, strategy, steps: int = 6, **kwargs) -> TinyClassifier:
    trainer(strategy, max_steps=steps, **kwargs).fit(module, classification_data())
    return module


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_left_in_the_optimizer_are_skipped_as_torch_skips_them(strategy: str) -> None:
    reference = _fit(PartlyFrozen(), "auto")
    offloaded = _fit(PartlyFrozen(), STRATEGIES[strategy]())
    initial = params_of(PartlyFrozen())
    for name, value in params_of(offloaded).items():
        torch.testing.assert_close(value, params_of(reference)[name], msg=name)
        if name in ("body.0.weight", "body.2.weight"):
            assert torch.equal(value, initial[name])  # not trained, as under plain Lightning
        else:
            assert not torch.equal(value, initial[name])
    assert offloaded.body[0].weight.requires_grad is False  # left as the user set it


class UnfreezeAt(pl.Callback):
    """A user's own unfreezing schedule: the first Linear starts training at step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.body[0].weight.requires_grad_(True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_parameter_unfrozen_during_the_fit_trains_as_under_plain_lightning(strategy: str) -> None:
    """torch.optim steps any parameter of its groups that has a gradient, its state created at that first step: so
    does the engine (a dense host step from then on, said in one log line)."""
    reference = _fit(PartlyFrozen(), "auto", callbacks=[UnfreezeAt(2)])
    offloaded = _fit(PartlyFrozen(), STRATEGIES[strategy](), callbacks=[UnfreezeAt(2)])
    initial = params_of(PartlyFrozen())
    for name, value in params_of(offloaded).items():
        torch.testing.assert_close(value, params_of(reference)[name], msg=name)
    assert not torch.equal(params_of(offloaded)["body.0.weight"], initial["body.0.weight"])


class WithBackbone(pl.LightningModule):
    """Lightning's ``BackboneFinetuning`` pattern: a backbone frozen by the callback, unfrozen at an epoch and added to
    the optimizer as a param group of its own; the optimizer built over what is trainable at the start."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 24), nn.GELU())
        self.head = nn.Linear(24, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backbone_finetuning_equals_plain_lightning(strategy: str) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    def fit(strategy_: object) -> WithBackbone:
        module = WithBackbone()
        callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, verbose=False)
        trainer(strategy_, max_steps=-1, max_epochs=3, callbacks=[callback]).fit(module, classification_data())
        return module

    reference, offloaded = fit("auto"), fit(STRATEGIES[strategy]())
    initial = params_of(WithBackbone())
    got, want = params_of(offloaded), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert not torch.equal(got["backbone.0.weight"], initial["backbone.0.weight"])  # the added group trained


class SharedWeight(pl.LightningModule):
    """Two projectable Linears holding one weight (``net[2].weight = net[0].weight``), each with its own bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))
        self.net[2].weight = self.net[0].weight

    def get_output_embeddings(self) -> nn.Module:
        return self.net[4]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_weight_shared_by_two_modules_gets_the_gradient_of_every_use(strategy: str) -> None:
    reference, offloaded = SharedWeight(), SharedWeight()
    for module, chosen in ((reference, "auto"), (offloaded, STRATEGIES[strategy]())):
        trainer(chosen, max_steps=8).fit(module, classification_data())
    for name, value in params_of(offloaded).items():
        torch.testing.assert_close(value, params_of(reference)[name], msg=name)
    assert offloaded.net[2].weight is offloaded.net[0].weight  # still one tensor, and the modules' own forwards back
    assert "forward" not in offloaded.net[0].__dict__ and not hasattr(offloaded.net[2], "_lsp_state")


def test_a_shared_weight_is_projected_once_for_all_its_modules() -> None:
    strategy = lossless_lsp()
    trainer(strategy, max_steps=1).fit(SharedWeight(), classification_data())
    (layer,) = strategy.offload_optimizer.projected_layers  # net.4 is the head: not projected
    assert layer.name == "net.0" and [id(m) for m in layer.modules] == [id(m) for m in strategy.model.net[0:3:2]]


def test_meft_trains_with_the_frozen_base_left_in_the_optimizer(tmp_path) -> None:
    """The README's MEFT snippet with ``AdamW(model.parameters())``: the frozen base is skipped, the adapters train
    exactly as with the trainable parameters filtered by hand."""
    from test_meft import batches, loader, meft_adapters, meft_model
    from test_meft import trainer as meft_trainer

    from lightning_offload import MEFTOffloadStrategy
    from lightning_offload.tasks.causal_lm import CausalLMModule

    def fit(everything: bool) -> list[torch.Tensor]:
        model = meft_model()

        def adamw(network: nn.Module) -> torch.optim.Optimizer:
            params = network.parameters() if everything else [p for p in network.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=1e-2)

        meft_trainer(tmp_path / str(everything), 4, MEFTOffloadStrategy(device="cpu")).fit(
            CausalLMModule(model, optimizer_factory=adamw), train_dataloaders=loader(batches(4, seed=3)))
        return [t for a in meft_adapters(model) for t in (a.host.keys, a.host.values, a.router.weight)]

    everything, filtered = fit(everything=True), fit(everything=False)
    assert all(bool(v.abs().sum() > 0) for v in everything[1::3])  # the values, zero at injection, trained
    for got, want in zip(everything, filtered):
        assert torch.equal(got, want)


class EMAAfterEachStep(pl.callbacks.WeightAveraging):
    """Lightning's weight averaging as an EMA updated after every optimizer step (decay 0.5: recent steps count)."""

    def __init__(self) -> None:
        super().__init__(avg_fn=torch.optim.swa_utils.get_ema_avg_fn(0.5))


PIPELINED_STRATEGIES = {
    "lsp-pipelined": lambda: lossless_lsp(pipelined=True),
    "lsp-synchronous": lambda: lossless_lsp(pipelined=False),
    "zero-pipelined": lambda: ZeroOffloadStrategy(pipelined=True),
    "zero-synchronous": lambda: ZeroOffloadStrategy(pipelined=False),
}


@pytest.mark.parametrize("strategy", PIPELINED_STRATEGIES)
def test_lightnings_weight_averaging_sees_each_steps_weights(strategy: str, caplog) -> None:
    """The average is taken right after each step and copied into the module at the end of fit: under an offload
    strategy it must read that step's weights (not the previous step's, nor weights the host worker is writing) and
    the module must end as the average (no pending update applied over it)."""
    import logging

    reference = _fit(TinyClassifier(), "auto", steps=8, callbacks=[EMAAfterEachStep()])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        offloaded = _fit(TinyClassifier(), PIPELINED_STRATEGIES[strategy](), steps=8, callbacks=[EMAAfterEachStep()])
    trained = _fit(TinyClassifier(), "auto", steps=8)
    for name, value in params_of(offloaded).items():
        torch.testing.assert_close(value, params_of(reference)[name], msg=name)
        assert not torch.allclose(value, params_of(trained)[name])  # the module ends as the average, not the last step
    if strategy.endswith("pipelined"):  # said, not silent: the pipelining it gives up after each step
        assert any("EMAAfterEachStep" in r.getMessage() and "may read or write the weights" in r.getMessage()
                   for r in caplog.records)


class SkipsEvenBatches(TinyClassifier):
    """``training_step`` returns None for every even batch index: Lightning's way to skip a batch."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 == 0 else super().training_step(batch, batch_idx)


def test_a_batch_the_projector_fit_draws_and_training_step_skips_is_replaced_by_another() -> None:
    from lightning_offload import LSPOffloadStrategy, ProjectorRefit

    refit = ProjectorRefit(num_samples=3, refit_every=0)
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.5, density=2, min_dim=16)
    module = SkipsEvenBatches()
    trainer(strategy, max_steps=2, callbacks=[refit]).fit(module, classification_data())
    (record,) = refit.history
    assert record.initial and set(record.refit) == {"body.0", "body.3"}


def test_sigterm_during_the_projector_fit_stops_it_at_the_next_layer() -> None:
    """A preempted job stops promptly: Lightning notes SIGTERM, and the fit checks for it between layers."""
    import os
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_offload import LSPOffloadStrategy, ProjectorRefit

    passes = []

    def loss_then_sigterm(module, batch):
        passes.append(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts the job during the first sampled pass
        x, y = batch
        return nn.functional.cross_entropy(module(x), y)

    refit = ProjectorRefit(num_samples=4, loss_fn=loss_then_sigterm)
    module = TinyClassifier()
    with pytest.raises(SIGTERMException):
        trainer(LSPOffloadStrategy(projectors="learned", rank=0.5, density=2, min_dim=16), max_steps=2,
                callbacks=[refit]).fit(
            module, classification_data())
    assert len(passes) == 1 and not refit.history and module.losses == []  # no second pass, no fit, no step


def test_weight_averaging_under_meft_says_the_host_rows_are_not_averaged(tmp_path) -> None:
    from test_meft import batches, loader, meft_model
    from test_meft import trainer as meft_trainer

    from lightning_offload import MEFTOffloadStrategy
    from lightning_offload.tasks.causal_lm import CausalLMModule

    with pytest.warns(UserWarning, match=r"meft_offload: EMAAfterEachStep averages the module's parameters \(the "
                                         r"routers\), not the adapter rows"):
        meft_trainer(tmp_path, 2, MEFTOffloadStrategy(device="cpu"), callbacks=[EMAAfterEachStep()]).fit(
            CausalLMModule(meft_model(), lr=1e-2), train_dataloaders=loader(batches(2, seed=3)))


def _through_zero(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A schedule that passes through lr 0 mid-run (steps 2 and 3), as a cosine to 0 or a linear decay does."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0 if step in (2, 3) else 1.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_schedule_through_lr_zero_runs_and_equals_plain_lightning(strategy: str) -> None:
    reference = _fit(TinyClassifier(scheduler=_through_zero), "auto", steps=6)
    offloaded = _fit(TinyClassifier(scheduler=_through_zero), STRATEGIES[strategy](), steps=6)
    for name, value in params_of(offloaded).items():
        torch.testing.assert_close(value, params_of(reference)[name], msg=name)


def test_meft_runs_through_lr_zero_and_moves_no_row_while_it_is_zero(tmp_path) -> None:
    """Blocks stepped after a gap at lr 0 made the block Adam divide by zero (the run stopped with HostWorkerError).
    At lr 0 AdamW moves nothing (no step, no decoupled decay): nor may the host rows."""
    from test_meft import batches, loader, meft_adapters, meft_model
    from test_meft import trainer as meft_trainer

    from lightning_offload import MEFTOffloadStrategy
    from lightning_offload.tasks.causal_lm import CausalLMModule

    class ThroughZero(CausalLMModule):
        def configure_optimizers(self):
            optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2,
                                          weight_decay=0.1)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": _through_zero(optimizer), "interval": "step"}}

    class RowsAfterEachStep(pl.Callback):
        def __init__(self) -> None:
            self.values: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            trainer.strategy.synchronize()
            self.values.append(torch.cat([a.host.values.clone() for a in meft_adapters(pl_module.model)]))

    model = meft_model()
    with torch.no_grad():  # values away from zero, so decay and the keys' gradients would show
        for adapter in meft_adapters(model):
            adapter.host.values.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    rows = RowsAfterEachStep()
    meft_trainer(tmp_path, 6, MEFTOffloadStrategy(device="cpu"), callbacks=[rows]).fit(
        ThroughZero(model), train_dataloaders=loader(batches(6, seed=9)))
    assert len(rows.values) == 6
    assert torch.equal(rows.values[2], rows.values[1]) and torch.equal(rows.values[3], rows.values[1])  # lr 0
    assert not torch.equal(rows.values[4], rows.values[3])  # and training goes on after it
