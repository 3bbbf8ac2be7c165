"""The Python snippets of the README and docs/ run as written, so that the docs cannot drift from the package.

Each ```` ```python ```` block runs in a fresh namespace holding what its page gives a reader: the imports the page's
earlier blocks made, the usual ones (``torch``, ``pl``, ``L``, ``transformers``, ``lightning_offload`` and the names the
page uses without importing them), and the objects a reader brings, on the smallest model that fits: ``model`` a
small LLaMA (vocabulary 64, hidden 128, so that ``lsp_offload``'s default ``min_dim=128`` projects its layers),
``loader``/``batch`` its batches as Hugging Face dicts, ``my_lightning_module``
and ``MyModule(model)`` a LightningModule with its data, ``args``/``data`` Hugging Face's ``TrainingArguments`` and
dataset. Trainers are shortened to two steps on the CPU without loggers (``lightning.pytorch.Trainer`` is replaced by a
subclass that says so); nothing else of a snippet is changed. A block that cannot run here (several GPUs) is listed in
:data:`CONSTRUCTED_ONLY` with the reason, and runs up to what it can.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
import transformers
from tiny_modules import TokenDicts

import lightning_offload
from lightning_offload import MEFTConfig, inject_meft
from lightning_offload.models.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks() -> list[tuple[str, int, str]]:
    """Every Python block of the pages: (page, first line, code)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            found.append((str(page.relative_to(ROOT)), line, match.group(1)))
    return found


BLOCKS = blocks()
#: A block's first code line (stripped), for those that need more than the common context: what is done first.
NEEDS_MEFT = "from lightning_offload import load_meft_adapters, save_meft_adapters, unload_meft"
#: Blocks that cannot run to the end on this machine: they are executed, and must stop exactly there.
CONSTRUCTED_ONLY = {
    "trainer = pl.Trainer(strategy=\"lsp_offload_ddp\", devices=8, num_nodes=2, precision=\"bf16-mixed\")":
        "8 devices on 2 nodes: the Trainer is built (its settings checked), not fitted",
}


class ShortTrainer(pl.Trainer):
    """``lightning.pytorch.Trainer`` for the snippets: two steps on the CPU; no loggers or checkpoints unless the
    snippet asks for them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(max_steps=2, accelerator="cpu")
        for setting in ("logger", "enable_checkpointing"):
            kwargs.setdefault(setting, False)  # what the snippet leaves to the defaults (the CLI sets its own)
        super().__init__(*args, **kwargs)


class TinyLM(pl.LightningModule):
    """A reader's LightningModule around a causal LM, with its own data (``MyModule`` in docs/meft.md)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(TokenDicts(n=16), batch_size=4)


def reader_model(seed: int = 0) -> torch.nn.Module:
    """The smallest LLaMA whose layers the default ``min_dim=128`` projects (token ids < 64, as TokenDicts has)."""
    return tiny_llama(vocab_size=64, hidden=128, intermediate=256, heads=4, kv_heads=2, seed=seed,
                      tie_word_embeddings=False, max_positions=64)


def reader_context(tmp_path: Path) -> dict[str, Any]:
    """What a reader of the pages holds before a snippet runs (see the module's docstring)."""
    loader = list(torch.utils.data.DataLoader(TokenDicts(n=32), batch_size=4))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    return {
        "torch": torch, "pl": pl, "L": lightning, "transformers": transformers, "lightning_offload": lightning_offload,
        "LlamaConfig": transformers.LlamaConfig, "LlamaForCausalLM": transformers.LlamaForCausalLM,
        "OffloadCallback": __import__("lightning_offload.faces.hf", fromlist=["OffloadCallback"]).OffloadCallback,
        "LSPOffloadStrategy": lightning_offload.LSPOffloadStrategy,
        "model": reader_model(), "loader": loader, "batch": loader[0], "args": args,
        "data": TokenDicts(n=16), "my_lightning_module": TinyLM(reader_model(seed=1)), "MyModule": TinyLM,
    }


def earlier_imports(page: str, line: int) -> str:
    """The import statements of the blocks before ``line`` on ``page`` (a reader has run them)."""
    statements = []
    for other_page, other_line, code in BLOCKS:
        if other_page == page and other_line < line:
            statements += [ast.unparse(node) for node in ast.parse(code).body
                           if isinstance(node, (ast.Import, ast.ImportFrom))]
    return "\n".join(statements)


# A snippet of lsp_offload on a model it projects nothing of would show nothing of the method.
@pytest.mark.filterwarnings("error:strategy .* found no layer to project")
@pytest.mark.parametrize(("page", "line", "code"), BLOCKS, ids=[f"{page}:{line}" for page, line, _ in BLOCKS])
def test_each_snippet_runs_as_written(page: str, line: int, code: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files a snippet writes ("adapters.pt", "runs/smoke") land here
    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pl, "Trainer", ShortTrainer)
    monkeypatch.setattr(lightning, "Trainer", ShortTrainer)
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    namespace = reader_context(tmp_path)
    exec(compile(earlier_imports(page, line), f"{page} (earlier imports)", "exec"), namespace)
    first = code.strip().splitlines()[0].strip()
    if first == NEEDS_MEFT:  # the page's earlier block trained adapters into the model
        inject_meft(namespace["model"], MEFTConfig(num_neurons=64, top_k=4, num_experts=4, experts_per_token=2))
    compiled = compile(code, f"{page}:{line}", "exec")
    if first in CONSTRUCTED_ONLY:
        exec(compiled, namespace)
        assert isinstance(namespace["trainer"], pl.Trainer), CONSTRUCTED_ONLY[first]
        return
    exec(compiled, namespace)
    trainer = namespace.get("trainer")
    if isinstance(trainer, pl.Trainer) and "trainer.fit(" in code:
        assert trainer.global_step == 2  # it trained
    optimizer = namespace.get("optimizer")
    if isinstance(optimizer, lightning_offload.OffloadOptimizer):
        optimizer.close()  # idempotent: a snippet that closed it already is unaffected
