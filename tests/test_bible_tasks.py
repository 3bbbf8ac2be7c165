"""bible_genre and bible_qa data, the token accuracy / exact-match metrics, and the sequence classifier."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_offload.data.bible import load_books
from lightning_offload.data.bible_tasks import IGNORE_INDEX, BibleGenreDataModule, BibleQADataModule, PadCollator
from lightning_offload.models import ByteTokenizer, tiny_gpt2, tiny_llama
from lightning_offload.tasks.causal_lm import CausalLMModule
from lightning_offload.tasks.classifier import SequenceClassifierModule, decoder_of


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("task_cache")


def test_genre_split_holds_out_whole_chapters_of_every_genre(cache_dir: Path) -> None:
    dm = BibleGenreDataModule(ByteTokenizer(), cache_dir=cache_dir, max_val_examples=None)
    dm.setup()
    assert dm.num_classes == 8 and dm.class_names[0] == "Law"
    train_labels = torch.stack([e["labels"] for e in dm.train_set])
    val_labels = torch.stack([e["labels"] for e in dm.val_set])
    assert set(val_labels.tolist()) == set(range(8)) == set(train_labels.tolist())
    assert 0.05 < len(dm.val_set) / (len(dm.train_set) + len(dm.val_set)) < 0.15
    assert max(e["input_ids"].numel() for e in dm.train_set) == dm.max_length


def test_genre_split_is_disjoint_by_chapter() -> None:
    from lightning_offload.data.bible import load_verses
    from lightning_offload.data.bible_tasks import _is_held_out_chapter

    held = {(v.book_id, v.chapter) for v in load_verses() if _is_held_out_chapter(v, 10)}
    kept = {(v.book_id, v.chapter) for v in load_verses() if not _is_held_out_chapter(v, 10)}
    assert held and kept and not held & kept


def test_qa_examples_mask_the_prompt_and_end_with_eos(cache_dir: Path) -> None:
    tok = ByteTokenizer()
    dm = BibleQADataModule(tok, books=["Jude"], cache_dir=cache_dir, max_val_examples=None)
    dm.setup()
    assert len(dm.train_set) == 25 and dm.val_set == dm.train_set  # closed-book: asked what was trained
    first = dm.train_set[0]
    text = tok.decode(first["input_ids"])
    assert text.startswith("Jude 1:1\nJude, a servant of Jesus Christ")
    prompt_len = len("Jude 1:1\n")
    assert (first["labels"][:prompt_len] == IGNORE_INDEX).all()
    assert torch.equal(first["labels"][prompt_len:], first["input_ids"][prompt_len:])
    assert first["input_ids"][-1] == tok.eos_token_id


@pytest.mark.parametrize("task", ["genre", "qa"])
def test_the_cache_gives_back_the_examples_it_was_built_from(task: str, tmp_path: Path) -> None:
    """Built (and saved packed) by one module, loaded by another: the same examples, shapes and dtypes (the genre
    task's labels are 0-d, the QA task's 1-d)."""
    def module() -> BibleGenreDataModule | BibleQADataModule:
        if task == "genre":
            return BibleGenreDataModule(ByteTokenizer(), cache_dir=tmp_path, max_val_examples=None)
        return BibleQADataModule(ByteTokenizer(), books=["Jude"], cache_dir=tmp_path, max_val_examples=None)

    built, loaded = module(), module()
    built.setup("fit")
    assert built.cache_path().is_file()
    loaded.setup("fit")
    for ours, theirs in ((built.train_set, loaded.train_set), (built.val_set, loaded.val_set)):
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys()
            assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_qa_rejects_an_unknown_book(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="Unknown book 'Hezekiah'"):
        BibleQADataModule(ByteTokenizer(), books=["Hezekiah"], cache_dir=cache_dir)
    assert "Jude" in [name for name, _ in load_books().values()]


def test_collator_pads_right_with_ignored_labels() -> None:
    examples = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
                {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    batch = PadCollator(pad_id=0)(examples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


class _FixedLogits(torch.nn.Module):
    """A 'model' whose logits predict a given token sequence (to test the metrics exactly)."""

    def __init__(self, predicted: torch.Tensor, vocab: int = 10) -> None:
        super().__init__()
        self.predicted = predicted
        self.vocab = vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = torch.nn.functional.one_hot(self.predicted, self.vocab).float() + 0 * self.weight
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), labels[:, 1:].reshape(-1),
                                                 ignore_index=IGNORE_INDEX)
        return type("Out", (), {"loss": loss, "logits": logits})()


def test_token_accuracy_and_exact_match_count_only_answer_tokens() -> None:
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 7, 8, -100, -100]])
    # Position t predicts label t+1. Row 0: answer 3,4,5 predicted 3,4,5 (exact); row 1: 7 right, 8 wrong.
    predicted = torch.tensor([[9, 3, 4, 5, 0], [7, 1, 0, 0, 0]])
    module = CausalLMModule(_FixedLogits(predicted), exact_match=True, loss="model")
    logged: dict[str, torch.Tensor] = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)  # type: ignore[method-assign]
    module.validation_step({"input_ids": predicted, "labels": labels}, 0)
    module.on_validation_epoch_end()
    assert logged["val/token_acc"].item() == pytest.approx(4 / 5)
    assert logged["val/exact_match"].item() == pytest.approx(1 / 2)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2])
def test_classifier_reads_the_last_real_token_so_padding_changes_nothing(factory) -> None:
    lm = factory()
    module = SequenceClassifierModule(decoder_of(lm), lm.config.hidden_size, num_classes=8).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    padded = torch.tensor([[5, 6, 7, 8, 0, 0, 0]])
    with torch.no_grad():
        plain = module(ids, torch.ones_like(ids))
        with_padding = module(padded, (padded != 0).long())
    assert plain.shape == (1, 8)
    torch.testing.assert_close(plain, with_padding, rtol=1e-4, atol=1e-5)
    assert not any("lm_head" in n for n, _ in module.named_parameters())


def test_classifier_learns_genres(cache_dir: Path) -> None:
    L.seed_everything(0)
    dm = BibleGenreDataModule(ByteTokenizer(), batch_size=16, max_train_examples=256, max_val_examples=64,
                              cache_dir=cache_dir)
    lm = tiny_llama()
    module = SequenceClassifierModule(decoder_of(lm), lm.config.hidden_size, dm.num_classes, lr=3e-3)
    trainer = L.Trainer(accelerator="cpu", max_steps=30, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=4,
                        num_sanity_val_steps=0)
    (before,) = trainer.validate(module, datamodule=dm, verbose=False)
    trainer.fit(module, datamodule=dm)
    (after,) = trainer.validate(module, datamodule=dm, verbose=False)
    assert after["val/loss"] < before["val/loss"] - 0.2
    assert 0.0 <= after["val/acc"] <= 1.0 and 0.0 <= after["val/macro_f1"] <= 1.0
