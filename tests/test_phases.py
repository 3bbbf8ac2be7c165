"""The engine's phase clock and where its host work runs on a CPU.

The clock (lightning_offload/engine/figures/phases.py) splits the engine's own share of a step into phases; it must see
every phase a step has, charge nested phases only their own time, and change no result. On a CPU device the host jobs
run inline in the main thread (no second thread competing for the same cores); with the same arithmetic, so a run is the
same as with a worker thread, bit for bit.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_offload import offload
from lightning_offload.engine.figures.phases import PHASES, PhaseClock
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.worker import HostWorker, HostWorkerError
from lightning_offload.engine.rules.adam import ADAM
from tiny_modules import params_of, tiny_hf_model, token_data

SMALL = dict(rank=0.5, density=2, min_dim=16, projectors="random")


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, clock_on: bool = False) -> float:
    """Trains on ``batches``; returns the wall seconds of the steps."""
    optimizer.phases.enabled = clock_on
    start = time.perf_counter()
    for (ids,) in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    return time.perf_counter() - start


def test_the_clock_sees_every_phase_of_an_lsp_step_and_charges_nested_ones_once():
    batches = list(token_data(n=16, batch_size=4))
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), **SMALL)
    assert optimizer.phases.take() == dict.fromkeys(PHASES, 0.0)
    _train(model, optimizer, batches[:1])  # off: nothing charged
    assert optimizer.phases.take() == dict.fromkeys(PHASES, 0.0)
    wall = _train(model, optimizer, batches[1:], clock_on=True)
    charged = optimizer.phases.take()
    optimizer.close()
    # The waits are 0 inline (the job ran before its update was asked for); every other phase ran.
    missing = [phase for phase in PHASES if phase != "waits" and not charged[phase] > 0]
    assert not missing, charged
    # Each second is charged to one phase only (an inline host step inside the launch is not charged twice), and the
    # model's own forward and backward to none.
    assert sum(charged.values()) < wall


def test_the_clock_changes_no_result():
    batches = list(token_data(n=12, batch_size=4))
    trained = []
    for clock_on in (False, True):
        model = tiny_hf_model("llama")
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), **SMALL)
        _train(model, optimizer, batches, clock_on)
        optimizer.close()
        trained.append(params_of(model))
    for name, value in trained[0].items():
        assert torch.equal(value, trained[1][name]), name


def test_a_phase_on_another_thread_is_charged_without_disturbing_the_main_thread_s():
    clock = PhaseClock()
    clock.enabled = True
    def host_job() -> None:
        with clock.phase("host_adam"):
            time.sleep(0.02)

    with clock.phase("step_launch"):
        worker = threading.Thread(target=host_job)
        worker.start()
        worker.join()
        time.sleep(0.01)
    charged = clock.take()
    assert charged["host_adam"] >= 0.02 and charged["step_launch"] >= 0.03  # the thread's time is not the stack's


def test_host_jobs_run_inline_on_a_cpu_device_and_on_a_thread_with_an_accelerator():
    inline = Lanes(torch.device("cpu"), torch.float32, None, ADAM)
    assert inline.worker.inline and not inline.worker._thread.is_alive()
    ran_on = []
    inline.worker.wait(inline.worker.submit(lambda: ran_on.append(threading.current_thread())))
    assert ran_on == [threading.current_thread()]
    threaded = Lanes(torch.device("meta"), torch.float32, None, ADAM)  # any device that is not the host
    assert not threaded.worker.inline
    threaded.worker.wait(threaded.worker.submit(lambda: ran_on.append(threading.current_thread())))
    assert ran_on[-1] is not threading.current_thread()
    threaded.worker.close()


def test_an_inline_job_s_failure_surfaces_at_its_wait_and_stops_later_jobs():
    worker = HostWorker(inline=True)
    ran = []

    def broken() -> None:
        raise KeyError("planted")

    job = worker.submit(broken)
    with pytest.raises(HostWorkerError) as info:
        worker.wait(job)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(HostWorkerError):
        worker.submit(lambda: ran.append(1))  # nothing runs on half-updated state
    assert ran == [] and worker.running
    worker.close()
    assert not worker.running


def test_inline_and_threaded_host_jobs_train_the_same_weights(monkeypatch):
    batches = list(token_data(n=12, batch_size=4))
    trained = []
    for inline in (True, False):
        monkeypatch.setattr(HostWorker, "__init__", _forced(inline))
        for settings in (SMALL, dict(strategy="zero_offload")):
            model = tiny_hf_model("llama")
            optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), **settings)
            assert optimizer.worker.inline == inline
            _train(model, optimizer, batches)
            optimizer.close()
            trained.append(params_of(model))
    for inline_run, threaded_run in zip(trained[:2], trained[2:]):
        for name, value in inline_run.items():
            assert torch.equal(value, threaded_run[name]), name


_INIT = HostWorker.__init__


def _forced(inline: bool):
    """A ``HostWorker.__init__`` that runs jobs inline or on a thread, whatever the engine asks."""
    def init(self, *args, **kwargs) -> None:
        _INIT(self, *args, **{**kwargs, "inline": inline})
    return init
