"""The projector benchmark's bookkeeping: equal-state sizes and the share of AdamW's gain over the frozen run."""

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark_projectors.py"


def _script():
    spec = importlib.util.spec_from_file_location("benchmark_projectors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_galore_rank_matches_the_lsp_state_on_square_and_mlp_layers():
    bench = _script()
    for rank in (0.25, 0.125):
        lsp = bench.projected_state_floats("lsp_learned", rank, 12, 0)
        galore = bench.projected_state_floats("galore", rank, 12, bench.galore_rank_for(rank))
        # k/v projections (192 × 576) are where the two differ: within 15%.
        assert galore == pytest.approx(lsp, rel=0.15)
    assert bench.projected_state_floats("adamw", 0.25, 12, 0) == 2 * sum(o * i for o, i in bench.SMOLLM2_LAYERS)


def test_report_gives_each_method_its_share_of_adamws_gain_over_frozen():
    bench = _script()

    def run(method, lr, loss, rank=0.25):
        return {"method": method, "rank": rank, "projected_lr": lr, "eval_loss_before": 3.5, "eval_loss_after": loss,
                "bytes_device_to_host_per_step": 2**20, "initial_fit_seconds": 0.0, "median_step_seconds": 1.0,
                "config": {"density": 8}}

    runs = [run("adamw", 1e-4, 3.0), run("adamw", 3e-4, 3.1), run("frozen", 1e-4, 3.2),
            run("lsp_learned", 1e-3, 3.02), run("lsp_learned", 3e-3, 3.05), run("lsp_random", 1e-4, 3.1)]
    store = {"runs": {f"{r['method']}|{r['projected_lr']}": r for r in runs}}
    args = argparse.Namespace(rank=0.25, lora_rank=12)
    table = bench.report(store, args)
    learned = next(line for line in table.splitlines() if line.startswith("| lsp_learned"))
    assert "| 3.0200 | 90% |" in learned  # (3.2 − 3.02) / (3.2 − 3.0): its best lr counts
    assert "16× fewer" in learned  # rank 0.25 on both sides: (1/4)² of the fp32 gradient bytes
    assert "| 50% |" in next(line for line in table.splitlines() if line.startswith("| lsp_random"))


def test_shared_rate_protocol_runs_every_method_at_the_users_rate(monkeypatch, tmp_path):
    bench = _script()
    runs = []

    def fake_run(method, rank, projected_lr, args, store):
        runs.append(bench.overrides_for(method, projected_lr, rank, args))

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "report", lambda store, args: "")
    monkeypatch.setattr("sys.argv", ["benchmark_projectors.py", "--out", str(tmp_path / "out.json"), "--shared-lr",
                                     "--lr", "2e-4", "--methods", "adamw", "frozen", "lsp_learned", "lsp_random",
                                     "--compression", "0.125"])
    bench.main()

    def setting(overrides, key):
        return next((o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")), None)

    cells = {(setting(o, "offload"), setting(o, "offload.method"), setting(o, "offload.strategy.projectors"),
              setting(o, "offload.strategy.rank")) for o in runs}
    assert cells == {("none", None, None, None), ("none", "frozen", None, None), ("lsp", None, "learned", "0.25"),
                     ("lsp", None, "random", "0.25"), ("lsp", None, "learned", "0.125"),
                     ("lsp", None, "random", "0.125")}
    assert len(runs) == 6
    # One rate for every parameter: the optimizer's and the projected layers'.
    assert all(setting(o, "optim.lr") == "0.0002" and setting(o, "offload.projected_lr") == "0.0002" for o in runs)
    assert all(setting(o, "model") == "smollm2_135m" and setting(o, "data") == "bible_lm" for o in runs)


def test_shared_lr_script_reports_shares_per_seed_and_their_mean():
    spec = importlib.util.spec_from_file_location("benchmark_shared_lr", SCRIPT.parent / "benchmark_shared_lr.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = [{"method": m, "seed": s, "eval_loss": loss} for m, s, loss in [
        ("adamw", 0, 3.0), ("frozen", 0, 4.0), ("learned_r0.25", 0, 3.1),
        ("adamw", 1, 3.0), ("frozen", 1, 3.5), ("learned_r0.25", 1, 3.0)]]
    table = module.report(runs)
    learned = next(line for line in table.splitlines() if line.startswith("| learned_r0.25"))
    # Per seed 90% and 100%, their mean 95%; the mean losses (frozen 3.75, AdamW 3.0, learned 3.05) give 93%.
    assert "3.1000 (90%)" in learned and "3.0000 (100%)" in learned and learned.endswith("| 95% | 93% |")
    assert "random_r0.25" not in table  # a method without runs has no row
