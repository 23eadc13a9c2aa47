"""shardwise.requested_keys: the collective-free exchange of every rank's requested keys behind the
strict ``*_all`` loads. Ranks are threads of this process here (the derived load id is pinned, as
every process of a launch derives the same one); the gloo comparison with Megatron is in
test_megatron_compat.py."""

from __future__ import annotations

import json
import os
import threading
import time
import zlib

import pytest

import shardwise
from shardwise import _native
from shardwise import requested_keys as rk

LOAD_ID = "0123456789abcdef01234567"


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setattr("shardwise.save.derived_id", lambda *a, **k: LOAD_ID)
    monkeypatch.delenv(rk.ENV_DIR, raising=False)
    path = tmp_path / "iter_0000010"
    path.mkdir()
    return str(path)


def _ranks(ckpt, keys_per_rank, timeout_s=30.0, world_size=None):
    world = len(keys_per_rank) if world_size is None else world_size
    out, errors = {}, {}

    def run(r):
        try:
            out[r] = rk.gather(ckpt, keys_per_rank[r], rank=r, world_size=world, timeout_s=timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(keys_per_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, errors


def _stale_record(path, rank, world_size, keys, written_ns):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    record = {"rank": rank, "world_size": world_size, "written_ns": written_ns, "process": "old:1", "keys": keys}
    with open(path, "wb") as f:
        f.write(zlib.compress(json.dumps(record).encode()))


def test_union_of_every_rank_and_cleanup(ckpt):
    out, errors = _ranks(ckpt, [["a", "x"], ["b"], ["a", "c"]])
    assert not errors
    assert out == {r: {"a", "b", "c", "x"} for r in range(3)}
    # Every rank read every file: the last one removed the exchange, and the empty keys directory.
    assert not os.path.exists(rk.keys_root(ckpt))
    assert os.listdir(os.path.dirname(ckpt)) == ["iter_0000010"]


def test_missing_rank_times_out_naming_it(ckpt):
    t0 = time.monotonic()
    out, errors = _ranks(ckpt, [["a"], ["b"]], timeout_s=0.5, world_size=3)
    assert time.monotonic() - t0 < 20
    assert not out and set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, shardwise.MissingRanksError)
        assert "ranks [2]" in str(e) and "world_size 3" in str(e) and ckpt in str(e)
    # Ranks 0 and 1 gave up; rank 2 never came, so nothing is removed under its feet.
    assert sorted(os.listdir(os.path.join(rk.keys_root(ckpt), LOAD_ID))) == ["done0", "done1", "rank0", "rank1"]


def test_earlier_launch_files_are_waited_past(ckpt):
    """A relaunch deriving the same id finds the crashed launch's files: they are older than this
    process, so rank 1's is not taken for this launch's (the wait ends in an error saying why), and
    once rank 1 publishes again the exchange completes and removes them all."""
    folder = os.path.join(rk.keys_root(ckpt), LOAD_ID)
    before = _native.process_start_ns() - 10**9
    _stale_record(os.path.join(folder, "rank1"), 1, 2, ["stale_key"], before)
    for r in (0, 1):
        _stale_record(os.path.join(folder, f"done{r}"), r, 2, [], before)
    with pytest.raises(shardwise.MissingRanksError, match=r"ranks \[1\].*rank 1's file was written by old:1 before this process started"):
        rk.gather(ckpt, ["a"], rank=0, world_size=2, timeout_s=0.3)
    out, errors = _ranks(ckpt, [["a"], ["b"]])
    assert not errors and out == {0: {"a", "b"}, 1: {"a", "b"}}
    assert not os.path.exists(rk.keys_root(ckpt))


def test_world_size_disagreement(ckpt):
    folder = os.path.join(rk.keys_root(ckpt), LOAD_ID)
    _stale_record(os.path.join(folder, "rank1"), 1, 4, ["b"], time.time_ns())
    with pytest.raises(shardwise.ValidationError, match="rank 1 loads with world_size 4, this rank with 2"):
        rk.gather(ckpt, ["a"], rank=0, world_size=2, timeout_s=5)


def test_corrupt_file_is_an_error(ckpt):
    folder = os.path.join(rk.keys_root(ckpt), LOAD_ID)
    os.makedirs(folder)
    with open(os.path.join(folder, "rank1"), "wb") as f:
        f.write(b"not zlib")
    with pytest.raises(shardwise.CorruptFileError, match="rank1"):
        rk.gather(ckpt, ["a"], rank=0, world_size=2, timeout_s=5)


def test_unwritable_location_and_override(ckpt, tmp_path, monkeypatch):
    """A location the keys cannot be written to (here: below a regular file, which even root cannot
    write into) is a StorageError naming the override; the override then takes the files."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    monkeypatch.setenv(rk.ENV_DIR, str(blocker / "sub"))
    with pytest.raises(shardwise.StorageError, match=rk.ENV_DIR):
        rk.gather(ckpt, ["a"], rank=0, world_size=1, timeout_s=5)
    scratch = tmp_path / "scratch"
    monkeypatch.setenv(rk.ENV_DIR, str(scratch))
    assert rk.keys_root(ckpt) == str(scratch / "iter_0000010")
    assert rk.gather(ckpt, ["a"], rank=0, world_size=1, timeout_s=5) == {"a"}
    assert not os.path.exists(scratch / "iter_0000010")


def test_bad_arguments(ckpt):
    with pytest.raises(shardwise.InvalidArgumentError):
        rk.gather(ckpt, ["a"], rank=2, world_size=2, timeout_s=5)
    with pytest.raises(shardwise.InvalidArgumentError):
        rk.gather(ckpt, ["a"], rank=0, world_size=1, timeout_s=-1)
