"""Full gradients of projected layers, one layer at a time, for fitting and measuring projectors.

Inside :func:`sample_gradients` a backward pass hands each projected layer's full gradient ``G`` (``o × i``, fp32) to
a callback as soon as autograd has produced it, then frees it, so at most one layer's full gradient exists at a time
(backward produces layer gradients one after another). Nothing is accumulated into the compressed buffers ``S`` and
no other parameter receives a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor, nn

from lightning_offload.lsp.linear import ProjectedWeight

GradientConsumer = Callable[[ProjectedWeight, Tensor], None]


@contextmanager
def sample_gradients(
    model: nn.Module, layers: Sequence[ProjectedWeight], consume: GradientConsumer
) -> Iterator[None]:
    """Route every backward run inside the block to ``consume(layer, G)`` for the given layers.

    Args:
        model: the module holding the layers; its other parameters get ``requires_grad=False`` inside the block
            (restored on exit), so backward computes no gradient it would throw away.
        layers: the projected layers whose gradients are wanted; they run their plain forward inside the block.
        consume: called once per layer per backward with ``G`` in the ``o × i`` layout (its layer layout's math
            view: transposed back for Hugging Face ``Conv1D``); ``G`` is freed when it returns.
    """
    wanted = {id(layer.weight) for layer in layers}
    flags = [(param, param.requires_grad) for param in model.parameters()]
    hooks = []
    try:
        for param, _ in flags:
            if id(param) not in wanted:
                param.requires_grad_(False)
        for layer in layers:
            layer.sampling = True
            layer.weight.requires_grad_(True)
            hooks.append(layer.weight.register_post_accumulate_grad_hook(_deliver(layer, consume)))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            layer.sampling = False
            layer.weight.grad = None
        for param, flag in flags:
            param.requires_grad_(flag)


def _deliver(layer: ProjectedWeight, consume: GradientConsumer) -> Callable[[Tensor], None]:
    def hook(weight: Tensor) -> None:
        grad, weight.grad = weight.grad, None  # dropped here: the next layer's gradient may then reuse the memory
        grad = grad.float()
        consume(layer, layer.layout.math_view(grad))

    return hook
