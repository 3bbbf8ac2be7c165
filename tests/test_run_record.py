"""The run's own history: every optimizer step's line carries that step's offload figures,
even when they arrive late."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.reporting.run_record import RunRecorder, read_history
from lightning_offload.setup.report import OffloadFacts, facts_of, figures_at_step_end, figures_of
from tiny_modules import TinyClassifier, classification_data, trainer


class NanAtSecondStep(TinyClassifier):
    """The second optimizer step's gradients are non-finite (its last micro-batch returns a nan loss)."""

    def __init__(self, accumulate: int) -> None:
        super().__init__()
        self.accumulate = accumulate

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 * self.accumulate - 1 else loss


STRATEGIES = {
    "lsp-pipelined": lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16),
    "lsp-not-pipelined": lambda: LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16,
                                                    pipelined=False),
    "zero": ZeroOffloadStrategy,
}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("make", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_each_step_line_carries_its_own_steps_figures(tmp_path: Path, make, accumulate: int) -> None:
    recorder = RunRecorder(tmp_path)
    with pytest.warns(UserWarning, match="Skipped an optimizer step"):
        trainer(make(), max_steps=4, accumulate_grad_batches=accumulate, callbacks=[recorder]).fit(
            NanAtSecondStep(accumulate), classification_data())
    lines = [r for r in read_history(tmp_path) if r["kind"] == "train"]
    assert lines == [{k: v for k, v in r.items()} for r in recorder.records if r["kind"] == "train"]
    assert len(lines) == 4 * accumulate
    assert [r["step"] for r in lines] == sorted(r["step"] for r in lines)  # written in order
    with_figures = {r["step"]: r for r in lines if "offload/skipped" in r}
    # Every step's figures, under its own number, including the last one (collected at the end of training).
    assert sorted(with_figures) == [1, 2, 3, 4]
    assert [with_figures[s]["offload/skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 0.0]
    assert [with_figures[s]["offload/skipped_steps"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    for step in (1, 3, 4):
        assert with_figures[step]["offload/bytes_device_to_host"] > 0
        assert with_figures[step]["offload/host_state_bytes"] > 0
    assert "offload/timeline/host_seconds" not in with_figures[2]  # a skipped step has no timeline
    assert len(recorder.telemetry) == 4


@pytest.mark.parametrize("make", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_a_one_step_run_reports_its_link_bytes_and_host_state(tmp_path: Path, make) -> None:
    recorder = RunRecorder(tmp_path)
    trainer(make(), fast_dev_run=True, callbacks=[recorder]).fit(TinyClassifier(), classification_data())
    (line,) = [r for r in read_history(tmp_path) if r["kind"] == "train"]
    assert line["offload/bytes_device_to_host"] > 0 and line["offload/bytes_host_to_device"] > 0
    assert line["offload/host_state_bytes"] > 0


def test_the_strategies_report_facts_and_figures_through_one_typed_face() -> None:
    module = TinyClassifier()
    lsp = LSPOffloadStrategy(projectors="random", rank=0.5, density=2, min_dim=16)
    trainer(lsp, max_steps=3).fit(module, classification_data())
    facts = facts_of(lsp)
    # Every distinct product of the projected layers ran on a kernel the run reports (its choice by timing).
    assert facts.kernels and set(facts.kernels.values()) <= {"csr", "dense", "native"}
    assert all(key.split()[0] in ("compress_tokens", "expand_columns", "update_rows") for key in facts.kernels)
    assert facts == OffloadFacts(gradients_offloaded=True, projected_layers=len(lsp.projected_layers),
                                 kernels=facts.kernels)
    assert facts.projected_layers > 0
    assert [number for number, _ in figures_of(lsp)] == [1, 2, 3]
    assert all(figures["offload/bytes_device_to_host"] > 0 for _, figures in figures_of(lsp))
    assert figures_at_step_end(lsp) == {}

    zero = ZeroOffloadStrategy()
    trainer(zero, max_steps=2).fit(TinyClassifier(), classification_data())
    assert facts_of(zero) == OffloadFacts(gradients_offloaded=True)

    # Lightning's own strategy offloads nothing and reports nothing.
    plain = trainer("auto", max_steps=1)
    plain.fit(TinyClassifier(), classification_data())
    assert facts_of(plain.strategy) == OffloadFacts() and figures_of(plain.strategy) == ()
    assert figures_at_step_end(plain.strategy) == {}
