"""Models: the embedded SmolLM2-135M checkpoint, any HF causal LM, and tiny test models."""

from lightning_offload.models.smollm2 import (
    cache_root,
    load_hf_model,
    load_smollm2,
    load_smollm2_tokenizer,
    smollm2_gguf_path,
)
from lightning_offload.models.tiny import ByteTokenizer, tiny_gpt2, tiny_llama

__all__ = [
    "ByteTokenizer",
    "cache_root",
    "load_hf_model",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "smollm2_gguf_path",
    "tiny_gpt2",
    "tiny_llama",
]
