"""Two supervised tasks on the World English Bible: genre classification and closed-book verse recall.

- :class:`BibleGenreDataModule` (``data=bible_genre``): a verse → one of the 8 genres (Law, History, Wisdom,
  Prophets, Gospels, Acts, Epistles, Apocalyptic). Held out by chapter (a fixed, hashed 10% of the chapters of every
  book), so every genre appears in both splits and no held-out verse is a neighbour of a training verse.
- :class:`BibleQADataModule` (``data=bible_qa``): closed-book knowledge. The prompt is a reference
  (``"Proverbs 3:5\\n"``), the answer is the verse text; the loss covers only the answer. Evaluation asks the
  *same* references: the task measures how much text an adapter can store and recall, which is what the capacity of
  MEFT's wide adapters is for. An answer counts as exactly right when greedy decoding would reproduce every one of
  its tokens (teacher-forced argmax equals the target at every answer position).

Both tokenise once and cache the result on disk (keyed by tokenizer, settings and a format version), like
:class:`~lightning_offload.data.bible.BibleLMDataModule`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_offload.data.bible import Verse, _resolve_books, _save_atomic, _tokenizer_fingerprint, load_genres, \
    load_verses
from lightning_offload.data.resumable import TrainOrder
from lightning_offload.lm_loss import IGNORE_INDEX
from lightning_offload.models.smollm2 import cache_root

# 2: each split stored packed (one flat tensor per key), not as a list of per-example tensors.
_FORMAT_VERSION = 2


def _is_held_out_chapter(verse: Verse, every: int) -> bool:
    # A content hash, not Python's salted hash(): the split must be the same in every process and on every machine.
    key = f"{verse.book_id}:{verse.chapter}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") % every == 0


def _pack(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A split as one flat tensor per key, with each example's element count and whether its values are 0-d: saved
    as tens of thousands of tiny tensors, a split took 3-6x longer to load than to tokenise again (one pickled
    storage per tensor)."""
    packed: dict[str, torch.Tensor] = {}
    for key in (examples[0] if examples else {}):
        values = [example[key] for example in examples]
        packed[key] = torch.cat([value.reshape(-1) for value in values])
        packed[f"{key}.numel"] = torch.tensor([value.numel() for value in values])
        packed[f"{key}.scalar"] = torch.tensor(values[0].ndim == 0)
    return packed


def _unpack(packed: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The examples of :func:`_pack` (views into its flat tensors)."""
    keys = [key for key in packed if "." not in key]
    columns = {}
    for key in keys:
        parts = packed[key].split(packed[f"{key}.numel"].tolist())
        columns[key] = [part.reshape(()) for part in parts] if bool(packed[f"{key}.scalar"]) else list(parts)
    count = len(columns[keys[0]]) if keys else 0
    return [{key: columns[key][i] for key in keys} for i in range(count)]


class _ExamplesDataset(Dataset):
    def __init__(self, examples: list[dict[str, torch.Tensor]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


class PadCollator:
    """Right-pads ``input_ids`` with ``pad_id``, ``labels`` (when sequences) with -100, and builds the attention mask.

    A class rather than a closure so DataLoaders with worker processes can pickle it.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = max(e["input_ids"].numel() for e in examples)
        ids = torch.full((len(examples), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), length), dtype=torch.long)
        batch: dict[str, torch.Tensor] = {}
        for row, e in enumerate(examples):
            n = e["input_ids"].numel()
            ids[row, :n] = e["input_ids"]
            mask[row, :n] = 1
        batch["input_ids"], batch["attention_mask"] = ids, mask
        if examples[0]["labels"].ndim == 0:  # one class label per example
            batch["labels"] = torch.stack([e["labels"] for e in examples])
        else:
            labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
            for row, e in enumerate(examples):
                labels[row, : e["labels"].numel()] = e["labels"]
            batch["labels"] = labels
        return batch


class _CachedBibleTask(L.LightningDataModule):
    """Shared plumbing: on-disk cache of the tokenised splits, seeded subsets, padded loaders."""

    task: str = ""

    def __init__(self, tokenizer: Any, batch_size: int, max_train_examples: int | None,
                 max_val_examples: int | None, seed: int, cache_dir: str | os.PathLike[str] | None,
                 num_workers: int) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("max_train_examples", max_train_examples),
                            ("max_val_examples", max_val_examples)):
            if value is not None and value < 1:
                raise ValueError(f"data.{name}={value} must be a positive integer (or null for all).")
        if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("The tokenizer needs a pad_token_id or an eos_token_id to pad batches.")
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_train_examples = max_train_examples
        self.max_val_examples = max_val_examples
        self.seed = seed
        self.train_order = TrainOrder(seed)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / self.task
        self.num_workers = num_workers
        self.train_set: list[dict[str, torch.Tensor]] | None = None
        self.val_set: list[dict[str, torch.Tensor]] | None = None
        self._splits: tuple[Path, dict[str, list[dict[str, torch.Tensor]]]] | None = None

    def _settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def _build(self) -> dict[str, list[dict[str, torch.Tensor]]]:
        raise NotImplementedError

    def cache_path(self) -> Path:
        """The cache file for this tokenizer and these settings."""
        name, digest = _tokenizer_fingerprint(self.tokenizer)
        settings = hashlib.sha256(json.dumps(self._settings(), sort_keys=True).encode()).hexdigest()[:10]
        return self.cache_dir / f"{name}-{digest}-{settings}-f{_FORMAT_VERSION}.pt"

    def _load(self) -> dict[str, list[dict[str, torch.Tensor]]]:
        path = self.cache_path()
        # Kept once loaded: prepare_data and setup (and every Trainer stage's setup) would each read the file again.
        if self._splits is not None and self._splits[0] == path:
            return self._splits[1]
        if path.is_file():
            splits = {name: _unpack(packed) for name, packed in torch.load(path, weights_only=True).items()}
        else:
            splits = self._build()
            _save_atomic({name: _pack(examples) for name, examples in splits.items()}, path)
        self._splits = (path, splits)
        return splits

    def prepare_data(self) -> None:
        """Tokenises and caches both splits."""
        self._load()

    def longest_sequence(self) -> int:
        """Tokens of the longest training example: what a padded batch reaches at most (a run's plan is made for
        it)."""
        return max(len(example["input_ids"]) for example in self._load()["train"])

    def setup(self, stage: str | None = None) -> None:
        """Loads the cached splits and applies the size limits (a seeded subset of train, evenly spaced val)."""
        splits = self._load()
        train, val = splits["train"], splits["val"]
        if self.max_train_examples is not None and self.max_train_examples < len(train):
            g = torch.Generator().manual_seed(self.seed)
            keep = torch.randperm(len(train), generator=g)[: self.max_train_examples].sort().values
            train = [train[i] for i in keep.tolist()]
        if self.max_val_examples is not None and self.max_val_examples < len(val):
            keep = torch.linspace(0, len(val) - 1, self.max_val_examples).round().long().unique()
            val = [val[i] for i in keep.tolist()]
        self.train_set, self.val_set = train, val

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def train_dataloader(self) -> DataLoader:
        """Shuffled, padded train batches; the order depends only on ``seed`` and the epoch, and a resumed run
        continues it (see :mod:`lightning_offload.data.resumable`)."""
        if self.train_set is None:
            self.setup()
        dataset = _ExamplesDataset(self.train_set)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=self.train_order.sampler(len(dataset)),
                          collate_fn=PadCollator(self._pad_id()), num_workers=self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """Where the training order stands (saved in checkpoints by Lightning)."""
        return self.train_order.state_dict(self.trainer, self.batch_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues the training order where a checkpoint left it."""
        self.train_order.load_state_dict(state_dict)

    def val_dataloader(self) -> DataLoader:
        """Padded validation batches in canonical order."""
        if self.val_set is None:
            self.setup()
        return DataLoader(_ExamplesDataset(self.val_set), batch_size=self.batch_size, shuffle=False,
                          collate_fn=PadCollator(self._pad_id()), num_workers=self.num_workers)


class BibleGenreDataModule(_CachedBibleTask):
    """Verse → genre (8 classes). Batches: ``input_ids``, ``attention_mask`` ``[B, T]`` and ``labels`` ``[B]``.

    Args:
        tokenizer: HF tokenizer or ``ByteTokenizer``.
        batch_size: Verses per batch.
        max_length: Verses are truncated to this many tokens.
        held_out_every: About one chapter in this many (chosen by a content hash) is held out for validation.
        max_train_examples: A seeded random subset of this many training verses (None: all ~28k).
        max_val_examples: This many evenly spaced validation verses (None: all ~3k).
        seed: Subset and shuffling seed.
        cache_dir: Cache of the tokenised splits; defaults to ``cache_root() / "bible_genre"``.
        num_workers: DataLoader workers.
    """

    task = "bible_genre"

    def __init__(self, tokenizer: Any, batch_size: int = 16, max_length: int = 64, held_out_every: int = 10,
                 max_train_examples: int | None = None, max_val_examples: int | None = 512, seed: int = 0,
                 cache_dir: str | os.PathLike[str] | None = None, num_workers: int = 0) -> None:
        if max_length < 2:
            raise ValueError(f"data.max_length={max_length} is too short; use at least 2 tokens.")
        if held_out_every < 2:
            raise ValueError(f"data.held_out_every={held_out_every} must be ≥ 2 (1 would hold out everything).")
        self.max_length = max_length
        self.held_out_every = held_out_every
        super().__init__(tokenizer, batch_size, max_train_examples, max_val_examples, seed, cache_dir, num_workers)

    @property
    def class_names(self) -> list[str]:
        """Genre names in label order (label ``i`` is genre id ``i + 1``)."""
        genres = load_genres()
        return [genres[g] for g in sorted(genres)]

    @property
    def num_classes(self) -> int:
        """Number of genres (8)."""
        return len(self.class_names)

    def _settings(self) -> dict[str, Any]:
        return {"task": self.task, "max_length": self.max_length, "every": self.held_out_every}

    def _build(self) -> dict[str, list[dict[str, torch.Tensor]]]:
        verses = [v for v in load_verses() if v.text]
        first_genre = min(load_genres())
        ids = self.tokenizer([v.text for v in verses], add_special_tokens=False)["input_ids"]
        splits: dict[str, list[dict[str, torch.Tensor]]] = {"train": [], "val": []}
        for verse, tokens in zip(verses, ids):
            example = {"input_ids": torch.tensor(tokens[: self.max_length], dtype=torch.long),
                       "labels": torch.tensor(verse.genre_id - first_genre, dtype=torch.long)}
            splits["val" if _is_held_out_chapter(verse, self.held_out_every) else "train"].append(example)
        return splits


class BibleQADataModule(_CachedBibleTask):
    """Reference → verse text, loss on the answer only. Batches: ``input_ids``, ``attention_mask``, ``labels``
    ``[B, T]`` with ``labels = -100`` on the prompt and the padding.

    Args:
        tokenizer: HF tokenizer or ``ByteTokenizer``.
        books: Books whose verses form the task (case-insensitive names).
        max_verses: Keep the first this many verses of those books (None: all).
        max_answer_tokens: Answers are truncated to this many tokens (then the eos token).
        batch_size: Examples per batch.
        max_train_examples: A seeded random subset of this many verses to train on (None: all).
        max_val_examples: Evaluate on this many evenly spaced verses of the same set (None: all).
        seed: Subset and shuffling seed.
        cache_dir: Cache of the tokenised examples; defaults to ``cache_root() / "bible_qa"``.
        num_workers: DataLoader workers.
    """

    task = "bible_qa"

    def __init__(self, tokenizer: Any, books: Sequence[str] = ("Proverbs",), max_verses: int | None = None,
                 max_answer_tokens: int = 64, batch_size: int = 16, max_train_examples: int | None = None,
                 max_val_examples: int | None = 256, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                 num_workers: int = 0) -> None:
        if not books:
            raise ValueError("data.books is empty; name at least one book, e.g. data.books=[Proverbs].")
        _resolve_books(books)  # unknown names fail here, with the list of valid ones
        if max_verses is not None and max_verses < 1:
            raise ValueError(f"data.max_verses={max_verses} must be a positive integer (or null for all).")
        if max_answer_tokens < 1:
            raise ValueError(f"data.max_answer_tokens={max_answer_tokens} must be ≥ 1.")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("bible_qa needs a tokenizer with an eos_token_id to end each answer.")
        self.books = tuple(books)
        self.max_verses = max_verses
        self.max_answer_tokens = max_answer_tokens
        super().__init__(tokenizer, batch_size, max_train_examples, max_val_examples, seed, cache_dir, num_workers)

    def _settings(self) -> dict[str, Any]:
        return {"task": self.task, "books": sorted(b.lower() for b in self.books), "max_verses": self.max_verses,
                "answer": self.max_answer_tokens}

    @staticmethod
    def prompt(verse: Verse) -> str:
        """The question for a verse: its reference and a newline."""
        return f"{verse.book_name} {verse.chapter}:{verse.verse}\n"

    def _build(self) -> dict[str, list[dict[str, torch.Tensor]]]:
        wanted = _resolve_books(self.books)
        verses = [v for v in load_verses() if v.book_id in wanted and v.text][: self.max_verses]
        prompts = self.tokenizer([self.prompt(v) for v in verses], add_special_tokens=False)["input_ids"]
        answers = self.tokenizer([v.text for v in verses], add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        examples = []
        for prompt, answer in zip(prompts, answers):
            answer = list(answer[: self.max_answer_tokens]) + [eos]
            ids = torch.tensor(list(prompt) + answer, dtype=torch.long)
            labels = ids.clone()
            labels[: len(prompt)] = IGNORE_INDEX  # only the answer is a target
            examples.append({"input_ids": ids, "labels": labels})
        # Closed-book recall: the evaluation asks the questions that were trained on (see the module docstring).
        return {"train": examples, "val": examples}
