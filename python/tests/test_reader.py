"""shardwise.open and the inspect / verify / status / merge commands, on our checkpoints and on
damaged copies of them (damage made with real torch: its own classes re-pickled)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import shardwise
from dcp_util import bits, read_all, row_shard, save_ranks

CLI = [sys.executable, "-m", "shardwise.cli"]


def cli(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture()
def ckpt(tmp_path):
    """A 2-rank shardwise checkpoint: w float32 (8, 8) in two row chunks, b bfloat16 (8,), an object."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    states = [
        {"w": row_shard("w", r, 2), "b": row_shard("b", 0, 1, rows=8, cols=1, dtype=torch.bfloat16, replica_id=r)}
        for r in range(2)
    ]
    states[0]["o"] = ShardedObject("o", {"lr": 0.5}, (1,), (0,), replica_id=0)
    d = tmp_path / "ckpt"
    save_ranks(str(d), states)
    return d


def test_reader_matches_plain_dcp_including_slices(tp2dp2):
    base, _ = tp2dp2
    d = base / "shardwise"
    full, _ = read_all(str(d))
    r = shardwise.open(d)
    tensor_keys = [k for k in r.keys() if r.metadata(k)["kind"] == "tensor"]
    assert sorted(tensor_keys) == sorted(full)
    g = torch.Generator().manual_seed(0)
    for k in tensor_keys:
        t = r.read(k)
        assert t.dtype == full[k].dtype and t.shape == full[k].shape and torch.equal(bits(t), bits(full[k])), k
        if t.dim() >= 2:
            lo = [int(torch.randint(0, n, (1,), generator=g)) for n in t.shape]
            index = (lo[0], slice(lo[1], None))
            assert torch.equal(r.read(k, index), full[k][index]), k


def test_reader_objects_and_errors(ckpt):
    r = shardwise.open(ckpt)
    assert r.keys() == ["b", "o/shard_0_1", "w"]
    assert r.metadata("w")["global_shape"] == [8, 8] and len(r.metadata("w")["chunks"]) == 2
    assert r.read("w", (slice(2, 6), 3)).tolist() == [2 * 8 + 3, 3 * 8 + 3, 1000 + 3, 1000 + 8 + 3]
    raw = r.read_bytes("o/shard_0_1")
    assert raw[:2] == b"PK" and torch.load(__import__("io").BytesIO(raw), weights_only=False) == [{"lr": 0.5}]
    with pytest.raises(IndexError):
        r.read("w", (8,))
    with pytest.raises(shardwise.MissingKeyError, match='no key "nope"'):
        r.read("nope")
    with pytest.raises(shardwise.ShardwiseError):
        shardwise.open(ckpt / "missing")


def test_cli_inspect_verify_status(ckpt):
    out = cli("inspect", ckpt)
    assert out.returncode == 0 and "w" in out.stdout and "2 tensors, 1 object," in out.stdout
    info = json.loads(cli("inspect", ckpt, "--json").stdout)
    assert {k["key"]: k["chunks"] for k in info["keys"]} == {"b": 1, "o/shard_0_1": 1, "w": 2}
    out = cli("verify", ckpt)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 items, 4 checked against save-time CRC-32s: OK" in out.stdout
    st = json.loads(cli("status", ckpt, "--json").stdout)
    assert st["checkpoint"] == "committed" and st["saves"][0]["state"] == "committed"
    assert cli("frobnicate", ckpt).returncode == 2


def _rewrite_metadata(d: Path, mutate):
    md = FileSystemReader(str(d)).read_metadata()
    mutate(md)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _verify_problems(d: Path) -> str:
    out = cli("verify", d)
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout


def test_verify_flipped_payload_byte(ckpt):
    md = FileSystemReader(str(ckpt)).read_metadata()
    item = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    data = ckpt / item.relative_path
    raw = bytearray(data.read_bytes())
    raw[item.offset + item.length // 2] ^= 0x40  # inside the payload of one w chunk
    data.write_bytes(bytes(raw))
    out = _verify_problems(ckpt)
    assert "PROBLEM w [" in out and "CRC-32" in out


def test_verify_truncated_file(ckpt):
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    out = _verify_problems(ckpt)
    assert "passes the end of the file" in out


def test_verify_missing_chunk(ckpt):
    _rewrite_metadata(ckpt, lambda md: md.state_dict_metadata["w"].chunks.pop())
    assert "coverage gap" in _verify_problems(ckpt)


def test_verify_and_reader_refuse_paths_out_of_the_directory(ckpt):
    secret = ckpt.parent / "outside.distcp"
    shutil.copy(ckpt / "__0_0.distcp", secret)

    def escape(md):
        for v in md.storage_data.values():
            v.relative_path = "../outside.distcp"

    _rewrite_metadata(ckpt, escape)
    # Refused while .metadata is decoded: verify cannot open it, and says why.
    out = cli("verify", ckpt)
    assert out.returncode == 1 and "leaves the checkpoint directory" in out.stderr, out.stdout + out.stderr
    with pytest.raises(shardwise.CorruptFileError, match="leaves the checkpoint directory"):
        shardwise.open(ckpt).read("w")


def test_verify_overlapping_chunk(ckpt):
    def overlap(md):
        c = md.state_dict_metadata["w"].chunks[1]
        c.sizes = torch.Size([5, 8])  # rows 4..9 of 8: out of bounds and overlapping
        c.offsets = torch.Size([3, 0])

    _rewrite_metadata(ckpt, overlap)
    out = _verify_problems(ckpt)
    assert "PROBLEM w" in out


def test_verify_dtype_mismatch(ckpt):
    _rewrite_metadata(ckpt, lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", torch.bfloat16))
    assert "item holds float32 but .metadata says bfloat16" in _verify_problems(ckpt)


def test_status_names_missing_ranks_and_merge_races_commit_once(tmp_path):
    d = tmp_path / "c"
    sid = uuid.uuid4().hex
    import shardwise.megatron as swm

    for r in (0, 1):
        swm.save({"w": row_shard("w", r, 3)}, str(d), rank=r, world_size=3, save_id=sid, merge_rank=None)
    out = cli("status", d)
    assert f"save {sid}: not committed; 2 of 3 rank parts" in out.stdout and "missing ranks: [2]" in out.stdout
    assert "s old" in out.stdout
    swm.save({"w": row_shard("w", 2, 3)}, str(d), rank=2, world_size=3, save_id=sid, merge_rank=None)
    results, errors = [], []

    def merger():
        try:
            results.append(shardwise.merge(str(d), sid, 3, 10.0))
        except shardwise.ShardwiseError as e:
            errors.append(e)

    threads = [threading.Thread(target=merger) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(r["already_committed"] for r in results) == [False, True, True, True], "exactly one merger commits"
    assert [r["keys"] for r in results if not r["already_committed"]] == [1]
    assert cli("merge", d).returncode == 0  # idempotent
    assert cli("verify", d).returncode == 0


def test_a_large_torch_metadata_decoded_in_parts_equals_torchs_own_read(tmp_path):
    """A `.metadata` of 8 MiB or more is decoded in parts on every core (issue 27): 60 keys x 1,000
    chunks made with torch's own classes, each rank's plan items and write results through a pickle
    round trip as `gather_object` gives them, pickled as `FileSystemWriter.finish` does
    (python/benchmarks/metadata_parse.py). Every key's chunks and their storage (file, offset,
    length) must equal what torch's `pickle.load` of the same file gives."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from metadata_parse import make

    out = tmp_path / "md"
    make("grid", str(out), 60, 1000)
    assert (out / ".metadata").stat().st_size >= 8 << 20  # read_metadata's SPLIT_MIN_INPUT
    with open(out / ".metadata", "rb") as f:
        md = pickle.load(f)  # made just above by torch: trusted
    storage = {(k.fqn, tuple(k.offset)): v for k, v in md.storage_data.items()}
    ck = shardwise._native.open_checkpoint(str(out))
    assert sorted(ck.keys()) == sorted(md.state_dict_metadata)
    for fqn, tmd in md.state_dict_metadata.items():
        got = ck.metadata(fqn)
        assert got["global_shape"] == list(tmd.size)
        want = []
        for c in tmd.chunks:
            s = storage[(fqn, tuple(c.offsets))]
            want.append((list(c.offsets), list(c.sizes), s.relative_path, s.offset, s.length))
        assert [(c["offsets"], c["sizes"], c["relative_path"], c["offset"], c["length"]) for c in got["chunks"]] == want, fqn
