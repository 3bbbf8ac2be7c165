"""Offline datasets: the World English Bible as a language-modelling corpus."""

from lightning_offload.data.bible import (
    DEFAULT_HELD_OUT_BOOKS,
    BibleLMDataModule,
    Verse,
    book_texts,
    load_books,
    load_genres,
    load_verses,
    lm_split,
    pack_blocks,
    strip_footnotes,
    tokenize_books,
)

__all__ = [
    "DEFAULT_HELD_OUT_BOOKS",
    "BibleLMDataModule",
    "Verse",
    "book_texts",
    "load_books",
    "load_genres",
    "load_verses",
    "lm_split",
    "pack_blocks",
    "strip_footnotes",
    "tokenize_books",
]
