"""lightning_offload under Hugging Face's ``Trainer``: the optimizer from ``lightning_offload.offload`` passed as
``optimizers=(optimizer, scheduler)``, and ``OffloadCallback`` (it fits the learned projectors on the Trainer's
dataloader, and applies pending updates before the Trainer saves or evaluates). Clipping moves from
``TrainingArguments.max_grad_norm`` (which clips ``model.parameters()`` and would miss projected gradients) to the
offload's ``max_grad_norm``; its ``accumulation_steps`` is the Trainer's ``gradient_accumulation_steps``.

    python examples/hf_trainer.py            # a tiny LLaMA on synthetic sequences; put your model and data in
"""

from __future__ import annotations

import tempfile

import torch
import transformers
from torch.utils.data import Dataset

import lightning_offload
from lightning_offload.faces.hf import OffloadCallback
from lightning_offload.models.tiny import tiny_llama
from progressions import VOCAB, progressions


class Sequences(Dataset):
    """The synthetic sequences as the dicts a Hugging Face causal LM takes."""

    def __init__(self) -> None:
        self.ids = torch.cat([ids for (ids,) in progressions()])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main(steps: int = 40, accumulation: int = 2) -> list[float]:
    """Trains ``steps`` optimizer steps with the Trainer; returns the logged losses."""
    model = tiny_llama(vocab_size=VOCAB, hidden=64, intermediate=128)
    optimizer = lightning_offload.offload(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), "lsp_offload",
        rank=0.5, min_dim=32, projectors="learned", refit_every=20,  # fitted and refitted by OffloadCallback
        max_grad_norm=1.0, accumulation_steps=accumulation)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulation, max_grad_norm=0.0,  # clipped by the offload instead
        use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(),
                                   optimizers=(optimizer, scheduler), callbacks=[OffloadCallback(optimizer)])
    trainer.train()
    optimizer.close()  # applies what is pending, gives the model back as it was
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


if __name__ == "__main__":
    trained = main()
    print(f"loss {trained[0]:.3f} -> {trained[-1]:.3f} over {len(trained)} steps")
