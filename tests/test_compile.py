"""torch.compile around a model trained by an offload strategy: same results, and no per-step recompilation.

The per-layer hooks that apply pipelined updates wait for the host worker (and time it), which no graph can hold:
traced with pending updates they broke the graph and recompiled it every step. The strategy now applies the updates
before a compiled forward starts, so the hooks find nothing pending there; a loop of one's own has them applied at
its step once a forward ran compiled.

Each projected layer is a custom operator (lsp/linear_ops.py): a model of many projected layers compiles without a
graph break from the package and without dynamo's recompile limit (its per-layer state was guarded in the one frame all
layers share), bit for bit as in eager mode, and a user's gradient hook on a projected weight is still said.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from tiny_modules import TinyClassifier, classification_data, trainer
from torch import nn

import lightning_offload
from lightning_offload import LSPOffloadStrategy, ProjectedWeightHookWarning, ZeroOffloadStrategy
from lightning_offload.lsp import norm_probe
from lightning_offload.models.tiny import tiny_llama

PACKAGE = str(Path(lightning_offload.__file__).parent)


class GraphCounter(pl.Callback):
    """A torch.compile backend that runs graphs eagerly and counts, per optimizer step, those it was handed."""

    def __init__(self) -> None:
        self.per_step: list[int] = [0]

    def backend(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        self.per_step[-1] += 1
        return graph.forward

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_step.append(0)


class CompiledBody(TinyClassifier):
    def __init__(self, counter: GraphCounter) -> None:
        super().__init__()
        self.counter = counter

    def configure_model(self) -> None:
        self.body = torch.compile(self.body, backend=self.counter.backend)


# Unclipped, the norm probes measure every UNCLIPPED_EVERY-th step (lsp/norm_probe.py): its forward keeps X z too,
# so that step has a graph of its own, made once. The runs cover two such steps.
STEPS = 2 * norm_probe.UNCLIPPED_EVERY + 2


def _fit(strategy_factory, compiled: bool, clip: float | None = None) -> tuple[TinyClassifier, GraphCounter]:
    torch._dynamo.reset()
    counter = GraphCounter()
    module = CompiledBody(counter) if compiled else TinyClassifier()
    trainer(strategy_factory(), max_steps=STEPS, callbacks=[counter], gradient_clip_val=clip).fit(
        module, classification_data())
    return module, counter


def test_a_compiled_model_trains_as_the_eager_one_without_recompiling_each_step() -> None:
    def lsp() -> LSPOffloadStrategy:
        return LSPOffloadStrategy(projectors="random", rank=0.5, min_dim=16)

    # (strategy, clipping, the index of the first step the probes measure: every 4th unclipped, after each clipped)
    for factory, clip, first_probed in ((lsp, None, norm_probe.UNCLIPPED_EVERY), (lsp, 1e-3, 1),
                                        (ZeroOffloadStrategy, None, None)):
        eager, _ = _fit(factory, compiled=False, clip=clip)
        compiled, counter = _fit(factory, compiled=True, clip=clip)
        assert compiled.losses == eager.losses
        for (name, got), want in zip(compiled.named_parameters(), eager.parameters()):
            assert torch.equal(got, want), name
        assert len(counter.per_step) == STEPS + 1 and counter.per_step[0] > 0  # it did compile (one count per step)
        # Graphs are made on the first step (and the first probed one) only: the pending-update hooks no longer
        # recompile a graph every step, and the probed step's graph is reused at the next probed step.
        later = [count for index, count in enumerate(counter.per_step[1:], 1) if index != first_probed]
        assert sum(later) == 0, str(counter.per_step)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def dynamo_messages() -> Iterator[list[str]]:
    """What dynamo logs while the block runs: every graph break and recompilation, with the user code that caused it,
    and its warnings (the recompile limit's)."""
    records = _Records()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    logger.addHandler(records)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)
        torch._logging.set_logs()


def _package_graph_breaks_and_recompiles(messages: list[str]) -> tuple[list[str], list[str]]:
    breaks = [m for m in messages if "graph break" in m.lower() and PACKAGE in m]
    recompiles = [m for m in messages if m.startswith("Recompiling") and PACKAGE in m]
    return breaks, recompiles


def _stack(bias: bool) -> nn.Module:
    """16 projected Linears; without biases the first one's backward has no output anyone needs (its input needs no
    gradient): only its S, which a compiler must not drop."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(128, 128, bias=bias), nn.GELU())])


def _llama() -> nn.Module:
    # 3 blocks of 7 projected Linears (hidden 128 is min_dim): 21 layers whose forwards share one function.
    return tiny_llama(hidden=128, intermediate=128, layers=3, heads=4)


def _loop(build, compiled: bool, steps: int) -> tuple[list[float], list[torch.Tensor], list[str]]:
    """``steps`` steps of ``offload(...)``'s loop (AdamW, clipped), compiled by dynamo and AOT autograd without
    inductor (so results can be compared bit for bit); the losses, the parameters and dynamo's messages."""
    torch._dynamo.reset()
    model = build()
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                                          max_grad_norm=1.0)
    called = torch.compile(model, backend="aot_eager") if compiled else model
    generator = torch.Generator().manual_seed(0)
    x, ids = torch.randn(4, 128, generator=generator), torch.randint(0, 256, (2, 16), generator=generator)
    losses = []
    with dynamo_messages() as messages:
        for _ in range(steps):  # one batch, learnt
            if isinstance(model, nn.Sequential):
                loss = called(x).square().mean()
            else:
                loss = called(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    optimizer.close()
    return losses, [p.detach().clone() for p in model.parameters()], messages


@pytest.mark.parametrize("build", [_llama, lambda: _stack(bias=False)], ids=["llama_21_layers", "linear_stack_16"])
def test_many_projected_layers_compile_without_graph_breaks_recompile_limit_or_any_change(build) -> None:
    # Past the 4th step, so the norm probes' step (lsp/norm_probe.py) runs compiled too.
    steps = norm_probe.UNCLIPPED_EVERY + 2
    eager_losses, eager_params, _ = _loop(build, compiled=False, steps=steps)
    losses, params, messages = _loop(build, compiled=True, steps=steps)
    assert not any("recompile_limit" in m for m in messages), "\n".join(messages)
    breaks, recompiles = _package_graph_breaks_and_recompiles(messages)
    assert breaks == [], breaks[0]
    # One more graph at most, made once: a step that probes the norms keeps X z too (what the compiler guards on).
    assert len(recompiles) <= 1 and all("norm_probe.active" in m for m in recompiles), recompiles
    assert losses == eager_losses
    assert all(torch.equal(got, want) for got, want in zip(params, eager_params))
    assert losses[-1] < losses[0]


def test_a_hook_on_a_projected_weight_of_a_compiled_model_is_said_at_the_step() -> None:
    torch._dynamo.reset()
    model = _stack(bias=True)
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    compiled = torch.compile(model, backend="aot_eager")
    calls: list[torch.Tensor] = []
    model[2].weight.register_post_accumulate_grad_hook(lambda param: calls.append(param.grad))
    x = torch.randn(4, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    optimizer.close()
    said = [w for w in caught if issubclass(w.category, ProjectedWeightHookWarning)]
    assert calls == [] and len(said) == 1, [str(w.message) for w in caught]
    assert "1 gradient hook(s) registered on 2.weight" in str(said[0].message)
    assert said[0].filename == __file__  # at the loop's step() call
