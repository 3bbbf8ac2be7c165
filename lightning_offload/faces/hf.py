"""Hugging Face's ``Trainer`` with the loop optimizer (:func:`~lightning_offload.faces.loop.offload`): a
``TrainerCallback`` for what the Trainer cannot know about it.

* **Weights read outside a forward.** With ``pipelined=True`` a step's updates are applied right before each module's
  next forward, so after ``optimizer.step()`` the weights lag by that step until the next forward. The Trainer saves
  and evaluates right after a step: the callback settles the optimizer first (every pending update, and the decay
  untouched embedding rows owe), so checkpoints and evaluations see that step's weights.
* **Learned projectors.** It fits them on the Trainer's dataloader before the first step and refits them when due
  (:attr:`~lightning_offload.faces.loop.LoopOffloadOptimizer.refit_due`), with ``loss_fn`` (by default the model's
  own loss on the batch, ``model(**batch).loss``).
* **The end.** After training it settles the optimizer; call ``optimizer.close()`` when done with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lightning_offload.engine.batch_gradients import LossFn
from lightning_offload.faces.loop import LoopOffloadOptimizer


def model_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """A Hugging Face model's own loss on a batch dict (moved to the model's device), as the Trainer computes it."""
    device = next(model.parameters()).device
    if isinstance(batch, Mapping):
        return model(**{key: value.to(device) if torch.is_tensor(value) else value
                        for key, value in batch.items()}).loss
    raise ValueError(f"model_loss takes the Trainer's batch dicts; got {type(batch).__name__}. Pass "
                     f"OffloadCallback(optimizer, loss_fn=lambda model, batch: ...).")


class OffloadCallback(TrainerCallback):
    """Settles the loop optimizer before the Trainer reads weights, and fits learned projectors when due.

    Args:
        optimizer: the optimizer from :func:`~lightning_offload.faces.loop.offload` passed to the Trainer.
        loss_fn: ``loss_fn(model, batch) -> loss`` for the projector fits. Default: ``model_loss`` (the model's own
            loss on the batch dict).

    Example::

        optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters()), max_grad_norm=1.0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None),
                                       callbacks=[OffloadCallback(optimizer)])
        trainer.train()
        optimizer.close()
    """

    def __init__(self, optimizer: LoopOffloadOptimizer, loss_fn: LossFn = model_loss) -> None:
        if not isinstance(optimizer, LoopOffloadOptimizer):
            raise TypeError(f"OffloadCallback takes the optimizer lightning_offload.offload(...) returned, got "
                            f"{type(optimizer).__name__}.")
        self.optimizer = optimizer
        self.loss_fn = loss_fn

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        # A resumed run has its fit back from the optimizer's state: only a fresh one fits first.
        if self.optimizer.needs_first_fit:
            self.optimizer.fit_projectors(kwargs["train_dataloader"], self.loss_fn)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self.optimizer.refit_due:
            self.optimizer.fit_projectors(kwargs["train_dataloader"], self.loss_fn)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # Called after the Trainer decided whether this step saves or evaluates, before it does.
        if control.should_save or control.should_evaluate:
            self.optimizer.settle()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.optimizer.settle()  # the model is read next (trainer.save_model, evaluation)
