"""No kernel trial that cannot fit (lsp/kernels/memory_budget.py, the selection's budget), and a plan that times a
large layer at a bounded size (planning/projection_time.py).

The ``dense`` candidate forms a projector densely: for a projected 150K head that is 21 GiB, which the OOM killer
answered on a 24 GiB machine (Linux overcommits: the allocation need not raise). A candidate whose working set exceeds
the device's spare memory is neither tried nor used, and the choice says why; a plan of Qwen2.5-1.5B times its head
at a bounded size.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_offload.lsp.kernels import memory_budget
from lightning_offload.lsp.kernels import selection as selection_module
from lightning_offload.lsp.kernels.candidates import KERNELS, DenseKernel
from lightning_offload.lsp.kernels.selection import KernelSelector
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.planning import projection_time

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def isolated_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of kernel choices for one test."""
    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(selection_module, "_MEMORY", {})
    return tmp_path


@pytest.fixture
def dense_projectors_formed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (rows, columns) of every dense projector the ``dense`` kernel forms."""
    formed: list[tuple[int, int]] = []
    original = DenseKernel._dense

    def spy(projector: SparseProjector, dtype: torch.dtype) -> torch.Tensor:
        formed.append((projector.dim_out, projector.dim_in))
        return original(projector, dtype)

    monkeypatch.setattr(DenseKernel, "_dense", staticmethod(spy))
    return formed


def _projector(n: int = 512, d: int = 128) -> SparseProjector:
    return SparseProjector.random(n, d, 4, torch.Generator().manual_seed(0))


def _budget(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(selection_module, "trial_budget_bytes", lambda device: size)


def test_a_candidate_over_the_budget_is_neither_tried_nor_used(isolated_choices, dense_projectors_formed, monkeypatch,
                                                                caplog):
    projector = _projector()  # dense: 128 × 512 × 4 bytes = 256 KiB
    _budget(monkeypatch, 200 * 2**10)
    selector = KernelSelector("auto")
    x = torch.randn(64, 512)
    with caplog.at_level(logging.INFO, logger="lightning_offload"):
        selector.compress_tokens(projector, x)
    (choice,) = selector.choices.values()
    assert dense_projectors_formed == []
    assert "dense" not in choice.milliseconds and "csr" in choice.milliseconds
    assert choice.not_tried["dense"].startswith("needs 0.00 GiB of the 0.00 GiB this device can spare")
    assert any("dense not tried" in record.getMessage() for record in caplog.records)


def test_within_the_budget_every_candidate_is_tried(isolated_choices, dense_projectors_formed, monkeypatch):
    _budget(monkeypatch, 2**30)
    selector = KernelSelector("auto")
    selector.compress_tokens(_projector(), torch.randn(64, 512))
    (choice,) = selector.choices.values()
    assert "dense" in choice.milliseconds and not choice.not_tried
    assert dense_projectors_formed


def test_a_kept_choice_of_a_kernel_now_over_the_budget_is_not_used(isolated_choices, monkeypatch):
    # Its use would form the dense projector at every step, not only in the trial.
    key = "compress_tokens n=512 d=128 r=4 T=64 float32 cpu"
    monkeypatch.setattr(selection_module, "_stored_choices", lambda: {key: {"kernel": "dense", "ms": 0.001}})
    _budget(monkeypatch, 2**10 * 100)
    selector = KernelSelector("auto")
    selector.compress_tokens(_projector(), torch.randn(64, 512))
    assert selector.choices[key].kernel != "dense"


def test_a_forced_kernel_over_the_budget_falls_back_to_csr_and_says_so(isolated_choices, dense_projectors_formed,
                                                                       monkeypatch):
    _budget(monkeypatch, 2**10 * 100)
    selector = KernelSelector("dense")
    x = torch.randn(64, 512)
    with pytest.warns(UserWarning, match=r"kernels='dense' would allocate .* over the .* this device can spare"):
        got = selector.compress_tokens(_projector(), x)
    assert dense_projectors_formed == []
    torch.testing.assert_close(got, _projector().compress_rows(x.t()))


def test_a_product_whose_trial_cannot_fit_runs_untimed_on_a_kernel_without_a_working_set(isolated_choices,
                                                                                          monkeypatch):
    weight = torch.randn(512, 64)  # the trial's copy: 128 KiB
    _budget(monkeypatch, 64 * 2**10)
    selector = KernelSelector("auto")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selection_module, "_time_kernels", lambda *args: pytest.fail("no kernel may be timed"))
        selector.update_rows_(weight, _projector(), torch.randn(128, 64), 1.0, None)
    (choice,) = selector.choices.values()
    native = KERNELS["native"].applies(torch.device("cpu"))
    assert choice.how == "untimed" and choice.kernel == ("native" if native else "csr")
    assert set(choice.not_tried) >= {"csr", "dense"}


def test_the_cpu_s_free_memory_respects_an_address_space_cap():
    script = textwrap.dedent("""
        import resource
        from lightning_offload.lsp.kernels import memory_budget
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
        print(memory_budget.free_bytes(__import__("torch").device("cpu")))
    """)
    free = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout)
    assert 0 < free < 6 * 2**30
    assert memory_budget.free_bytes(torch.device("cpu")) > 0


def test_a_150k_vocabulary_head_trains_its_first_step_under_a_4_gib_cap(tmp_path):
    # The head's dense projector would be 150000 × 7500 × 4 = 4.2 GiB: before, the trial asked for it (and a machine
    # without the cap met the OOM killer). Rank 0.05 keeps the projectors' draw short.
    script = textwrap.dedent("""
        import logging, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        import torch, lightning_offload
        from lightning_offload.models.tiny import tiny_llama
        model = tiny_llama(vocab_size=150_000, hidden=128, layers=1, intermediate=256, tie_word_embeddings=False)
        optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), head="projected",
                                              rank=0.05, density=4)
        ids = torch.randint(0, 150_000, (2, 32), generator=torch.Generator().manual_seed(0))
        loss = lightning_offload.causal_lm_loss(model, {"input_ids": ids, "labels": ids})
        loss.backward()
        optimizer.step()
        print("first step", float(loss))
    """)
    env = {**os.environ, "LIGHTNING_OFFLOAD_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "first step" in done.stdout
    log = done.stdout + done.stderr
    assert "n=150000 d=7500" in log and "dense not tried" in log
    assert "failed" not in log and "can't allocate" not in log


def test_a_plan_times_a_layer_beyond_the_bound_at_a_cut_size(monkeypatch):
    timed: list[tuple[int, int, int, int]] = []

    def fake(o, i, d_o, d_i, *rest):  # noqa: ANN001, ANN202
        timed.append((o, i, d_o, d_i))
        return 1.0, 2.0, 3.0, 4.0

    monkeypatch.setattr(projection_time, "_timed_seconds", fake)
    args = (8, 2048, torch.bfloat16, torch.bfloat16, False, "cpu", "auto")
    # A 151936 × 1536 head, 2048 tokens: 311M gradient elements, cut 19 times along the vocabulary.
    seconds = projection_time._bounded_seconds(151936, 1536, 37984, 384, *args)
    cut = -(-151936 * 2048 // projection_time.TIMED_ELEMENTS)
    (o, i, d_o, d_i), = timed
    assert (i, d_i) == (1536, 384) and o == -(-151936 // cut) and d_o == -(-37984 // cut)
    assert o * i <= projection_time.TIMED_ELEMENTS and 2048 * o <= projection_time.TIMED_ELEMENTS
    # The forward compresses the 1536 input features: not cut, counted once; the rest counted `cut` times.
    assert seconds == pytest.approx(1.0 + (2.0 + 3.0 + 4.0) * cut)
    timed.clear()
    # A layer within the bound is timed at its own size.
    assert projection_time._bounded_seconds(1536, 1536, 384, 384, *args) == pytest.approx(10.0)
    assert timed == [(1536, 1536, 384, 384)]


def test_planning_qwen2_5_1_5b_on_this_cpu_times_only_bounded_products_under_an_8_gib_cap(tmp_path):
    # A fresh cache: the native kernels built, the machine calibrated and every product timed. Before, the head's
    # products were timed on 150K-row operands (49-93 s, and an OOM kill without a cap); how long it takes now is
    # measured by scripts/benchmark_plan.py --time-qwen (docs/benchmarks.md), not here.
    script = textwrap.dedent("""
        import logging, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        import torch, transformers, lightning_offload
        config = transformers.Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                          num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                          tie_word_embeddings=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        plan = lightning_offload.plan(model, "lsp_offload", batch_size=4, seq_len=512, device_memory="24GiB",
                                      precision="bf16-true")
        print("planned", plan.fits)
    """)
    env = {**os.environ, "LIGHTNING_OFFLOAD_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planned True" in done.stdout
    assert "can't allocate" not in done.stdout + done.stderr and "failed" not in done.stdout + done.stderr
    timed = [line for line in done.stdout.splitlines() if line.startswith("lightning_offload kernels: ")]
    assert any("T=2048" in line for line in timed)
    for line in timed:
        sizes = dict(part.split("=") for part in line.split(" -> ")[0].split() if "=" in part)
        operand = int(sizes["n"]) * int(sizes["T"]) if "T" in sizes else \
            int(sizes["n"]) * int(sizes["k"]) if "k" in sizes else int(sizes["rows"]) * int(sizes["cols"])
        assert operand <= projection_time.TIMED_ELEMENTS, line
