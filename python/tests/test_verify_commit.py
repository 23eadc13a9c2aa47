"""`verify`, `status` and the load agree on a checkpoint whose commit state is not whole: a `.metadata`
that no save of the directory committed (another save's, with the same keys and shapes in another
file order: read anyway, q and k came back swapped while verify said OK), a removed `COMMITTED`
record, a removed checksum sidecar. Real saves, the real CLI, the real loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

import shardwise
import shardwise.megatron as swm
from dcp_util import tree_digest

SHARDWISE = str(Path(sys.executable).parent / "shardwise")


def sw(*args):
    return subprocess.run([SHARDWISE, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """q and k (same shape) saved in the order q, k into `qk` and k, q into `kq`: the two `.metadata`
    have the same keys and shapes and place the items at each other's offsets."""
    d = tmp_path_factory.mktemp("saves")
    gen = torch.Generator().manual_seed(0)
    tensors = {"q": torch.randn(4, 4, generator=gen), "k": torch.randn(4, 4, generator=gen)}
    for name in ("qk", "kq"):
        swm.save({n: ShardedTensor.from_rank_offsets(n, tensors[n]) for n in name}, d / name, rank=0, world_size=1)
    return d, tensors


def _copy(saves, tmp_path, *, metadata_of="qk"):
    d, _ = saves
    x = tmp_path / "x"
    shutil.copytree(d / "qk", x)
    shutil.copy(d / metadata_of / ".metadata", x / ".metadata")
    return x


def _load(x):
    req = {n: ShardedTensor.from_rank_offsets(n, torch.empty(4, 4)) for n in ("q", "k")}
    return swm.load(req, x, rank=0, world_size=1)


def _loads_right(x, tensors):
    got = _load(x)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert torch.equal(shardwise.open(x).read("q"), tensors["q"])


def test_another_saves_metadata_is_refused_by_every_load_and_verify(saves, tmp_path):
    x = _copy(saves, tmp_path, metadata_of="kq")
    status = sw("status", x)
    assert "DAMAGED: .metadata" in status.stdout and "is not the one save" in status.stdout, status.stdout
    v = sw("verify", x)
    assert v.returncode == 1, (v.stdout, v.stderr)
    assert f"PROBLEM .metadata: damaged, as `shardwise status {x}` says: .metadata (" in v.stdout, v.stdout
    assert f"`shardwise merge --repair {x}` rebuilds it" in v.stdout and not v.stdout.rstrip().endswith("OK")
    for quick in ([], ["--quick"]):
        problems = json.loads(sw("verify", "--json", *quick, x).stdout)["problems"]
        assert [p["key"] for p in problems if "is not the one save" in p["message"]] == [".metadata"], problems
    for load in (_load, shardwise.open, lambda x: shardwise.open(x).read("q")):
        with pytest.raises(shardwise.CorruptFileError) as e:
            load(x)
        msg = str(e.value)
        assert f"{x} holds a damaged checkpoint, not loaded: .metadata (" in msg, msg
        assert "is not the one save" in msg and f"`shardwise merge --repair {x}`" in msg, msg
        assert f"`shardwise status {x}`" in msg, msg
    for cmd in (["inspect", x], ["diff", x, saves[0] / "qk"]):
        r = sw(*cmd)
        assert r.returncode != 0 and "holds a damaged checkpoint" in r.stderr, (cmd, r.stdout, r.stderr)


def test_repair_rebuilds_what_loads_and_verifies(saves, tmp_path):
    x = _copy(saves, tmp_path, metadata_of="kq")
    r = sw("merge", "--repair", x)
    assert r.returncode == 0, (r.stdout, r.stderr)
    v = sw("verify", x)
    assert v.returncode == 0 and "2 items, 2 checked against save-time CRC-32s: OK" in v.stdout, v.stdout
    _loads_right(x, saves[1])


def test_a_removed_commit_record_is_not_committed_for_verify(saves, tmp_path):
    x = _copy(saves, tmp_path)
    for rec in x.glob(".shardwise/*/COMMITTED"):
        rec.unlink()
    assert "not committed (.metadata was written by a merger" in sw("status", x).stdout
    v = sw("verify", x)
    assert v.returncode == 1, (v.stdout, v.stderr)
    assert f"PROBLEM .metadata: not committed, as `shardwise status {x}` says: .metadata was written by a merger" in v.stdout
    assert v.stdout.rstrip().endswith("1 PROBLEM"), v.stdout


def test_a_removed_checksum_sidecar_is_a_problem(saves, tmp_path):
    x = _copy(saves, tmp_path)
    (sidecar,) = x.glob(".shardwise/*/checksums")
    sidecar.unlink()
    assert "committed (save" in sw("status", x).stdout
    v = sw("verify", x)
    assert v.returncode == 1, (v.stdout, v.stderr)
    rel = sidecar.relative_to(x)
    assert f"PROBLEM {rel}: missing: save {rel.parent.name} committed this .metadata with its checksum sidecar" in v.stdout
    assert "0 checked against save-time CRC-32s: 1 PROBLEM" in v.stdout, v.stdout
    # The bytes are the ones committed: loads read them, unchecked as a torch checkpoint's.
    _loads_right(x, saves[1])


def test_a_copy_without_shardwise_state_opens_as_a_torch_checkpoint(saves, tmp_path):
    x = _copy(saves, tmp_path, metadata_of="kq")
    shutil.rmtree(x / ".shardwise")
    assert sw("status", x).stdout.startswith(f"{x}: committed\n")
    v = sw("verify", x)
    assert v.returncode == 0 and "0 checked against save-time CRC-32s: OK" in v.stdout, v.stdout
    # Nothing tells another save's .metadata from the directory's own here: read as it places items.
    got = _load(x)
    assert torch.equal(got["q"], saves[1]["k"])


def test_a_whole_save_verifies_and_loads(saves, tmp_path):
    x = _copy(saves, tmp_path)
    v = sw("verify", x)
    assert v.returncode == 0 and "2 items, 2 checked against save-time CRC-32s: OK" in v.stdout, v.stdout
    _loads_right(x, saves[1])


# --- what status and merge --repair say is true (issue 44) ------------------------------------------

CLI = [sys.executable, "-m", "shardwise.cli"]


def cli(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def _two_rank_save(d, states, timeout_s=5.0):
    """Ranks 1 then 0 of one save into ``d`` (rank 0 merges); rank 0's error, or None."""
    import uuid

    sid = uuid.uuid4().hex
    swm.save(states[1], d, rank=1, world_size=2, save_id=sid, wait_for_commit=False)
    try:
        swm.save(states[0], d, rank=0, world_size=2, save_id=sid, timeout_s=timeout_s)
    except shardwise.ShardwiseError as e:
        return e
    return None


def test_status_recommends_merge_only_when_it_would_commit(tmp_path):
    """Two ranks save the same chunk: the merge fails its validation, and every part is there.
    `status` said "`shardwise merge` would commit it", and `merge` refused. Now status names the
    failure and recommends nothing, and merge still refuses, committing nothing. A save that failed
    only for a rank that published late is still recommended, and merge commits it."""
    full = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 8), replica_id=0)}
    d = tmp_path / "overlap"
    err = _two_rank_save(d, [full, full])
    assert isinstance(err, shardwise.ValidationError) and "both save the same chunk" in str(err), err
    data = {p.name: p.read_bytes() for p in d.glob("__*.distcp")}
    st = cli("status", d)
    assert st.returncode == 1 and "failed: validation failed: key w: rank 0 and rank 1 both save" in st.stdout
    assert "would commit" not in st.stdout and "shardwise merge" not in st.stdout, st.stdout
    js = json.loads(cli("status", d, "--json").stdout)
    assert js["saves"][0]["state"] == "failed" and "would commit" not in js["saves"][0]["detail"], js
    m = cli("merge", d)
    assert m.returncode == 1 and "both save the same chunk" in m.stderr and "nothing committed" in m.stderr, m.stderr
    assert not (d / ".metadata").exists() and not list(d.glob(".shardwise/*/COMMITTED"))
    assert {p.name: p.read_bytes() for p in d.glob("__*.distcp")} == data
    # The control: rank 1's part arrives after the merger gave up; status recommends merge, truly.
    d = tmp_path / "late"
    import uuid

    sid = uuid.uuid4().hex
    with pytest.raises(shardwise.MissingRanksError):
        swm.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 8), (0, 0, 2), replica_id=0)}, d,
                 rank=0, world_size=2, save_id=sid, timeout_s=0.5)
    swm.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 8), (0, 1, 2), replica_id=0)}, d,
             rank=1, world_size=2, save_id=sid, wait_for_commit=False)
    st = cli("status", d)
    assert "every rank's part is now present: `shardwise merge` would commit it" in st.stdout, st.stdout
    assert cli("merge", d).returncode == 0 and cli("verify", d).returncode == 0


def test_repair_of_a_flipped_data_byte_says_what_it_checked(saves, tmp_path):
    """A bit flipped in a data file keeps its size: the commit state is "committed" (status does not
    read data), and `merge --repair` said "committed and whole". It says now what it checked and
    that verify reads the data; verify names the item; nothing changes."""
    x = _copy(saves, tmp_path)
    item = shardwise.open(x).metadata("q")["chunks"][0]
    data = x / item["relative_path"]
    raw = bytearray(data.read_bytes())
    raw[item["offset"] + item["length"] - 8] ^= 0x10  # inside the tensor's bytes, before the zip's end records
    data.write_bytes(bytes(raw))
    before = tree_digest(x)
    r = cli("merge", "--repair", x)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "whole" not in r.stderr, r.stderr
    assert "the data's CRC-32s were not read: `shardwise verify" in r.stderr, r.stderr
    assert "every data file has at least its recorded size" in r.stderr
    v = cli("verify", x)
    assert v.returncode == 1 and "PROBLEM q" in v.stdout and "CRC-32" in v.stdout, v.stdout
    assert tree_digest(x) == before
    with pytest.raises(shardwise.CorruptFileError, match="CRC-32"):
        _load(x)
