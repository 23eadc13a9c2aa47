"""Differential fuzzer: shardwise's torch.save reader against torch's own, on the same bytes.

shardwise's side is ``examples/archive_view.rs`` (``shardwise::fuzzing::archive_view``: the
archive as ``format::archive`` resolves it, the tensor it decodes, the globals ``verify`` finds);
torch's side is torch_reader_oracle.py, run by torch 2.15 (this venv) and torch 2.3.1 (the side
venv ``.venv/torch231``, when present). Archives come from torch_reader_gen.py. The one rule
(:func:`compare`): wherever shardwise accepts an archive, torch must open it as a zip, list the same
records, read the same bytes for every record it reads by name, load the same tensor (dtype, shape,
strides, offset, storage bytes) and import no global shardwise did not see; and where shardwise's
``verify`` finds nothing wrong, torch's ``weights_only=False`` load must succeed. Anything else is
a FAIL. Where shardwise refuses and torch reads, the difference is conservative (counted, never a
wrong read).

    python torch_reader_diff.py run --seconds 3600 --corpus fuzz/corpus/torch_reader
    python torch_reader_diff.py replay fuzz/corpus/torch_reader

``run`` keeps one archive per new outcome (and every FAIL) in the corpus; ``replay`` checks a
corpus. test_torch_reader_diff.py replays the committed corpus in ``make test``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ORACLE = HERE / "torch_reader_oracle.py"
# The side venv the Makefile installs (`.venv/torch231`), as test_torch231.py finds it.
TORCH231 = Path(sys.prefix) / "torch231" / "bin" / "python"


def shardwise_binary() -> Path:
    """Builds (a no-op when current) and returns the archive_view example; ``SHARDWISE_ARCHIVE_VIEW``
    names a prebuilt one instead (a long run from a frozen copy)."""
    if os.environ.get("SHARDWISE_ARCHIVE_VIEW"):
        return Path(os.environ["SHARDWISE_ARCHIVE_VIEW"])
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "--example", "archive_view"],
        cwd=ROOT,
        check=True,
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "examples" / "archive_view"


def _lines(cmd: list[str]) -> dict[str, dict]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    views = {}
    for line in out.stdout.splitlines():
        rec = json.loads(line)
        views[rec["file"]] = rec["view"]
    return views


def shardwise_views(directory: Path, binary: Path) -> dict[str, dict]:
    return _lines([str(binary), str(directory)])


def torch_views(directory: Path, python: str) -> dict[str, dict]:
    """The oracle's view of every file; a file on which torch's reader kills the process (a
    crash is torch refusing, loudly) is named by rerunning the rest one file at a time."""
    env = {**os.environ, "PYTHONPATH": str(HERE), "PYTHONWARNINGS": "ignore"}

    def views(path: Path) -> tuple[dict, subprocess.CompletedProcess]:
        out = subprocess.run([python, str(ORACLE), str(path)], capture_output=True, text=True, env=env, timeout=3600)
        return {json.loads(line)["file"]: json.loads(line)["view"] for line in out.stdout.splitlines()}, out

    found, out = views(directory)
    if out.returncode == 0:
        return found
    for f in sorted(p.name for p in directory.iterdir() if p.name not in found):
        with tempfile.TemporaryDirectory() as one:
            os.link(directory / f, Path(one) / f)
            got, single = views(Path(one))
        if single.returncode != 0 and f not in got:
            if "can't open file" in single.stderr:
                raise RuntimeError(single.stderr)
            got[f] = {"crash": single.returncode, "stderr": single.stderr[-300:]}
        found.update(got)
    return found


def oracles() -> list[str]:
    """The torch interpreters to compare with: this one, and torch 2.3.1's when set up."""
    found = [sys.executable]
    if TORCH231.exists():
        found.append(str(TORCH231))
    return found


def _torch_reads_it(t: dict) -> bool:
    if t.get("legacy") or "crash" in t or "open_error" in t or "names_error" in t or t.get("torchscript"):
        return False
    return "error" not in t.get("tensor", {"error": 1}) or "error" not in t.get("object", {"error": 1})


def compare(sw: dict, t: dict) -> tuple[str, str]:
    """("agree" | "conservative" | "FAIL", why) for shardwise's view ``sw`` and torch's ``t``."""
    if "error" in sw:
        return ("conservative", sw["error"]) if _torch_reads_it(t) else ("agree", "both refuse")
    if t.get("legacy"):
        return "FAIL", "shardwise reads a zip; torch.load unpickles the file's start (not PK\\3\\4)"
    for k in ("crash", "open_error", "names_error"):
        if k in t:
            return "FAIL", f"shardwise reads it; torch's reader fails: {t[k]}"
    if t.get("torchscript"):
        return "FAIL", "shardwise reads it; torch.load runs it as TorchScript"
    folder = sw["folder"]
    names = [n[len(folder):] for n in sw["names"]]
    torch_names = [n for n in t["names"]]
    if names != torch_names:
        return "FAIL", f"records differ: shardwise {names}, torch {torch_names}"
    for name, got in sw["records"].items():
        if t["records"].get(name) != got:
            return "FAIL", f"record {name}: shardwise reads {str(got)[:40]}, torch {str(t['records'].get(name))[:40]}"
    if "error" not in sw["tensor"] and t["tensor"] != sw["tensor"]:
        return "FAIL", f"tensor: shardwise {str(sw['tensor'])[:200]}, torch {str(t['tensor'])[:200]}"
    g = sw["globals"]
    if g is None:  # no data.pkl: verify reports it, and torch.load fails
        return "agree", "same records; no pickle"
    ours = {re.sub(r"^torch\.tensor\.", "torch._tensor.", x) for x in g["imported"]}
    unseen = set(t["object"]["imported"]) - ours
    if unseen:
        return "FAIL", f"torch imports {sorted(unseen)}, which shardwise's scan does not see"
    if g["error"] is None and not g["refused"] and g["storage_error"] is None and "error" in t["object"]:
        return "FAIL", f"verify finds nothing wrong, torch.load(weights_only=False) fails: {t['object']['error']}"
    return "agree", "same reads"


def signature(sw: dict, verdicts: list[tuple[str, str]]) -> str:
    """An outcome class: which side refuses and why (numbers and names blurred)."""
    why = sw.get("error") or ("tensor" if "error" not in sw["tensor"] else "object")
    why = re.sub(r"[0-9]+", "N", why)
    why = re.sub(r"\S*/\S*", "R", why)
    return "|".join([why[:80]] + [v for v, _ in verdicts])


def check_dir(directory: Path, binary: Path) -> list[tuple[str, str, list[tuple[str, str]], dict]]:
    """(file, torch version label, verdicts per oracle, shardwise view) for every file."""
    sw = shardwise_views(directory, binary)
    per_oracle = [(py, torch_views(directory, py)) for py in oracles()]
    out = []
    for f, view in sorted(sw.items()):
        verdicts = [compare(view, tv[f]) for _, tv in per_oracle]
        out.append((f, verdicts, view))
    return out


def generate_into(directory: Path, rng: random.Random, n: int) -> dict:
    """Writes ``n`` generated archives into ``directory``; returns them by file name."""
    import torch_reader_gen as gen

    cases = {}
    for i in range(n):
        case = gen.generate(rng)
        name = f"{i:05d}-{case.kind}-{'+'.join(case.mutations)}.bin"[:120]
        (directory / name).write_bytes(case.data)
        cases[name] = case
    return cases


def run(seconds: float, seed: int, corpus: Path | None, batch: int) -> Counter:
    rng = random.Random(seed)
    binary = shardwise_binary()
    seen: set[str] = set()
    if corpus:
        corpus.mkdir(parents=True, exist_ok=True)
    stats: Counter = Counter()
    fails = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        with tempfile.TemporaryDirectory() as tmp:
            cases = generate_into(Path(tmp), rng, batch)
            for f, verdicts, view in check_dir(Path(tmp), binary):
                for v, _ in verdicts:
                    stats[v] += 1
                stats["cases"] += 1
                sig = signature(view, verdicts)
                failed = any(v == "FAIL" for v, _ in verdicts)
                if failed:
                    fails.append((f, verdicts))
                if corpus and (failed or sig not in seen):
                    seen.add(sig)
                    data = cases[f].data
                    digest = hashlib.sha1(data).hexdigest()[:12]
                    (corpus / f"{digest}.bin").write_bytes(data)
        print(f"{time.monotonic() - t0:7.0f} s {dict(stats)} corpus {len(seen)}", flush=True)
    for f, verdicts in fails[:50]:
        print("FAIL", f, verdicts)
    stats["kept"] = len(seen)
    return stats


def replay(directory: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """The FAILs of a corpus (empty when shardwise and every torch agree)."""
    results = check_dir(directory, shardwise_binary())
    return [(f, v) for f, v, _ in results if any(x == "FAIL" for x, _ in v)]


def main() -> None:
    sys.path.insert(0, str(HERE))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seconds", type=float, default=60)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch", type=int, default=400)
    r.add_argument("--corpus", type=Path)
    q = sub.add_parser("replay")
    q.add_argument("corpus", type=Path)
    a = p.parse_args()
    if a.cmd == "run":
        stats = run(a.seconds, a.seed, a.corpus, a.batch)
        print(json.dumps(dict(stats)))
        sys.exit(1 if stats["FAIL"] else 0)
    fails = replay(a.corpus)
    for f, v in fails:
        print("FAIL", f, v)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
