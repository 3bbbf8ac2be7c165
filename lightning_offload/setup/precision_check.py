"""Which precisions an offload face trains under: the host Adam and its state are fp32, and projected gradients never
fill ``param.grad``, so fp16 loss scaling cannot reach them. Lightning's and Fabric's precision plugins alike."""

from __future__ import annotations

from typing import Any

_PRECISION_ADVICE = {
    "16-mixed": (
        "fp16 loss scaling only unscales param.grad, but projected weights deliver their gradient compressed and "
        "never fill param.grad. Use precision='bf16-mixed' (bf16 needs no loss scaling) or 'bf16-true'."
    ),
    "16-true": "fp16 weights without loss scaling underflow. Use precision='bf16-true' or 'bf16-mixed'.",
}
_SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


def check_precision(strategy_name: str, plugin: Any, plain: type, half: tuple[type, ...]) -> None:
    """Refuse a precision plugin the offload cannot train under (Lightning's and Fabric's plugins alike: ``plain`` is
    the framework's fp32 plugin, ``half`` its bf16/fp16 ones).

    Raises:
        ValueError: naming the precision and what to use instead.
    """
    name = str(getattr(plugin, "precision", "32-true"))
    supported = type(plugin) is plain or (isinstance(plugin, half) and name in _SUPPORTED_PRECISION)
    if not supported or name not in _SUPPORTED_PRECISION:
        advice = _PRECISION_ADVICE.get(
            name, f"Use one of {', '.join(_SUPPORTED_PRECISION)} (the host Adam and its state are fp32).")
        raise ValueError(f"strategy {strategy_name!r} does not support precision={name!r}: {advice}")
