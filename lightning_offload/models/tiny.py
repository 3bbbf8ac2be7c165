"""Tiny randomly initialised causal LMs and a byte-level tokenizer, for fast CPU tests.

The LLaMA model covers ``nn.Linear`` projections and RMSNorm (like SmolLM2); the GPT-2 model covers
HF ``Conv1D`` layers (transposed weights), LayerNorm with bias, and learned position embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM


class ByteTokenizer:
    """A UTF-8 byte-level tokenizer: token ``i`` is byte ``i``.

    Byte 0 (NUL, which never occurs in normal text) serves as both eos and pad token, so the vocabulary is
    exactly the 256 byte values. Calling the tokenizer mimics the subset of the HF tokenizer call API
    that the data modules use.
    """

    vocab_size: int = 256
    eos_token_id: int = 0
    pad_token_id: int = 0
    eos_token: str = "\x00"
    pad_token: str = "\x00"
    name_or_path: str = "byte-tokenizer"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Encodes ``text`` as its UTF-8 bytes (no special tokens are ever added)."""
        del add_special_tokens  # Accepted for HF compatibility; there is no bos to add.
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        """Decodes byte ids back to text; invalid UTF-8 sequences become U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        data = bytes(i for i in ids if not (skip_special_tokens and i == self.eos_token_id))
        return data.decode("utf-8", errors="replace")

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = False) -> dict[str, Any]:
        """Returns ``{"input_ids": ...}`` for one string or a list of strings, like an HF tokenizer."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def get_vocab(self) -> dict[str, int]:
        """Maps each token's string form to its id (used to fingerprint the tokenizer for caching)."""
        return {f"<0x{i:02X}>": i for i in range(self.vocab_size)}

    def __len__(self) -> int:
        return self.vocab_size


def _seeded_init(seed: int, build: Any) -> Any:
    # fork_rng keeps the caller's global RNG stream untouched, so building a model inside a test does not
    # change what later random draws produce.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tiny_llama(
    vocab_size: int = 256,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 128,
    seed: int = 0,
    kv_heads: int | None = None,
    tie_word_embeddings: bool = True,
    max_positions: int = 512,
) -> LlamaForCausalLM:
    """Builds a tiny randomly initialised LLaMA causal LM, deterministic given ``seed``.

    Args:
        vocab_size: Vocabulary size (256 matches :class:`ByteTokenizer`).
        hidden: Hidden size.
        layers: Number of decoder layers.
        heads: Number of attention heads (must divide ``hidden``).
        intermediate: MLP inner size.
        seed: Seed for the weight initialisation.
        kv_heads: Key/value heads for grouped-query attention; defaults to ``heads``.
        tie_word_embeddings: Tie input and output embeddings, as SmolLM2 does.
        max_positions: Maximum sequence length.

    Returns:
        A ``LlamaForCausalLM`` in train mode with all parameters requiring grad.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ByteTokenizer.eos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
    )
    model = _seeded_init(seed, lambda: LlamaForCausalLM(config))
    model.train()
    return model


def tiny_gpt2(
    vocab_size: int = 256,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 128,
    seed: int = 0,
    max_positions: int = 512,
) -> GPT2LMHeadModel:
    """Builds a tiny randomly initialised GPT-2 causal LM (HF ``Conv1D`` layers), deterministic given ``seed``.

    Dropout is disabled so that two runs with the same data and seed compute identical losses.

    Args:
        vocab_size: Vocabulary size (256 matches :class:`ByteTokenizer`).
        hidden: Embedding size ``n_embd``.
        layers: Number of blocks.
        heads: Number of attention heads (must divide ``hidden``).
        intermediate: MLP inner size ``n_inner``.
        seed: Seed for the weight initialisation.
        max_positions: Number of learned position embeddings.

    Returns:
        A ``GPT2LMHeadModel`` (embeddings tied) in train mode with all parameters requiring grad.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_inner=intermediate,
        n_positions=max_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=ByteTokenizer.eos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
    )
    model = _seeded_init(seed, lambda: GPT2LMHeadModel(config))
    model.train()
    return model
