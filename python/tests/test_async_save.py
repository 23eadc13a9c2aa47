"""Async save on CPU (the path CI can run): the handle returns once every byte is staged, the caller
may then change its tensors, and the checkpoint holds the values at call time."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

import shardwise
import shardwise.megatron as swm
from dcp_util import read_all, row_shard


def test_async_save_stages_then_persists(tmp_path):
    sid = uuid.uuid4().hex
    states = [{"w": row_shard("w", r, 2, rows=256, cols=1024)} for r in range(2)]
    originals = [s["w"].data.clone() for s in states]
    h1 = swm.save(states[1], str(tmp_path), rank=1, world_size=2, save_id=sid, async_save=True, wait_for_commit=False)
    assert isinstance(h1, shardwise.SaveHandle) and h1.staged_bytes == 256 * 1024 * 4
    states[1]["w"].data.fill_(-1)  # allowed as soon as save returned
    h0 = swm.save(states[0], str(tmp_path), rank=0, world_size=2, save_id=sid, async_save=True, timeout_s=30)
    states[0]["w"].data.fill_(-2)
    r0 = h0.wait(60)
    h1.wait(60)
    assert r0["committed"] and h0.done() and h1.done()
    assert h0.stall_s >= 0 and h0.stall_s < 30
    tensors, _ = read_all(str(tmp_path))
    assert torch.equal(tensors["w"], torch.cat(originals))


def test_async_save_with_budget_below_the_data_applies_back_pressure(tmp_path):
    state = {"w": row_shard("w", 0, 1, rows=512, cols=1024)}  # 2 MiB
    original = state["w"].data.clone()
    h = swm.save(state, str(tmp_path), rank=0, world_size=1, async_save=True, staging_budget_bytes=128 << 10)
    state["w"].data.zero_()
    h.wait(60)
    tensors, _ = read_all(str(tmp_path))
    assert torch.equal(tensors["w"], original)


def test_async_save_reraises_its_error(tmp_path):
    h = swm.save({"w": row_shard("w", 0, 2)}, str(tmp_path), rank=0, world_size=2, async_save=True, timeout_s=0.5)
    with pytest.raises(shardwise.MissingRanksError, match=r"ranks \[1\]"):
        h.wait(30)
    assert h.done()
    with pytest.raises(shardwise.MissingRanksError):
        h.wait(1)  # the same error again
    assert not (tmp_path / ".metadata").exists()


def test_wait_times_out_while_in_flight_and_concurrent_saves_both_land(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    sid = uuid.uuid4().hex
    ha = swm.save({"w": row_shard("w", 0, 2)}, str(a), rank=0, world_size=2, save_id=sid, async_save=True, timeout_s=30)
    with pytest.raises(shardwise.NotCommittedError, match="still in flight"):
        ha.wait(0.2)
    assert not ha.done()
    # A second save of this process while the first is in flight: its writes wait for the first's.
    big = {"v": row_shard("v", 0, 1, rows=1024, cols=1024)}
    hb = swm.save(big, str(b), rank=0, world_size=1, async_save=True, staging_budget_bytes=1 << 20)
    swm.save({"w": row_shard("w", 1, 2)}, str(a), rank=1, world_size=2, save_id=sid, merge_rank=None)
    assert ha.wait(30)["committed"] and hb.wait(30)["committed"]
    assert read_all(str(a))[0]["w"].shape == (8, 8)
    assert torch.equal(read_all(str(b))[0]["v"], big["v"].data)


def test_reserve_staging_counts_main_replicas_and_refuses_bad_numbers():
    """Issue 27: reserve_staging returns at once; from a sharded state dict it counts the bytes the
    save writes (main replicas only), and the default budget is the save's. Without CUDA nothing is
    pinned (host saves need no reservation); the GPU test measures the stall it removes."""
    state = {"a": row_shard("a", 0, 2, rows=256, cols=1024),  # 1 MiB, main replica
             "b": row_shard("b", 0, 2, rows=256, cols=1024, replica_id=1),  # another rank writes it
             "opt": {"c": row_shard("c", 1, 2, rows=128, cols=1024)}}  # 0.5 MiB
    t0 = time.monotonic()
    r = swm.reserve_staging(state)
    assert time.monotonic() - t0 < 5
    assert r["rank_bytes"] == (256 + 128) * 1024 * 4
    assert r["budget_bytes"] == 4 << 30  # the save's default: at least 4 GiB
    assert swm.reserve_staging(10 << 30, staging_budget_bytes=1 << 30)["budget_bytes"] == 1 << 30
    if not torch.cuda.is_available():
        assert r["pinned"] is False and r["buffers"] == 0
    for bad in (-1, 1.5, True, 2**64, "1"):
        with pytest.raises(shardwise.InvalidArgumentError):
            swm.reserve_staging(bad)
    with pytest.raises(shardwise.InvalidArgumentError, match="staging_budget_bytes"):
        swm.reserve_staging(1, staging_budget_bytes=0)
