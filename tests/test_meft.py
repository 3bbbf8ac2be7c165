"""MEFT: injection, Key-Experts routing, host rows with the block Adam, accumulation, resume,
the meft_offload strategy."""

from __future__ import annotations

import multiprocessing
import os
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_offload import BlockRowAdam, MEFTConfig, MEFTOffloadStrategy, inject_meft, meft_adapters
from lightning_offload.engine import optimizer as engine_optimizer
from lightning_offload.engine.lanes.worker import HostWorkerError
from lightning_offload.engine.rows.block_row_adam import RENORMALIZE_BELOW, RowAdamSettings
from lightning_offload.engine.rows.native_row_adam import LandedRows
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.engine.step.clipping import NonFiniteGradientError
from lightning_offload.meft.routing import expert_key_scores, route, select_experts, select_neurons
from lightning_offload.models import tiny_gpt2, tiny_llama
from lightning_offload.setup.report import facts_of, figures_at_step_end
from lightning_offload.tasks.causal_lm import CausalLMModule
import lightning_offload  # noqa: F401  (registers meft_offload)

# Standardisation measured on the first batch alone: tests that compare runs fix it with one forward beforehand
# (the calibration tests set calibration_batches themselves).
SMALL = dict(num_neurons=256, top_k=8, num_experts=16, experts_per_token=4, calibration_batches=1)


def batches(n: int, batch: int = 2, length: int = 12, seed: int = 0, pad_last: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 256, (batch, length), generator=g)
        mask = torch.ones_like(ids)
        if pad_last:
            mask[-1, -pad_last:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def loader(data: list[dict]) -> DataLoader:
    return DataLoader(data, batch_size=None, shuffle=False)


def meft_model(factory=tiny_llama, **config) -> torch.nn.Module:
    model = factory()
    inject_meft(model, MEFTConfig(**{**SMALL, **config}))
    return model


def test_config_rejects_bad_values_with_the_fix() -> None:
    with pytest.raises(ValueError, match="num_neurons=100 must be a multiple of num_experts=16"):
        MEFTConfig(num_neurons=100, num_experts=16)
    with pytest.raises(ValueError, match="top_k=999 exceeds"):
        MEFTConfig(**{**SMALL, "top_k": 999})
    with pytest.raises(ValueError, match="routing='gpu'"):
        MEFTConfig(routing="gpu")
    with pytest.raises(ValueError, match="experts_per_token=32 exceeds num_experts=16"):
        MEFTConfig(**{**SMALL, "experts_per_token": 32})
    with pytest.raises(ValueError, match="experts_per_token ≤ experts_per_sequence ≤ num_experts"):
        MEFTConfig(**{**SMALL, "experts_per_sequence": 2})
    with pytest.raises(ValueError, match="expert_choice='batch' is not one of"):
        MEFTConfig(**{**SMALL, "expert_choice": "batch"})


class _ReadsItsChild(torch.nn.Module):
    """A module of a user's that reads its child's weight rather than calling it (a hand-fused kernel would)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.proj.weight, self.proj.bias)


def _encoder_layer(dim_feedforward: int = 32) -> torch.nn.Module:
    return torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=dim_feedforward, batch_first=True)


@pytest.mark.parametrize("build, pattern, target, reader, fix", [
    (lambda: torch.nn.Sequential(_encoder_layer()), r"linear2$", "0.linear2", "'0' (TransformerEncoderLayer)",
     r"target_modules=r'^\d+$'"),
    (lambda: torch.nn.Sequential(torch.nn.MultiheadAttention(32, 4)), r"out_proj$", "0.out_proj",
     "'0' (MultiheadAttention)", "write the FFN as a module"),
    (lambda: torch.nn.TransformerEncoder(_encoder_layer(), 2, enable_nested_tensor=False), r"layers\.\d+$",
     "layers.0", "the model (TransformerEncoder)", "write the FFN as a module"),
    (lambda: torch.nn.Sequential(_ReadsItsChild()), r"proj$", "0.proj", "'0' (_ReadsItsChild)",
     r"target_modules=r'^\d+$'"),
], ids=["encoder_layer_linear2", "attention_out_proj", "encoder_first_layer", "users_module"])
def test_a_target_read_directly_by_a_module_above_it_is_refused_naming_the_reader_and_the_fix(
        build, pattern: str, target: str, reader: str, fix: str) -> None:
    model = build()
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    with pytest.raises(ValueError) as caught:
        inject_meft(model, MEFTConfig(**{**SMALL, "target_modules": pattern}))
    message = str(caught.value)
    assert f"beside {target!r}" in message and reader in message and "instead of calling it" in message, message
    assert "weight" in message or "self_attn" in message, message
    assert fix in message, message
    # Refused before anything changed: no wrapper, nothing frozen.
    assert not meft_adapters(model) and {n: p.requires_grad for n, p in model.named_parameters()} == before


def test_the_block_a_refusal_names_takes_an_adapter_and_evaluates_on_torchs_fast_path() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_encoder_layer()).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        base = model(x)
    adapters = inject_meft(model, MEFTConfig(**{**SMALL, "target_modules": r"^\d+$"}))
    assert len(adapters) == 1
    with torch.no_grad():  # the encoder layer's own fast path reads its children: they are untouched
        torch.testing.assert_close(model(x), base)  # values start at zero: the base model's output


def test_a_linear_whose_output_is_not_its_input_size_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"beside '0'.*maps 32 features to 16.*Target the whole FFN"):
        inject_meft(model, MEFTConfig(**{**SMALL, "target_modules": r"^0$"}))


def test_sequence_routing_keeps_its_row_bound_and_the_top_neurons_inside_its_experts() -> None:
    config = MEFTConfig(**SMALL, experts_per_sequence=5)
    g = torch.Generator().manual_seed(3)
    sequences, length, hidden = 2, 40, 16
    tokens = sequences * length
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, config.num_experts, generator=g)
    scores = torch.randn(tokens, config.num_neurons, generator=g)
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[-7:] = False  # padding at the end of the last sequence
    r = route(x, logits, scores, config, valid, sequences)
    rows = torch.unique(r.neurons[valid])
    bound = config.row_bound(sequences, tokens)
    assert bound == sequences * 5 * config.neurons_per_expert < tokens * config.top_k
    assert rows.numel() <= bound
    token_routing = route(x, logits, scores, MEFTConfig(**SMALL, expert_choice="token"), valid)
    assert torch.unique(token_routing.neurons[valid]).numel() > bound  # the per-token union is not bounded so
    probabilities = torch.softmax(logits, dim=-1)
    for s in range(sequences):
        run = slice(s * length, (s + 1) * length)
        mean = (probabilities[run] * valid[run, None]).sum(0)
        kept = set(mean.topk(5).indices.tolist())
        for t in range(s * length, (s + 1) * length):
            experts = set(r.experts[t].tolist())
            assert experts <= kept
            best_experts = sorted(kept, key=lambda e: -logits[t, e].item())[: config.experts_per_token]
            assert experts == set(best_experts)
            allowed = [n for n in range(config.num_neurons) if n // config.neurons_per_expert in experts]
            best = sorted(allowed, key=lambda n: -scores[t, n].item())[: config.top_k]
            assert set(r.neurons[t].tolist()) == set(best)
    assert (r.gates[~valid] == 0).all()


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2])
def test_injected_model_equals_the_base_model(factory) -> None:
    base = factory()
    injected = factory()
    adapters = inject_meft(injected, MEFTConfig(**SMALL))
    assert len(adapters) == 2  # one per block
    batch = batches(1, pad_last=3)[0]
    with torch.no_grad():
        expected = base(**batch).logits
        got = injected(**batch).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _forward_in_child(model: torch.nn.Module, batch: dict, results: Any) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP team is not in the child either; the fetch thread is what is tested
    with torch.no_grad():
        results.put(model(**batch).logits.tolist())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is a POSIX call")
def test_a_forked_child_gathers_rows_on_a_thread_of_its_own() -> None:
    # fork copies only the calling thread: the parent's row-fetch thread (started by its forward) is not in the child,
    # whose forwards must gather on a thread of their own rather than wait on that one forever (DDP's fork launcher).
    model, batch = meft_model(), batches(1)[0]
    with torch.no_grad():
        expected = model(**batch).logits.tolist()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_forward_in_child, args=(model, batch, results))
    child.start()
    child.join(timeout=60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, "the forked child's forward waited for the parent's row-fetch thread"
    assert child.exitcode == 0
    assert results.get(timeout=10) == expected


def test_only_adapter_routers_are_trainable_on_the_device() -> None:
    model = meft_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith("adapter.router.weight") for n in trainable)
    # Keys and values are host tensors, not parameters or buffers that `.to(device)` would move.
    assert not any(n.endswith(("keys", "values")) for n, _ in model.named_parameters())
    assert any(k.endswith("adapter.keys") for k in model.state_dict())


def test_routing_picks_top_k_neurons_inside_the_selected_experts() -> None:
    config = MEFTConfig(**SMALL, expert_choice="token")  # the paper's per-token routing
    g = torch.Generator().manual_seed(1)
    tokens, hidden = 40, 32
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, config.num_experts, generator=g)
    scores = torch.randn(tokens, config.num_neurons, generator=g)
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[-5:] = False
    r = route(x, logits, scores, config, valid)
    assert r.neurons.shape == (tokens, config.top_k)
    for t in range(tokens):
        chosen = set(r.neurons[t].tolist())
        assert len(chosen) == config.top_k
        experts = set(logits[t].topk(config.experts_per_token).indices.tolist())
        assert set(r.experts[t].tolist()) == experts
        assert {n // config.neurons_per_expert for n in chosen} <= experts
        allowed = [n for n in range(config.num_neurons) if n // config.neurons_per_expert in experts]
        best = sorted(allowed, key=lambda n: -scores[t, n].item())[: config.top_k]
        assert chosen == set(best)
    assert (r.gates[~valid] == 0).all() and (r.gates[valid] >= 0).all()
    # Gates average 1 over a token's kept experts (a uniform router leaves each neuron's contribution unscaled).
    experts, expert_gates = select_experts(logits, config)
    torch.testing.assert_close(expert_gates.mean(dim=1), torch.ones(tokens))


def test_gate_selection_ranks_neurons_by_key_score_times_gate() -> None:
    config = MEFTConfig(**SMALL, expert_choice="token", gate_selection=True)
    g = torch.Generator().manual_seed(5)
    tokens = 30
    logits = torch.randn(tokens, config.num_experts, generator=g) * 3
    scores = torch.randn(tokens, config.num_neurons, generator=g).abs()  # positive: the gate can only reorder them
    valid = torch.ones(tokens, dtype=torch.bool)
    r = route(torch.zeros(tokens, 4), logits, scores, config, valid)
    plain = route(torch.zeros(tokens, 4), logits, scores, MEFTConfig(**SMALL, expert_choice="token"), valid)
    experts, gates = select_experts(logits, config)
    for t in range(tokens):
        gate_of = {e: float(gates[t, j]) for j, e in enumerate(experts[t].tolist())}
        allowed = [n for n in range(config.num_neurons) if n // config.neurons_per_expert in gate_of]
        best = sorted(allowed, key=lambda n: -scores[t, n].item() * gate_of[n // config.neurons_per_expert])
        assert set(r.neurons[t].tolist()) == set(best[: config.top_k])
    assert not torch.equal(r.neurons.sort(1).values, plain.neurons.sort(1).values)  # the gate changed the choice


def test_scoring_only_the_kept_experts_routes_like_scoring_every_neuron() -> None:
    config = MEFTConfig(**SMALL)
    g = torch.Generator().manual_seed(2)
    tokens, hidden = 50, 24
    x = torch.randn(tokens, hidden, generator=g)
    keys = torch.randn(config.num_neurons, hidden, generator=g)
    logits = torch.randn(tokens, config.num_experts, generator=g)
    valid = torch.ones(tokens, dtype=torch.bool)
    reference = route(x, logits, x @ keys.T, config, valid)
    experts, expert_gates = select_experts(logits, config)
    scores = expert_key_scores(x, experts, keys, config.num_experts)
    for t in range(tokens):  # [T, e, N/E]: row j holds the scores of the token's j-th kept expert
        for j, e in enumerate(experts[t].tolist()):
            block = slice(e * config.neurons_per_expert, (e + 1) * config.neurons_per_expert)
            torch.testing.assert_close(scores[t, j], (x[t] @ keys[block].T))
    fast = select_neurons(scores, experts, expert_gates, config, valid)
    assert torch.equal(fast.neurons.sort(dim=1).values, reference.neurons.sort(dim=1).values)
    order_fast, order_ref = fast.neurons.argsort(dim=1), reference.neurons.argsort(dim=1)
    torch.testing.assert_close(fast.gates.gather(1, order_fast), reference.gates.gather(1, order_ref))


def _first_adapter_inputs(model: torch.nn.Module) -> tuple[Any, list[torch.Tensor]]:
    """The first adapter and a list that collects the FFN inputs it is given."""
    ffn = meft_adapters(model)[0]
    seen: list[torch.Tensor] = []
    host_module = next(m for m in model.modules() if getattr(m, "adapter", None) is ffn)
    host_module.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().reshape(-1, 64)))
    return ffn, seen


@pytest.mark.parametrize("calibration_batches", [1, 3])
def test_inputs_are_standardised_over_the_calibration_batches_and_kept(calibration_batches: int) -> None:
    model = meft_model(calibration_batches=calibration_batches)
    ffn, seen = _first_adapter_inputs(model)
    data = batches(calibration_batches + 1, pad_last=4)
    with torch.no_grad():
        for batch in data[:calibration_batches]:
            model(**batch)
    # Over the real tokens of every calibration batch (padding left out): zero mean, unit mean square.
    valid = torch.cat([b["attention_mask"].reshape(-1).bool() for b in data[:calibration_batches]])
    x = ffn.adapter_input(torch.cat(seen), valid)[valid]
    torch.testing.assert_close(x.mean(dim=0), torch.zeros(64), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.pow(2).mean(), torch.tensor(1.0), atol=1e-5, rtol=0)
    mean = ffn.input_mean.clone()
    with torch.no_grad():
        model(**data[-1])
    assert torch.equal(ffn.input_mean, mean)  # fixed after the calibration batches
    # Saved with the model: a fresh injected model loads the same standardisation instead of measuring its own.
    fresh = meft_model(calibration_batches=calibration_batches)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        fresh(**data[-1])
    assert torch.equal(meft_adapters(fresh)[0].input_mean, mean)
    # Off: the adapter reads the FFN input itself.
    plain = meft_adapters(meft_model(standardize_inputs=False))[0]
    assert torch.equal(plain.adapter_input(seen[0]), seen[0])


def test_an_evaluation_during_calibration_adds_nothing_to_it() -> None:
    # In eval mode (Lightning's validation, a reader's model.eval()) the adapter reads the statistics as they are: the
    # calibration, and so the run, is the same whether or not something was evaluated mid-way (it took the
    # evaluation's tokens in before, and an evaluation forward between training steps changed the training after it).
    data = batches(4, pad_last=4)
    straight, evaluated = meft_model(calibration_batches=3), meft_model(calibration_batches=3)
    with torch.no_grad():
        for batch in data[:3]:
            straight(**batch)
        evaluated(**data[0])
        evaluated.eval()
        evaluated(**data[3])  # other tokens, read in eval mode
        evaluated.train()
        for batch in data[1:3]:
            evaluated(**batch)
    a, b = meft_adapters(straight)[0], meft_adapters(evaluated)[0]
    assert int(b.input_batches) == 3 and bool(b.input_calibrated)
    assert torch.equal(a.input_mean, b.input_mean) and torch.equal(a.input_inv_scale, b.input_inv_scale)


def test_calibration_resumed_midway_continues_the_same_estimate() -> None:
    data = batches(3, pad_last=4)
    straight = meft_model(calibration_batches=3)
    interrupted = meft_model(calibration_batches=3)
    with torch.no_grad():
        for batch in data:
            straight(**batch)
        interrupted(**data[0])
        resumed = meft_model(calibration_batches=3)
        resumed.load_state_dict(interrupted.state_dict())  # after one of the three calibration batches
        for batch in data[1:]:
            resumed(**batch)
    a, b = meft_adapters(straight)[0], meft_adapters(resumed)[0]
    assert bool(b.input_calibrated) and int(b.input_batches) == 3
    torch.testing.assert_close(b.input_mean, a.input_mean, rtol=0, atol=0)
    torch.testing.assert_close(b.input_inv_scale, a.input_inv_scale, rtol=0, atol=0)


def test_padding_tokens_fetch_no_rows() -> None:
    model = meft_model()
    adapters = meft_adapters(model)
    batch = batches(1, batch=1, length=10)[0]
    batch["attention_mask"][0, 2:] = 0
    model(**batch).loss.backward()
    for adapter in adapters:
        # 2 real tokens x top_k rows at most; padding routed nowhere.
        assert 0 < int(adapter.host.touched.sum()) <= 2 * SMALL["top_k"]


def _block_adam_run(settings: RowAdamSettings, clip=None, steps: int = 7, block_rows: int = 4):
    """A BlockRowAdam over 24 rows and torch's own Adam/AdamW (not fused) on a separate copy of the always-touched
    blocks (rows 4–11), both fed the same gradients; every step touches those blocks plus one random other row."""
    g = torch.Generator().manual_seed(0)
    rows, hidden = 24, 5
    always = torch.arange(4, 12)
    param = torch.randn(rows, hidden, generator=g)
    reference = param[always].clone().requires_grad_(True)
    block = BlockRowAdam([param], block_rows)
    optimizer_class = torch.optim.AdamW if settings.decoupled else torch.optim.Adam
    torch_adam = optimizer_class([reference], lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                 weight_decay=settings.weight_decay, maximize=settings.maximize)
    accumulator = torch.zeros(rows, hidden)
    for _ in range(steps):
        touched = torch.zeros(rows, dtype=torch.bool)
        touched[always] = True
        touched[int(torch.randint(rows, (1,), generator=g))] = True
        grads = torch.randn(rows, hidden, generator=g) * touched.unsqueeze(1)
        accumulator += grads
        block.step(block.blocks_of(touched), [accumulator], settings, clip)
        assert (accumulator == 0).all()  # the stepped rows' sums are zeroed, ready for the next step
        reference.grad = grads[always].clone()
        if clip is not None and clip[0] == "norm":
            reference.grad.mul_(clip[1])
        elif clip is not None:
            reference.grad.clamp_(-clip[1], clip[1])
        torch_adam.step()
    return param[always], reference.detach(), block


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("clip", [None, ("norm", 0.3), ("value", 0.5)], ids=["noclip", "norm", "value"])
def test_block_adam_equals_torch_adam_on_blocks_touched_every_step(decoupled: bool, maximize: bool, clip) -> None:
    settings = RowAdamSettings(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, decoupled=decoupled,
                               maximize=maximize)
    stepped, reference, block = _block_adam_run(settings, clip)
    torch.testing.assert_close(stepped, reference, rtol=1e-6, atol=1e-6)
    assert block.step_count == 7 and (block.last_step[1:3] == 7).all()


def test_block_adam_moments_over_a_gap_equal_dense_adamw_with_zero_gradients() -> None:
    g = torch.Generator().manual_seed(1)
    rows, hidden, block_rows = 12, 3, 4
    settings = RowAdamSettings(lr=0.02, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.5)
    param = torch.randn(rows, hidden, generator=g)
    dense = param.clone().requires_grad_(True)
    block = BlockRowAdam([param], block_rows)
    torch_adam = torch.optim.AdamW([dense], lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                   weight_decay=settings.weight_decay)
    accumulator = torch.zeros(rows, hidden)
    # Block 1 (rows 4–7) is touched at steps 1 and 5 only; block 0 at every step; block 2 never.
    for step in range(1, 6):
        touched = torch.zeros(rows, dtype=torch.bool)
        touched[0:4] = True
        if step in (1, 5):
            touched[5] = True  # one row of block 1: the whole block is stepped, its other rows with zero gradient
        grads = torch.randn(rows, hidden, generator=g) * touched.unsqueeze(1)
        accumulator += grads
        block.step(block.blocks_of(touched), [accumulator], settings)
        dense.grad = grads.clone()
        torch_adam.step()
        if step == 4:
            # Over the gap dense AdamW decays the block's weights and moves them on momentum; the block Adam
            # leaves them alone until the block is touched again.
            assert not torch.equal(dense.detach()[4:8], param[4:8])
    state = torch_adam.state[dense]
    exp_avg, exp_avg_sq = block.moments(0)
    # Moments of the block that missed steps 2–4 were caught up: they equal dense AdamW's with zero gradients.
    torch.testing.assert_close(exp_avg[4:8], state["exp_avg"][4:8], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq[4:8], state["exp_avg_sq"][4:8], rtol=1e-5, atol=1e-9)
    # The block touched at every step equals dense AdamW outright; the untouched block kept its value and no state.
    torch.testing.assert_close(param[0:4], dense.detach()[0:4], rtol=1e-6, atol=1e-6)
    assert (exp_avg[8:] == 0).all() and (block.last_step == torch.tensor([5, 5, 0])).all()


def _explicit_catch_up_adam(param: torch.Tensor, block_rows: int, steps: list[tuple[torch.Tensor, torch.Tensor]],
                            settings: RowAdamSettings, coefficient: float) -> tuple[torch.Tensor, ...]:
    """The block Adam written out plainly, in float64: a touched block's moments and (decoupled) decay are caught up
    by multiplying them over its gap, then the textbook Adam step at the global step count."""
    p, m, v = param.double().clone(), torch.zeros_like(param, dtype=torch.float64), torch.zeros_like(
        param, dtype=torch.float64)
    last = torch.zeros(param.shape[0] // block_rows, dtype=torch.int64)
    beta1, beta2 = settings.betas
    for t, (blocks, grad) in enumerate(steps, start=1):
        for block in blocks.tolist():
            rows = slice(block * block_rows, (block + 1) * block_rows)
            gap = t - 1 - int(last[block])
            g = grad[rows].double() * coefficient
            g = -g if settings.maximize else g
            m[rows] *= beta1**gap
            v[rows] *= beta2**gap
            if settings.decoupled:
                p[rows] *= (1 - settings.lr * settings.weight_decay)**(gap + 1)
            else:
                g = g + settings.weight_decay * p[rows]
            m[rows] = beta1 * m[rows] + (1 - beta1) * g
            v[rows] = beta2 * v[rows] + (1 - beta2) * g * g
            denominator = (v[rows] / (1 - beta2**t)).sqrt() + settings.eps
            p[rows] -= settings.lr * m[rows] / (1 - beta1**t) / denominator
            last[block] = t
    return p, m, v


@pytest.mark.parametrize("decoupled, maximize, coefficient, beta2", [
    (True, False, 1.0, 0.999), (False, True, 0.25, 0.99), (True, True, 0.5, 0.5)],
    ids=["adamw", "adam-l2-max-clip", "adamw-max-clip-renormalising"])
def test_block_adam_equals_the_catch_up_written_out(decoupled: bool, maximize: bool, coefficient: float,
                                                    beta2: float) -> None:
    """Blocks drawn at random for 40 steps, gaps of up to tens of steps (at β₂ = 0.5 the scales fall below the
    renormalisation threshold within ten): the scaled moments give the explicit catch-up's weights and moments."""
    g = torch.Generator().manual_seed(5)
    rows, hidden, block_rows = 32, 3, 4
    # ε comparable to √v, so that its rescaling in the scaled step is checked too.
    settings = RowAdamSettings(lr=0.01, betas=(0.8, beta2), eps=0.3, weight_decay=0.2, decoupled=decoupled,
                               maximize=maximize)
    param = torch.randn(rows, hidden, generator=g)
    start = param.clone()
    block = BlockRowAdam([param], block_rows)
    accumulator = torch.zeros(rows, hidden)
    steps = []
    for t in range(40):
        count = 1 + int(torch.randint(4, (1,), generator=g))
        blocks = torch.randperm(rows // block_rows, generator=g)[:count].sort().values
        if t >= 20:
            blocks = blocks[blocks != 7]  # block 7 then misses the last 20 steps, once touched again at the end
        if t == 39:
            blocks = torch.cat([blocks, torch.tensor([7])]).unique()
        grad = torch.randn(rows, hidden, generator=g) * block.blocks_mask(blocks).unsqueeze(1)
        steps.append((blocks, grad))
        accumulator += grad
        block.step(blocks, [accumulator], settings, ("norm", coefficient) if coefficient != 1.0 else None)
    want_p, want_m, want_v = _explicit_catch_up_adam(start, block_rows, steps, settings, coefficient)
    got_m, got_v = block.moments(0)
    last = block.last_step.repeat_interleave(block_rows).unsqueeze(1).double()
    # moments() decays every block to the latest step; the written-out version holds them as of each block's last.
    torch.testing.assert_close(got_m.double(), want_m * settings.betas[0]**(40 - last), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got_v.double(), want_v * beta2**(40 - last), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(param.double(), want_p, rtol=1e-5, atol=1e-6)
    assert (block.scale1 != 1).any()  # the scaled path ran, not only the plain one
    if beta2**20 < RENORMALIZE_BELOW:  # block 7's moments were rescaled in place after its 20-step gap
        assert block.scale1[7] == 1 and block.scale2[7] == 1


def test_block_adam_catches_up_decoupled_weight_decay_over_a_gap() -> None:
    rows, hidden = 8, 2
    lr, decay = 0.1, 0.5
    param = torch.ones(rows, hidden)
    block = BlockRowAdam([param], 4)
    accumulator = torch.zeros(rows, hidden)
    settings = RowAdamSettings(lr=lr, weight_decay=decay)
    touched_first, touched_second = torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool)
    touched_first[0], touched_second[4] = True, True
    block.step(block.blocks_of(touched_first | touched_second), [accumulator], settings)  # step 1: both, zero grads
    for _ in range(3):  # steps 2–4: block 0 only
        block.step(block.blocks_of(touched_first), [accumulator], settings)
    block.step(block.blocks_of(touched_second), [accumulator], settings)  # step 5: block 1 again, after 3 missed
    # Zero gradients throughout: the weights see only decay, five steps of it in both blocks.
    torch.testing.assert_close(param[4:], torch.full((4, hidden), (1 - lr * decay) ** 5))
    torch.testing.assert_close(param[:4], torch.full((4, hidden), (1 - lr * decay) ** 4))


def test_block_adam_refuses_bad_layouts_and_foreign_state() -> None:
    with pytest.raises(ValueError, match="block_rows=5 must be a positive divisor of the 12 rows"):
        BlockRowAdam([torch.zeros(12, 2)], 5)
    block = BlockRowAdam([torch.zeros(12, 2)], 4)
    with pytest.raises(ValueError, match="not written by this version's block Adam"):
        block.load_state_dict({"exp_avg": [torch.zeros(12, 2)], "exp_avg_sq": [torch.zeros(12, 2)],
                               "steps": torch.zeros(12, dtype=torch.int64)})
    other = BlockRowAdam([torch.zeros(12, 2)], 6).state_dict()
    with pytest.raises(ValueError, match=r"row_block=6"):
        block.load_state_dict(other)


def _dense_reference_grads(model: torch.nn.Module, micro_batches: list[dict]) -> list[tuple[torch.Tensor, ...]]:
    """Accumulated gradients of every adapter's full K and V, with dense parameters and a selection mask."""
    adapters = meft_adapters(model)
    dense = [(a.host.keys.clone().requires_grad_(True), a.host.values.clone().requires_grad_(True)) for a in adapters]
    originals = [(a.prefetch, a.mix) for a in adapters]

    def dense_forward(adapter, keys, values):
        def forward(hidden):
            flat = hidden.reshape(-1, adapter.hidden_size)
            valid = adapter._valid_tokens(flat.shape[0], flat.device)
            x = adapter.adapter_input(flat, valid)
            r = route(x, adapter.router(x), adapter._key_scores(x), adapter.config, valid,
                      hidden.shape[0] if hidden.ndim == 3 else 1)
            mask = torch.zeros(flat.shape[0], adapter.config.num_neurons)
            gates = torch.zeros_like(mask).scatter(1, r.neurons, r.gates)
            mask.scatter_(1, r.neurons, valid.unsqueeze(1).float().expand_as(r.neurons))
            act = torch.relu(x @ keys.T) * gates * mask
            return (act @ values).reshape(hidden.shape)
        return forward

    for adapter, (k, v) in zip(adapters, dense):
        forward = dense_forward(adapter, k, v)
        adapter.prefetch = lambda hidden: None
        adapter.mix = lambda hidden, fetch, forward=forward: forward(hidden)
    try:
        for batch in micro_batches:
            (model(**batch).loss / len(micro_batches)).backward()
    finally:
        for adapter, (prefetch, mix) in zip(adapters, originals):
            adapter.prefetch, adapter.mix = prefetch, mix
    return [(k.grad, v.grad) for k, v in dense]


def test_accumulated_row_gradients_match_a_dense_masked_reference() -> None:
    model = meft_model()
    adapters = meft_adapters(model)
    with torch.no_grad():  # nonzero values, so keys get gradients too
        for a in adapters:
            a.host.values.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
            a.refresh_routing_keys()
    micro = batches(2, seed=5, pad_last=4)
    reference = _dense_reference_grads(model, micro)
    for batch in micro:
        (model(**batch).loss / len(micro)).backward()
    for adapter, (grad_k, grad_v) in zip(adapters, reference):
        touched = adapter.host.touched
        assert touched.any() and not touched.all()
        torch.testing.assert_close(adapter.host.grad_keys, grad_k, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(adapter.host.grad_values, grad_v, rtol=1e-4, atol=1e-6)
        assert (grad_v[~touched] == 0).all()  # rows nobody routed to get nothing, in both


def trainer(tmp_path: Path, steps: int, strategy=None, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy or MEFTOffloadStrategy(device="cpu"), accelerator="cpu", max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


def test_meft_offload_trains_adapters_and_leaves_the_base_alone(tmp_path: Path) -> None:
    model = meft_model()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    module = CausalLMModule(model, lr=1e-2)
    strategy = MEFTOffloadStrategy(device="cpu")
    data = batches(6, seed=2)
    before = sum(float(module.model(**b).loss) for b in data)
    trainer(tmp_path, 6, strategy).fit(module, train_dataloaders=loader(data))
    after = sum(float(module.model(**b).loss) for b in data)
    assert after < before
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n
    for adapter in meft_adapters(model):
        assert adapter.host.values.abs().sum() > 0
        assert adapter.host.keys.device.type == "cpu" and adapter.host.grad_keys.abs().sum() == 0
    metrics = strategy.figures_at_step_end()
    hidden = meft_adapters(model)[0].hidden_size
    assert metrics["meft/rows_moved"] > 0
    assert metrics["meft/bytes_host_to_device"] == metrics["meft/rows_moved"] * 2 * hidden * 4
    assert metrics["meft/bytes_device_to_host"] == metrics["meft/bytes_host_to_device"]
    assert 0 < metrics["meft/expert_usage_entropy"] <= 1
    assert metrics["meft/adapter_device_bytes"] > 0
    # All Adam state on the host: the dense optimizer's and the rows'.
    assert strategy.offload_optimizer.device_state_bytes() == 0
    # What the run summary reads: the adapters' host rows and the rows' figures of the last step.
    facts = facts_of(strategy)
    assert facts.host_trainable_parameters == sum(a.host.keys.numel() + a.host.values.numel()
                                                  for a in meft_adapters(model)) > 0
    assert facts.adapter_rows == sum(a.config.num_neurons for a in meft_adapters(model))
    assert facts.host_rows_bytes == 4 * facts.host_trainable_parameters * 4  # 8 N×h fp32 arrays per adapter
    assert facts.gradients_offloaded and facts.adapter_device_bytes > 0
    assert figures_at_step_end(strategy) == metrics


@pytest.mark.parametrize("expert_choice", ["sequence", "token"])
def test_rows_per_step_stay_within_the_stated_bound(expert_choice, tmp_path: Path) -> None:
    model = meft_model(expert_choice=expert_choice)
    strategy = MEFTOffloadStrategy(device="cpu")
    seen: list[float] = []

    class Rows(pl.Callback):
        def on_train_batch_end(self, *args) -> None:
            seen.append(strategy.figures_at_step_end()["meft/rows_updated"])

    data = batches(4, batch=2, length=48, seed=4)
    trainer(tmp_path, 4, strategy, callbacks=[Rows()]).fit(CausalLMModule(model, lr=1e-2),
                                                           train_dataloaders=loader(data))
    adapters = meft_adapters(model)
    bound = len(adapters) * MEFTConfig(**SMALL).row_bound(sequences=2, tokens=96)  # the sequence-routing bound
    assert bound == len(adapters) * 2 * 4 * 16  # 2 sequences × 4 experts × 16 neurons, of 256 rows per adapter
    if expert_choice == "sequence":
        assert max(seen) <= bound
    else:
        assert max(seen) > bound  # per-token routing of 96 tokens × 8 neurons spreads over nearly every row


def test_step_telemetry_leaves_out_the_rows_evaluation_fetched(tmp_path: Path) -> None:
    strategy = MEFTOffloadStrategy(device="cpu")
    data = batches(4, seed=6)
    trainer(tmp_path, 3, strategy, limit_val_batches=4, val_check_interval=2, num_sanity_val_steps=0).fit(
        CausalLMModule(meft_model(), lr=1e-2), train_dataloaders=loader(data), val_dataloaders=loader(data))
    # Step 3 follows an evaluation: with one micro-batch per step, the rows it moved are the rows it updated.
    assert strategy.figures_at_step_end()["meft/rows_moved"] == strategy.figures_at_step_end()["meft/rows_updated"] > 0


def test_host_routing_trains_without_keys_on_the_device(tmp_path: Path) -> None:
    model = meft_model(routing="host")
    assert all(a.routing_keys is None for a in meft_adapters(model))
    strategy = MEFTOffloadStrategy(device="cpu")
    trainer(tmp_path, 2, strategy).fit(CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(2)))
    assert strategy.figures_at_step_end()["meft/rows_updated"] > 0


def _row_gradients_per_step(strategy: MEFTOffloadStrategy) -> list[list[torch.Tensor]]:
    """Records, at every optimizer step, the accumulated row gradients the block Adam is about to consume."""
    seen: list[list[torch.Tensor]] = []
    setup = strategy.setup_optimizers

    def recording_setup(trainer: pl.Trainer) -> None:
        setup(trainer)
        first = strategy.attached.slots[0]  # the first adapter's rows are prepared before any row step is queued
        prepare = first.prepare

        def recording_prepare(step: Any) -> None:
            strategy.attached.gradients.flush()  # the gradients of the last backward are still being added on the host
            seen.append([g for a in strategy.adapters for g in a.host.summed_gradients()])
            prepare(step)

        first.prepare = recording_prepare

    strategy.setup_optimizers = recording_setup
    return seen


def test_accumulation_equals_one_large_batch(tmp_path: Path) -> None:
    data = batches(4, batch=2, seed=7)
    big = [{k: torch.cat([data[i][k], data[i + 1][k]]) for k in data[0]} for i in (0, 2)]
    small_model, big_model = meft_model(), meft_model()
    for model in (small_model, big_model):
        with torch.no_grad():  # the same standardisation for both: it is measured on an adapter's first forward
            model(**big[0])
    small_strategy, big_strategy = MEFTOffloadStrategy(device="cpu"), MEFTOffloadStrategy(device="cpu")
    small_grads, big_grads = _row_gradients_per_step(small_strategy), _row_gradients_per_step(big_strategy)
    trainer(tmp_path / "a", 2, small_strategy, accumulate_grad_batches=2).fit(
        CausalLMModule(small_model, lr=1e-2), train_dataloaders=loader(data))
    trainer(tmp_path / "b", 2, big_strategy).fit(CausalLMModule(big_model, lr=1e-2), train_dataloaders=loader(big))
    # The gradients each block Adam step consumed: the second step's depend on the first step's update, so they
    # agree only if the accumulated rows (which change between micro-batches) were summed correctly both times.
    assert len(small_grads) == len(big_grads) == 2
    for small_step, big_step in zip(small_grads, big_grads):
        for small, large in zip(small_step, big_step):
            assert torch.equal(small.any(1), large.any(1))  # the same rows touched
            torch.testing.assert_close(small, large, rtol=1e-4, atol=1e-6)
    for a, b in zip(meft_adapters(small_model), meft_adapters(big_model)):
        torch.testing.assert_close(a.host.values, b.host.values, rtol=1e-4, atol=1e-6)


def test_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    # Three batches per epoch and a checkpoint after step 3: the resumed run starts a fresh epoch, as the
    # uninterrupted one does (a plain DataLoader cannot resume mid-epoch).
    data = batches(3, seed=11)
    straight = meft_model()
    trainer(tmp_path / "straight", 6).fit(CausalLMModule(straight, lr=1e-2), train_dataloaders=loader(data))

    first = meft_model()
    t = pl.Trainer(strategy=MEFTOffloadStrategy(device="cpu"), accelerator="cpu", max_steps=3, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "resumed",
                   callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True,
                                                           every_n_train_steps=3)])
    t.fit(CausalLMModule(first, lr=1e-2), train_dataloaders=loader(data))
    for name in ("last.ckpt",):
        resumed = meft_model()
        trainer(tmp_path / name, 6).fit(CausalLMModule(resumed, lr=1e-2), train_dataloaders=loader(data),
                                        ckpt_path=tmp_path / "ckpt" / name)
        for a, b in zip(meft_adapters(straight), meft_adapters(resumed)):
            assert torch.equal(a.host.values, b.host.values), name
            assert torch.equal(a.host.keys, b.host.keys), name
            assert torch.equal(a.router.weight, b.router.weight), name


def test_strategy_without_adapters_says_how_to_add_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inject_meft"):
        trainer(tmp_path, 1).fit(CausalLMModule(tiny_llama(), lr=1e-2), train_dataloaders=loader(batches(1)))


def test_strategy_name_is_registered() -> None:
    t = pl.Trainer(strategy="meft_offload", accelerator="cpu", logger=False)
    assert isinstance(t.strategy, MEFTOffloadStrategy)


def test_a_failing_row_fetch_surfaces_in_the_forward() -> None:
    model = meft_model()
    adapter = meft_adapters(model)[1]

    def broken(rows, pin, dtype):
        raise RuntimeError("host gather failed")

    adapter._gather = broken
    with pytest.raises(RuntimeError, match="host gather failed"):
        model(**batches(1)[0])


def _full_size(optimizer: BlockRowAdam, blocks: torch.Tensor, grads: list[Any]) -> list[torch.Tensor]:
    """The gradients a block Adam step was given (a full-size accumulator, one gradient per stepped block, or where
    they landed), as full-size ``[N, h]`` matrices, zero outside the stepped blocks."""
    out = []
    for grad in grads:
        if isinstance(grad, LandedRows):  # read where they landed by the native kernel
            grad = grad.dense(optimizer.params[0].shape[0])
        elif not isinstance(grad, torch.Tensor):
            full = torch.zeros(optimizer.params[0].shape)
            full.view(optimizer.num_blocks, optimizer.block_rows, -1)[blocks] = torch.stack(list(grad))
            grad = full
        out.append(grad)
    return out


def _record_row_steps(strategy: MEFTOffloadStrategy) -> list[tuple[list[tuple[int, int]], list[torch.Tensor], Any]]:
    """Wraps the row optimizers once they exist: records the row ranges, the gradient rows and the clipping each
    block Adam step consumed."""
    consumed: list[tuple[list[tuple[int, int]], list[torch.Tensor], Any]] = []
    setup = strategy.setup_optimizers

    def recording_setup(trainer: pl.Trainer) -> None:
        setup(trainer)
        for optimizer in [slot.row_adam for slot in strategy.attached.slots]:
            step = optimizer.step

            def recording_step(blocks, grads, settings, clip=None, zero_grads=True, step=step, optimizer=optimizer):
                ranges = optimizer.row_ranges(blocks)
                consumed.append((ranges, [torch.cat([g[a:b] for a, b in ranges]).clone()
                                          for g in _full_size(optimizer, blocks, grads)], clip))
                return step(blocks, grads, settings, clip, zero_grads)

            optimizer.step = recording_step

    strategy.setup_optimizers = recording_setup
    return consumed


@pytest.mark.parametrize("mode", ["norm", "value"])
def test_gradient_clipping_covers_the_adapter_rows(tmp_path: Path, mode: str) -> None:
    model = meft_model()
    strategy = MEFTOffloadStrategy(device="cpu")
    before = _row_gradients_per_step(strategy)
    consumed = _record_row_steps(strategy)
    clip_value = 1e-3 if mode == "norm" else 1e-5
    trainer(tmp_path, 1, strategy, gradient_clip_val=clip_value, gradient_clip_algorithm=mode).fit(
        CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(1)))
    adapters = meft_adapters(model)
    assert len(consumed) == len(adapters)
    raw = before[0]
    clips = {clip for _, _, clip in consumed}
    assert len(clips) == 1  # one clipping decision for every adapter
    kind, amount = clips.pop()
    assert kind == mode
    if mode == "norm":
        row_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw]))
        # The norm the coefficient came from includes the routers' gradients too: strictly larger than the rows'.
        assert amount * row_norm < clip_value
    else:
        assert amount == clip_value
        assert max(float(g.abs().max()) for _, grads, _ in consumed for g in grads) > clip_value  # the bound bites
    # The optimizer received the accumulated gradients unaltered (it applies the clipping itself; the block Adam
    # tests compare its clipped steps with torch's).
    for i, (ranges, grads, _) in enumerate(consumed):
        for got, full in zip(grads, (raw[2 * i], raw[2 * i + 1])):
            torch.testing.assert_close(got, torch.cat([full[a:b] for a, b in ranges]), rtol=0, atol=0)


def test_row_squares_taken_on_the_device_clip_as_the_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows' squared norms taken on the device before the copy (a GPU's default) clip the steps as those the
    host takes as the rows land (the CPU's): a clip that bites at every step, both paths alike up to the rounding
    of the norms' sums."""
    runs = []
    for on_device in (False, True):
        monkeypatch.setattr(engine_optimizer, "RowGradients", partial(RowGradients, squares_on_device=on_device))
        model = meft_model()
        trainer(tmp_path / str(on_device), 3, MEFTOffloadStrategy(device="cpu"), gradient_clip_val=1e-3).fit(
            CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(3, seed=5)))
        runs.append(meft_adapters(model))
    for host, device, start in zip(*runs, meft_adapters(meft_model())):
        assert not torch.equal(host.host.values, start.host.values)  # it trained
        torch.testing.assert_close(device.host.values, host.host.values)
        torch.testing.assert_close(device.host.keys, host.host.keys)


def test_pipelined_row_updates_equal_finishing_them_in_the_step(tmp_path: Path) -> None:
    data = batches(3, seed=13)
    runs = {}
    for pipelined in (True, False):
        model = meft_model()
        trainer(tmp_path / str(pipelined), 5, MEFTOffloadStrategy(device="cpu", pipelined=pipelined)).fit(
            CausalLMModule(model, lr=1e-2), train_dataloaders=loader(data))
        runs[pipelined] = meft_adapters(model)
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a.host.values, b.host.values) and torch.equal(a.host.keys, b.host.keys)
        assert a.rows_slot is None and a.row_pipeline is None  # fit ended: finished and handed back


def test_a_failing_row_update_surfaces_instead_of_hanging(tmp_path: Path) -> None:
    strategy = MEFTOffloadStrategy(device="cpu")
    setup = strategy.setup_optimizers

    def breaking_setup(trainer: pl.Trainer) -> None:
        setup(trainer)

        def broken(*args, **kwargs):
            raise RuntimeError("host Adam failed")

        strategy.attached.slots[1].row_adam.step = broken

    strategy.setup_optimizers = breaking_setup
    model = meft_model()
    with pytest.raises(HostWorkerError) as failure:
        trainer(tmp_path, 3, strategy).fit(CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(3)))
    assert "host Adam failed" in str(failure.value.__cause__)
    # The adapters are handed back: a plain forward and backward work again, gradients added in the hook.
    assert all(a.row_pipeline is None and a.rows_slot is None for a in meft_adapters(model))
    model(**batches(1)[0]).loss.backward()
    assert any(a.host.grad_values.abs().sum() > 0 for a in meft_adapters(model))


def _poison_row_gradients(adapter: Any) -> None:
    """Puts a NaN into every row gradient of ``adapter`` as backward hands it to the host (as a real overflow
    would arrive)."""
    make_sink = adapter._gradient_sink

    def poisoned(rows: torch.Tensor, accumulator: torch.Tensor, written: torch.Tensor) -> Any:
        sink = make_sink(rows, accumulator, written)

        def poisoned_sink(grad: torch.Tensor) -> None:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
            sink(grad)

        return poisoned_sink

    adapter._gradient_sink = poisoned


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_non_finite_row_gradients_leave_the_host_rows_untouched(tmp_path: Path, policy: str) -> None:
    model = meft_model()
    adapters = meft_adapters(model)
    strategy = MEFTOffloadStrategy(device="cpu", on_nonfinite=policy)
    _poison_row_gradients(adapters[0])
    values = [a.host.values.clone() for a in adapters]
    keys = [a.host.keys.clone() for a in adapters]
    _fit_one_skipped_step(trainer(tmp_path, 1, strategy), model, strategy, policy)
    for adapter, v, k in zip(adapters, values, keys):
        assert torch.equal(adapter.host.values, v) and torch.equal(adapter.host.keys, k)
        assert not adapter.host.touched.any() and not adapter.host.written_values.any()  # the gradients dropped
        assert all(g.abs().sum() == 0 for g in adapter.host.summed_gradients())


def _fit_one_skipped_step(fit: pl.Trainer, model: torch.nn.Module, strategy: MEFTOffloadStrategy,
                          policy: str) -> None:
    """One step whose gradients are poisoned: it raises under ``"raise"`` and is counted as skipped under ``"skip"``."""
    run = lambda: fit.fit(CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(1)))  # noqa: E731
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError, match="on_nonfinite='skip'"):
            run()
    else:
        run()
        assert strategy.figures_at_step_end()["meft/skipped_steps"] == 1


def test_key_lr_scale_slows_the_keys_only() -> None:
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)
    start_keys, start_values = keys.clone(), values.clone()
    adam = BlockRowAdam([keys, values], 2, lr_scales=[0.1, 1.0])
    blocks = torch.tensor([0, 2])
    stepped = torch.tensor([0, 1, 4, 5])
    adam.step(blocks, [torch.ones(6, 3), torch.ones(6, 3)], RowAdamSettings(lr=0.01))
    # First Adam step: each element moves by lr·scale (the sign of a constant gradient).
    torch.testing.assert_close(start_keys[stepped] - keys[stepped], torch.full((4, 3), 1e-3))
    torch.testing.assert_close(start_values[stepped] - values[stepped], torch.full((4, 3), 1e-2))
    assert torch.equal(keys[2:4], start_keys[2:4])
    with pytest.raises(ValueError, match="lr_scales"):
        BlockRowAdam([keys, values], 2, lr_scales=[0.1])
    with pytest.raises(ValueError, match="key_lr_scale=0"):
        MEFTOffloadStrategy(device="cpu", key_lr_scale=0)


def test_rows_cross_in_the_autocast_dtype_with_the_same_gradients() -> None:
    batch = batches(1, seed=9, pad_last=2)[0]
    models = [meft_model(), meft_model()]
    for model in models:
        with torch.no_grad():
            for a in meft_adapters(model):
                a.host.values.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
                a.refresh_routing_keys()
    fp32_rows = meft_adapters(models[1])
    import lightning_offload.meft.adapter as adapter_module

    original = adapter_module.link_dtype
    for model in models:
        if model is models[1]:
            adapter_module.link_dtype = lambda x: x.dtype  # the reference: fp32 rows, cast by autocast
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
        finally:
            adapter_module.link_dtype = original
    for bf16, fp32 in zip(meft_adapters(models[0]), fp32_rows):
        assert bf16.host.traffic.bytes_to_device * 2 == fp32.host.traffic.bytes_to_device  # half the bytes
        assert bf16.host.traffic.bytes_to_host * 2 == fp32.host.traffic.bytes_to_host
        assert torch.equal(bf16.host.touched, fp32.host.touched)
        assert torch.equal(bf16.host.grad_values, fp32.host.grad_values)
        assert torch.equal(bf16.host.grad_keys, fp32.host.grad_keys)


@pytest.mark.parametrize("poisoned", ["rows", "routers"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_one_non_finite_decision_covers_routers_and_rows(tmp_path: Path, poisoned: str, policy: str) -> None:
    """Rows and routers step together or not at all: neither steps when only the other's gradient is non-finite."""
    from lightning.pytorch.callbacks import Callback

    model = meft_model()
    adapters = meft_adapters(model)
    strategy = MEFTOffloadStrategy(device="cpu", on_nonfinite=policy)

    if poisoned == "rows":
        _poison_row_gradients(adapters[0])

    class Poison(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if poisoned == "routers":
                router = next(p for p in model.parameters() if p.requires_grad and p.grad is not None)
                router.grad.fill_(float("nan"))

    routers = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    values = [a.host.values.clone() for a in adapters]
    _fit_one_skipped_step(trainer(tmp_path, 1, strategy, callbacks=[Poison()]), model, strategy, policy)
    if policy == "skip":
        assert strategy.offload_optimizer.telemetry.skipped_steps == 1
    for name, p in model.named_parameters():
        if name in routers:
            assert torch.equal(p.detach(), routers[name]), f"{name} stepped on a skipped step"
    for adapter, v in zip(adapters, values):
        assert torch.equal(adapter.host.values, v)
        assert not adapter.host.touched.any()


# Every neuron fires (top_k = num_neurons, one expert): the adapter is then a dense ReLU memory, every row is touched
# at every step, and meft_offload must train it exactly as torch.optim trains the same memory held as parameters.
# The reference is torch's fused implementation, the kernel the row step calls. torch's default for-loop AdamW rounds
# differently in the last place, and this setting amplifies that: a value clip at 2e-5 leaves many gradients within a
# few hundred eps, where Adam's g/(|g|+eps) is steep. After 4 steps torch's own two implementations are ~1e-4 apart
# here (9.9e-5 on AVX-512, 1.1e-4 on AVX2), so a comparison with the for-loop one depended on how the CPU rounded.
DENSE_EQUIVALENT = dict(num_neurons=32, top_k=32, num_experts=1, experts_per_sequence=1, experts_per_token=1)
USER_OPTIMIZERS = {
    "adamw": lambda maximize: lambda model: torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
        maximize=maximize, fused=True),
    "adam_l2": lambda maximize: lambda model: torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
        maximize=maximize, fused=True),
}
USER_CLIPS = {"none": {}, "norm": {"gradient_clip_val": 2e-3, "gradient_clip_algorithm": "norm"},
              "value": {"gradient_clip_val": 2e-5, "gradient_clip_algorithm": "value"}}


def _with_dense_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Gives each adapter its keys and values as ordinary parameters, which its own forward then reads in place of
    the fetched host rows (the reference: the same arithmetic, trained by torch.optim)."""
    for adapter in meft_adapters(model):
        adapter.dense_keys = torch.nn.Parameter(adapter.host.keys.clone())
        adapter.dense_values = torch.nn.Parameter(adapter.host.values.clone())

        def rows_of_the_parameters(rows: torch.Tensor, keys: Any, values: Any, device: Any, adapter=adapter) -> Any:
            return adapter.dense_keys.index_select(0, rows), adapter.dense_values.index_select(0, rows)

        adapter._to_device = rows_of_the_parameters
    return model


def _fit_user_setting(tmp_path: Path, dense: bool, optimizer: str, clip: str, maximize: bool,
                      accumulate: int) -> list[torch.Tensor]:
    model = meft_model(**DENSE_EQUIVALENT)
    if dense:
        _with_dense_parameters(model)
    strategy = "auto" if dense else MEFTOffloadStrategy(device="cpu")
    module = CausalLMModule(model, optimizer_factory=USER_OPTIMIZERS[optimizer](maximize))
    trainer(tmp_path / f"{dense}-{optimizer}-{clip}", 4, strategy, accumulate_grad_batches=accumulate,
            **USER_CLIPS[clip]).fit(module, train_dataloaders=loader(batches(4 * accumulate, seed=21)))
    adapters = meft_adapters(model)
    if dense:
        return [t.detach() for a in adapters for t in (a.dense_keys, a.dense_values, a.router.weight)]
    return [t.detach() for a in adapters for t in (a.host.keys, a.host.values, a.router.weight)]


@pytest.mark.parametrize("optimizer", list(USER_OPTIMIZERS))
@pytest.mark.parametrize("clip", list(USER_CLIPS))
@pytest.mark.parametrize("maximize, accumulate", [(False, 1), (True, 2)], ids=["min-acc1", "max-acc2"])
def test_meft_offload_equals_torch_optim_at_the_users_settings(tmp_path: Path, optimizer: str, clip: str,
                                                               maximize: bool, accumulate: int) -> None:
    offloaded = _fit_user_setting(tmp_path, False, optimizer, clip, maximize, accumulate)
    reference = _fit_user_setting(tmp_path, True, optimizer, clip, maximize, accumulate)
    initial = [t for a in meft_adapters(meft_model(**DENSE_EQUIVALENT)) for t in (a.host.keys, a.host.values)]
    for got, want, start in zip(offloaded[0::3], reference[0::3], initial[0::2]):
        assert not torch.equal(want, start)  # the keys trained: the comparison is not vacuous
    # Bit for bit, except that a norm clip's coefficient enters the kernel as its gradient scale (a division) where
    # Lightning multiplies the gradients by it: the two round differently in the last place.
    exact = {"rtol": 0.0, "atol": 0.0} if clip != "norm" else {}
    for got, want in zip(offloaded, reference):
        torch.testing.assert_close(got, want, **exact)
    if clip != "none":  # the clipping fired: the unclipped run ends elsewhere
        unclipped = _fit_user_setting(tmp_path / "unclipped", True, optimizer, "none", maximize, accumulate)
        assert not torch.allclose(unclipped[1], reference[1])


def test_idle_rows_of_a_stepped_block_read_zero_though_their_old_sums_were_never_zeroed(tmp_path: Path) -> None:
    """Accumulator rows are overwritten by a step's first gradient rather than zeroed after each step; a row the
    step did not touch, in a block it steps, must still read zero, not the sum an earlier step consumed."""
    strategy = MEFTOffloadStrategy(device="cpu")
    setup = strategy.setup_optimizers
    checked = {"idle": 0, "stale": 0}

    def checking_setup(trainer: pl.Trainer) -> None:
        setup(trainer)
        for adapter, optimizer in zip(strategy.adapters, [slot.row_adam for slot in strategy.attached.slots]):
            step = optimizer.step
            ever_touched = torch.zeros(adapter.config.num_neurons, dtype=torch.bool)

            def checking_step(blocks, grads, settings, clip=None, zero_grads=True, step=step, optimizer=optimizer,
                              adapter=adapter, ever_touched=ever_touched):
                idle = optimizer.blocks_mask(blocks) & ~adapter.host.touched
                checked["idle"] += int(idle.sum())
                checked["stale"] += int((idle & ever_touched).sum())
                for grad in _full_size(optimizer, blocks, grads):
                    assert (grad[idle] == 0).all()
                ever_touched |= adapter.host.touched
                return step(blocks, grads, settings, clip, zero_grads)

            optimizer.step = checking_step

    strategy.setup_optimizers = checking_setup
    model = meft_model()
    with torch.no_grad():  # values away from zero, so keys get gradients too
        for adapter in meft_adapters(model):
            adapter.host.values.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    trainer(tmp_path, 6, strategy).fit(CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(6, seed=9)))
    assert checked["stale"] > 0  # the case in question happened: idle rows that an earlier step had written


def test_bad_row_settings_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"row_block=0 must be a positive integer"):
        MEFTOffloadStrategy(device="cpu", row_block=0)
    with pytest.raises(ValueError, match=r"row_block=5 does not divide num_neurons=256"):
        trainer(tmp_path, 1, MEFTOffloadStrategy(device="cpu", row_block=5)).fit(
            CausalLMModule(meft_model(), lr=1e-2), train_dataloaders=loader(batches(1)))
    amsgrad = lambda model: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],  # noqa: E731
                                              amsgrad=True)
    with pytest.raises(ValueError, match="no amsgrad"):
        trainer(tmp_path, 1, MEFTOffloadStrategy(device="cpu")).fit(
            CausalLMModule(meft_model(), optimizer_factory=amsgrad), train_dataloaders=loader(batches(1)))


def test_a_smaller_row_block_steps_fewer_idle_rows(tmp_path: Path) -> None:
    stepped = {}
    for row_block in (None, 2):
        strategy = MEFTOffloadStrategy(device="cpu", row_block=row_block)
        trainer(tmp_path / str(row_block), 1, strategy).fit(CausalLMModule(meft_model(), lr=1e-2),
                                                            train_dataloaders=loader(batches(1)))
        metrics = strategy.figures_at_step_end()
        assert metrics["meft/rows_updated"] <= metrics["meft/rows_stepped"]
        stepped[row_block] = metrics["meft/rows_stepped"]
        assert all(o.block_rows == (row_block or 16) for o in [slot.row_adam for slot in strategy.attached.slots])
    assert stepped[2] < stepped[None]
