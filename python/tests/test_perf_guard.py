"""Regression guard for save speed (issue 7): the quick mode of python/benchmarks/compare_save.py.

Two gloo ranks save the same 69 MB Megatron GPT (TP=2) with shardwise and with torch DCP
(FileSystemWriter), interleaved, medians of 2 after a warm-up. It fails only on a gross regression:
shardwise slower than torch DCP on the same data (normally DCP takes several times longer here), or
shardwise more than 5x slower than a raw write of the same bytes. A failing first attempt is
measured once more before failing, because a shared machine's disk can stall for a second.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import compare_save  # noqa: E402


def _verdict(tmp_path, attempt):
    report = compare_save.main(["--quick", "--dir", str(tmp_path / f"a{attempt}")])
    r = report["big"]["results"]
    sw, dcp, raw = (r[m]["median_s"] for m in ("shardwise", "dcp", "raw"))
    problems = []
    if sw >= dcp:
        problems.append(f"shardwise {sw:.3f} s is not faster than torch DCP {dcp:.3f} s")
    if sw > 5 * raw + 0.5:
        problems.append(f"shardwise {sw:.3f} s is more than 5x the raw write {raw:.3f} s")
    return problems, (sw, dcp, raw)


def test_shardwise_not_grossly_slower(tmp_path):
    problems, times = _verdict(tmp_path, 0)
    if problems:
        problems, times = _verdict(tmp_path, 1)
    assert not problems, "; ".join(problems)
    print("quick comparison (shardwise, dcp, raw) seconds:", times)
