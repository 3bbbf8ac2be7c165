"""The projector benchmark's bookkeeping: equal-state sizes and the share of AdamW's gain over the frozen run."""

import argparse

import pytest
import torch
from scripts_loader import load_script


def _script():
    return load_script("benchmark_projectors")


def _shared_lr_script():
    return load_script("benchmark_shared_lr")


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
    module = _shared_lr_script()
    runs = [{"method": m, "seed": s, "eval_loss": loss} for m, s, loss in [
        ("adamw", 0, 3.0), ("frozen", 0, 4.0), ("learned_r0.25", 0, 3.1),
        ("adamw", 1, 3.0), ("frozen", 1, 3.5), ("learned_r0.25", 1, 3.0)]]
    table = module.report(runs)
    learned = next(line for line in table.splitlines() if line.startswith("| learned_r0.25"))
    # Per seed 90% and 100%, their mean 95%; the mean losses (frozen 3.75, AdamW 3.0, learned 3.05) give 93%.
    assert "3.1000 (90%)" in learned and "3.0000 (100%)" in learned and learned.endswith("| 95% | 93% |")
    assert "random_r0.25" not in table  # a method without runs has no row


def test_shared_lr_report_says_where_adamw_gained_nothing():
    # A seed where AdamW ends at the frozen run's loss defines no share: said in its cell, left out of the mean.
    runs = [{"method": m, "seed": s, "eval_loss": loss} for m, s, loss in [
        ("adamw", 0, 3.0), ("frozen", 0, 4.0), ("learned_r0.25", 0, 3.5),
        ("adamw", 1, 3.5), ("frozen", 1, 3.5), ("learned_r0.25", 1, 3.4)]]
    learned = next(line for line in _shared_lr_script().report(runs).splitlines()
                   if line.startswith("| learned_r0.25"))
    # Seed 0: 50%; seed 1: none; the mean losses (frozen 3.75, AdamW 3.25, learned 3.45) give 60%.
    assert "3.5000 (50%)" in learned and "3.4000 (no AdamW gain)" in learned and learned.endswith("| 50% | 60% |")


def test_block_diagonal_draws_mix_coordinates_only_within_their_block():
    from lightning_offload.lsp.update_size import update_scale

    draw = _shared_lr_script().block_diagonal_projector(4)
    projector = draw(128, 32, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    column_block = torch.arange(128).unsqueeze(1) // 32
    assert torch.equal(projector.indices.long() // 8, column_block.expand(128, 8))  # rows 8b…8b+7 for block b
    assert torch.allclose(projector.values.abs(), torch.full((128, 8), 8**-0.5))
    assert update_scale(projector, projector) == 1.0  # the draws keep the user's step size, as the default's do
    narrow = draw(128, 8, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert narrow.nnz_per_column == 2  # a block of 2 compressed rows takes both
    with pytest.raises(ValueError, match="--blocks 4 must divide"):
        draw(130, 32, 8, torch.Generator().manual_seed(0), torch.device("cpu"))


def test_update_scale_option_scales_random_layers_only_when_not_learned_only(monkeypatch):
    from lightning_offload.lsp import linear
    from lightning_offload.lsp.projector import SparseProjector

    bench = _shared_lr_script()
    monkeypatch.setattr(linear, "update_scale", linear.update_scale)  # restored after the test
    draw = SparseProjector.random(64, 16, 4, generator=torch.Generator().manual_seed(0))
    bench._scale_updates(2.0, learned_only=True)
    assert linear.update_scale(draw, draw) == 1.0  # a random draw's c = 1 is left alone
    bench._scale_updates(1.5, learned_only=False)
    assert linear.update_scale(draw, draw) == 1.5


@pytest.mark.parametrize("moments", ["rotate", "reset-momentum"])
def test_redraw_carries_or_resets_the_first_moment(moments):
    import lightning_offload

    bench = _shared_lr_script()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128))
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):
        model(torch.randn(8, 128)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.settle()
    layer = optimizer.projected_layers[0]
    before = layer.proj_out.indices.clone()
    trainer = argparse.Namespace(global_step=2, strategy=argparse.Namespace(offload_optimizer=optimizer))
    bench.RedrawRandomProjectors(every=2, seed=0, moments=moments).on_train_batch_start(trainer, None, None, 0)
    state = next(s for s in optimizer.slots if s.layer is layer).host_optimizer_state()
    assert not torch.equal(layer.proj_out.indices, before)  # a fresh draw
    assert (state["exp_avg"].abs().sum() == 0) == (moments == "reset-momentum")
    assert state["exp_avg_sq"].abs().sum() > 0  # the second moment is carried either way
    assert int(state["step"]) == 2
    optimizer.close()


def test_galore_method_trains_at_the_bytes_of_rank_one_quarter(monkeypatch):
    from lightning_offload.cli import baselines

    bench = _shared_lr_script()
    ranks = []
    real = baselines.galore_optimizer

    def recording(model, **kwargs):
        ranks.append(kwargs["rank"])
        return real(model, **kwargs)

    monkeypatch.setattr(baselines, "galore_optimizer", recording)
    args = bench.build_parser().parse_args(["--tokenizer", "bytes", "--steps", "3", "--warmup", "1",
                                            "--eval-blocks", "2", "--layers", "1"])
    result = bench.run("galore_r0.25", args, seed=0)
    # rank·max(o, i) = (o/4)·(i/4) on layers whose smaller side is the hidden size 128: rank 8.
    assert ranks == [8]
    assert result["eval_loss"] < result["eval_loss_before"]
