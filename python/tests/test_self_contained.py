"""The repository is self-sufficient (issue 45, part 5): a user's clone, with nothing beside it, holds
everything its tests read and every document its comments cite. ``.ci/run`` runs the whole suite in
such a clone; these checks name the file and line that would break it, in a second.

- No file of the repository refers to a path outside it: the development machine's shared folder
  (``../shared/...``, ``/work/shared/...``) is not in a clone.
- A note cited by name with a section (``some-note.md §3``) is a file of the repository.
- The golden fixtures are in the repository (``tests/fixtures``, tests/fixtures/README.md) and
  every file of them is tracked, so a clone has them (a ``.gitignore`` rule must not drop, say,
  ``.metadata`` or ``*.pt``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from dcp_util import FIXTURES, golden

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"(\.\./|/work/)shared\b|\bshared/(fixtures|reference|tools)\b")
CITED_NOTE = re.compile(r"([\w.-]+\.md)\s*§")
# Where `git` is missing (an unpacked archive), the tree itself less what the build and tests make.
NOT_SOURCE = {".git", ".venv", "target", "__pycache__", ".pytest_cache", ".mypy_cache"}


def tracked() -> list[Path] | None:
    """The files git tracks in the repository, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [ROOT / name for name in out.decode().split("\0") if name]


def source_files() -> list[Path]:
    files = tracked()
    if files is None:
        files = [p for p in ROOT.rglob("*") if p.is_file() and not NOT_SOURCE & set(p.relative_to(ROOT).parts)]
    return [p for p in files if p.is_file()]


def texts():
    """(relative path, text) of every source file that is text (the fixtures' binaries are not),
    this one left out: it spells the patterns it looks for."""
    for p in source_files():
        if p == Path(__file__).resolve():
            continue
        try:
            yield p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def test_no_file_refers_to_a_path_outside_the_repository():
    found = [f"{rel}:{n}: {line.strip()}" for rel, text in texts()
             for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert found == [], "paths outside the repository:\n" + "\n".join(found)


def test_every_note_cited_by_section_is_in_the_repository():
    names = {p.name for p in source_files()}
    found = [f"{rel}:{n}: {m.group(1)}" for rel, text in texts()
             for n, line in enumerate(text.splitlines(), 1)
             for m in CITED_NOTE.finditer(line) if Path(m.group(1)).name not in names]
    assert found == [], "notes cited that the repository does not hold:\n" + "\n".join(found)


def test_the_golden_fixtures_are_in_the_repository_and_tracked():
    dirs = golden()
    assert FIXTURES == ROOT / "tests" / "fixtures" and all(d.is_relative_to(FIXTURES) for d in dirs)
    assert {d.parent.name for d in dirs} == {"dcp", "megatron"}
    files = tracked()
    if files is None:  # not a git checkout: nothing can be untracked
        return
    on_disk = {p for d in dirs for p in d.iterdir() if p.is_file()}
    assert on_disk - set(files) == set(), "golden fixture files git does not track"
