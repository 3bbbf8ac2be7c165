"""torch.compile around a model trained by an offload strategy: same results, and no per-step recompilation.

The per-layer hooks that apply pipelined updates wait for the host worker (and time it), which no graph can hold:
traced with pending updates they broke the graph and recompiled it every step. The strategy now applies the updates
before a compiled forward starts, so the hooks find nothing pending there.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from tiny_modules import TinyClassifier, classification_data, trainer

from lightning_offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.lsp import norm_probe


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
