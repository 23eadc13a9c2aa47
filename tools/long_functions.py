"""Lists the Rust functions of ``src/`` and ``crates/*/src/`` longer than a bound (default 120 lines, issue 39) and fails
when one is not in the allowlist ``tools/long_functions.txt``: the functions that were already that
long when the bound came in, each to be split into named steps. A function that is split leaves the
list (the script says which entries are stale); none joins it.

A function's length is counted from its ``fn`` line to its closing brace, by brace matching that skips
strings, chars and comments (enough for this code base; not a Rust parser). Exits 1 listing the
offenders, 0 otherwise. Run: ``python tools/long_functions.py [--max 120] [--write]`` (``--write``
rewrites the allowlist from the current code: for a reviewed change only).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOW = ROOT / "tools" / "long_functions.txt"
FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+(\w+)")


def strip(line: str, state: dict) -> str:
    """``line`` with strings, chars and comments blanked; ``state['block']`` carries /* */ across lines."""
    out, i, n = [], 0, len(line)
    while i < n:
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"], i = False, j + 2
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"], i = True, i + 2
            continue
        if c == '"':
            i += 1
            while i < n and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path: Path):
    """``(name, first line, lines)`` of each function in ``path`` (nested ones too)."""
    lines = path.read_text().splitlines()
    state, depth, open_fns, found = {"block": False}, 0, [], []
    pending, nest = None, 0  # nest: ( and [ open in a pending signature (`[T; 2]` holds a `;`)
    for no, raw in enumerate(lines, 1):
        m = FN.match(raw)
        if m and not state["block"]:
            pending, nest = (m.group(1), no), 0
        code = strip(raw, state)
        for c in code:
            if c in "([":
                nest += 1
            elif c in ")]":
                nest -= 1
            if c == "{":
                depth += 1
                if pending:
                    open_fns.append((pending[0], pending[1], depth))
                    pending = None
            elif c == "}":
                if open_fns and open_fns[-1][2] == depth:
                    name, start, _ = open_fns.pop()
                    found.append((name, start, no - start + 1))
                depth -= 1
            elif c == ";" and pending and nest <= 0:
                pending = None  # a declaration without a body (trait method)
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=120)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    long = sorted(
        (f"{p.relative_to(ROOT)}::{name}", n)
        for p in sorted([*(ROOT / "src").rglob("*.rs"), *(ROOT / "crates").glob("*/src/**/*.rs")])
        for name, _, n in functions(p)
        if n > a.max
    )
    if a.write:
        head = "# Functions over the bound when it came in (issue 39); split them, then drop their line.\n"
        ALLOW.write_text(head + "".join(f"{k}\n" for k, _ in long))
        print(f"wrote {len(long)} entries to {ALLOW.relative_to(ROOT)}")
        return 0
    allowed = {l.strip() for l in ALLOW.read_text().splitlines() if l.strip() and not l.startswith("#")}
    new = [(k, n) for k, n in long if k not in allowed]
    stale = sorted(allowed - {k for k, _ in long})
    print(f"{len(long)} functions over {a.max} lines ({len(long) - len(new)} allowlisted)")
    for k in stale:
        print(f"stale allowlist entry (now short or gone; remove it): {k}")
    for k, n in new:
        print(f"NEW long function: {k}: {n} lines (split it into named steps)", file=sys.stderr)
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
