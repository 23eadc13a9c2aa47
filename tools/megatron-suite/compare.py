"""compare.py <baseline_run_dir> <dropin_run_dir> [out.md]: per-test outcome from the junit_r*.xml files
anywhere under each run directory (run.sh or run-files.sh).
A test's outcome over ranks: 'failed' if any rank failed/errored, else 'skipped' if any rank skipped,
else 'passed'. Prints counts, regressions (baseline passed, drop-in not), fixes, and both-pass."""
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


def main():
    b, bm = load(sys.argv[1])
    d, dm = load(sys.argv[2])
    lines = []
    p = lines.append
    p(f"baseline {sys.argv[1]}: {dict(Counter(b.values()))} ({len(b)} tests)")
    p(f"drop-in  {sys.argv[2]}: {dict(Counter(d.values()))} ({len(d)} tests)")
    reg = [t for t in b if b[t] == "passed" and d.get(t) != "passed"]
    fix = [t for t in d if d[t] == "passed" and b.get(t) != "passed"]
    both = [t for t in b if b[t] == "passed" and d.get(t) == "passed"]
    other = [t for t in b if t in d and b[t] != d[t] and t not in reg and t not in fix]
    p(f"\n## Regressions (pass in baseline, not with drop-in): {len(reg)}")
    for t in reg:
        p(f"- {t}: {d.get(t)} -- {dm.get(t, '')!r}")
    p(f"\n## Pass only with drop-in: {len(fix)}")
    for t in fix:
        p(f"- {t}: baseline {b.get(t)} -- {bm.get(t, '')!r}")
    p(f"\n## Other outcome changes: {len(other)}")
    for t in other:
        p(f"- {t}: {b[t]} -> {d[t]}")
    p(f"\n## Pass with both: {len(both)}")
    for t in both:
        p(f"- {t}")
    text = "\n".join(lines)
    print(text)
    if len(sys.argv) > 3:
        open(sys.argv[3], "w").write(text + "\n")


main()
