"""MEFT: experts that routing never picks owe AdamW's decoupled decay, and every read shows it: ``state_dict()``,
``save_meft_adapters``, a checkpoint, the rows after the strategy settles them and after the run hands them back,
each against torch's AdamW fed the same gradients; training is the same, bit for bit, whether or not anything read
the rows, and a checkpoint holding the shown rows resumes as the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from test_meft import SMALL, _full_size, batches, loader, trainer

from lightning_offload import MEFTConfig, MEFTOffloadStrategy, inject_meft, meft_adapters
from lightning_offload.meft.export import load_meft_adapters, save_meft_adapters
from lightning_offload.models.tiny import tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule

# Many small experts and few steps: some experts are never routed to. A large decay, so that it shows.
IDLE = {**SMALL, "num_experts": 32}
STEPS, READ_AT, WEIGHT_DECAY = 4, 2, 0.5
# torch's AdamW rounds its decay at every step, the row Adam once over the steps a block missed: fp32 rounding apart.
ROUNDING = {"rtol": 1e-6, "atol": 1e-7}


def _model() -> torch.nn.Module:
    model = tiny_llama()
    inject_meft(model, MEFTConfig(**IDLE))
    return model


def _module(model: torch.nn.Module) -> CausalLMModule:
    return CausalLMModule(model, lr=1e-2, weight_decay=WEIGHT_DECAY)


def _record_steps(strategy: MEFTOffloadStrategy) -> list[list[tuple[torch.Tensor, list[torch.Tensor], Any]]]:
    """Per adapter, each row step's blocks, full-size gradients and settings, as the row Adam consumed them."""
    steps: list[list[tuple[torch.Tensor, list[torch.Tensor], Any]]] = []
    setup = strategy.setup_optimizers

    def recording_setup(trainer: pl.Trainer) -> None:
        setup(trainer)
        for slot in strategy.attached.slots:
            record: list[tuple[torch.Tensor, list[torch.Tensor], Any]] = []
            steps.append(record)
            optimizer, step = slot.row_adam, slot.row_adam.step

            def recording_step(blocks, grads, settings, clip=None, zero_grads=True, step=step, optimizer=optimizer,
                               record=record):
                record.append((blocks.clone(), [g.clone() for g in _full_size(optimizer, blocks, grads)], settings))
                return step(blocks, grads, settings, clip, zero_grads)

            optimizer.step = recording_step

    strategy.setup_optimizers = recording_setup
    return steps


def _torch_adamw(initial: list[torch.Tensor], record: list[tuple[torch.Tensor, list[torch.Tensor], Any]],
                 steps: int) -> list[torch.Tensor]:
    """An adapter's keys and values after ``steps`` steps of torch's AdamW over the whole matrices, fed the
    gradients the row Adam was given (zero in every row it did not step)."""
    params = [torch.nn.Parameter(matrix.clone()) for matrix in initial]
    settings = record[0][2]
    adamw = torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                              weight_decay=settings.weight_decay)
    for _, grads, settings in record[:steps]:
        assert settings.lr == adamw.param_groups[0]["lr"] and settings.decoupled
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        adamw.step()
    return [param.detach() for param in params]


def _idle_rows(adapter: Any, record: list[tuple[torch.Tensor, list[torch.Tensor], Any]]) -> torch.Tensor:
    """The rows of the experts no step of the run touched (asserted to exist: the comparison is not vacuous)."""
    block_rows = adapter.config.neurons_per_expert
    stepped = torch.zeros(adapter.config.num_experts, dtype=torch.bool)
    for blocks, _, _ in record:
        stepped[blocks] = True
    assert 0 < int(stepped.sum()) < stepped.numel()
    return (~stepped).repeat_interleave(block_rows).nonzero().squeeze(1)


class _Reads(pl.Callback):
    """At step ``READ_AT``: ``state_dict()``, ``save_meft_adapters``, the host rows after the strategy settles them and
    an evaluation forward's logits; and a read between a backward and its step. Said to leave the weights alone, so
    the strategy settles nothing after each step for it: each read must show the decay by itself."""

    leaves_weights_alone = True

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "adapters.pt"
        self.state: dict[str, torch.Tensor] = {}
        self.settled: list[torch.Tensor] = []
        self.logits = torch.zeros(0)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != READ_AT:
            return
        model = pl_module.model
        self.logits = _eval_logits(model)  # the first read after the step: its own forward shows the decay
        self.state = {name: value.clone() for name, value in model.state_dict().items() if name.endswith("keys")}
        save_meft_adapters(model, self.path)
        trainer.strategy.synchronize()  # the strategy's settle: the engine's settle_row_decay
        self.settled = [adapter.host.keys.clone() for adapter in meft_adapters(model)]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == READ_AT + 1:
            pl_module.model.state_dict()  # shows the decay between backward and step: the step must not see it


def _eval_logits(model: torch.nn.Module) -> torch.Tensor:
    batch = batches(1, seed=12)[0]
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _fit(tmp_path: Path, callbacks: list[pl.Callback]) -> tuple[torch.nn.Module, list[torch.Tensor], list[Any]]:
    model = _model()
    initial = [t.clone() for adapter in meft_adapters(model) for t in (adapter.host.keys, adapter.host.values)]
    strategy = MEFTOffloadStrategy(device="cpu")
    steps = _record_steps(strategy)
    trainer(tmp_path, STEPS, strategy, callbacks=callbacks).fit(_module(model),
                                                                train_dataloaders=loader(batches(STEPS, seed=4)))
    return model, initial, steps


def test_idle_experts_show_adamws_decay_in_every_read_and_after_the_run(tmp_path: Path) -> None:
    reads = _Reads(tmp_path)
    model, initial, steps = _fit(tmp_path / "read", [reads])
    saved = torch.load(reads.path, weights_only=True)["adapters"]
    names = [name for name, _ in model.named_modules() if name.endswith(".adapter")]
    for index, (name, adapter) in enumerate(zip(names, meft_adapters(model))):
        idle = _idle_rows(adapter, steps[index])
        start = initial[2 * index:2 * index + 2]
        at_read, at_end = _torch_adamw(start, steps[index], READ_AT), _torch_adamw(start, steps[index], STEPS)
        assert not torch.allclose(at_read[0][idle], start[0][idle])  # the decay is there to be shown
        for shown in (reads.state[f"{name}.keys"], saved[f"{name.removesuffix('.adapter')}.keys"],
                      reads.settled[index]):
            torch.testing.assert_close(shown[idle], at_read[0][idle], **ROUNDING)
        # Handed back at the end of the run: the rows themselves, and what state_dict() reads of them.
        torch.testing.assert_close(adapter.host.keys[idle], at_end[0][idle], **ROUNDING)
        torch.testing.assert_close(model.state_dict()[f"{name}.keys"][idle], at_end[0][idle], **ROUNDING)
        assert torch.equal(adapter.host.values[idle], at_end[1][idle])  # zero, as AdamW keeps zero
    # An evaluation forward computes with the rows as shown: those of the adapters saved at the same step.
    exported = load_meft_adapters(tiny_llama(), reads.path)
    assert torch.equal(reads.logits, _eval_logits(exported))
    # The reads changed no step: the run without them ends on the same rows, bit for bit.
    unread, _, _ = _fit(tmp_path / "unread", [])
    for read_adapter, unread_adapter in zip(meft_adapters(model), meft_adapters(unread)):
        assert torch.equal(read_adapter.host.keys, unread_adapter.host.keys)
        assert torch.equal(read_adapter.host.values, unread_adapter.host.values)


def test_a_checkpoint_shows_the_decay_and_resumes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    data = batches(3, seed=11)
    straight = _model()
    trainer(tmp_path / "straight", 6).fit(_module(straight), train_dataloaders=loader(data))

    first = _model()
    initial = [t.clone() for adapter in meft_adapters(first) for t in (adapter.host.keys, adapter.host.values)]
    strategy = MEFTOffloadStrategy(device="cpu")
    steps = _record_steps(strategy)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=3)
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=tmp_path / "first", callbacks=[checkpoint]).fit(
        _module(first), train_dataloaders=loader(data))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    names = [name for name, _ in first.named_modules() if name.endswith(".adapter")]
    for index, (name, adapter) in enumerate(zip(names, meft_adapters(first))):
        idle = _idle_rows(adapter, steps[index])
        reference = _torch_adamw(initial[2 * index:2 * index + 2], steps[index], 3)
        torch.testing.assert_close(saved[f"model.{name}.keys"][idle], reference[0][idle], **ROUNDING)

    resumed = _model()
    trainer(tmp_path / "resumed", 6).fit(_module(resumed), train_dataloaders=loader(data),
                                         ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    for a, b in zip(meft_adapters(straight), meft_adapters(resumed)):
        assert torch.equal(a.host.keys, b.host.keys)
        assert torch.equal(a.host.values, b.host.values)
        assert torch.equal(a.router.weight, b.router.weight)
