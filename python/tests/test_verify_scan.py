"""`shardwise verify` tells the truth about what a load would do (issue 36 item 5).

- It scans every pickle torch or Megatron unpickles on load (`.metadata`, each item's `data.pkl`,
  `common.pt`'s) for globals outside the classes a checkpoint holds, and fails naming them, without
  running anything. The premise is proved: plain torch loads of the same files do run the payload.
- Every golden fixture and a fresh shardwise save still verify clean.
- `verify`, `status` and `merge --repair` agree on damage, and `status` recommends only what works.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import shardwise
from dcp_util import FIXTURES, golden, row_shard, save_ranks, tree_digest

CLI = [sys.executable, "-m", "shardwise.cli"]
GOLDEN = golden()


def cli(*args, timeout=60):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout)


class Payload:
    """What an attacker pickles: a reduce to `os.system` (`posix.system` on Linux) that creates
    `marker` when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def python(code: str):
    """Runs `code` in a fresh interpreter (an unpickled payload runs there, not in the tests)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def hostile_metadata(d: Path, marker: Path):
    """`.metadata` as torch wrote it, with `planner_data` replaced by the payload, pickled by
    `pickle.dump` as torch's `FileSystemWriter.finish` does."""
    md = FileSystemReader(str(d)).read_metadata()
    md.planner_data = {"x": Payload(marker)}
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def hostile_common(d: Path, marker: Path):
    """`common.pt` with the payload beside its real content, saved by torch.save as Megatron does."""
    common = torch.load(d / "common.pt", weights_only=False)
    common["evil"] = Payload(marker)
    torch.save(common, d / "common.pt")


def hostile_item(d: Path, marker: Path):
    """A torch DCP save whose byte object is the payload (DCP's planner torch.saves it)."""
    dcp.save({"w": torch.arange(6.0), "obj": Payload(marker)}, checkpoint_id=str(d), no_dist=True)


CASES = {
    # what is made, how, the global named, and a torch load of it that runs the payload
    ".metadata": (
        lambda d, m: (shutil.copytree(FIXTURES / "dcp" / "torch-2.15.0", d), hostile_metadata(d, m)),
        ".metadata",
        "import torch, torch.distributed.checkpoint as dcp; "
        "dcp.load({'w': torch.zeros(1)}, checkpoint_id=DIR, no_dist=True)",
    ),
    "common.pt": (
        lambda d, m: (shutil.copytree(FIXTURES / "megatron" / "core-0.16.1_torch-2.15", d), hostile_common(d, m)),
        "common.pt",
        "import torch; torch.load(DIR + '/common.pt', weights_only=False)",
    ),
    "byte object": (
        hostile_item,
        "obj",
        "import torch, torch.distributed.checkpoint as dcp; "
        "dcp.load({'obj': None}, checkpoint_id=DIR, no_dist=True)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_names_a_global_a_load_would_run_and_runs_nothing(tmp_path, case):
    make, where, load = CASES[case]
    marker = tmp_path / "executed"
    d = tmp_path / "ckpt"
    make(d, marker)
    assert not marker.exists(), "making the checkpoint ran nothing"
    before = tree_digest(d)

    t0 = time.monotonic()
    v = cli("verify", d)
    assert time.monotonic() - t0 < 10, "bounded time"
    assert v.returncode == 1, v.stdout + v.stderr
    lines = [line for line in (v.stdout + v.stderr).splitlines() if "posix.system" in line]
    assert len(lines) == 1 and where in (v.stdout + v.stderr), v.stdout + v.stderr
    # --quick reads every pickle a load runs too (no payload): the same verdict.
    assert cli("verify", "--quick", d).returncode == 1
    # The Python API opens and reads it as data.
    r = shardwise.open(d)
    for k in r.keys():
        r.read(k) if r.metadata(k)["kind"] == "tensor" else r.read_bytes(k)
    assert not marker.exists(), "shardwise ran the payload"
    assert tree_digest(d) == before, "an input byte changed"

    # The premise: plain torch runs it, so the test above is not vacuous.
    run = python(load.replace("DIR", repr(str(d))))
    assert marker.exists(), f"torch did not run the payload: {run.stderr[-2000:]}"


@pytest.mark.parametrize("ckpt", GOLDEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_fixtures_verify_clean(ckpt):
    v = cli("verify", ckpt)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_fresh_shardwise_save_verifies_clean(tmp_path):
    d = tmp_path / "ckpt"
    save_ranks(str(d), [{"w": row_shard("w", r, 2), **({"iteration": 7} if r == 0 else {})} for r in range(2)])
    v = cli("verify", d)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A committed 2-rank Megatron save (data files, common.pt, metadata.json, parts)."""
    d = tmp_path_factory.mktemp("agree") / "ckpt"
    save_ranks(str(d), [{"w": row_shard("w", r, 2), **({"iteration": 7} if r == 0 else {})} for r in range(2)])
    return d


def checkpoint_digest(c: Path) -> dict:
    """sha256 of the checkpoint's files and commit records (a refused merge may leave a FAILED
    marker for its save: a record of the attempt, not a change to the checkpoint)."""
    return {k: v for k, v in tree_digest(c).items() if not k.endswith("FAILED")}


def drop_commit_record(c: Path):
    (record,) = c.glob(".shardwise/*/COMMITTED")
    record.unlink()


DAMAGE = {
    # bytes appended to a committed data file: every item reads as committed
    "data file grown": lambda c: open(c / "__0_0.distcp", "ab").write(b"\0" * 4096),
    "data file truncated": lambda c: os.truncate(c / "__0_0.distcp", 100),
    "data file missing": lambda c: (c / "__1_0.distcp").unlink(),
    "common.pt replaced": lambda c: (c / "common.pt").write_bytes(b"not the committed common state"),
    "metadata.json removed": lambda c: (c / "metadata.json").unlink(),
    ".metadata random": lambda c: (c / ".metadata").write_bytes(os.urandom(4096)),
    ".metadata removed, data file truncated": lambda c: ((c / ".metadata").unlink(), os.truncate(c / "__1_0.distcp", 10)),
    "commit unfinished": drop_commit_record,
    "commit unfinished, data file grown": lambda c: (drop_commit_record(c), open(c / "__0_0.distcp", "ab").write(b"\0")),
}
DAMAGED = {"data file truncated", "data file missing", "common.pt replaced", "metadata.json removed", ".metadata random", ".metadata removed, data file truncated"}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_verify_status_and_repair_agree_and_status_recommends_only_what_succeeds(committed, tmp_path, damage):
    c = tmp_path / "ckpt"
    shutil.copytree(committed, c)
    want = torch.cat([row_shard("w", r, 2).data for r in range(2)])
    DAMAGE[damage](c)

    st = cli("status", c)
    state = json.loads(cli("status", c, "--json").stdout)["checkpoint"]
    assert state == ("damaged" if damage in DAMAGED else "not_committed" if "unfinished" in damage else "committed"), st.stdout
    if state != "not_committed":
        # verify reads every item as a loader would: it fails exactly when status says damaged
        v = cli("verify", c)
        assert (v.returncode != 0) == (state == "damaged"), v.stdout + st.stdout
    if state == "committed":
        assert torch.equal(shardwise.open(c).read("w"), want)

    # Each command status recommends succeeds; one it does not recommend changes nothing.
    first = st.stdout.splitlines()[0]
    for cmd, recommended in (("merge --repair", "`shardwise merge --repair" in first), ("merge", "`shardwise merge`" in first)):
        before = checkpoint_digest(c)
        r = cli(*cmd.split(), c)
        if recommended:
            assert r.returncode == 0, first + r.stderr
            assert json.loads(cli("status", c, "--json").stdout)["checkpoint"] == "committed"
            assert cli("verify", c).returncode == 0
            assert torch.equal(shardwise.open(c).read("w"), want)
            break
        if state != "committed" or cmd == "merge --repair":
            assert r.returncode != 0, f"{cmd} succeeded but status did not recommend it: {first}"
            assert checkpoint_digest(c) == before, f"a refused {cmd} changed the checkpoint"
    else:
        assert damage in {"data file grown"} | {d for d in DAMAGED if "truncated" in d or "missing" in d or "common.pt" in d} | {
            "commit unfinished, data file grown"
        }, f"status recommends nothing for a {damage} that a command could fix: {first}"


def test_what_torch_and_megatron_allow_in_a_torch_save_verifies_clean(tmp_path):
    """The allow-list for torch.save pickles holds every global of torch's weights_only allow-list
    and of megatron-core's SAFE_GLOBALS, as the installed versions name them; one more is refused."""
    import zipfile

    import torch._weights_only_unpickler as wo
    from megatron.core.safe_globals import SAFE_GLOBALS

    names = set(wo._get_allowed_globals()) | {f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS}

    def common_with(globals_):
        body = b"".join(f"c{g.rsplit('.', 1)[0]}\n{g.rsplit('.', 1)[1]}\n".encode() for g in sorted(globals_))
        d = tmp_path / f"ckpt{len(globals_)}"
        shutil.copytree(FIXTURES / "megatron" / "core-0.16.1_torch-2.15", d)
        with zipfile.ZipFile(d / "common.pt", "w", zipfile.ZIP_STORED) as z:
            z.writestr("common/data.pkl", b"\x80\x02(" + body + b"t.")
            z.writestr("common/version", b"3\n")
        return d

    v = cli("verify", common_with(names))
    assert v.returncode == 0, v.stdout + v.stderr
    v = cli("verify", common_with(names | {"torch.load"}))
    assert v.returncode == 1 and "torch.load" in v.stdout + v.stderr, v.stdout + v.stderr


def test_status_recommends_merging_the_save_an_overwrite_crash_left_half_committed(committed, tmp_path):
    """`overwrite=True` renames its staged common.pt into place, then its .metadata: a crash between
    the two leaves the old commit damaged and its parts unable to rebuild it (common.pt changed),
    while the new save's parts are whole. status names `merge --save-id NEW`, which commits it."""
    import shardwise.megatron as swm

    c = tmp_path / "ckpt"
    shutil.copytree(committed, c)
    new = uuid.uuid4().hex
    for r in (1, 0):
        state = {"w": row_shard("w", r, 2), **({"iteration": 8} if r == 0 else {})}
        swm.save(state, str(c), rank=r, world_size=2, save_id=new, overwrite=True, merge_rank=None, wait_for_commit=False)
    os.rename(c / ".shardwise" / new / "common.pt", c / "common.pt")  # the crash window

    first = cli("status", c).stdout.splitlines()[0]
    assert "DAMAGED" in first and f"`shardwise merge --save-id {new}`" in first and "--repair" not in first, first
    assert cli("verify", c).returncode == 1
    before = checkpoint_digest(c)
    assert cli("merge", "--repair", c).returncode == 1 and checkpoint_digest(c) == before
    assert cli("merge", "--save-id", new, c).returncode == 0
    assert json.loads(cli("status", c, "--json").stdout)["checkpoint"] == "committed"
    assert cli("verify", c).returncode == 0
