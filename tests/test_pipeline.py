"""The layer-wise pipeline: same results as the synchronous path, failures surface, nothing leaks or hangs."""

import json
import threading
import time

import pytest
import torch

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.engine.lanes.worker import HostWorker, HostWorkerError
from tiny_modules import (TinyCausalLM, TinyClassifier, classification_data, params_of, tiny_hf_model, token_data,
                          trainer)


def _strategy(kind, **kwargs):
    if kind == "zero":
        return ZeroOffloadStrategy(**kwargs)
    return LSPOffloadStrategy(rank=0.5, density=2, min_dim=16, **kwargs)


def _fit_llm(kind, model_kind, pipelined, precision="32-true", link_dtype="fp32", steps=8, **kwargs):
    module = TinyCausalLM(tiny_hf_model(model_kind))
    strategy = _strategy(kind, pipelined=pipelined, link_dtype=link_dtype, **kwargs)
    trainer(strategy, max_steps=steps, precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.3).fit(
        module, token_data(n=64)
    )
    return module, strategy


@pytest.mark.parametrize("model_kind", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["lsp", "zero"])
@pytest.mark.parametrize("precision, link_dtype", [("32-true", "fp32"), ("bf16-mixed", "fp32"), ("bf16-true", "bf16")])
def test_pipelined_equals_synchronous_exactly(kind, model_kind, precision, link_dtype):
    synchronous, _ = _fit_llm(kind, model_kind, False, precision, link_dtype)
    pipelined, strategy = _fit_llm(kind, model_kind, True, precision, link_dtype)
    a, b = params_of(synchronous), params_of(pipelined)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"
    assert synchronous.losses == pipelined.losses
    assert strategy.offload_optimizer.telemetry.steps == 8


@pytest.mark.parametrize("kernels", ["dense", "csr"])
def test_pipelined_equals_synchronous_under_autocast_whatever_the_kernel(kernels):
    # Pipelined, a layer's update is applied by its module's forward pre-hook, inside the user's autocast region:
    # the update's products must still run in the engine's dtypes (a dense kernel's matmul was rounded to bf16 there).
    synchronous, _ = _fit_llm("lsp", "llama", False, "bf16-mixed", steps=4, kernels=kernels)
    pipelined, _ = _fit_llm("lsp", "llama", True, "bf16-mixed", steps=4, kernels=kernels)
    a, b = params_of(synchronous), params_of(pipelined)
    assert all(torch.equal(a[name], b[name]) for name in a), [name for name in a if not torch.equal(a[name], b[name])]
    assert synchronous.losses == pipelined.losses


@pytest.mark.parametrize("model_kind, buffers", [("llama", 1), ("gpt2", 3)])
def test_updates_through_a_small_ring_of_device_buffers_equal_the_direct_path(model_kind, buffers):
    # On the CPU updates are read in place by default; forcing the ring exercises the accelerator's path: claims,
    # prefetches into free buffers, release after the apply, and no fallback allocation when forward order holds.
    direct, _ = _fit_llm("lsp", model_kind, True, "bf16-true", "bf16", update_buffers=0)
    ringed, strategy = _fit_llm("lsp", model_kind, True, "bf16-true", "bf16", update_buffers=buffers)
    a, b = params_of(direct), params_of(ringed)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"
    ring = strategy.offload_optimizer.update_ring
    layers = len(strategy.offload_optimizer.projected_layers)
    assert len(ring.buffers) == buffers and ring.free == buffers and ring.fallbacks == 0
    assert strategy.offload_optimizer.telemetry.metrics()["offload/update_ring_fallbacks"] == 0.0
    assert max(s.layer.compressed_shape[0] * s.layer.compressed_shape[1]
               for s in strategy.offload_optimizer.slots if s.layer is not None) == ring.buffers[0].numel()
    if buffers > 1:
        assert ring.prefetched > 0  # later layers' updates were copied before their forwards asked
    assert layers > buffers


def test_bf16_link_halves_the_gradient_bytes():
    _, fp32 = _fit_llm("lsp", "llama", True, steps=2)
    _, bf16 = _fit_llm("lsp", "llama", True, link_dtype="bf16", steps=2)
    # The row-sparse embedding's row indices (8 bytes per row) cross as int64 whatever the link dtype.
    rows = fp32.offload_optimizer.telemetry.last.sparse_rows
    assert rows > 0 and rows == bf16.offload_optimizer.telemetry.last.sparse_rows
    index_bytes = 8 * rows
    assert (bf16.offload_optimizer.telemetry.last.bytes_device_to_host - index_bytes) * 2 == \
        fp32.offload_optimizer.telemetry.last.bytes_device_to_host - index_bytes


class _Planted(RuntimeError):
    pass


def test_a_worker_failure_surfaces_in_the_training_loop_with_its_traceback():
    strategy = _strategy("lsp")
    failed_at = {}

    class Sabotage(TinyClassifier):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 3:
                slot = self.trainer.strategy.offload_optimizer.slots[0]

                def broken_step(*args, **kwargs):
                    failed_at["time"] = time.perf_counter()
                    raise _Planted("planted in the host worker")

                slot.host_optimizer.step = broken_step

    with pytest.raises(HostWorkerError) as info:
        trainer(strategy, max_steps=20).fit(Sabotage(), classification_data())
    raised_at = time.perf_counter()
    assert isinstance(info.value.__cause__, _Planted)
    frames = list(_frame_names(info.value.__cause__.__traceback__))
    assert "_host_job" in frames and "broken_step" in frames  # the worker's own traceback, not a re-creation
    assert raised_at - failed_at["time"] < 1.0
    assert not strategy.offload_optimizer.worker.running


def _frame_names(traceback):
    while traceback is not None:
        yield traceback.tb_frame.f_code.co_name
        traceback = traceback.tb_next


def test_interrupt_leaves_no_worker_thread_behind():
    class Interrupt(TinyClassifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    before = {t for t in threading.enumerate() if t.name.startswith("lightning_offload")}
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        trainer(_strategy("lsp"), max_steps=20).fit(Interrupt(), classification_data())
    after = {t for t in threading.enumerate() if t.name.startswith("lightning_offload") and t.is_alive()}
    assert after <= before


def test_worker_close_never_hangs_on_a_stuck_job():
    worker = HostWorker()
    release = threading.Event()
    worker.submit(lambda: release.wait(10))
    start = time.perf_counter()
    worker.close(timeout=0.2)
    assert time.perf_counter() - start < 1.0
    release.set()


def _rss_bytes():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def test_two_hundred_steps_do_not_grow_host_memory():
    """Bound: 16 MiB of resident growth between step 50 and step 250 (buffers are preallocated; Python and
    allocator noise stay well below that on this tiny model)."""
    samples = {}

    class Measure(TinyCausalLM):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step in (50, 250):
                samples[self.trainer.global_step] = _rss_bytes()

    module = Measure(tiny_hf_model("llama"))
    trainer(_strategy("lsp"), max_steps=250).fit(module, token_data(n=64))
    assert samples[250] - samples[50] < 16 * 2**20


def test_timeline_is_logged_and_exports_as_a_chrome_trace(tmp_path):
    strategy = _strategy("lsp")
    trainer(strategy, max_steps=4).fit(TinyClassifier(), classification_data())
    metrics = strategy.offload_optimizer.telemetry.metrics()
    for lane in ("device", "link_to_host", "host_wait", "host", "link_to_device", "device_wait"):
        assert metrics[f"offload/timeline/{lane}_seconds"] >= 0
    assert metrics["offload/timeline/host_seconds"] > 0 and metrics["offload/timeline/device_seconds"] > 0
    path = tmp_path / "trace.json"
    strategy.offload_optimizer.timelines.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert lanes == {"device", "device_wait", "link_to_host", "host_wait", "host", "link_to_device"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == {1, 2, 3, 4}
    assert all(e["dur"] >= 0 for e in spans)


@pytest.mark.parametrize("cores, expected", [(8, list(range(1, 8))), (2, None)])
def test_the_worker_leaves_the_main_thread_a_core_on_an_accelerator(monkeypatch, cores, expected):
    import lightning_offload.engine.lanes.worker as pipeline

    calls = []
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(pipeline.os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, list(cpus))),
                        raising=False)
    worker = HostWorker(leave_main_a_core=True)
    worker.wait(worker.submit(lambda: None))
    worker.close()
    assert worker.cpus == expected
    # Set from the worker thread for itself (pid 0), never for the process; below 4 cores it keeps them all.
    assert calls == ([(0, expected)] if expected else [])
    unrestricted = HostWorker()  # the CPU default: host and device share every core
    unrestricted.wait(unrestricted.submit(lambda: None))
    unrestricted.close()
    assert unrestricted.cpus is None and len(calls) == (1 if expected else 0)
