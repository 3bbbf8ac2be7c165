"""``update="scaled"``: the full-rank update from compressed host moments equals the rule written with torch only
(tests/scaled_reference.py, a separate optimizer over a separate model) in every face, with and without the limiter,
across redraws, under a schedule that reaches lr 0, with clipping (the offload's and the user's own) and accumulation;
resumes bit for bit; and what it cannot take is refused by name."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_offload import FabricOffload, LSPOffloadStrategy, offload
from lightning_offload.lsp.channel_scales import channel_scales
from scaled_reference import ScaledAdamWReference
from tiny_modules import TinyCausalLM, TokenDicts, params_of, tiny_hf_model, token_data, trainer

LR = 3e-3
CLIP = 0.1  # fires at every step of these runs (the tiny models' gradient norms are ~0.3-1)
RULE = dict(rank=0.5, redraw_every=2)
SCALED = dict(strategy="lsp_offload", update="scaled", min_dim=16, embeddings="host", **RULE)


def scaled_modules(model: nn.Module) -> list[nn.Module]:
    """The layers the engine selects at ``min_dim=16`` (every Linear/Conv1D but the LM head), in model order."""
    return [module for name, module in model.named_modules()
            if type(module).__name__ in ("Linear", "Conv1D") and name != "lm_head"
            and min(module.weight.shape) >= 16]


def reference_optimizer(model: nn.Module, limit: float | None = 1.01, weight_decay: float = 0.01,
                        **rule: Any) -> ScaledAdamWReference:
    return ScaledAdamWReference(model, scaled_modules(model), lr=LR, weight_decay=weight_decay, limit=limit,
                                **{**RULE, **rule})


def to_zero(step: int, steps: int = 6) -> float:
    """Linear warm-up over 2 steps, then linear decay reaching lr 0 at the last step."""
    return (step + 1) / 2 if step < 2 else max(0.0, (steps - 1 - step) / (steps - 3))


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def run_loop(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, micro: int = 1,
             user_clip: float | None = None, schedule: bool = False) -> None:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, to_zero) if schedule else None
    for start in range(0, len(batches), micro):
        for batch in batches[start:start + micro]:
            (lm_loss(model, batch) / micro).backward()
        if user_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), user_clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def assert_equal(model: nn.Module, reference: nn.Module) -> None:
    got, want = params_of(model), params_of(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def moved(model: nn.Module, start: nn.Module) -> None:
    """Every scaled weight trained (the comparison is not between two untrained models)."""
    for module, before in zip(scaled_modules(model), scaled_modules(start)):
        assert not torch.equal(module.weight, before.weight)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("limit", [1.01, None], ids=["limiter", "no_limiter"])
def test_a_loop_equals_the_torch_reference_across_redraws_under_a_schedule_to_zero(kind: str, limit: float | None
                                                                                   ) -> None:
    batches = list(token_data(n=24, batch_size=4))
    reference = tiny_hf_model(kind)
    run_loop(reference, reference_optimizer(reference, limit), batches, schedule=True)
    model = tiny_hf_model(kind)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
                        norm_growth_limit=limit, **SCALED)
    run_loop(model, optimizer, batches, schedule=True)
    optimizer.close()
    assert_equal(model, reference)
    moved(model, tiny_hf_model(kind))


class SharedAndFrozen(nn.Module):
    """A weight shared by two modules, a frozen layer left in the optimizer, and a head (never projected)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.frozen = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.second.weight = self.first.weight
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.frozen(self.first(x))))))


@pytest.mark.parametrize("reads", [False, True], ids=["plain_loop", "reads_state_dict_each_step"])
def test_a_shared_weight_a_frozen_layer_and_reads_after_each_step(reads: bool) -> None:
    """The shared weight is one scaled tensor (its gradient sums both uses), the frozen layer is left alone, and reading
    ``model.state_dict()`` after every step (an EMA callback's habit) changes nothing: equal to the reference."""
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)) for _ in range(6)]
    reference = SharedAndFrozen()
    optimizer = ScaledAdamWReference(reference, [reference.first], lr=LR, weight_decay=0.01, **RULE)
    model = SharedAndFrozen()
    engine = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), **SCALED)
    for x, y in batches:
        for net, opt in ((reference, optimizer), (model, engine)):
            (net(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if reads:
            read = {name: value.clone() for name, value in model.state_dict().items()}
            torch.testing.assert_close(read["first.weight"], reference.first.weight.detach())
    engine.close()
    assert model.second.weight is model.first.weight and not model.frozen.weight.requires_grad
    assert torch.equal(model.frozen.weight, SharedAndFrozen().frozen.weight)
    assert_equal(model, reference)
    assert not torch.equal(model.first.weight, SharedAndFrozen().first.weight)


def test_the_limiter_changes_the_run() -> None:
    """The limiter is not idle in these runs: without it the weights differ (so the parametrisation above tests
    both arms of it)."""
    batches = list(token_data(n=24, batch_size=4))
    runs = []
    for limit in (1.01, None):
        model = tiny_hf_model("llama")
        run_loop(model, reference_optimizer(model, limit), batches)
        runs.append(params_of(model))
    assert any(not torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


@pytest.mark.parametrize("user_clip", [False, True], ids=["offload_clip", "torch_clip_grad_norm"])
def test_clipping_and_accumulation_equal_the_reference(user_clip: bool) -> None:
    """Clipping by norm (the offload's ``max_grad_norm``, or the user's own ``clip_grad_norm_``, exact here since the
    full gradient is ``param.grad``) with 2 micro-batches per step."""
    batches = list(token_data(n=24, batch_size=4))
    reference = tiny_hf_model("llama")
    run_loop(reference, reference_optimizer(reference), batches, micro=2, user_clip=CLIP)
    model = tiny_hf_model("llama")
    clip = dict(max_grad_norm=None) if user_clip else dict(max_grad_norm=CLIP)
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), accumulation_steps=2,
                        **clip, **SCALED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the user's edit makes the edited gradients cross again (said once)
        run_loop(model, optimizer, batches, micro=2, user_clip=CLIP if user_clip else None)
    optimizer.close()
    assert_equal(model, reference)
    unclipped = tiny_hf_model("llama")
    run_loop(unclipped, reference_optimizer(unclipped), batches, micro=2)
    assert not torch.equal(params_of(unclipped)["model.layers.0.mlp.up_proj.weight"],
                           params_of(model)["model.layers.0.mlp.up_proj.weight"])  # clipping changed the run


def test_clipping_by_value_clamps_the_full_gradient() -> None:
    batches = list(token_data(n=16, batch_size=4))
    bound = 2e-3
    reference = tiny_hf_model("llama")
    optimizer = reference_optimizer(reference)
    for batch in batches:
        lm_loss(reference, batch).backward()
        torch.nn.utils.clip_grad_value_(reference.parameters(), bound)
        optimizer.step()
        optimizer.zero_grad()
    model = tiny_hf_model("llama")
    engine = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), **SCALED)
    for batch in batches:
        lm_loss(model, batch).backward()
        engine.clip_grad_value_(bound)
        engine.step()
        engine.zero_grad()
    engine.close()
    assert_equal(model, reference)


def test_resume_in_the_middle_is_bit_for_bit(tmp_path: Path) -> None:
    """Save after 3 steps (mid-way between redraws), resume in a fresh model and engine: the rest equals the
    uninterrupted run bit for bit (moments, step counts, draws, the limiter's last norm)."""
    batches = list(token_data(n=28, batch_size=4))
    whole = tiny_hf_model("llama")
    optimizer = offload(whole, torch.optim.AdamW(whole.parameters(), lr=LR, weight_decay=0.01), **SCALED)
    run_loop(whole, optimizer, batches)
    optimizer.close()
    first = tiny_hf_model("llama")
    optimizer = offload(first, torch.optim.AdamW(first.parameters(), lr=LR, weight_decay=0.01), **SCALED)
    run_loop(first, optimizer, batches[:3])
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "mid.pt")
    optimizer.close()
    saved = torch.load(tmp_path / "mid.pt", weights_only=False)
    resumed = tiny_hf_model("llama", seed=1)  # other weights: all of them come from the checkpoint
    resumed.load_state_dict(saved["model"])
    optimizer = offload(resumed, torch.optim.AdamW(resumed.parameters(), lr=LR, weight_decay=0.01), seed=5,
                        **SCALED)  # another seed: the draws are the checkpoint's
    optimizer.load_state_dict(saved["optimizer"])
    run_loop(resumed, optimizer, batches[3:])
    optimizer.close()
    got, want = params_of(resumed), params_of(whole)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_checkpoint_of_the_other_rule_is_refused() -> None:
    batches = list(token_data(n=4, batch_size=4))
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **SCALED)
    run_loop(model, optimizer, batches)
    state = optimizer.state_dict()
    optimizer.close()
    other = tiny_hf_model("llama")
    projected = offload(other, torch.optim.AdamW(other.parameters(), lr=LR), rank=0.5, min_dim=16, density=2,
                        embeddings="host")
    with pytest.raises(ValueError, match="update='scaled'.*Resume with update='scaled'"):
        projected.load_state_dict(state)
    projected.close()


def test_bf16_weights_train_with_stochastic_rounding_reproducibly() -> None:
    batches = list(token_data(n=12, batch_size=4))
    runs = []
    for _ in range(2):
        model = tiny_hf_model("llama").to(torch.bfloat16)
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), **SCALED)
        run_loop(model, optimizer, batches)
        optimizer.close()
        runs.append(params_of(model))
    fp32 = tiny_hf_model("llama")
    run_loop(fp32, reference_optimizer(fp32), batches)
    start = params_of(tiny_hf_model("llama").to(torch.bfloat16))
    name = "model.layers.0.mlp.up_proj.weight"
    assert all(torch.equal(runs[0][key], runs[1][key]) for key in runs[0])  # seeded rounding: reproducible
    # Each step moves a weight by ~lr (3e-3), below half a bf16 ulp of most weights: round-to-nearest would leave
    # many unchanged, stochastic rounding moves them on average as the fp32 run does.
    change, want = runs[0][name] - start[name], params_of(fp32)[name] - params_of(tiny_hf_model("llama"))[name]
    assert torch.nn.functional.cosine_similarity(change.flatten(), want.flatten(), dim=0) > 0.8


def test_telemetry_reports_the_held_gradients_and_the_projections() -> None:
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **SCALED)
    run_loop(model, optimizer, list(token_data(n=8, batch_size=4)))
    optimizer.synchronize()
    figures = optimizer.telemetry.metrics()
    optimizer.close()
    weights = sum(module.weight.numel() * 4 for module in scaled_modules(model))
    assert figures["offload/device_held_gradient_bytes"] == weights
    assert figures["offload/device_persistent_bytes/scaled_projections"] > 0
    assert figures["offload/device_persistent_bytes/projectors"] == 0


def test_row_sparse_embeddings_train_beside_it() -> None:
    """The default embedding placement (row-sparse on the host) with the scaled rule on the other layers."""
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
                        **{**SCALED, "embeddings": "sparse"})
    run_loop(model, optimizer, list(token_data(n=12, batch_size=4)))
    optimizer.synchronize()
    figures = optimizer.telemetry.metrics()
    optimizer.close()
    assert figures["offload/sparse_rows"] > 0 and figures["offload/device_held_gradient_bytes"] > 0
    moved(model, tiny_hf_model("llama"))
    assert not torch.equal(model.model.embed_tokens.weight, tiny_hf_model("llama").model.embed_tokens.weight)


class Scaled(TinyCausalLM):
    """The usual AdamW; with ``reference``, the torch-only rule instead (for plain Lightning)."""

    def __init__(self, model: nn.Module, reference: bool = False) -> None:
        super().__init__(model)
        self.reference = reference

    def configure_optimizers(self) -> Any:
        if self.reference:
            return reference_optimizer(self.model)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def test_the_trainer_equals_plain_lightning_with_the_reference() -> None:
    data = token_data(n=24, batch_size=4)
    reference = Scaled(tiny_hf_model("gpt2"), reference=True)
    trainer("auto", max_steps=6, gradient_clip_val=CLIP).fit(reference, data)
    module = Scaled(tiny_hf_model("gpt2"))
    strategy = LSPOffloadStrategy(update="scaled", min_dim=16, embeddings="host", **RULE)
    trainer(strategy, max_steps=6, gradient_clip_val=CLIP).fit(module, data)
    assert_equal(module.model, reference.model)  # read through model.state_dict()'s tensors, as users do


def test_fabric_equals_plain_fabric_with_the_reference() -> None:
    batches = list(token_data(n=20, batch_size=4))
    results = []
    for strategy in ("auto", FabricOffload(update="scaled", min_dim=16, embeddings="host", **RULE)):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model = tiny_hf_model("llama")
        optimizer = reference_optimizer(model) if strategy == "auto" else torch.optim.AdamW(
            model.parameters(), lr=LR, weight_decay=0.01)
        model, optimizer = fabric.setup(model, optimizer)
        for batch in batches:
            fabric.backward(lm_loss(model, batch))
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
        if strategy != "auto":
            optimizer.close()
        results.append(model)
    assert_equal(results[1], results[0])


transformers = pytest.importorskip("transformers")


def test_hugging_face_s_trainer_and_its_max_grad_norm_equal_the_reference(tmp_path: Path) -> None:
    """HF's own clipping call reaches the full gradients (``param.grad``): exact without ``OffloadCallback``."""
    def train(model: nn.Module, optimizer: torch.optim.Optimizer, out: Path) -> None:
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=4, max_grad_norm=CLIP, use_cpu=True,
            report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=TokenDicts(), optimizers=(optimizer, None)).train()

    reference = tiny_hf_model("llama")
    train(reference, reference_optimizer(reference, weight_decay=0.0), tmp_path / "plain")
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), **SCALED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, optimizer, tmp_path / "offload")
    optimizer.close()
    assert_equal(model, reference)


@pytest.mark.parametrize("settings, match", [
    (dict(update="sideways"), "update must be one of"),
    (dict(update="scaled", density=4), "density=4: this setting applies only to update='projected'"),
    (dict(update="scaled", projectors="learned"), "projectors='learned'.*only to update='projected'"),
    (dict(redraw_every=50), "redraw_every=50: this setting applies only to update='scaled'"),
    (dict(update="scaled", norm_growth_limit=0.9), "norm_growth_limit must be None"),
    (dict(update="scaled", redraw_every=0), "redraw_every must be a positive int"),
])
def test_bad_settings_are_refused_by_name(settings: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LSPOffloadStrategy(**settings)


def test_what_the_rule_cannot_take_is_refused_by_name() -> None:
    from lightning_offload import ZeroOffloadStrategy
    from lightning_offload.faces.trainer.ddp import LSPOffloadDDPStrategy

    with pytest.raises(ValueError, match="update='scaled'.*nothing is projected"):
        ZeroOffloadStrategy(update="scaled")
    with pytest.raises(ValueError, match="update='scaled' trains on one process"):
        LSPOffloadDDPStrategy(update="scaled")
    model = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="coupled L2.*torch.optim.AdamW"):
        offload(model, torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.1),
                **{**SCALED, "embeddings": "frozen"})
    # Refused at set-up, the model is given back as it was: its embedding trainable again, no engine on it.
    assert model.model.embed_tokens.weight.requires_grad and not hasattr(model, "_lightning_offload_engine")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR), **SCALED)  # it can be offloaded now
    optimizer.close()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_weight_projected_to_one_number_per_channel_takes_one_scale(kind: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """At rank 0.2 the tiny models' layers project each channel to r = 1 or 2 numbers: those at 1 take one scale
    for the whole weight, the others one per channel, as the reference writes the rule."""
    start = tiny_hf_model(kind)
    ranks = [ScaledAdamWReference(start, [module], lr=LR, rank=0.2).rule[id(module.weight)]["r"]
             for module in scaled_modules(start)]
    assert set(ranks) == {1, 2}, ranks  # both forms are exercised
    batches = list(token_data(n=16, batch_size=4))
    reference = tiny_hf_model(kind)
    run_loop(reference, reference_optimizer(reference, rank=0.2), batches, schedule=True)
    model = tiny_hf_model(kind)
    with caplog.at_level(logging.INFO):
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
                            **{**SCALED, "rank": 0.2})
    said = f"{ranks.count(1)} of them project each channel to 1 number and take one scale per weight"
    assert said in caplog.text
    run_loop(model, optimizer, batches, schedule=True)
    optimizer.close()
    assert_equal(model, reference)
    moved(model, start)


def test_the_scales_are_per_weight_at_one_number_per_channel_and_per_channel_above() -> None:
    generator = torch.Generator().manual_seed(0)
    for r in (1, 2):
        direction = torch.randn(6, r, generator=generator)
        projected = torch.randn(6, r, generator=generator)
        squares = torch.rand(6, generator=generator)
        scales, norm = channel_scales(direction, projected.norm(dim=1), squares, None, None)
        want = ((direction.norm() / projected.norm()).expand(6) if r == 1
                else direction.norm(dim=1) / projected.norm(dim=1))
        torch.testing.assert_close(scales, want)
        assert norm == pytest.approx(float((want.square() * squares).sum().sqrt()), rel=1e-6)
    zero_scales, zero_norm = channel_scales(torch.zeros(6, 1), torch.zeros(6), torch.zeros(6), None, None)
    assert not zero_scales.any() and zero_norm == 0.0
