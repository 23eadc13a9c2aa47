"""Archives that torch reads differently from a naive zip reader (issue 44, part 1): shardwise reads
every torch.save archive as torch's reader does, and refuses what torch would read differently or
run. Each case is a checkpoint whose files were crafted as an attacker or a buggy writer leaves
them; each test runs the real loads (torch DCP, Megatron's dist_checkpointing, torch.load of
common.pt) to show what they do with the same files, then asserts that ``shardwise verify``
(CLI, ``--quick`` too) and shardwise's loads refuse, naming the record or global; that nothing is
written; and that the files are unchanged.

The payload is ``fuzz_marker.touch_file(path)``: a load that runs it leaves the file behind.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import shardwise
from dcp_util import _load, tree_digest
from mcore import spawn
from torch_reader_gen import FOLDER, Rec, build, torch_item

CLI = [sys.executable, "-m", "shardwise.cli"]
# The key Megatron stores ShardedObject("obj", value, (1,), (0,)) under.
OBJ = "obj/shard_0_1"


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import fuzz_marker

        return (fuzz_marker.touch_file, (self.path,))


def object_archive(pickles: list[tuple[bytes, bytes]]) -> bytes:
    """A torch.save-shaped archive whose pickles are ``pickles`` [(name under the folder, pickle)],
    in that order, before byteorder/version."""
    recs = [Rec(FOLDER + n, p) for n, p in pickles]
    recs += [Rec(FOLDER + b"byteorder", b"little"), Rec(FOLDER + b"version", b"3\n"), Rec(FOLDER + b".data/serialization_id", b"0" * 40)]
    return build(recs)


def tensor_archive(t: torch.Tensor, twin: bytes | None = None) -> bytes:
    """torch.save(t)'s records; with ``twin``, a record ``DATA/0`` holding ``twin`` after ``data/0``."""
    rec = torch_item(t)
    recs = [Rec(FOLDER + n.encode(), rec[n]) for n in ["data.pkl", "byteorder", "data/0"]]
    if twin is not None:
        recs.append(Rec(FOLDER + b"DATA/0", twin))
    recs += [Rec(FOLDER + n.encode(), rec[n]) for n in ["version", ".data/serialization_id"]]
    return build(recs)


def write_checkpoint(d: Path, tensors: dict[str, tuple[torch.Tensor, bytes]], objects: dict[str, bytes], megatron=True) -> None:
    """A one-file DCP checkpoint written the way torch's FileSystemWriter lays it out, with each
    item's bytes given; with ``megatron``, Megatron's metadata.json and an empty common.pt."""
    d.mkdir()
    data, md, storage = bytearray(), {}, {}
    for key, (t, blob) in tensors.items():
        zeros = torch.Size([0] * t.dim())
        md[key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, [ChunkStorageMetadata(zeros, t.shape)])
        storage[MetadataIndex(key, zeros)] = _StorageInfo("__0_0.distcp", len(data), len(blob))
        data += blob
    for key, blob in objects.items():
        md[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", len(data), len(blob))
        data += blob
    (d / "__0_0.distcp").write_bytes(bytes(data))
    with open(d / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=md, storage_data=storage), f)
    if megatron:
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}))
        torch.save({}, d / "common.pt")


def verify(d: Path, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "verify", *flags, str(d)], capture_output=True, text=True, timeout=120)


def dcp_objects(d: Path) -> dict:
    """torch DCP's own load of every byte object (torch.load(weights_only=False) of each item)."""
    md = FileSystemReader(str(d)).read_metadata()
    sd = {k: io.BytesIO() for k, m in md.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    _load(sd, FileSystemReader(str(d)))
    return sd


def dcp_tensor(d: Path, key: str, like: torch.Tensor) -> torch.Tensor:
    sd = {key: torch.zeros_like(like)}
    _load(sd, FileSystemReader(str(d)))
    return sd[key]


def assert_refused(d: Path, *needles: str) -> None:
    """verify (full and --quick) exits 1 naming every needle; shardwise's own read refuses too."""
    for flags in ((), ("--quick",)):
        out = verify(d, *flags)
        assert out.returncode == 1, (flags, out.stdout, out.stderr)
        for n in needles:
            assert n in out.stdout, (flags, n, out.stdout)


@pytest.fixture()
def marker(tmp_path):
    return tmp_path / "payload-ran"


def test_an_uppercase_pickle_name_is_the_pickle_torch_runs(tmp_path, marker):
    """An object item whose pickle is named ``archive/DATA.PKL``: torch's lookup ignores case, so
    DCP and Megatron unpickle it and run its payload; verify used to see no pickle at all."""
    payload = pickle.dumps({"lr": 0.5, "x": _Payload(marker)}, protocol=2)
    d = tmp_path / "ckpt"
    write_checkpoint(d, {}, {OBJ: object_archive([(b"DATA.PKL", payload)])})
    before = tree_digest(d)
    assert_refused(d, "fuzz_marker.touch_file", "PROBLEM obj")
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import shardwise.megatron as swm

    with pytest.raises(swm.UnsafeObjectError, match="fuzz_marker"):
        swm.load({"obj": ShardedObject("obj", None, (1,), (0,), replica_id=0)}, str(d), rank=0, world_size=1)
    assert not marker.exists()
    # The real loads run it.
    dcp_objects(d)
    assert marker.exists(), "torch DCP did not run the payload: the case no longer shows the hazard"
    marker.unlink()
    res = spawn(__import__("archive_workers").megatron_load_object, 1, str(tmp_path / "mc"), str(d), "obj", timeout_s=300)
    assert res[0]["ok"], res
    assert marker.exists(), f"Megatron did not run the payload: {res}"
    assert tree_digest(d) == before


def test_a_case_twin_of_the_pickle_is_refused(tmp_path, marker):
    """A benign ``data.pkl`` first and a payload ``DATA.PKL`` after it: two names torch cannot
    tell apart. verify names both records."""
    benign = pickle.dumps({"lr": 0.5}, protocol=2)
    payload = pickle.dumps({"lr": 0.5, "x": _Payload(marker)}, protocol=2)
    d = tmp_path / "ckpt"
    write_checkpoint(d, {}, {OBJ: object_archive([(b"data.pkl", benign), (b"DATA.PKL", payload)])})
    before = tree_digest(d)
    assert_refused(d, "archive/data.pkl", "archive/DATA.PKL", "differ only in case")
    out = dcp_objects(d)
    ran = marker.exists()
    # Whichever twin torch's binary search finds, shardwise refuses to say which: both are named.
    assert ran or out[OBJ] == {"lr": 0.5}
    assert tree_digest(d) == before


def test_a_case_twin_of_the_storage_is_refused(tmp_path):
    """A tensor item holding the real ``data/0`` and a ``DATA/0`` with other bytes: shardwise read
    the first, torch DCP loads the second. Every shardwise reader now refuses, naming both."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    other = (w + 100).numpy().tobytes()
    d = tmp_path / "ckpt"
    write_checkpoint(d, {"w": (w, tensor_archive(w, twin=other))}, {})
    before = tree_digest(d)
    got = dcp_tensor(d, "w", w)
    assert torch.equal(got, w + 100) or torch.equal(got, w)
    assert_refused(d, "archive/data/0", "archive/DATA/0")
    with pytest.raises(shardwise.CorruptFileError, match="DATA/0"):
        shardwise.open(d).read("w")
    out = subprocess.run([*CLI, "diff", str(d), str(d)], capture_output=True, text=True, timeout=120)
    assert out.returncode not in (0,), out.stdout
    assert "DATA/0" in out.stdout + out.stderr
    assert tree_digest(d) == before


def test_common_pt_with_an_uppercase_pickle_is_refused(tmp_path, marker):
    """The same trick in common.pt, which Megatron loads with torch.load (weights_only=False is the
    default of torch 2.3-2.5)."""
    w = torch.arange(4, dtype=torch.float32)
    d = tmp_path / "ckpt"
    write_checkpoint(d, {"w": (w, tensor_archive(w))}, {})
    payload = pickle.dumps({"args": None, "x": _Payload(marker)}, protocol=2)
    (d / "common.pt").write_bytes(object_archive([(b"Data.Pkl", payload)]))
    before = tree_digest(d)
    out = verify(d)
    assert out.returncode == 1 and "fuzz_marker.touch_file" in out.stdout and "common.pt" in out.stdout, out.stdout
    torch.load(d / "common.pt", weights_only=False)
    assert marker.exists()
    assert tree_digest(d) == before


@pytest.mark.parametrize(
    "case, needle",
    [
        ("legacy_prefix", "legacy"),
        ("torchscript", "TorchScript"),
        ("byteorder_big", "byteorder"),
        ("version_11", "version"),
        ("numel_lies", "declares"),
    ],
)
def test_what_torch_reads_otherwise_is_refused(tmp_path, case, needle):
    """The other ways an archive means something else to torch: a pickle before the zip (torch
    unpickles it as a legacy file), a ``constants.pkl`` (torch.jit.load), ``byteorder`` big (torch
    byteswaps), a format version torch refuses, a storage whose declared size is not its record's."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rec = torch_item(w)
    recs = [Rec(FOLDER + n.encode(), rec[n]) for n in ["data.pkl", "byteorder", "data/0", "version", ".data/serialization_id"]]
    lead = b""
    if case == "legacy_prefix":
        lead = pickle.dumps({"x": 1}, protocol=2)
    elif case == "torchscript":
        recs.append(Rec(FOLDER + b"constants.pkl", b"\x80\x02)."))
    elif case == "byteorder_big":
        recs[1] = Rec(FOLDER + b"byteorder", b"big")
    elif case == "version_11":
        recs[3] = Rec(FOLDER + b"version", b"11\n")
    else:
        recs[2] = Rec(FOLDER + b"data/0", rec["data/0"][:-4])
    from torch_reader_gen import Layout

    blob = build(recs, Layout(lead=lead))
    d = tmp_path / "ckpt"
    write_checkpoint(d, {"w": (w, blob)}, {})
    before = tree_digest(d)
    out = verify(d)
    assert out.returncode == 1 and "PROBLEM w" in out.stdout and needle in out.stdout, out.stdout
    with pytest.raises(shardwise.CorruptFileError):
        shardwise.open(d).read("w")
    # What torch does instead: anything but reading these bytes as shardwise would have.
    try:
        got = dcp_tensor(d, "w", w)
        assert not torch.equal(got, w), f"{case}: torch reads the same tensor; the case shows no hazard"
    except (Exception, CheckpointException):  # noqa: BLE001 - torch refusing is the other outcome
        pass
    assert tree_digest(d) == before
