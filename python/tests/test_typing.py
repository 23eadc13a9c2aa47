"""The typed Python surface (issue 39): ``python/shardwise`` type-checks with mypy against the shipped
stub ``_native.pyi``; the stub matches the extension module (``mypy.stubtest``); and the stub's
report ``TypedDict``s bite: a report field that does not exist, or used as the wrong type, fails
the check. The mypy settings are ``[tool.mypy]`` in pyproject.toml."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def _mypy(*args: str) -> subprocess.CompletedProcess:
    """``python -m mypy ARGS`` from the repository root with its pyproject.toml settings (the cache
    in ROOT/.mypy_cache: the first run analyses torch and megatron-core, about 20 s; later ones
    take a second)."""
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(PYPROJECT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_package_type_checks_against_the_stub():
    r = _mypy()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout, r.stdout


def test_the_stub_matches_the_extension_module():
    """Every name, signature (positional, keyword-only, defaults) and class of the built
    ``shardwise._native`` against the stub; only the stub-only report types are allow-listed."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "shardwise._native", "--mypy-config-file", str(PYPROJECT),
         "--allowlist", str(Path(__file__).with_name("stubtest_allowlist.txt"))],
        cwd=ROOT / "python", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


# Each line marked `# E: text` must fail the check with `text` in the message; no other line may.
_MISUSE = '''
import shardwise
import shardwise.dcp
import shardwise.megatron as swm

st = shardwise.status("ckpt")
st["no_such_field"]  # E: TypedDict "StatusReport" has no key "no_such_field"
n: int = st["checkpoint"]  # E: Incompatible types in assignment
st["saves"][0]["ranks"][0]["age"]  # E: TypedDict "RankStatus" has no key "age"
shardwise.diff("a", "b")["keys"][0]["max_abs"] + 1.0  # E: Unsupported operand types for + ("None" and "float")
shardwise.merge("ckpt", "id", 2, 10.0)["keys"].upper()  # E: "int" has no attribute "upper"
shardwise.to_hf("ckpt", "out")["tensor"]  # E: TypedDict "ToHfSummary" has no key "tensor"
shardwise.from_hf("hf", "ckpt")["tracker"].upper()  # E: Item "None" of "str | None" has no attribute "upper"
swm.save({}, "ckpt")["commit"]["keys"]  # E: Value of type "CommitSummary | None" is not indexable
swm.save({}, "ckpt", async_save=True)["committed"]  # E: Value of type "SaveHandle" is not indexable
swm.save_checkpoint("root", 1, {})["no_such_field"]  # E: TypedDict "CheckpointReport" has no key "no_such_field"
shardwise.dcp.finish("ckpt")["already_committed"]  # E: TypedDict "RankLocalMergeSummary" has no key
shardwise.status("ckpt", keys="yes")  # E: Argument "keys" to "status" has incompatible type "str"
shardwise.to_hf("ckpt", "out", "config.json")  # E: Too many positional arguments for "to_hf"
'''

# The same reports used as they are: no error.
_USE = '''
import shardwise
import shardwise.dcp
import shardwise.megatron as swm
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise._native import KeyDiff, StatusReport

st: StatusReport = shardwise.status("ckpt", keys=True)
committed: bool = st["checkpoint"] == "committed" and all(s["state"] == "committed" for s in st["saves"])
ages: list[float] = [r["age_s"] for s in st["saves"] for r in s["ranks"]]
d = shardwise.diff("a", "b", atol=1e-3)
worst: list[KeyDiff] = [k for k in d["keys"] if k["status"] != "equal"]
exit_code: int = d["exit_code"]
rep = swm.save({}, "ckpt", rank=0, world_size=1)
commit = rep["commit"]
keys: int = commit["keys"] if commit is not None else 0
handle = swm.save({}, "ckpt", async_save=True)
later: float = handle.wait(60)["write_s"]
ck = swm.save_checkpoint("root", 1, {})
deleted: list[str] = ck.get("deleted", [])
md = shardwise.open("ckpt").metadata("w")
if md["kind"] == "tensor":
    shape: list[int] = md["global_shape"]
merged: int = shardwise.dcp.finish("ckpt")["ranks"]
gb: float = shardwise.to_hf("ckpt", "out", workers=2)["gb_per_s"] + shardwise.from_hf("hf", "ckpt")["gb_per_s"]
'''


def _check(tmp_path, name: str, source: str) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    expected = {i: m.group(1) for i, line in enumerate(source.splitlines(), start=1)
                if (m := re.search(r"# E: (.*)$", line))}
    return _mypy(str(path)), expected


def test_misused_reports_fail_the_check(tmp_path):
    r, expected = _check(tmp_path, "misuse.py", _MISUSE)
    assert r.returncode == 1, r.stdout + r.stderr
    errors: dict[int, list[str]] = {}
    for m in re.finditer(r"misuse\.py:(\d+): error: (.*)$", r.stdout, re.M):
        errors.setdefault(int(m.group(1)), []).append(m.group(2))
    for line, text in expected.items():
        assert any(text in e for e in errors.get(line, [])), (line, text, r.stdout)
    assert set(errors) == set(expected), r.stdout


def test_reports_used_as_documented_pass_the_check(tmp_path):
    r, _ = _check(tmp_path, "use.py", _USE)
    assert r.returncode == 0, r.stdout + r.stderr
