"""Training runs on 2 CPU processes (gloo) for tests/test_ddp.py: ``python tests/ddp_runs.py OUT_DIR SCENARIO``.

Lightning's launcher starts rank 1 by running this script again; each rank writes what it saw under ``OUT_DIR`` as
``<run>_rank<r>.pt`` (final weights, losses, projectors, bytes between ranks per step), and checkpoints where a run
resumes. Scenarios: ``equivalence`` (lossless and learned projectors, accumulation and clipping, resume), ``bytes``
(lsp vs zero on a model whose layers are all projectable), ``variants`` (a device Adam, speculation, bf16, the
clipping norm's probes) and
``fail_on_rank_<r>`` (a host job raises on rank r).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))

from tiny_modules import TinyClassifier, classification_data, params_of  # noqa: E402

import lightning_offload  # noqa: E402,F401
from lightning_offload import (  # noqa: E402
    LSPOffloadDDPStrategy,
    ProjectorRefit,
    ZeroOffloadDDPStrategy,
    signed_permutation_projector,
)
from lightning_offload.engine.step.commit import CommitAfterNorm  # noqa: E402
from lightning_offload.lsp import norm_probe  # noqa: E402

#: Batch per rank; the single-process runs they are compared with use twice this.
BATCH = 4


class BytesBetweenRanks(Callback):
    """Keeps the strategy's ``bytes_between_ranks`` of each completed step."""

    def __init__(self) -> None:
        self.per_step: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        optimizer = trainer.strategy.offload_optimizer
        if optimizer is not None and optimizer.telemetry.steps:
            self.per_step.append(optimizer.telemetry.last.bytes_between_ranks)


class InitialProjectors(Callback):
    """Keeps the projector values right after the initial fit (it runs before this, in ``on_train_start``)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values = {name: (layer.proj_out.values.clone(), layer.proj_in.values.clone())
                       for name, layer in trainer.strategy.projected_layers.items()}


class Projectable(pl.LightningModule):
    """Three bias-free Linears: every weight is projectable (``target_modules`` names them all)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64, bias=False), nn.GELU(), nn.Linear(64, 64, bias=False), nn.GELU(),
                                 nn.Linear(64, 16, bias=False))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float()[:, :8], y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def strategy(kind: str, **kwargs: Any) -> Any:
    """The DDP strategy of a run kind (``lossless``, ``learned``, ``zero``, ``lsp_all``)."""
    common = dict(process_group_backend="gloo", **kwargs)
    if kind == "lossless":
        return LSPOffloadDDPStrategy(rank=1.0, density=1, min_dim=16, projectors="random",
                                     projector_factory=signed_permutation_projector, **common)
    if kind.startswith("lossless_"):  # lossless_<setting>=<value>: one setting changed
        setting, value = kind.removeprefix("lossless_").split("=")
        parsed: Any = {"True": True, "False": False}.get(value, value)
        return LSPOffloadDDPStrategy(rank=1.0, density=1, min_dim=16, projectors="random",
                                     projector_factory=signed_permutation_projector, **{setting: parsed}, **common)
    if kind == "learned":
        # The kernels pinned: the golden records hold these bits, and "auto" chooses by timing. The vectors on the
        # host, as the records were made (their checkpoint holds the host Adam's state of the biases).
        return LSPOffloadDDPStrategy(rank=0.5, density=2, min_dim=16, projectors="learned", kernels="native",
                                     vectors="host", **common)
    if kind == "lsp_all":
        return LSPOffloadDDPStrategy(rank=0.25, density=2, target_modules=[r"net\.\d"], projectors="random", **common)
    if kind == "zero":
        return ZeroOffloadDDPStrategy(**common)
    raise ValueError(kind)


def refit() -> ProjectorRefit:
    """Refits at every second step (threshold 0: every layer), so a run of 4 steps refits twice."""
    return ProjectorRefit(refit_every=2, threshold=0.0, num_samples=2, max_iters=6, seed=0)


def fit(out: Path, run: str, kind: str, module: pl.LightningModule, steps: int, resume: str | None = None,
        checkpoint_every: int | None = None, dump_checkpoint: bool = False, **trainer_kwargs: Any) -> None:
    bytes_seen, initial = BytesBetweenRanks(), InitialProjectors()
    callbacks: list[Callback] = [bytes_seen]
    if kind == "learned":
        callbacks += [refit(), initial]
    if checkpoint_every is not None:
        callbacks.append(ModelCheckpoint(dirpath=out / run, every_n_train_steps=checkpoint_every, save_top_k=-1))
    # Lightning's own distributed sampler shuffles training data; an unshuffled split makes rank r's batch k the
    # samples r, r + 2, … of the single-process batch k at twice the size.
    trainer = pl.Trainer(strategy=strategy(kind), accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_checkpointing=checkpoint_every is not None, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                         use_distributed_sampler=False, **trainer_kwargs)
    dataset = classification_data().dataset
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for rank 1; rank 0 launches it
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
    trainer.fit(module, DataLoader(dataset, batch_size=BATCH, sampler=sampler), ckpt_path=resume)
    optimizer = trainer.strategy.offload_optimizer
    layers = trainer.strategy.projected_layers if kind != "zero" else {}
    record = {
        "params": params_of(module),
        "bytes_between_ranks": bytes_seen.per_step,
        "projectors": {name: (layer.proj_out.values.clone(), layer.proj_in.values.clone(),
                              layer.proj_out.indices.clone(), layer.proj_in.indices.clone())
                       for name, layer in layers.items()},
        "initial_projectors": initial.values,
        "refit_steps": [record.step for callback in callbacks if isinstance(callback, ProjectorRefit)
                        for record in callback.history],
        "owned": [slot.name for slot in optimizer.slots if slot.owned] if optimizer is not None else [],
        "host_state_bytes": optimizer.telemetry.host_state_bytes if optimizer is not None else 0,
        "steps": optimizer.telemetry.steps if optimizer is not None else 0,
        "norm_ratios": {name: layer.norm_ratio for name, layer in layers.items()},
    }
    torch.save(record, out / f"{run}_rank{trainer.global_rank}.pt")
    if dump_checkpoint:
        # What each rank would put in a checkpoint (a saved file holds rank 0's alone): every rank builds it, as
        # Trainer.save_checkpoint has every rank do, since gathering a rank-sharded state takes all of them.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        torch.save(checkpoint, out / f"{run}_rank{trainer.global_rank}.ckpt")


def main() -> None:
    # Several scenarios may run in one launch, in the order given (comma-separated): each launch costs two fresh
    # interpreters' imports and a process group, which is most of a small scenario's time.
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    for scenario in sys.argv[2].split(","):
        run_scenario(out, scenario)
    if torch.distributed.is_initialized():
        # Both ranks done before either closes its connections, then the group torn down before the interpreter
        # exits: a rank whose peer exited first could otherwise see the socket close in gloo's own thread, which
        # aborts the process (a launch of the golden scenario once ended with SIGABRT after its runs).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_scenario(out: Path, scenario: str) -> None:
    """One scenario's runs, their records written under ``out``."""
    clipping = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    if scenario == "equivalence":
        # An epoch is 4 steps (64 samples, 2 ranks × 4 per batch, 2 batches per step): runs are checkpointed at its
        # end, since a plain DataLoader cannot resume mid-epoch, and resumed from there into a model initialised
        # differently (everything must come from the checkpoint).
        for kind in ("lossless", "learned"):
            fit(out, kind, kind, TinyClassifier(), 8, checkpoint_every=4, **clipping)
            (path,) = (out / kind).glob("*step=4.ckpt")
            fit(out, f"{kind}_resumed", kind, TinyClassifier(seed=7), 8, resume=str(path), **clipping)
    elif scenario == "variants":
        # A device Adam's parameters (all-reduced, stepped on every rank), speculative host steps, and bf16
        # weights with bf16 crossing between ranks.
        fit(out, "device_head", "lossless_head=device", TinyClassifier(), 4, **clipping)
        fit(out, "speculative", "lossless_speculative=True", TinyClassifier(), 4, **clipping)
        fit(out, "bf16", "lossless_link_dtype=bf16", TinyClassifier(), 4, precision="bf16-true", **clipping)
        fit(out, "fp32_link", "lossless", TinyClassifier(), 4, precision="bf16-true", **clipping)
        # The clipping norm's probes (lsp/norm_probe.py) on projectors that keep norms inexactly, averaged over 2
        # steps here so that they replace ρ within the run (and set back: a scenario after it keeps the default).
        window, norm_probe.WINDOW_STEPS = norm_probe.WINDOW_STEPS, 2
        fit(out, "norm_probes", "lsp_all", Projectable(), 6, **clipping)
        norm_probe.WINDOW_STEPS = window
    elif scenario == "golden":
        # tests/golden_runs.py: learned projectors refitted every second step, accumulation and norm clipping.
        fit(out, "golden", "learned", TinyClassifier(), 4, dump_checkpoint=True, **clipping)
    elif scenario == "bytes":
        # The second step's figures: the reductions of its gradients and the broadcasts of the first step's updates.
        fit(out, "zero", "zero", Projectable(), 3)
        fit(out, "lsp_all", "lsp_all", Projectable(), 3)
    elif scenario.startswith("fail_on_rank_"):
        failing_rank = int(scenario.removeprefix("fail_on_rank_"))
        if int(os.environ.get("LOCAL_RANK", "0")) == failing_rank:
            planted = CommitAfterNorm._host_job  # the CPU's policy (no speculation)
            steps: list[Any] = []  # the figures object of each step whose host jobs ran here

            def failing(self: CommitAfterNorm, record: Any, clip: Any, compute_done: Any, step: Any, *args: Any,
                        **kwargs: Any) -> None:
                if all(step is not seen for seen in steps):
                    steps.append(step)
                if len(steps) >= 2:  # the second step's first host job
                    raise RuntimeError(f"planted failure on rank {failing_rank}")
                planted(self, record, clip, compute_done, step, *args, **kwargs)

            CommitAfterNorm._host_job = failing  # type: ignore[method-assign]
        fit(out, "fail", "lossless", TinyClassifier(), 6)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
