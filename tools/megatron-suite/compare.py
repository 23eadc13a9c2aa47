"""compare.py <baseline_run_dir> <dropin_run_dir> [out.md]: per-test outcome from the junit_r*.xml files
anywhere under each run directory (run.sh or run-files.sh).
A test's outcome over ranks: 'failed' if any rank failed/errored, else 'skipped' if any rank skipped,
else 'passed'. Prints a per-file table of passed/failed/skipped (baseline | drop-in), regressions
(baseline passed, drop-in not), fixes, and both-pass."""
import glob
import sys
import xml.etree.ElementTree as ET
from collections import Counter

RANK = {"passed": 0, "skipped": 1, "failed": 2}


def load(run_dir):
    out, msgs = {}, {}
    for f in sorted(glob.glob(f"{run_dir}/**/junit_r*.xml", recursive=True)):
        for tc in ET.parse(f).getroot().iter("testcase"):
            tid = f"{tc.get('classname')}::{tc.get('name')}"
            st, msg = "passed", ""
            for child in tc:
                if child.tag in ("failure", "error"):
                    st, msg = "failed", (child.get("message") or "")[:300]
                elif child.tag == "skipped" and st != "failed":
                    st, msg = "skipped", (child.get("message") or "")[:200]
            if tid not in out or RANK[st] > RANK[out[tid]]:
                out[tid], msgs[tid] = st, msg
    return out, msgs


def _file(test_id):
    """The test file of a junit test id (module path up to the test class; a collection error has
    no class name and the module path as its name)."""
    classname, name = test_id.split("::", 1)
    module = classname or name
    parts = module.split(".")
    # classname is package.module.Class: drop the class (it starts with an upper-case letter)
    if parts and parts[-1][:1].isupper():
        parts = parts[:-1]
    return parts[-1] if parts else module


def main():
    b, bm = load(sys.argv[1])
    d, dm = load(sys.argv[2])
    lines = []
    p = lines.append
    p(f"baseline {sys.argv[1]}: {dict(Counter(b.values()))} ({len(b)} tests)")
    p(f"drop-in  {sys.argv[2]}: {dict(Counter(d.values()))} ({len(d)} tests)")
    p("\n| file | baseline passed / failed / skipped | drop-in passed / failed / skipped |")
    p("|---|---|---|")
    files = sorted({_file(t) for t in list(b) + list(d)})
    for f in files:
        bc = Counter(st for t, st in b.items() if _file(t) == f)
        dc = Counter(st for t, st in d.items() if _file(t) == f)
        p(f"| {f} | {bc['passed']} / {bc['failed']} / {bc['skipped']} | {dc['passed']} / {dc['failed']} / {dc['skipped']} |")
    reg = [t for t in b if b[t] == "passed" and d.get(t) != "passed"]
    fix = [t for t in d if d[t] == "passed" and b.get(t) != "passed"]
    both = [t for t in b if b[t] == "passed" and d.get(t) == "passed"]
    other = [t for t in b if t in d and b[t] != d[t] and t not in reg and t not in fix]
    sections = [
        ("Regressions (pass in baseline, not with drop-in)", reg, lambda t: f"{t}: {d.get(t)} -- {dm.get(t, '')!r}"),
        ("Pass only with drop-in", fix, lambda t: f"{t}: baseline {b.get(t)} -- {bm.get(t, '')!r}"),
        ("Other outcome changes", other, lambda t: f"{t}: {b[t]} -> {d[t]}"),
        ("Pass with both", both, str),
    ]
    for title, tests, line in sections:
        p(f"\n## {title}: {len(tests)}")
        lines.extend(f"- {line(t)}" for t in tests)
    text = "\n".join(lines)
    print(text)
    if len(sys.argv) > 3:
        open(sys.argv[3], "w").write(text + "\n")


main()
