"""Small LightningModules and data shared by the strategy tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def adamw_factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


class TinyClassifier(pl.LightningModule):
    """Linear → GELU → LayerNorm → Linear → GELU → head, with biases: projected and dense parameters both.

    Two param groups with different hyper-parameters: weights (rank ≥ 2) and the rest.
    """

    def __init__(
        self,
        optimizer_factory: OptimizerFactory = adamw_factory,
        group_overrides: tuple[dict[str, Any], dict[str, Any]] = ({}, {"lr": 3e-3, "weight_decay": 0.0}),
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        seed: int = 0,
        in_dim: int = 16,
        hidden: int = 32,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, 24), nn.GELU()
        )
        self.head = nn.Linear(24, 8)
        self.optimizer_factory = optimizer_factory
        self.group_overrides = group_overrides
        self.scheduler = scheduler
        self.losses: list[float] = []

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> Any:
        weights = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": weights, **self.group_overrides[0]}, {"params": rest, **self.group_overrides[1]}]
        optimizer = self.optimizer_factory(groups)
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler(optimizer), "interval": "step"}}


def classification_data(n: int = 64, in_dim: int = 16, batch_size: int = 8, seed: int = 1) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_dim, generator=generator)
    y = torch.randint(0, 8, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def trainer(strategy: Any = "auto", **kwargs: Any) -> pl.Trainer:
    defaults = dict(
        # scripts/gpu_bench.py runs the pipeline, equivalence and checkpoint tests again with "cuda" here.
        accelerator=os.environ.get("LIGHTNING_OFFLOAD_TEST_ACCELERATOR", "cpu"),
        devices=1,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


def lossless_lsp(**kwargs: Any) -> Any:
    """LSP with signed-permutation projectors: it must reproduce plain Adam exactly (Adam is elementwise).

    Embeddings are stepped densely (the default row-sparse step lets untouched rows rest where dense Adam would move
    them on momentum)."""
    from lightning_offload import LSPOffloadStrategy, signed_permutation_projector

    kwargs.setdefault("embeddings", "host")
    return LSPOffloadStrategy(rank=1.0, density=1, min_dim=16, projectors="random",
                              projector_factory=signed_permutation_projector, **kwargs)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in module.named_parameters()}


def check_checkpoint_loads_into_plain(fit: pl.Trainer, path: Path, keys: list[str], plain: pl.LightningModule,
                                      trained: nn.Module, ids: torch.Tensor) -> None:
    """``fit``'s checkpoint, saved to ``path``, holds the module's ``keys`` in order and loads strictly into ``plain``
    (another module of the plain architecture), whose logits on ``ids`` then equal the ``trained`` network's."""
    fit.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert list(state) == keys
    plain.load_state_dict(state, strict=True)
    plain.eval(), trained.eval()  # GPT-2 has dropout
    with torch.no_grad():
        torch.testing.assert_close(plain.model(input_ids=ids).logits, trained(input_ids=ids).logits)


class TinyCausalLM(pl.LightningModule):
    """Wraps a tiny Hugging Face causal LM with the usual AdamW; the tests' stand-in for a real fine-tune."""

    def __init__(self, model: nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def tiny_hf_model(kind: str, seed: int = 0) -> nn.Module:
    """A randomly initialised 2-layer LLaMA or GPT-2 (GPT-2 uses Hugging Face's transposed Conv1D)."""
    from lightning_offload.models.tiny import tiny_gpt2, tiny_llama

    if kind == "llama":
        return tiny_llama(vocab_size=64, hidden=32, intermediate=64, heads=4, kv_heads=2, seed=seed,
                          tie_word_embeddings=False, max_positions=64)
    return tiny_gpt2(vocab_size=64, hidden=32, intermediate=128, heads=4, seed=seed, max_positions=64)


def token_data(n: int = 32, length: int = 16, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Sequences with structure to learn: each is an arithmetic progression of tokens mod 64."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 64, (n, 1), generator=generator)
    stride = torch.randint(1, 4, (n, 1), generator=generator)
    ids = (start + stride * torch.arange(length)) % 64
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


class ProjectedUpdateRMS(pl.Callback):
    """Records the RMS of each optimizer step's change to the strategy's projected weights (``rms``, one per step).

    Its ``on_train_batch_start`` snapshots the weights: a ProjectorRefit listed before it refits first."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.rms: list[float] = []
        self.before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before = [layer.weight.detach().clone() for layer in self.strategy.projected_layers.values()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        deltas = [layer.weight.detach() - old for layer, old in zip(self.strategy.projected_layers.values(),
                                                                  self.before)]
        self.rms.append(float(torch.cat([d.reshape(-1) for d in deltas]).square().mean().sqrt()))


class TokenDicts(torch.utils.data.Dataset):
    """The tests' token sequences (:func:`token_data`) as the dicts a Hugging Face causal LM and its Trainer take."""

    def __init__(self, n: int = 24) -> None:
        self.ids = torch.cat([ids for (ids,) in token_data(n=n, batch_size=4)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
