"""Every relative link of the README and docs/ reaches a file that exists and, where it names one, a heading there.

The benchmark record moved from one long page into dated pages; links into it broke silently before (an anchor is only
text). Anchors follow GitHub's slugs: the heading lowercased, punctuation but hyphens and underscores dropped, each
space a hyphen, a repeated slug numbered ``-1``, ``-2``, …
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: ``[text](target)``, images included; the target ends at the first space or closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())  # Markdown emphasis and code marks are not in the text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a ``# comment`` in a shell block is no heading)."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, numbered as GitHub numbers repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(page: Path) -> list[str]:
    """The targets of ``page``'s links that stay in the repository (no scheme, no ``mailto:``)."""
    targets = []
    for line in prose_lines(page):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # a link inside inline code is an example
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                targets.append(target)
    return targets


def test_the_slugs_follow_githubs_rules() -> None:
    assert slug("Sized to the machine (issue 41 item 3, 2026-12-03)") == \
        "sized-to-the-machine-issue-41-item-3-2026-12-03"
    assert slug("Core: `lsp_offload` vs `zero_offload` vs plain AdamW (CPU)") == \
        "core-lsp_offload-vs-zero_offload-vs-plain-adamw-cpu"
    assert slug("On paper: 8 GPUs × 1–4 nodes") == "on-paper-8-gpus--14-nodes"


def test_a_broken_anchor_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n[a](#missing) [b](#same-1)\n")
    assert anchors(page) == {"title", "same", "same-1"}
    assert relative_links(page) == ["#missing", "#same-1"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_benchmarks_page_names_every_script() -> None:
    # docs/benchmarks.md lists the scripts by subject, and each script's docstring says what it measures: a script
    # added or removed without the list is caught here (the shell scripts and the harness's CLI entry are not
    # benchmarks).
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    named = set(re.findall(r"`(?:scripts/)?([a-z_0-9]+\.py)`", page))
    scripts = {path.name for path in (ROOT / "scripts").glob("*.py")} - {"train.py"}
    assert not scripts - named, f"scripts docs/benchmarks.md does not name: {sorted(scripts - named)}"
    assert not {name for name in named if name.startswith(("benchmark_", "gpu_", "check_"))} - scripts, \
        "docs/benchmarks.md names scripts that do not exist"
