"""MEFT: injection, Key-Experts routing, host rows with lazy Adam, accumulation, resume, the meft_offload strategy."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_offload  # noqa: F401  (registers meft_offload)
from lightning_offload import LazyRowAdam, MEFTConfig, MEFTOffloadStrategy, inject_meft, meft_adapters
from lightning_offload.meft.adapter import route
from lightning_offload.meft.lazy_adam import LazyAdamSettings
from lightning_offload.models import tiny_gpt2, tiny_llama
from lightning_offload.module import CausalLMModule

SMALL = dict(num_neurons=256, top_k=8, num_experts=16, experts_per_token=4)


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


def test_only_adapter_routers_are_trainable_on_the_device() -> None:
    model = meft_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith("adapter.router.weight") for n in trainable)
    # Keys and values are host tensors, not parameters or buffers that `.to(device)` would move.
    assert not any(n.endswith(("keys", "values")) for n, _ in model.named_parameters())
    assert any(k.endswith("adapter.keys") for k in model.state_dict())


def test_routing_picks_top_k_neurons_inside_the_selected_experts() -> None:
    config = MEFTConfig(**SMALL)
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


def test_padding_tokens_fetch_no_rows() -> None:
    model = meft_model()
    adapters = meft_adapters(model)
    batch = batches(1, batch=1, length=10)[0]
    batch["attention_mask"][0, 2:] = 0
    model(**batch).loss.backward()
    for adapter in adapters:
        # 2 real tokens x top_k rows at most; padding routed nowhere.
        assert 0 < int(adapter.host.touched.sum()) <= 2 * SMALL["top_k"]


def test_lazy_adam_equals_dense_adam_on_rows_touched_every_step() -> None:
    g = torch.Generator().manual_seed(0)
    rows, hidden, steps = 20, 6, 7
    always = torch.tensor([1, 4, 9, 15])
    lazy_param = torch.randn(rows, hidden, generator=g)
    dense_param = lazy_param[always].clone().requires_grad_(True)
    lazy = LazyRowAdam([lazy_param])
    settings = LazyAdamSettings(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    dense = torch.optim.AdamW([dense_param], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(steps):
        extra = torch.randperm(rows, generator=g)[:3]
        touched = torch.unique(torch.cat([always, extra]))
        grads = torch.randn(rows, hidden, generator=g)
        lazy.step(touched, [grads[touched]], settings)
        dense_param.grad = grads[always].clone()
        dense.step()
    torch.testing.assert_close(lazy_param[always], dense_param.detach(), rtol=1e-6, atol=1e-6)
    assert (lazy.steps[always] == steps).all()


def _dense_reference_grads(model: torch.nn.Module, micro_batches: list[dict]) -> list[tuple[torch.Tensor, ...]]:
    """Accumulated gradients of every adapter's full K and V, with dense parameters and a selection mask."""
    adapters = meft_adapters(model)
    dense = [(a.host.keys.clone().requires_grad_(True), a.host.values.clone().requires_grad_(True)) for a in adapters]
    originals = [(a.prefetch, a.mix) for a in adapters]

    def dense_forward(adapter, keys, values):
        def forward(hidden):
            flat = hidden.reshape(-1, adapter.hidden_size)
            valid = adapter._valid_tokens(flat.shape[0], flat.device)
            r = route(flat, adapter.router(flat), adapter._key_scores(flat), adapter.config, valid)
            mask = torch.zeros(flat.shape[0], adapter.config.num_neurons)
            gates = torch.zeros_like(mask).scatter(1, r.neurons, r.gates)
            mask.scatter_(1, r.neurons, valid.unsqueeze(1).float().expand_as(r.neurons))
            act = torch.relu(flat @ keys.T) * gates * mask
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
    metrics = strategy.last_metrics
    hidden = meft_adapters(model)[0].hidden_size
    assert metrics["meft/rows_moved"] > 0
    assert metrics["meft/bytes_host_to_device"] == metrics["meft/rows_moved"] * 2 * hidden * 4
    assert metrics["meft/bytes_device_to_host"] == metrics["meft/bytes_host_to_device"]
    assert 0 < metrics["meft/expert_usage_entropy"] <= 1
    assert metrics["meft/adapter_device_bytes"] > 0
    # All Adam state on the host: the dense optimizer's and the rows'.
    assert strategy.offload_optimizer.device_state_bytes() == 0


def test_host_routing_trains_without_keys_on_the_device(tmp_path: Path) -> None:
    model = meft_model(routing="host")
    assert all(a.routing_keys is None for a in meft_adapters(model))
    strategy = MEFTOffloadStrategy(device="cpu")
    trainer(tmp_path, 2, strategy).fit(CausalLMModule(model, lr=1e-2), train_dataloaders=loader(batches(2)))
    assert strategy.last_metrics["meft/rows_updated"] > 0


def test_accumulation_equals_one_large_batch(tmp_path: Path) -> None:
    data = batches(4, batch=2, seed=7)
    big = [{k: torch.cat([data[i][k], data[i + 1][k]]) for k in data[0]} for i in (0, 2)]
    small_model, big_model = meft_model(), meft_model()
    trainer(tmp_path / "a", 2, accumulate_grad_batches=2).fit(CausalLMModule(small_model, lr=1e-2),
                                                              train_dataloaders=loader(data))
    trainer(tmp_path / "b", 2).fit(CausalLMModule(big_model, lr=1e-2), train_dataloaders=loader(big))
    for a, b in zip(meft_adapters(small_model), meft_adapters(big_model)):
        torch.testing.assert_close(a.host.values, b.host.values, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a.host.keys, b.host.keys, rtol=1e-4, atol=1e-6)


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
    resumed = meft_model()
    trainer(tmp_path / "resumed", 6).fit(CausalLMModule(resumed, lr=1e-2), train_dataloaders=loader(data),
                                         ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    for a, b in zip(meft_adapters(straight), meft_adapters(resumed)):
        assert torch.equal(a.host.values, b.host.values)
        assert torch.equal(a.host.keys, b.host.keys)
        assert torch.equal(a.router.weight, b.router.weight)


def test_strategy_without_adapters_says_how_to_add_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inject_meft"):
        trainer(tmp_path, 1).fit(CausalLMModule(tiny_llama(), lr=1e-2), train_dataloaders=loader(batches(1)))


def test_strategy_name_is_registered() -> None:
    t = pl.Trainer(strategy="meft_offload", accelerator="cpu", logger=False)
    assert isinstance(t.strategy, MEFTOffloadStrategy)


def test_a_failing_row_fetch_surfaces_in_the_forward() -> None:
    model = meft_model()
    adapter = meft_adapters(model)[1]

    def broken(rows, pin):
        raise RuntimeError("host gather failed")

    adapter._gather = broken
    with pytest.raises(RuntimeError, match="host gather failed"):
        model(**batches(1)[0])
