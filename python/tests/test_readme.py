"""The README's quick start runs as written, and every relative link of the docs points at a file
(and a heading) that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The Markdown files whose links are checked: the README, docs/ and the other top-level guides.
DOCS = [README, ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # links and images


def quick_start() -> str:
    """The first ```python block after the README's "## Quick start" heading."""
    text = README.read_text()
    section = text[text.index("\n## Quick start\n"):]
    section = section[: section.index("\n## ", 1)]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quick_start_runs_as_written(tmp_path):
    code = quick_start()
    assert "rank=0, world_size=1" in code and "to_hf(" in code and "load(" in code
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "'committed': True" in r.stdout, r.stdout


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each blank a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    """The anchors of a Markdown file's headings (code blocks skipped; repeats get -1, -2, ...)."""
    seen: dict = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
            if seen[s]:
                seen[f"{s}-{seen[s]}"] = 0
    return set(seen)


def links(path: Path) -> list:
    """The relative links (and images) of ``path`` outside code blocks and code spans: (target, anchor)."""
    kept, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    text = re.sub(r"`[^`]*`", "", "\n".join(kept))
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        out.append((file, anchor))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert doc.is_file(), doc
    broken = []
    for file, anchor in links(doc):
        target = (doc.parent / file).resolve() if file else doc
        if not target.exists():
            broken.append(f"{file}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            broken.append(f"{file}#{anchor}: no such heading")
    assert not broken, broken


def test_the_docs_index_reaches_every_doc():
    """Every file of docs/ is linked from the README."""
    linked = {(ROOT / f).resolve() for f, _ in links(README) if f}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, missing
