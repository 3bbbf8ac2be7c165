"""Hugging Face's ``Conv1D`` layout (GPT-2 style): the weight stored transposed, ``i × o``."""

from __future__ import annotations

from torch import nn

from lightning_offload.lsp.layouts.layout import LayerLayout


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for Hugging Face's ``Conv1D`` (GPT-2 style), which stores its weight transposed (``i × o``).

    Recognised by its name and its ``nf`` (output features) attribute, so ``transformers`` need not be imported.
    """
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


HF_CONV1D = LayerLayout("Conv1D", is_hf_conv1d, transposed=True)
