"""One method's run of ``scripts/gpu_bench.py``, in its own process: the synthetic LLaMA, the strategy, the timed
steps and every figure the report gives (the step split, a profiled step, link bytes, device memory, MEFT's rows).

``gpu_bench.py`` starts one process per method and shape (``--single``), so an out-of-memory or a crash cannot poison
the next; this module is what such a process runs. torch, Lightning and the package are imported inside the
functions: the parent process imports this module without them.
"""

from __future__ import annotations

import time
from typing import Any

from harness import spread, steady, synchronize

SHAPES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, intermediate (LLaMA-style MLP), vocabulary
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=256),
    "llama_1b3": dict(hidden=2048, layers=24, heads=16, intermediate=5504, vocab=32000),
    "llama_2b7": dict(hidden=2560, layers=32, heads=20, intermediate=6912, vocab=32000),
    "llama_6b7": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000),
    "llama_13b": dict(hidden=5120, layers=40, heads=40, intermediate=13824, vocab=32000),
}
# MEFT adapter sizes per shape: (neurons, top_k, experts, experts per token).
# Experts per token equal experts per sequence (MEFTConfig's default routing keeps 4 per sequence): at the 1.3B shape
# a 4×512 batch then touches at most 4 × 4 × 128 = 2048 of each adapter's 8192 rows.
MEFT_NEURONS: dict[str, tuple[int, int, int, int]] = {"tiny": (256, 8, 16, 4)}
MEFT_DEFAULT = (8192, 16, 64, 4)


def _step_split(telemetry: Any) -> dict[str, Any]:
    """Median busy seconds per timeline lane over the steady steps, and the host worker's page faults per step."""
    if telemetry is None or not telemetry.completed:
        return {}
    # The first steps include allocation and warm-up.
    steps = steady([metrics for _, metrics in telemetry.completed], 2)

    def median(key: str) -> float:
        values = [m[key] for m in steps if key in m]
        return spread(values).median if values else 0.0

    lanes = sorted({key for m in steps for key in m if key.startswith("offload/timeline/")})
    return {"step_split_seconds": {key.removeprefix("offload/timeline/"): median(key) for key in lanes},
            "host_optimizer_seconds_per_step": median("offload/host_optimizer_seconds"),
            "host_page_faults_per_step": median("offload/host_page_faults"),
            # Speculative host steps (on by default on a GPU): how much host work ran during backward, and how many
            # tensors' steps were confirmed or redone.
            "host_share_before_backward_end": median("offload/host_share_before_backward_end"),
            "speculative_steps_per_step": median("offload/speculative_steps"),
            "rolled_back_steps_per_step": median("offload/rolled_back_steps")}


class _ProfiledStep:
    """One training step under ``torch.profiler``, summarised by kernel class (device time where there is one)."""

    CLASSES = (("gemm", ("gemm", "matmul", "mm", "cutlass", "cublas", "addmm", "bmm", "linear")),
               ("sparse", ("sparse", "csr", "spmm", "sddmm", "index_add", "index_put", "gather", "scatter")),
               ("copy", ("copy", "memcpy", "to_copy")), ("adam", ("adam",)), ("attention", ("attention", "sdpa",
                                                                                         "flash")),
               ("elementwise", ("mul", "add", "div", "sub", "silu", "exp", "pow", "sqrt", "round", "clamp", "neg")))

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def record(self, profiler: Any, on_device: bool) -> None:
        for event in profiler.key_averages():
            # Self times only: an op's total includes the ops and kernels under it, which are listed themselves.
            if on_device:
                seconds = getattr(event, "self_device_time_total", None)
                if seconds is None:
                    seconds = getattr(event, "self_cuda_time_total", 0.0)
            else:
                seconds = event.self_cpu_time_total
            if seconds:
                self.events.append((event.key, float(seconds) / 1e6))

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, seconds in self.events:
            name = key.lower()
            kind = next((k for k, words in self.CLASSES if any(w in name for w in words)), "other")
            out[kind] = out.get(kind, 0.0) + seconds
        return {k: round(v, 6) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def _profile_step(trainer: Any, module: Any) -> _ProfiledStep:
    """Profiles the third training step (steady state) of ``trainer.fit``."""
    import lightning.pytorch as pl
    import torch

    profiled = _ProfiledStep()

    class Profile(pl.Callback):
        def __init__(self) -> None:
            self.profiler: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                profiled.record(self.profiler, on_device=torch.cuda.is_available())
                self.profiler = None

    trainer.callbacks.append(Profile())
    return profiled


def _synthetic_module(method: str, shape: str, steps: int, batch: int, seq: int, cap_gib: float | None) -> Any:
    """The LLaMA of ``shape`` (random init, bf16, on the GPU where there is one) in a LightningModule that draws random
    tokens, times each training step (the GPU synchronised) and builds the optimizer ``method`` steps with."""
    import lightning.pytorch as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available()
    s = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
        max_position_embeddings=max(seq, 64), tie_word_embeddings=False,
    )

    class Synthetic(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # Built in bf16 directly: an fp32 init of a 6.7B shape alone would not fit a 24 GiB cap.
            with torch.device("cuda" if cuda else "cpu"):
                self.model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
            if method == "lora_device":
                from lightning_offload.cli.baselines import add_lora

                self.model = add_lora(self.model, rank=16, min_dim=min(128, s["hidden"]), train_others=False)
            self.manual = method == "torchao_offload"
            self.automatic_optimization = not self.manual
            self.offloaded: Any = None
            if cap_gib is not None:
                # Under a memory cap the question is whether the shape fits at all: recompute activations.
                self.model.gradient_checkpointing_enable()
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            synchronize()
            self.times.append(time.perf_counter() - self._start)

        def training_step(self, batch_index: Any, batch_idx: int) -> Any:
            ids = torch.randint(0, s["vocab"], (batch, seq), device=self.device)
            loss = self.model(input_ids=ids, labels=ids).loss
            if self.manual:
                # torchao's optimizer is not a torch.optim.Optimizer: stepped here, outside Lightning's loop.
                self.manual_backward(loss)
                self.offloaded.step()
                self.offloaded.zero_grad()
            return loss

        def on_fit_start(self) -> None:
            if self.manual:
                from torchao.optim import CPUOffloadOptimizer

                trainable = [p for p in self.parameters() if p.requires_grad]
                self.offloaded = CPUOffloadOptimizer(trainable, torch.optim.AdamW, fused=True, lr=1e-5)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(steps), batch_size=1)

        def configure_optimizers(self) -> Any:
            trainable = [p for p in self.parameters() if p.requires_grad]  # MEFT: the routers only
            if self.manual:
                return None  # built in on_fit_start and stepped in training_step
            if method == "deepspeed_offload":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(trainable, lr=1e-5)
            return torch.optim.AdamW(trainable, lr=1e-5, fused=True)

    return Synthetic()


def _strategy(method: str, shape: str, model: Any) -> Any:
    """The Lightning strategy ``method`` trains with (MEFT's adapters injected into ``model`` first)."""
    import lightning_offload

    min_dim = min(128, SHAPES[shape]["hidden"])
    if method.startswith("meft"):
        neurons, top_k, experts, per_token = MEFT_NEURONS.get(shape, MEFT_DEFAULT)
        lightning_offload.inject_meft(model, lightning_offload.MEFTConfig(
            num_neurons=neurons, top_k=top_k, num_experts=experts, experts_per_token=per_token,
            routing="host" if method == "meft_host_routing" else "device"))
        return lightning_offload.MEFTOffloadStrategy(link_dtype="bf16")
    if method == "zero_offload":
        return lightning_offload.ZeroOffloadStrategy(link_dtype="bf16")
    if method == "lsp_offload":
        # Learned projectors (the default is random since 2026-12-02): the fit's device peak is one of the figures.
        return lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min_dim, projectors="learned")
    if method == "lsp_offload_dense_ends":
        # The previous default: embedding and head stepped densely on the host (what the defaults are compared to).
        return lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min_dim, projectors="learned",
                                                    embeddings="host", head="host")
    if method == "lsp_offload_scaled":
        # update="scaled" at the host bytes of rank 0.25: full-rank updates from compressed moments (its own lane: the
        # device forms each projected weight's gradient and keeps it until the step's scales return).
        return lightning_offload.LSPOffloadStrategy(link_dtype="bf16", min_dim=min_dim, update="scaled")
    if method == "deepspeed_offload":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=2, offload_optimizer=True, pin_memory=True)
    return "auto"  # native, lora_device, torchao_offload: Lightning's own


def single(method: str, shape: str, steps: int, batch: int, seq: int, cap_gib: float | None,
           profile_step: bool = False, phases: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps of one method on one shape in this process; return its measurements (``phases``: with
    the engine's phase clock on after two steps, which synchronizes the device at each phase boundary)."""
    import lightning.pytorch as pl
    import torch

    import lightning_offload
    from benchmark_run import PhaseReader

    cuda = torch.cuda.is_available()
    if cap_gib is not None and cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    module = _synthetic_module(method, shape, steps, batch, seq, cap_gib)
    strategy = _strategy(method, shape, module.model)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fit_peak = _fit_peak_probe(pl, cuda)
    callbacks: list[Any] = []
    if method in ("lsp_offload", "lsp_offload_dense_ends"):
        # The learned strategy's default fit, named here so the probe after it sees the device peak the fit reached.
        callbacks = [lightning_offload.ProjectorRefit(), fit_peak]
    phase_reader = PhaseReader(warmup=2) if phases else None
    if phase_reader is not None:
        callbacks.append(phase_reader)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="auto", devices=1, precision="bf16-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    profile = _profile_step(trainer, module) if profile_step else None
    trainer.fit(module)
    telemetry = getattr(getattr(trainer.strategy, "offload_optimizer", None), "telemetry", None)
    params = sum(p.numel() for p in module.parameters())
    return {
        "method": method,
        "shape": shape,
        "batch": batch,
        "seq": seq,
        "parameters": params,
        **_step_split(telemetry),
        **({"profile": profile.summary()} if profile is not None else {}),
        **({"phases_seconds_per_step": phase_reader.medians()} if phase_reader is not None else {}),
        "median_step_seconds": spread(steady(module.times, 2)).median,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        **_link_figures(telemetry, method, params),
        **_device_memory(telemetry, trainer, fit_peak),
        **(_meft_figures(trainer.strategy, batch, seq) if method.startswith("meft") else {}),
    }


def _link_figures(telemetry: Any, method: str, params: int) -> dict[str, Any]:
    """Bytes over the link per step, each way where the strategy counts them."""
    return {
        "link_bytes_per_step": (
            telemetry.last.bytes_device_to_host + telemetry.last.bytes_host_to_device if telemetry is not None
            else (4 * params if method.endswith("_offload") else 0)  # bf16 gradient out + bf16 params back
        ),
        "link_bytes_to_host_per_step": telemetry.last.bytes_device_to_host if telemetry is not None else None,
        "link_bytes_to_device_per_step": telemetry.last.bytes_host_to_device if telemetry is not None else None,
        "link_bytes_measured": telemetry is not None,
        # Rows of the row-sparse embedding that crossed and were stepped (lsp_offload's default placement).
        "sparse_embedding_rows_per_step": telemetry.last.sparse_rows if telemetry is not None else None,
    }


def _meft_figures(strategy: Any, batch: int, seq: int) -> dict[str, Any]:
    """MEFT's rows moved and stepped, its link and host figures, and its routing bound."""
    rows = strategy.figures_at_step_end()
    total_rows = sum(a.config.num_neurons for a in strategy.adapters)
    config = strategy.adapters[0].config
    return {
        "meft_rows_share_per_step": rows["meft/rows_moved"] / total_rows,
        # Whole blocks are stepped on the host: the touched rows plus their blocks' idle rows.
        "meft_rows_stepped_share_per_step": rows["meft/rows_stepped"] / total_rows,
        "meft_link_bytes_per_step": rows["meft/bytes_host_to_device"] + rows["meft/bytes_device_to_host"],
        "meft_routing_key_bytes_per_step": rows["meft/bytes_routing_keys_to_device"],
        "meft_host_seconds_per_step": rows["meft/host_optimizer_seconds"],
        "meft_adapter_device_bytes": rows["meft/adapter_device_bytes"],
        # Rows of each adapter a step may touch at most (MEFT's per-sequence routing bound).
        "meft_row_bound_share": config.row_bound(batch, batch * seq) / config.num_neurons,
    }


def _fit_peak_probe(pl: Any, cuda: bool) -> Any:
    """A callback measuring the device bytes the initial projector fit added above what training had allocated
    when it set up (CUDA only). Placed after the :class:`~lightning_offload.ProjectorRefit`, its
    ``on_train_start`` runs once the fit is done."""
    import torch

    class FitPeak(pl.Callback):
        def __init__(self) -> None:
            self.baseline: int | None = None
            self.extra: int | None = None

        def setup(self, trainer: Any, module: Any, stage: str) -> None:
            if cuda:
                torch.cuda.synchronize()
                self.baseline = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if cuda and self.baseline is not None:
                self.extra = torch.cuda.max_memory_allocated() - self.baseline

    return FitPeak()


def _device_memory(telemetry: Any, trainer: Any, fit_peak: Any) -> dict[str, Any]:
    """Device bytes of the offload machinery by category: persistent, transient per step, and the fit's."""
    if telemetry is None:
        return {}
    refits = [cb for cb in trainer.callbacks if type(cb).__name__ == "ProjectorRefit"]
    initial = refits[0].history[0] if refits and refits[0].history else None
    return {
        "device_persistent_bytes": dict(telemetry.device_persistent_bytes),
        "device_transient_bytes": {
            "compressed_grads": telemetry.last.device_compressed_grad_bytes,
            "saved_projections": telemetry.last.device_saved_projection_bytes,
            "held_gradients": telemetry.last.device_held_gradient_bytes,
        },
        "fit_device_state_bytes": initial.device_fit_state_bytes if initial is not None else None,
        "fit_extra_peak_bytes": fit_peak.extra,
    }
