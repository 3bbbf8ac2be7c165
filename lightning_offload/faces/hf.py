"""Hugging Face's ``Trainer`` with the loop optimizer (:func:`~lightning_offload.faces.loop.offload`): a
``TrainerCallback`` for what the Trainer cannot know about it.

* **Weights read outside a forward.** With ``pipelined=True`` a step's updates are applied right before each module's
  next forward, so after ``optimizer.step()`` the weights lag by that step until the next forward. The Trainer saves
  and evaluates right after a step: the callback settles the optimizer first (every pending update, and the decay
  untouched embedding rows owe), so checkpoints and evaluations see that step's weights.
* **Learned projectors.** It fits them on the Trainer's dataloader before the first step and refits them when due
  (:attr:`~lightning_offload.LoopOffloadOptimizer.refit_due`), with ``loss_fn`` (by default the model's
  own loss on the batch, ``model(**batch).loss``).
* **Clipping.** ``TrainingArguments.max_grad_norm`` (1.0 by default) becomes the offload's own clipping, over every
  gradient (projected ones included, which the Trainer's ``clip_grad_norm_`` over ``model.parameters()`` cannot see),
  said in one log line; the Trainer's own clipping call is turned off for the run (``max_grad_norm`` is put back at
  its end). So the default run equals the same Trainer with torch's AdamW.
* **Accumulation.** ``TrainingArguments.gradient_accumulation_steps`` above the offload's ``accumulation_steps`` is
  refused when training begins (the optimizer would send gradients before the last micro-batch).
* **The end.** After training it settles the optimizer; call ``optimizer.close()`` when done with it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lightning_offload.engine.fitting.batch_gradients import LossFn
from lightning_offload.setup.loop_optimizer import LoopOffloadOptimizer

log = logging.getLogger(__name__)


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
        # While a run is on: the max_grad_norm its TrainingArguments had, and the offload's own before the run.
        self._taken_over: tuple[float, float | None] | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._check_accumulation(args)
        self._take_over_clipping(args)
        # A resumed run has its fit back from the optimizer's state: only a fresh one fits first.
        if self.optimizer.needs_first_fit:
            self.optimizer.fit_projectors(kwargs["train_dataloader"], self.loss_fn)

    def _check_accumulation(self, args: TrainingArguments) -> None:
        """Refuse a Trainer that accumulates more micro-batches than the offload was told, before the first step (the
        engine itself would see it only at the second micro-batch of the first step).

        Raises:
            ValueError: when ``args.gradient_accumulation_steps`` exceeds the offload's ``accumulation_steps``.
        """
        trainer_steps = args.gradient_accumulation_steps
        own = self.optimizer.loop.settings.accumulation_steps
        if own is not None and trainer_steps > own:
            raise ValueError(
                f"TrainingArguments(gradient_accumulation_steps={trainer_steps}) and offload(..., "
                f"accumulation_steps={own}) disagree: the offload would send the gradients to the host after "
                f"micro-batch {own} of each step, before the Trainer's last. Pass offload(..., "
                f"accumulation_steps={trainer_steps}) (the Trainer's gradient_accumulation_steps), or "
                f"accumulation_steps=None to send every gradient at the step.")

    def _take_over_clipping(self, args: TrainingArguments) -> None:
        """``args.max_grad_norm`` becomes the offload's clipping; the Trainer's own call is off until the run ends.

        Raises:
            ValueError: when the offload was given another ``max_grad_norm`` (two limits: which one is meant?).
        """
        limit = args.max_grad_norm
        if limit is None or not limit > 0:
            return
        own = self.optimizer.max_grad_norm
        if own is not None and own != limit:
            raise ValueError(f"TrainingArguments(max_grad_norm={limit!r}) and offload(..., max_grad_norm={own!r}) "
                             f"disagree. OffloadCallback makes the Trainer's the offload's: pass the same value to "
                             f"both, or leave the offload's out (or set the Trainer's to 0 to keep the offload's).")
        self._taken_over = (limit, own)
        self.optimizer.max_grad_norm = float(limit)
        args.max_grad_norm = 0.0
        log.info("OffloadCallback: TrainingArguments.max_grad_norm=%s is the offload's clipping for this run, over "
                 "every gradient (projected ones included); the Trainer's own clip_grad_norm_ over "
                 "model.parameters() is off until the run ends.", limit)

    def _give_back_clipping(self, args: TrainingArguments) -> None:
        if self._taken_over is not None:
            args.max_grad_norm, self.optimizer.max_grad_norm = self._taken_over
            self._taken_over = None

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
        self._give_back_clipping(args)
        self.optimizer.settle()  # the model is read next (trainer.save_model, evaluation)
