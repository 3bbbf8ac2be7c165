"""The benchmark harness: fine-tune the embedded SmolLM2-135M on World English Bible text, one fixed recipe.

``python -m lightning_offload.finetune`` (or ``lightning-offload-finetune``) evaluates the held-out loss, trains a
bounded number of steps and evaluates again, returning step times and offload telemetry in a
:class:`FinetuneResult`. ``scripts/benchmark_core.py`` and ``scripts/benchmark_projectors.py`` drive it side by side;
the product's command line (Hydra configs, loggers, sweeps) is ``lightning-offload-train`` (:mod:`lightning_offload.train`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_offload  # noqa: F401  (registers the strategy names)
from lightning_offload.callbacks import ProjectorRefit
from lightning_offload.data.bible import BibleLMDataModule
from lightning_offload.models.smollm2 import load_smollm2
from lightning_offload.module import CausalLMModule
from lightning_offload.policies import METHODS, OffloadPolicy
from lightning_offload.run_record import RunRecorder, optimizer_state_bytes
from lightning_offload.strategy import LSPOffloadStrategy, ZeroOffloadStrategy

STRATEGIES = ("lsp_offload", "zero_offload", "none")


@dataclass
class FinetuneConfig:
    """Settings of one run (defaults: 100 steps of 4×128 tokens with lsp_offload, ~10 minutes on 2 CPU cores)."""

    strategy: str = "lsp_offload"
    steps: int = 100
    batch_size: int = 4
    block_size: int = 128
    lr: float = 1e-4
    projected_lr: float | None = None  # learning rate of the projectable layers (default: lr)
    weight_decay: float = 0.0
    precision: str = "bf16-mixed"
    rank: float = 0.25
    density: int = 8
    eval_blocks: int = 64
    seed: int = 0
    log_every_n_steps: int = 10
    fused_adam: bool = True  # plain AdamW's fastest kernel on CPU; the offload strategies always use it on the host
    pipelined: bool = True
    link_dtype: str = "fp32"
    projectors: str = "learned"
    refit_every: int = 500
    method: str = "full"
    lora_rank: int = 12
    galore_rank: int = 36
    galore_scale: float = 0.25
    galore_update_proj_gap: int = 200


@dataclass
class FinetuneResult:
    """What a run measured."""

    config: FinetuneConfig
    eval_loss_before: float
    eval_loss_after: float
    step_seconds: list[float] = field(default_factory=list)
    bytes_device_to_host_per_step: float = 0.0
    bytes_host_to_device_per_step: float = 0.0
    host_optimizer_seconds_per_step: float = 0.0
    host_state_bytes: float = 0.0
    device_state_bytes: float = 0.0
    trainable_parameters: int = 0
    projected_layers: int = 0
    timeline_seconds_per_step: dict[str, float] = field(default_factory=dict)
    initial_fit_seconds: float = 0.0
    initial_fit_error: float = float("nan")
    initial_fitted_error: float = float("nan")
    train_seconds: float = 0.0

    @property
    def median_step_seconds(self) -> float:
        """Median wall time of a training step, first two steps (warm-up) excluded."""
        steps = self.step_seconds[2:] or self.step_seconds
        return statistics.median(steps) if steps else float("nan")

    def summary(self) -> str:
        """Human-readable lines."""
        mib = 1024**2
        fit = []
        if self.initial_fit_seconds:
            fit = [f"projector fit       {self.initial_fit_seconds:.1f} s, mean error {self.initial_fit_error:.3f} -> "
                   f"{self.initial_fitted_error:.3f} (held-out)"]
        return "\n".join(
            [
                f"strategy            {self.config.strategy} (precision {self.config.precision})",
                f"trainable params    {self.trainable_parameters:,} ({self.projected_layers} projected layers)",
                f"eval loss           {self.eval_loss_before:.4f} -> {self.eval_loss_after:.4f}",
                f"median step time    {self.median_step_seconds:.2f} s over {len(self.step_seconds)} steps",
                f"link bytes / step   {self.bytes_device_to_host_per_step / mib:.1f} MiB to host, "
                f"{self.bytes_host_to_device_per_step / mib:.1f} MiB to device",
                f"host optimizer      {self.host_optimizer_seconds_per_step * 1e3:.0f} ms / step, state "
                f"{self.host_state_bytes / mib:.0f} MiB on host, {self.device_state_bytes / mib:.0f} MiB on device",
                *fit,
            ]
        )


def build_strategy(config: FinetuneConfig) -> Any:
    """The strategy object (or name) a config asks for."""
    if config.strategy == "lsp_offload":
        return LSPOffloadStrategy(
            rank=config.rank, density=config.density, seed=config.seed, pipelined=config.pipelined,
            link_dtype=config.link_dtype, projectors=config.projectors,
        )
    if config.strategy == "zero_offload":
        return ZeroOffloadStrategy(seed=config.seed, pipelined=config.pipelined, link_dtype=config.link_dtype)
    if config.strategy == "none":
        return "auto"
    raise ValueError(f"strategy={config.strategy!r} is not one of {STRATEGIES}.")


def build_policy(config: FinetuneConfig) -> OffloadPolicy:
    """The :class:`~lightning_offload.policies.OffloadPolicy` a config describes (strategy + method)."""
    return OffloadPolicy(
        name=config.strategy, strategy=build_strategy(config), method=config.method,
        projected_lr=config.projected_lr, lora_rank=config.lora_rank, galore_rank=config.galore_rank,
        galore_scale=config.galore_scale, galore_update_proj_gap=config.galore_update_proj_gap,
        fused_adam=config.fused_adam, refit=ProjectorRefit(every_n_steps=config.refit_every, seed=config.seed),
    )


def build_module(config: FinetuneConfig, model: torch.nn.Module, policy: OffloadPolicy | None = None
                 ) -> CausalLMModule:
    """The LightningModule for ``config.method``: full fine-tuning, frozen projectable layers, LoRA or GaLore."""
    policy = policy or build_policy(config)
    return CausalLMModule(policy.prepare(model), lr=config.lr, weight_decay=config.weight_decay,
                          optimizer_factory=policy.optimizer_factory(config.lr, config.weight_decay))


def _trainer(config: FinetuneConfig, strategy: Any, steps: int, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="auto",
        devices=1,
        precision=config.precision,
        max_steps=steps,
        limit_val_batches=config.eval_blocks // config.batch_size or 1,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=config.log_every_n_steps,
        callbacks=list(callbacks),
    )


def _validate(config: FinetuneConfig, module: CausalLMModule, data: BibleLMDataModule) -> float:
    (metrics,) = _trainer(config, "auto", 0).validate(module, datamodule=data, verbose=False)
    return float(metrics["val/loss"])


def run_finetune(config: FinetuneConfig) -> FinetuneResult:
    """Evaluate, fine-tune ``config.steps`` steps, evaluate again; return the measurements."""
    if config.strategy not in STRATEGIES:
        raise ValueError(f"strategy={config.strategy!r} is not one of {STRATEGIES}.")
    pl.seed_everything(config.seed, workers=True, verbose=False)
    model, tokenizer = load_smollm2()
    policy = build_policy(config)
    module = build_module(config, model, policy)
    data = BibleLMDataModule(
        tokenizer,
        block_size=config.block_size,
        batch_size=config.batch_size,
        max_val_blocks=config.eval_blocks,
        seed=config.seed,
    )
    before = _validate(config, module, data)
    timer = RunRecorder(None)
    strategy = policy.strategy
    callbacks: list[pl.Callback] = [timer, *policy.callbacks()]
    fit_trainer = _trainer(config, strategy, config.steps, callbacks)
    start = time.perf_counter()
    fit_trainer.fit(module, datamodule=data)
    train_seconds = time.perf_counter() - start
    after = _validate(config, module, data)

    result = FinetuneResult(
        config=config,
        eval_loss_before=before,
        eval_loss_after=after,
        step_seconds=timer.step_seconds,
        trainable_parameters=sum(p.numel() for p in module.parameters() if p.requires_grad),
        train_seconds=train_seconds,
    )
    refits = [cb for cb in callbacks if isinstance(cb, ProjectorRefit)]
    if refits and refits[0].history:
        first = refits[0].history[0]
        result.initial_fit_seconds = first.seconds
        result.initial_fit_error = statistics.fmean(first.errors.values())
        result.initial_fitted_error = statistics.fmean(first.fitted_errors.values())
    if timer.telemetry:
        def mean(key: str) -> float:
            return statistics.fmean(t[f"offload/{key}"] for t in timer.telemetry)

        result.bytes_device_to_host_per_step = mean("bytes_device_to_host")
        result.bytes_host_to_device_per_step = mean("bytes_host_to_device")
        result.host_optimizer_seconds_per_step = statistics.median(
            t["offload/host_optimizer_seconds"] for t in timer.telemetry
        )
        result.host_state_bytes = timer.telemetry[-1]["offload/host_state_bytes"]
        lanes = [key for key in timer.telemetry[-1] if key.startswith("offload/timeline/")]
        result.timeline_seconds_per_step = {
            key.removeprefix("offload/timeline/"): statistics.median(t[key] for t in timer.telemetry[2:] or timer.telemetry)
            for key in lanes
        }
        result.device_state_bytes = timer.telemetry[-1]["offload/device_state_bytes"]
        result.projected_layers = len(strategy.offload_optimizer.projected_layers)
    else:
        # Plain AdamW: the whole model's gradients and Adam state stay on the device; nothing crosses a link.
        result.device_state_bytes = optimizer_state_bytes(fit_trainer.optimizers)
    return result


def parse_args(argv: Sequence[str] | None = None) -> FinetuneConfig:
    """Command-line flags for every :class:`FinetuneConfig` field."""
    defaults = FinetuneConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default=defaults.strategy)
    parser.add_argument("--method", choices=METHODS, default=defaults.method)
    parser.add_argument("--projectors", choices=("learned", "random"), default=defaults.projectors)
    for name, value in asdict(defaults).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif name not in ("strategy", "method", "projectors"):
            parser.add_argument(flag, type=float if value is None else type(value), default=value)
    return FinetuneConfig(**vars(parser.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m lightning_offload.finetune`` and ``lightning-offload-finetune``."""
    result = run_finetune(parse_args(argv))
    print("\n" + result.summary())


if __name__ == "__main__":
    main()
