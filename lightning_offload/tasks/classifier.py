"""A LightningModule that fine-tunes a causal LM's decoder as a sequence classifier (``data=bible_genre``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from lightning_offload.tasks.causal_lm import param_groups, with_schedule
from lightning_offload.tasks.schedule import OptimSettings


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a Hugging Face causal LM (``LlamaModel``, ``GPT2Model``, …), without its LM head.

    Dropping the head matters for offloading: an unused ``lm_head`` would otherwise be a trainable parameter that
    never gets a gradient (and, untied, a vocabulary-sized matrix of optimizer state for nothing).
    """
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face model with a separate LM head; "
                        "the classifier needs a causal LM such as LlamaForCausalLM or GPT2LMHeadModel.")
    return base


class SequenceClassifierModule(L.LightningModule):
    """Classifies a padded token sequence from the decoder state at its last real token.

    Logs ``train/loss`` every step and, per validation epoch, ``val/loss``, ``val/acc`` (micro accuracy) and
    ``val/macro_f1`` (torchmetrics, so they are exact over the whole epoch and across processes).

    Args:
        decoder: A decoder stack returning ``.last_hidden_state`` (see :func:`decoder_of`), possibly wrapped by
            ``peft``.
        hidden_size: Width of the decoder's hidden states.
        num_classes: Number of labels.
        lr: Learning rate of the torch AdamW built when no ``optimizer_factory`` is given.
        weight_decay: Decoupled weight decay of matrices.
        warmup_steps: Linear warmup length in optimizer steps; 0 disables the scheduler.
        betas: Adam betas.
        eps: Adam epsilon.
        warmup_ratio: Linear warmup as a share of the run's optimizer steps (instead of ``warmup_steps``).
        decay: After warmup, ``"constant"``, ``"linear"`` or ``"cosine"`` down to ``min_lr_ratio · lr``.
        min_lr_ratio: The decay's floor as a share of ``lr``.
        optimizer_factory: Builds the optimizer from this module's trainable network instead (LoRA, GaLore).
    """

    def __init__(self, decoder: nn.Module, hidden_size: int, num_classes: int, lr: float = 1e-4,
                 weight_decay: float = 0.0, warmup_steps: int = 0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, warmup_ratio: float = 0.0, decay: str = "constant", min_lr_ratio: float = 0.0,
                 optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes} must be at least 2.")
        self.optim_settings = OptimSettings(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                                            warmup_steps=warmup_steps, warmup_ratio=warmup_ratio, decay=decay,
                                            min_lr_ratio=min_lr_ratio)
        # The decoder is a constructor argument, not a hyperparameter: pickling it would copy every weight.
        self.save_hyperparameters(ignore=["decoder", "optimizer_factory"])
        self.decoder = decoder
        self.head = nn.Linear(hidden_size, num_classes)
        self.optimizer_factory = optimizer_factory
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_f1 = MulticlassF1Score(num_classes, average="macro")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Class logits ``[batch, num_classes]``."""
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # Right padding: the last real token of row b sits at attention_mask[b].sum() - 1.
        last = attention_mask.sum(dim=1).clamp(min=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.head(pooled.to(self.head.weight.dtype))

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the batch, logged as ``train/loss``."""
        loss = nn.functional.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch["labels"].shape[0])
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Accumulates loss and predictions."""
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = nn.functional.cross_entropy(logits.float(), batch["labels"]).detach()
        # sync_dist: with several ranks, the mean over all of them (each sees its share of the validation set).
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["labels"].shape[0], sync_dist=True)
        self.val_acc.update(logits.detach(), batch["labels"])
        self.val_f1.update(logits.detach(), batch["labels"])
        return loss

    def on_validation_epoch_end(self) -> None:
        """Logs the epoch's accuracy and macro F1, then resets them."""
        if self.val_acc.update_called:
            self.log("val/acc", self.val_acc.compute(), prog_bar=True)
            self.log("val/macro_f1", self.val_f1.compute())
        self.val_acc.reset()
        self.val_f1.reset()

    def configure_optimizers(self) -> Any:
        """AdamW over decayed/undecayed groups, or what ``optimizer_factory`` builds."""
        network = nn.ModuleDict({"decoder": self.decoder, "head": self.head})
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(network)
        else:
            optimizer = torch.optim.AdamW(param_groups(network, self.hparams.weight_decay), lr=self.hparams.lr,
                                          betas=self.optim_settings.betas, eps=self.optim_settings.eps)
        return with_schedule(self, optimizer)
