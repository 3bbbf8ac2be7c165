"""Each example under examples/ runs as a user would run it (its ``main``), on its tiny model, and trains: the loss
falls."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture()
def examples(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as `python examples/x.py` puts its folder first
    yield
    for name in ("progressions", "plain_loop", "fabric_loop", "hf_trainer"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(("name", "arguments"), [("plain_loop", {}), ("fabric_loop", {"accelerator": "cpu"}),
                                                 ("hf_trainer", {})])
def test_each_example_trains(name: str, arguments: dict, examples: object, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    losses = importlib.import_module(name).main(steps=24, **arguments)
    assert len(losses) == 24
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, (first, last)
