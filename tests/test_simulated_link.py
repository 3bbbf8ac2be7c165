"""The GPU path's own ordering, proven on the CPU behind the simulated asynchronous link
(engine/lanes/simulated_link.py).

Under ``LIGHTNING_OFFLOAD_SIMULATED_LINK`` the link's copies land on threads of their own, each ``bytes / bandwidth``
plus a random jitter after it was issued, the host worker runs on a thread of its own core, and the update ring,
speculation and update prefetch are on, as on a GPU. A copy reads and writes when its time is up, so a missing wait
reads stale values: every run here must give the synchronous mode's results bit for bit (at the same intra-op thread
count), under three jitter seeds, and with one wait removed the same runs differ (the harness can fail).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch

import golden_runs
import lightning_offload
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import simulated_link
from lightning_offload.engine.lanes.link import CopyLabel
from lightning_offload.engine.lanes.simulated_link import (ENVIRONMENT_VARIABLE, LinkSpec, SimulatedEvent,
                                                           SimulatedLink)
from lightning_offload.models.tiny import tiny_llama

#: Three jitter seeds, a few ms each; the bandwidth high enough that the jitter decides the order of landings.
SPECS = [f"gbps=2,jitter_ms=3,seed={seed}" for seed in range(3)]
#: What the set-up logs when it uses the simulated link.
SIMULATED = f"simulated link ({ENVIRONMENT_VARIABLE})"
STEPS = 4


@contextlib.contextmanager
def link(spec: str | None) -> Iterator[None]:
    """The simulated link ``spec`` (``None``: the synchronous CPU link) for the engines set up in the block, at one
    torch thread: the simulation gives the device one core of two, and results are compared at one thread."""
    saved, threads = os.environ.get(ENVIRONMENT_VARIABLE), torch.get_num_threads()
    if spec is None:
        os.environ.pop(ENVIRONMENT_VARIABLE, None)
    else:
        os.environ[ENVIRONMENT_VARIABLE] = spec
    torch.set_num_threads(1)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENVIRONMENT_VARIABLE, None)
        else:
            os.environ[ENVIRONMENT_VARIABLE] = saved
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------------ the link
def test_a_spec_is_read_and_a_bad_one_named() -> None:
    assert LinkSpec.parse("gbps=2.5,jitter_ms=3,seed=7") == LinkSpec(2.5, 3.0, 7)
    assert LinkSpec.parse("gbps=1") == LinkSpec(1.0, 0.0, 0)
    for bad, said in [("jitter_ms=3", "gbps= must be given"), ("gbps=fast", "gbps='fast' is not a number"),
                      ("gbps=1,latency=2", "'latency=2' is not one of"), ("gbps=1,seed=0.5", "seed= an integer")]:
        with pytest.raises(ValueError, match=said):
            LinkSpec.parse(bad)


def test_a_bad_spec_in_the_environment_is_refused_at_set_up() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(128, 128))
    with link("gbps=0"), pytest.raises(ValueError, match=f"{ENVIRONMENT_VARIABLE}='gbps=0': gbps= must be given"):
        lightning_offload.offload(model, torch.optim.AdamW(model.parameters()))


def test_a_copy_lands_when_its_time_is_up_not_when_issued() -> None:
    simulated = SimulatedLink(torch.device("cpu"), LinkSpec(gbps=1.0))
    source, destination = torch.ones(2_000_000), torch.zeros(2_000_000)  # 8 MB: 8 ms at 1 GB/s
    timeline = StepTimeline()
    start = time.perf_counter()
    event = simulated.to_host(source, destination, CopyLabel(timeline, "x"))
    assert not event.query() and not destination.any()  # a reader that does not wait sees the old values
    event.synchronize()
    assert time.perf_counter() - start >= 8e-3
    assert torch.equal(destination, source) and event.query()
    assert timeline.busy("link_to_host") >= 8e-3
    simulated.close()


def test_each_direction_copies_in_issue_order_and_after_its_event() -> None:
    simulated = SimulatedLink(torch.device("cpu"), LinkSpec(gbps=10.0, jitter_ms=2.0, seed=3))
    destination = torch.zeros(1000)
    events = [simulated.to_device(torch.full((1000,), float(value)), destination) for value in range(5)]
    events[-1].synchronize()
    assert all(event.query() for event in events) and bool((destination == 4).all())  # the last one issued, last
    compute = SimulatedEvent()  # the device's last use of the destination, not done yet
    blocked = simulated.to_device(torch.full((1000,), 9.0), destination, after=compute)
    time.sleep(0.02)
    assert not blocked.query() and bool((destination == 4).all())
    compute.complete()
    blocked.synchronize()
    assert bool((destination == 9).all())
    simulated.close()


def test_a_failed_copy_raises_for_its_waiter_instead_of_hanging() -> None:
    simulated = SimulatedLink(torch.device("cpu"), LinkSpec(gbps=1.0))
    event = simulated.to_host(torch.ones(3), torch.zeros(4))  # shapes that cannot be copied
    with pytest.raises(RuntimeError, match="A simulated link copy failed"):
        event.synchronize()
    assert simulated.to_host(torch.ones(3), torch.zeros(3)) is not None  # the lane goes on
    simulated.close()


def test_under_the_simulated_link_the_gpu_path_is_on_and_the_main_thread_given_back() -> None:
    model = tiny_llama(vocab_size=256, hidden=128, layers=1, intermediate=256)
    with link(SPECS[0]):
        before = os.sched_getaffinity(threading.get_native_id())
        optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters()))
        assert isinstance(optimizer.lanes.link, SimulatedLink)
        assert not optimizer.lanes.worker.inline and optimizer.lanes.worker.running
        assert optimizer.commit.speculative and optimizer.lanes.ring is not None
        if optimizer.lanes.split is not None:  # two cores or more: the device keeps to its half
            assert os.sched_getaffinity(threading.get_native_id()) == set(optimizer.lanes.split.device_cpus)
        optimizer.close()
        assert os.sched_getaffinity(threading.get_native_id()) == before
    without = lightning_offload.offload(copy.deepcopy(model), torch.optim.AdamW(model.parameters()))
    assert without.lanes.worker.inline and not without.commit.speculative and without.lanes.ring is None
    without.close()


# ---------------------------------------------------------------------------------- the golden cases, bit for bit
@pytest.mark.parametrize("case", list(golden_runs.CASES))
def test_each_golden_case_under_the_simulated_link_gives_the_synchronous_results(
        case: str, caplog: pytest.LogCaptureFixture) -> None:
    # Each case under one of the three seeds (in turn), against the same case on the synchronous link: both at one
    # thread (golden_runs.run_case's), the latter shared with tests/test_golden_results.py where it ran first.
    spec = SPECS[list(golden_runs.CASES).index(case) % len(SPECS)]
    with link(None):
        synchronous = golden_runs.run_case_cached(case)
    with link(spec), caplog.at_level(logging.INFO, logger="lightning_offload"):
        simulated = golden_runs.run_case(case)
    assert any(SIMULATED in record.getMessage() for record in caplog.records), "the simulated link was not used"
    assert sorted(simulated) == sorted(synchronous)
    differ = [name for name in synchronous if simulated[name] != synchronous[name]]
    assert not differ, f"{case} under {spec}: {len(differ)} tensors differ, e.g. {differ[0]}"


# --------------------------------------------------------------------- the faces and the habits, three seeds each
def _batches(count: int = STEPS, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=generator) for _ in range(count)]


def _model() -> torch.nn.Module:
    return tiny_llama(vocab_size=256, hidden=128, layers=2, intermediate=256, seed=0)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _loop(kind: str, habit: str) -> dict[str, torch.Tensor]:
    """A plain loop of ``STEPS`` steps under ``kind`` with one of the users' habits; the weights and the host state
    after it."""
    model = _model()
    settings: dict[str, Any] = {"max_grad_norm": 0.05 if habit == "clipping fires" else 1.0}
    if habit == "accumulation":
        settings["accumulation_steps"] = 2
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                          kind, **settings)
    ema = [p.detach().clone() for p in model.parameters()]
    batches = _batches(2 * STEPS if habit == "accumulation" else STEPS)
    for index, ids in enumerate(batches):
        loss = _loss(model, ids)
        if habit == "a skipped step" and index == 1:
            loss = loss * float("inf")
        loss.backward()
        if habit == "accumulation" and index % 2 == 0:
            continue
        optimizer.step()
        optimizer.zero_grad()
        if habit == ".data writes and EMA reads":
            with torch.no_grad():
                for kept, param in zip(ema, model.parameters()):
                    kept.mul_(0.9).add_(param, alpha=0.1)  # reads every weight while updates are pending
                if index == 1:
                    model.model.layers[0].mlp.up_proj.weight.data.mul_(0.5)
    state = {f"weight/{name}": p.detach().clone() for name, p in model.named_parameters()}
    state.update({f"ema/{i}": kept for i, kept in enumerate(ema)})
    state.update(_tensors(optimizer.state_dict(), "optimizer"))
    optimizer.close()
    return state


def _resumed(kind: str) -> dict[str, torch.Tensor]:
    """Two steps, a save while the last update is pending, a new model and optimizer resumed from it, two more steps."""
    model = _model()
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2), kind,
                                          max_grad_norm=1.0)
    batches = _batches()
    for ids in batches[:2]:
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())}
    optimizer.close()
    model = _model()
    model.load_state_dict(saved["model"])
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2), kind,
                                          max_grad_norm=1.0)
    optimizer.load_state_dict(saved["optimizer"])
    for ids in batches[2:]:
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {f"weight/{name}": p.detach().clone() for name, p in model.named_parameters()}
    state.update(_tensors(optimizer.state_dict(), "optimizer"))
    optimizer.close()
    return state


def _fabric(kind: str) -> dict[str, torch.Tensor]:
    fabric = L.Fabric(strategy=kind, accelerator="cpu", devices=1)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for ids in _batches():
        fabric.backward(_loss(model, ids))
        fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
    state = {f"weight/{name}": p.detach().clone() for name, p in model.named_parameters()}
    fabric.strategy.teardown()
    return state


def _tensors(tree: Any, prefix: str) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in golden_runs.tensors_of(tree, prefix)}


RUNS = {
    **{f"loop {kind}, {habit}": (lambda kind=kind, habit=habit: _loop(kind, habit))
       for kind in ("lsp_offload", "zero_offload")
       for habit in ("plain", "clipping fires", "a skipped step", "accumulation", ".data writes and EMA reads")},
    **{f"loop {kind}, saved and resumed mid-pipeline": (lambda kind=kind: _resumed(kind))
       for kind in ("lsp_offload", "zero_offload")},
    **{f"fabric {kind}, clipping fires": (lambda kind=kind: _fabric(kind)) for kind in ("lsp_offload", "zero_offload")},
}
_SYNCHRONOUS: dict[str, dict[str, torch.Tensor]] = {}


def _synchronous(run: str) -> dict[str, torch.Tensor]:
    if run not in _SYNCHRONOUS:
        with link(None):
            _SYNCHRONOUS[run] = RUNS[run]()
    return _SYNCHRONOUS[run]


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(got) == sorted(want)
    return [name for name in want if not torch.equal(got[name], want[name])]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("run", list(RUNS))
def test_each_face_and_habit_under_the_simulated_link_gives_the_synchronous_results(
        run: str, spec: str, caplog: pytest.LogCaptureFixture) -> None:
    with link(spec), caplog.at_level(logging.INFO, logger="lightning_offload"):
        simulated = RUNS[run]()
    assert any(SIMULATED in record.getMessage() for record in caplog.records), "the simulated link was not used"
    differ = _differing(simulated, _synchronous(run))
    assert not differ, f"{run} under {spec}: {len(differ)} tensors differ, e.g. {differ[0]}"


# ------------------------------------------------------------------------------------------- the harness can fail
@pytest.mark.parametrize("removed", ["host_wait", "device_wait"])
def test_with_one_wait_removed_the_same_runs_differ(removed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # host_wait: a host job reads its gradient before the copy landed; device_wait: an update is applied before its
    # copy arrived. Either way the results must move, or the tests above could not see a missing wait.
    monkeypatch.setattr(simulated_link.SimulatedLink, removed, lambda self, event: None)
    run = "loop lsp_offload, plain"
    with link(SPECS[0]):
        broken = RUNS[run]()
    assert _differing(broken, _synchronous(run))


# ------------------------------------------------------------------------------------------------- the planner
def test_the_planner_s_simulated_machine_has_the_engine_s_ring_and_backups_and_overlaps() -> None:
    # plan(hardware=None) under the variable plans what the engine sets up: a ring of one buffer per projected layer
    # and speculation's backups on the host, with the parts overlapping as on a GPU.
    network = tiny_llama(vocab_size=256, hidden=128, layers=2, intermediate=256, seed=0)
    with link(SPECS[0]):
        planned = lightning_offload.plan(copy.deepcopy(network), "lsp_offload", batch_size=2, seq_len=16,
                                         device_memory="24GiB", precision="32-true", loss="model")
        optimizer = lightning_offload.offload(network, torch.optim.AdamW(network.parameters(), lr=1e-2))
        for ids in _batches(2):
            _loss(network, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
        telemetry = optimizer.telemetry
        optimizer.close()
    assert "behind a simulated link of 2 GB/s each way" in planned.hardware
    ring = telemetry.device_persistent_bytes["update_ring"]
    assert ring > 0 and planned.persistent["update_ring"] == ring
    assert planned.host_speculation_bytes > 0
    assert planned.host_state_bytes == pytest.approx(telemetry.host_state_bytes, rel=0.05)
    # Overlapped: the step is less than the sum of its parts (on the plain CPU the parts add).
    step = planned.step
    assert step.step < step.device + step.link + step.host


def test_updates_cross_back_as_soon_as_computed() -> None:
    # Each update's copy back is issued by the host worker right after its host step (under speculation, during
    # backward), into a ring of one buffer per projected layer, instead of by the main thread when its layer's next
    # forward nears (docs/benchmarks/2026-12-07.md: 1.17x -> 1.03x the instant step at a 50% link).
    network = tiny_llama(vocab_size=256, hidden=128, layers=4, intermediate=256, seed=0)
    with link("gbps=0.05"):
        optimizer = lightning_offload.offload(network, torch.optim.AdamW(network.parameters(), lr=1e-2))
        assert len(optimizer.update_ring.buffers) == len(optimizer.projected_layers)
        projected = [record for record in optimizer.orchestrator.records.values() if record.slot.fetches_update]
        for ids in _batches(3):
            _loss(network, ids).backward()
            optimizer.step()
            for record in projected:  # every host step done, no layer's forward run yet
                optimizer.lanes.worker.wait(record.job)
            assert all(record.slot.fetch_started() for record in projected)
            optimizer.zero_grad()
        assert optimizer.update_ring.fallbacks == 0 and optimizer.update_ring.prefetched == 0
        optimizer.close()


def test_where_the_link_lags_behind_backward_the_deepest_gradients_cross_at_the_launch_with_the_same_results() -> None:
    # A slow link: a step's copies to the host outlast its backward, so the engine sends the deepest layers'
    # gradients at the launch (they cross during the next forward; their updates are needed last there). The
    # results are the synchronous link's, bit for bit.
    def run() -> tuple[dict[str, torch.Tensor], list[float]]:
        # Tied embeddings: the deepest tensors are the last layer's small compressed gradients (an untied head, the
        # deepest of all and larger than the forward's share of the link, would be sent in backward).
        network = tiny_llama(vocab_size=256, hidden=128, layers=4, intermediate=256, seed=0)
        optimizer = lightning_offload.offload(network, torch.optim.AdamW(network.parameters(), lr=1e-2),
                                              max_grad_norm=1.0)
        deferred = []
        generator = torch.Generator().manual_seed(2)
        for ids in [torch.randint(0, 256, (8, 64), generator=generator) for _ in range(6)]:
            _loss(network, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
            deferred.append(optimizer.telemetry.last.deferred_sends)
        weights = {name: p.detach().clone() for name, p in network.named_parameters()}
        weights.update(_tensors(optimizer.state_dict(), "optimizer"))
        optimizer.close()
        return weights, deferred

    with link(None):
        synchronous, never = run()
    with link("gbps=0.002,jitter_ms=1,seed=4"):
        simulated, deferred = run()
    assert not any(never)  # a link that copies at once never lags
    assert max(deferred) > 0
    differ = _differing(simulated, synchronous)
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[0]}"
