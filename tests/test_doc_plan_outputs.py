"""The planner's outputs quoted in the docs are what the planner prints now, so that they cannot drift again.

- Every ```` ```python ```` block of docs/planning.md and README.md that plans with a named hardware profile (whose
  figures are fixed, unlike a calibration of this machine) and is followed by an output block is run (meta-device
  models: cheap), and each line of the output block must be a line it prints, in order. A line ``...`` stands for
  lines left out; a line ending in ``...`` keeps only the start of the printed line; other lines may be left out.
- The table of Llama-3.1-8B and Qwen2.5-7B in docs/planning.md and the README's "Will it fit, and how fast?" figures are
  rendered from plans of the same configurations and must appear as the page has them.

To regenerate after a change to the planner: ``.venv/bin/python tests/test_doc_plan_outputs.py`` prints each checked
block as the planner prints it now (with its page and line), and the table rows and README sentence to paste.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import lightning_offload
from lightning_offload.planning.calibration import PROFILES

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "docs" / "planning.md", ROOT / "README.md")
# A python block, then (blank lines apart) a block without a language: what it prints.
PAIR = re.compile(r"^```python\n(.*?)^```\n\s*^```\n(.*?)^```", re.DOTALL | re.MULTILINE)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
PROFILE = re.compile(r"""hardware=["'](%s)["']""" % "|".join(map(re.escape, PROFILES)))
REGENERATE = ("regenerate it: `.venv/bin/python tests/test_doc_plan_outputs.py` prints what the planner prints now; "
              "paste it into the page, keeping the page's cuts (a line '...' stands for lines left out, a line ending "
              "in '...' keeps the start of a printed line)")


def planner_blocks() -> list[tuple[str, int, str, str]]:
    """Each (page, line, code, documented output) whose code plans with a named profile."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in PAIR.finditer(text):
            if PROFILE.search(match.group(1)):
                line = text.count("\n", 0, match.start()) + 2
                found.append((str(page.relative_to(ROOT)), line, match.group(1), match.group(2)))
    return found


def _earlier_imports(page: str, line: int) -> str:
    """The imports of the page's blocks before ``line`` (a reader ran them)."""
    text = (ROOT / page).read_text()
    statements = []
    for match in PYTHON.finditer(text):
        if text.count("\n", 0, match.start()) + 2 < line:
            statements += [ast.unparse(node) for node in ast.parse(match.group(1)).body
                           if isinstance(node, (ast.Import, ast.ImportFrom))]
    return "\n".join(statements)


def printed(page: str, line: int, code: str) -> str:
    """What the block prints, run as a reader of the page runs it."""
    namespace: dict[str, Any] = {"torch": torch, "lightning_offload": lightning_offload}
    exec(compile(_earlier_imports(page, line), f"{page} (earlier imports)", "exec"), namespace)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
    return out.getvalue()


def stale_lines(documented: str, output: str) -> list[str]:
    """The documented lines the output does not hold, in order (empty: the block is current)."""
    lines = [line.rstrip() for line in output.splitlines()]
    position, stale = 0, []
    for doc in documented.splitlines():
        doc = doc.rstrip()
        if doc.strip() in ("", "...", "…"):
            continue
        prefix = doc[:-3] if doc.endswith("...") else None
        for index in range(position, len(lines)):
            if (lines[index].startswith(prefix) if prefix is not None else lines[index] == doc):
                position = index + 1
                break
        else:
            label = doc.split("  ")[0] if "  " in doc.strip() else doc[:20]
            now = next((line for line in lines if line.startswith(label)), "(no such line now)")
            stale.append(f"  page: {doc}\n  now:  {now}")
    return stale


BLOCKS = planner_blocks()


def test_the_docs_quote_planner_outputs() -> None:
    # The pages' planner blocks are found: a change of their form would otherwise check nothing.
    pages = {page for page, *_ in BLOCKS}
    assert "docs/planning.md" in pages and len(BLOCKS) >= 4


@pytest.mark.parametrize(("page", "line", "code", "documented"), BLOCKS,
                         ids=[f"{page}:{line}" for page, line, *_ in BLOCKS])
def test_each_documented_planner_output_is_what_the_planner_prints(page: str, line: int, code: str,
                                                                    documented: str) -> None:
    stale = stale_lines(documented, printed(page, line, code))
    assert not stale, f"{page}:{line}: the output block no longer matches what its snippet prints:\n" + \
        "\n".join(stale) + f"\nTo {REGENERATE}."


def test_the_comparison_finds_a_stale_figure() -> None:
    printed_now = "step time      1.000 s (2,048 tokens/s)\n  parts        device 0.9 s\nRejected:\n  a: fits, ties: x"
    assert stale_lines("step time      1.000 s (2,048 tokens/s)\n...\n  a: fits, ...", printed_now) == []
    assert stale_lines("step time      1.581 s (2,048 tokens/s)", printed_now) != []
    assert stale_lines("  a: fits, but slower...", printed_now) != []


# The configurations of today's models the pages quote (Hugging Face's config.json sizes; built offline).
def llama_3_1_8b() -> torch.nn.Module:
    """Llama-3.1-8B (untied 128K head) on the meta device."""
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                            tie_word_embeddings=False))


def qwen2_5_7b() -> torch.nn.Module:
    """Qwen2.5-7B (untied 152K head) on the meta device."""
    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                            num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                            tie_word_embeddings=False))


def llama_3_2_1b() -> torch.nn.Module:
    """Llama-3.2-1B (tied 128K head) on the meta device."""
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                            head_dim=64, tie_word_embeddings=True))


#: The plan the table and the README quote (docs/planning.md says it in words).
DEFAULTS = dict(batch_size=4, seq_len=512, device_memory="24GiB", host_memory="32GiB", precision="bf16-true",
                gradient_checkpointing=True, hardware="rtx4090")
MODELS: dict[str, Callable[[], torch.nn.Module]] = {"Llama-3.1-8B": llama_3_1_8b, "Qwen2.5-7B": qwen2_5_7b}


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def table_rows() -> dict[str, str]:
    """docs/planning.md's rows for today's 7–8B models, as the planner gives them now."""
    rows = {}
    for name, build in MODELS.items():
        model = build()
        found = lightning_offload.plan(model, "lsp_offload", **DEFAULTS)
        dense = lightning_offload.plan(model, "lsp_offload", head="host", **DEFAULTS)
        rows[name] = (f"| {name} | {_gib(found.device_bytes)} GiB of 24 | {_gib(found.host_bytes)} GiB of 32 "
                      f"({_gib(found.host_speculation_bytes)}) | {found.step_seconds:.3f} s | host "
                      f"{_gib(dense.host_bytes)} GiB: {'fits' if dense.fits_host else 'does not fit'} |")
    return rows


def readme_sentence() -> str:
    """The README's planned figures, as the planner gives them now."""
    choice = lightning_offload.choose(llama_3_2_1b(), seq_len=512, device_memory="4GiB", host_memory="16GiB",
                                      precision="bf16-true", hardware="laptop-4gb", batch_sizes=(4,))
    plans = [lightning_offload.plan(build(), "lsp_offload", **DEFAULTS) for build in MODELS.values()]
    device, host, step = (" / ".join(figure(p) for p in plans) for figure in (
        lambda p: f"{p.device_bytes / 2**30:.1f}", lambda p: f"{p.host_bytes / 2**30:.1f}",
        lambda p: f"{p.step_seconds:.1f}"))
    return (f"Llama-3.2-1B fits a 4 GiB GPU with a 16 GiB host ({_gib(choice.plan.device_bytes)} GiB, by `choose`); "
            f"Llama-3.1-8B and Qwen2.5-7B fit a 24 GiB GPU and a 32 GiB host at the defaults (device {device} GiB, "
            f"host {host} GiB; predicted steps {step} s on the `rtx4090` profile).")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_7b_and_8b_table_is_what_the_planner_gives() -> None:
    text = (ROOT / "docs" / "planning.md").read_text()
    for name, row in table_rows().items():
        documented = next((line for line in text.splitlines() if line.startswith(f"| {name} |")), None)
        assert documented == row, (f"docs/planning.md's {name} row is stale:\n  page: {documented}\n  now:  {row}\n"
                                   f"To {REGENERATE}.")


def test_the_readme_s_planned_figures_are_what_the_planner_gives() -> None:
    sentence = readme_sentence()
    assert _flat(sentence) in _flat((ROOT / "README.md").read_text()), \
        f"README.md's planned figures are stale; they are now:\n  {sentence}\nTo {REGENERATE}."


def main() -> None:
    """Print what each checked block, the table and the README sentence say now."""
    for page, line, code, _ in BLOCKS:
        print(f"--- {page}:{line}: its output block now\n```\n{printed(page, line, code)}```\n")
    print("--- docs/planning.md: the table's rows now")
    print("\n".join(table_rows().values()))
    print("\n--- README.md: the planned figures now")
    print(readme_sentence())


if __name__ == "__main__":
    main()
