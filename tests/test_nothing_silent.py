"""Nothing silent: skipped steps, nothing projected, an added callback and refits that cannot succeed are all said."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_offload import LSPOffloadStrategy, NonFiniteStepWarning, ProjectorRefit, ZeroOffloadStrategy
from lightning_offload.reporting.summary import format_summary
from tiny_modules import TinyCausalLM, TinyClassifier, classification_data, tiny_hf_model, token_data, trainer


class NanLoss(TinyClassifier):
    """Steps 1 and 3 return a nan loss."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in (1, 3) else loss


@pytest.mark.parametrize("make", [ZeroOffloadStrategy, lambda: LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)],
                         ids=["zero", "lsp"])
def test_every_skipped_step_is_warned_and_counted(make):
    strategy = make()
    with pytest.warns(NonFiniteStepWarning) as caught:
        trainer(strategy, max_steps=5).fit(NanLoss(), classification_data())
    messages = [str(w.message) for w in caught if issubclass(w.category, NonFiniteStepWarning)]
    assert len(messages) == 2
    assert "1 step(s) skipped so far" in messages[0] and "2 step(s) skipped so far" in messages[1]
    assert "on_nonfinite='raise'" in messages[0]
    assert strategy.offload_optimizer.telemetry.skipped_steps == 2


def test_the_summary_says_how_many_steps_were_skipped():
    summary = {"device_peak_bytes": None, "device": "cpu", "host_peak_rss_bytes": 2**30, "median_step_seconds": 0.1,
               "model": "m", "task": "t", "offload": "zero", "strategy": "S", "precision": "32-true",
               "trainable_parameters": 1, "link_bytes_to_host_per_step": 0.0, "link_bytes_to_device_per_step": 0.0,
               "host_optimizer_seconds_per_step": 0.0, "host_state_bytes": 0.0, "device_state_bytes": 0.0,
               "steps": 8, "train_seconds": 1.0, "loss_before": 3.0, "loss_after": 2.0, "metric": "val/loss",
               "skipped_steps": 7}
    assert "8 in 1.0 s (median 0.10 s / step), 7 skipped (non-finite gradients)" in format_summary(summary)
    summary["skipped_steps"] = 0
    assert "skipped" not in format_summary(summary)


def test_nothing_to_project_is_warned():
    strategy = LSPOffloadStrategy(projectors="random")  # min_dim=128: nothing in the tiny model qualifies
    with pytest.warns(UserWarning, match=r"found no layer to project.*min_dim=128.*as with zero_offload"):
        trainer(strategy, max_steps=1).fit(TinyClassifier(), classification_data())
    assert strategy.projected_layers == {}


class _LoRALinear(torch.nn.Module):
    """A frozen Linear with a trainable low-rank adapter beside it, as LoRA (or PEFT) puts it."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _lora_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    model[0], model[2] = _LoRALinear(model[0]), _LoRALinear(model[2])
    return model


class _NoLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(300, 256)
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.embedding(ids))


@pytest.mark.parametrize("build, found, fix", [
    (_lora_model, r"the 4 trainable Linear/Conv1D layers are all below min_dim=128 \(the largest 4×256: out × in\), "
                  r"and the other 2 are frozen: adapters such as LoRA's", r"Fix: use zero_offload instead"),
    (_NoLinear, r"_NoLinear has no nn.Linear or Conv1D layer", r"Fix: use zero_offload instead"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 8)),
     r"the 2 trainable Linear/Conv1D layers are all below min_dim=128 \(the largest 64×256", r"Fix: lower min_dim \(to "
     r"64 for the largest\), or use zero_offload instead"),
], ids=["lora", "no_linear", "small"])
def test_nothing_to_project_says_what_was_found_and_the_fix_for_that_model(build, found, fix):
    import lightning_offload

    model = build()
    trained = [p for p in model.parameters() if p.requires_grad]
    with pytest.warns(UserWarning, match=rf"found no layer to project: {found}.*as with zero_offload\. {fix} "
                                         rf"\(strategy='zero_offload', FabricZeroOffload, or "
                                         rf"lightning_offload.offload\(model, optimizer, 'zero_offload'\)\)") as caught:
        lightning_offload.offload(model, torch.optim.AdamW(trained)).close()
    said = [str(w.message) for w in caught if "no layer to project" in str(w.message)]
    # Lowering min_dim is the fix only where the trainable layers are merely small.
    assert ("lower min_dim" in said[0].lower()) == (fix.startswith("Fix: lower")), said[0]


def test_the_default_refit_callback_is_announced(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer(LSPOffloadStrategy(projectors="learned", rank=0.5, density=2, min_dim=16), max_steps=1).fit(
            TinyCausalLM(tiny_hf_model("llama")), token_data())
    assert any(r.getMessage().startswith("lsp_offload: projectors='learned' added ProjectorRefit(refit_every=500")
               for r in caplog.records)  # under the strategy's own name (lsp_offload_ddp says its own)


def test_no_announcement_when_the_user_brings_the_callback(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer(LSPOffloadStrategy(projectors="learned", rank=0.5, density=2, min_dim=16), max_steps=1,
                callbacks=[ProjectorRefit(refit_every=0)]).fit(TinyCausalLM(tiny_hf_model("llama")), token_data())
    assert not any("added ProjectorRefit" in r.getMessage() for r in caplog.records)


def test_a_refit_that_cannot_reach_its_threshold_is_warned():
    refit = ProjectorRefit(refit_every=2, threshold=0.0, num_samples=2, max_iters=2)
    with pytest.warns(UserWarning, match=r"ProjectorRefit at step 2: \d+ of \d+ refitted layers stay above "
                                         r"threshold=0.0.*refitted at every check"):
        trainer(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16), max_steps=3,
                callbacks=[refit]).fit(
            TinyCausalLM(tiny_hf_model("llama")), token_data())
    assert torch.isfinite(torch.tensor(list(refit.history[-1].fitted_errors.values()))).all()


def test_an_initial_fit_that_ends_above_its_threshold_is_warned():
    refit = ProjectorRefit(refit_every=0, threshold=0.0, num_samples=2, max_iters=2)
    with pytest.warns(UserWarning, match=r"ProjectorRefit: the initial fit left \d+ of \d+ layers above "
                                         r"threshold=0.0 .* projectors='random'"):
        trainer(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16), max_steps=1,
                callbacks=[refit]).fit(
            TinyCausalLM(tiny_hf_model("llama")), token_data())


def test_random_draws_leave_the_update_scale_exactly_one():
    """The README promises random projectors' arithmetic untouched: c = 1 exactly at every density."""
    from lightning_offload import random_projector
    from lightning_offload.lsp.update_size import update_scale

    generator = torch.Generator().manual_seed(0)
    for density in range(1, 13):
        out, inp = (random_projector(size, max(density, size // 4), density, generator, torch.device("cpu"))
                    for size in (96, 160))
        assert update_scale(out, inp) == 1.0, density


def test_the_first_steps_device_time_does_not_include_the_projector_fit():
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.5, density=2, min_dim=16)
    refit = ProjectorRefit(refit_every=0, num_samples=2, max_iters=16, target_error=0.0)
    module = TinyCausalLM(tiny_hf_model("llama"))
    first = {}

    class FirstStep(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:  # step 1's timeline is complete once step 2 has synchronised it
                first["device"] = strategy.offload_optimizer.timelines.steps[0][1].busy("device")

    trainer(strategy, max_steps=2, callbacks=[refit, FirstStep()]).fit(module, token_data())
    fit_seconds = refit.history[0].seconds
    assert fit_seconds > 0
    # Before, the fit's seconds were counted in the first step's forward+backward.
    assert first["device"] < 0.5 * fit_seconds, (first["device"], fit_seconds)


@pytest.mark.parametrize("make", [ZeroOffloadStrategy, lambda: LSPOffloadStrategy(projectors="random")],
                         ids=["zero", "lsp"])
def test_more_than_one_device_is_refused_instead_of_silently_using_one(make):
    module = TinyClassifier()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"trains on one device, but the Trainer asks for 2 device\(s\).*devices=1"):
        trainer(make(), devices=2, max_steps=1).fit(module, classification_data())
    assert all(torch.equal(before[n], p) for n, p in module.named_parameters())


def test_the_projector_fit_says_what_it_does_and_shows_progress(caplog, capsys):
    module = TinyCausalLM(tiny_hf_model("llama"))
    strategy = LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16)
    refit = ProjectorRefit(num_samples=2, max_iters=4)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer(strategy, max_steps=1, callbacks=[refit], enable_progress_bar=True).fit(module, token_data())
    layers = len(strategy.projected_layers)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"fitting the projectors of {layers} layers before the first step on 2 sampled batches" in m
               for m in messages), messages
    done = [m for m in messages if f"fitted {layers} of {layers} layers in" in m]
    assert len(done) == 1 and "(norm-scaled random) ->" in done[0] and "(held-out)" in done[0]
    # Its own bar counts layer samples: 2 batches × every layer (and clears itself when done).
    assert f"Projector fit:   0%|          | 0/{2 * layers}" in capsys.readouterr().err


def test_no_fit_bar_without_progress_bars(capsys):
    trainer(LSPOffloadStrategy(projectors="learned", rank=0.25, density=2, min_dim=16), max_steps=1,
            callbacks=[ProjectorRefit(num_samples=1, max_iters=2)]).fit(TinyCausalLM(tiny_hf_model("llama")),
                                                                        token_data())
    assert "Projector fit" not in capsys.readouterr().err


def with_scheduler():
    return TinyClassifier(
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s)))


@pytest.mark.parametrize("module", [TinyClassifier, with_scheduler], ids=["no-scheduler", "scheduler"])
@pytest.mark.parametrize("make", [ZeroOffloadStrategy, lambda: LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)],
                         ids=["zero", "lsp"])
def test_the_learning_rate_is_logged_once_under_the_users_optimizer(tmp_path, make, module):
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="", version="")
    trainer(make(), max_steps=3, logger=logger, log_every_n_steps=1,
            callbacks=[LearningRateMonitor(logging_interval="step")]).fit(module(), classification_data())
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    # The tiny classifier has two parameter groups.
    assert [key for key in header if key.startswith("lr-")] == ["lr-AdamW/pg1", "lr-AdamW/pg2"], header
