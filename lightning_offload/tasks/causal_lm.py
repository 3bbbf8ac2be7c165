"""A LightningModule that fine-tunes any Hugging Face causal language model."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_offload.lm_loss import (
    IGNORE_INDEX, LogitTransform, base_and_head, causal_lm_loss, check_loss_kind, head_predictions, hidden_and_head)
from lightning_offload.tasks.schedule import LinearWarmup, OptimSettings  # noqa: F401  (LinearWarmup: public here too)


def count_target_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Number of tokens that contribute to an HF causal-LM loss for ``batch`` (HF shifts labels left by one inside
    the model, so a row's first label is never a target)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def _lm_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Pass only what a causal LM's forward takes; datamodules may add extra fields.
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels") if k in batch}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Splits trainable parameters into a decayed and an undecayed optimizer group.

    Matrices and embeddings (rank >= 2) get ``weight_decay``; biases and norm scales get 0, as decaying them only
    pulls activations toward zero. ``named_parameters`` yields a tied parameter once, so it is not stepped twice.

    Returns:
        ``[{"params": decayed, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]``;
        either list may be empty.
    """
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def run_length(module: L.LightningModule) -> int | None:
    """The optimizer steps of the run ``module`` is attached to (``None`` outside a Trainer or when unbounded)."""
    if module._trainer is None:
        return None
    steps = module.trainer.estimated_stepping_batches
    return int(steps) if math.isfinite(steps) else None


def with_schedule(module: L.LightningModule, optimizer: torch.optim.Optimizer) -> Any:
    """``configure_optimizers``' return value: the optimizer, with its per-step scheduler when the module's
    ``optim_settings`` ask for one."""
    scheduler = module.optim_settings.scheduler(optimizer, run_length(module))
    if scheduler is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


class CausalLMModule(L.LightningModule):
    """Trains an HF causal LM on batches of ``{"input_ids", "attention_mask", "labels"}``.

    Logs ``train/loss`` every step and, per validation epoch, ``val/loss`` (mean over target tokens, not over batches,
    so a short last batch is not over-weighted), ``val/ppl = exp(val/loss)``, ``val/token_acc`` (share of target
    tokens whose argmax is right) and, with ``exact_match=True``, ``val/exact_match`` (share of sequences whose every
    target token is right, i.e. that greedy decoding from the prompt reproduces).

    Args:
        model: Any HF model whose forward returns ``.loss`` when given ``labels``.
        lr: Peak learning rate.
        weight_decay: Decoupled weight decay for rank >= 2 parameters (see :func:`param_groups`).
        betas: Adam betas.
        eps: Adam epsilon.
        warmup_steps: Linear warmup length in optimizer steps; 0 disables the scheduler.
        warmup_ratio: Linear warmup as a share of the run's optimizer steps (instead of ``warmup_steps``).
        decay: After warmup, ``"constant"``, ``"linear"`` or ``"cosine"`` down to ``min_lr_ratio · lr`` at the
            run's last step (the run's length is the Trainer's ``estimated_stepping_batches``).
        min_lr_ratio: The decay's floor as a share of ``lr``.
        optimizer: ``"adamw"`` (decoupled decay) or ``"adam"`` (L2 penalty), both from ``torch.optim``.
        fused: Passed to the torch optimizer (``None`` lets torch choose; fused is fastest on CPU).
        optimizer_factory: builds the optimizer from the model instead (e.g. GaLore from
            :func:`lightning_offload.cli.baselines.galore_optimizer`); ``optimizer``, ``betas``, ``eps`` and ``fused``
            are then unused.
        exact_match: Also log ``val/exact_match`` (meaningful for prompt → answer data such as ``bible_qa``).
        loss: ``"chunked"`` computes the head and the loss chunk by chunk of tokens, so the ``tokens × vocabulary``
            logits never exist (:func:`lightning_offload.causal_lm_loss`); ``"model"`` takes the model's own ``.loss``
            (a model without a separate base and head).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        decay: str = "constant",
        min_lr_ratio: float = 0.0,
        optimizer: str = "adamw",
        fused: bool | None = None,
        optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
        exact_match: bool = False,
        loss: str = "chunked",
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "adam"):
            raise ValueError(f"optimizer must be 'adamw' or 'adam', got {optimizer!r}")
        check_loss_kind(loss)
        if loss == "chunked":
            try:
                base_and_head(model)
            except TypeError as error:
                raise TypeError(f"{error} Pass loss='model' to train with the model's own loss.") from None
        self.optim_settings = OptimSettings(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                                            warmup_steps=warmup_steps, warmup_ratio=warmup_ratio, decay=decay,
                                            min_lr_ratio=min_lr_ratio)
        # Pickling the model into hparams would duplicate every weight in checkpoints and loggers.
        self.save_hyperparameters(ignore=["model", "optimizer_factory"])
        self.model = model
        self.optimizer_factory = optimizer_factory
        self.val_loss = MeanMetric()
        self.val_token_acc = MeanMetric()
        self.val_exact_match = MeanMetric()

    def forward(self, **batch: torch.Tensor) -> Any:
        """Runs the wrapped model."""
        return self.model(**batch)

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Returns the mean token loss of the batch and logs it as ``train/loss``."""
        if self.hparams.loss == "chunked":
            loss = causal_lm_loss(self.model, _lm_inputs(batch))
        else:
            loss = self.model(**_lm_inputs(batch)).loss
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Accumulates the batch's mean loss weighted by its number of target tokens."""
        inputs = _lm_inputs(batch)
        # Position t predicts label t+1 (HF shifts inside the model): a position's loss and argmax are against it.
        targets = batch["labels"][:, 1:]
        if self.hparams.loss == "chunked":
            hidden, head = hidden_and_head(self.model, inputs)
            transform = LogitTransform.of(self.model.config)
            losses, right = head_predictions(hidden, head, batch["labels"], transform=transform)
            targets, predicted = targets.to(losses.device), right[:, :-1]
        else:
            out = self.model(**inputs)
            targets = targets.to(out.logits.device)
            predicted = out.logits[:, :-1].argmax(-1) == targets
        is_target = targets != IGNORE_INDEX
        correct = predicted & is_target
        count = is_target.sum()
        loss = losses.sum() / count if self.hparams.loss == "chunked" else out.loss.detach()
        self.val_loss.update(loss.float(), weight=count.float())
        if is_target.any():
            self.val_token_acc.update(correct.sum() / is_target.sum(), weight=is_target.sum().float())
        if self.hparams.exact_match:
            has_target = is_target.any(dim=1)
            all_right = (correct | ~is_target).all(dim=1)
            self.val_exact_match.update(all_right[has_target].float())
        return loss

    def on_validation_epoch_end(self) -> None:
        """Logs the epoch's token-weighted ``val/loss``, ``val/ppl`` and accuracies, then resets the accumulators."""
        if not self.val_loss.update_called:
            return
        # compute() all-reduces across processes, so every rank logs the same global value.
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # Already global; sync_dist only tells Lightning so (it would warn under DDP), averaging equal values.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)
        if self.val_token_acc.update_called:
            self.log("val/token_acc", self.val_token_acc.compute(), sync_dist=True)
        if self.hparams.exact_match and self.val_exact_match.update_called:
            self.log("val/exact_match", self.val_exact_match.compute(), prog_bar=True, sync_dist=True)
        self.val_token_acc.reset()
        self.val_exact_match.reset()

    def configure_optimizers(self) -> Any:
        """Builds the torch Adam/AdamW over two parameter groups, plus a per-step schedule if one is set."""
        hp = self.hparams
        if self.optimizer_factory is not None:
            opt = self.optimizer_factory(self.model)
        else:
            cls = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
            kwargs: dict[str, Any] = {"lr": hp.lr, "betas": tuple(hp.betas), "eps": hp.eps}
            if hp.fused is not None:
                kwargs["fused"] = hp.fused
            opt = cls(param_groups(self.model, hp.weight_decay), **kwargs)
        return with_schedule(self, opt)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    dataloader: Iterable[Mapping[str, torch.Tensor]],
    device: torch.device | str | None = None,
    max_batches: int | None = None,
) -> float:
    """Token-weighted mean causal-LM loss of ``model`` over ``dataloader``, outside any Trainer, in eval mode.

    Args:
        model: HF causal LM.
        dataloader: Yields ``{"input_ids", "attention_mask", "labels"}`` batches.
        device: Where to run; defaults to the device of the model's first parameter.
        max_batches: Stop after this many batches (None: all).

    Returns:
        The mean loss per target token (``math.nan`` if the loader yields no targets).
    """
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i, batch in enumerate(dataloader):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in _lm_inputs(batch).items()}
            n = int(count_target_tokens(batch))
            total += float(model(**batch).loss.float()) * n
            count += n
    finally:
        model.train(was_training)
    return total / count if count else math.nan
