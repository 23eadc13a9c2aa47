"""Single-process tests of issue 9: the file barrier, install/uninstall, save_checkpoint's tracker
and retention, DPBalance input checks and the slime hook."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

import shardwise
import shardwise.megatron as swm
from dcp_util import read_all, row_shard


def test_barrier_names_stuck_rank_and_its_phase(tmp_path):
    shardwise.record_phase(tmp_path, 2, "update_weights:gather")  # rank 2 reports, then hangs
    errors, waited = {}, {}

    def rank(r):
        t0 = time.monotonic()
        try:
            shardwise.barrier(tmp_path, "save-10", r, 3, timeout_s=1.0)
        except shardwise.ShardwiseError as e:
            errors[r] = e
        waited[r] = time.monotonic() - t0

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(errors) == [0, 1]
    for r, e in errors.items():
        assert isinstance(e, shardwise.MissingRanksError) and isinstance(e, shardwise.BarrierTimeoutError)
        assert e.missing == [2] and e.last_phases[2][0] == "update_weights:gather"
        assert "ranks [2]" in str(e) and "'update_weights:gather'" in str(e)
        assert 1.0 <= waited[r] < 3.0, waited


def test_barrier_passes_when_all_arrive_and_reports_never_seen_rank(tmp_path):
    threads = [threading.Thread(target=shardwise.barrier, args=(tmp_path, "b1", r, 3, 10.0)) for r in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert time.monotonic() - t0 < 5
    with pytest.raises(shardwise.BarrierTimeoutError, match="rank 1: never reported a phase"):
        shardwise.barrier(tmp_path / "other", "b2", 0, 2, timeout_s=0.2)


@pytest.mark.parametrize(
    "args", [dict(rank=3, world_size=3), dict(rank=0, world_size=0), dict(name="../x"), dict(timeout_s=-1)]
)
def test_barrier_rejects_bad_input(tmp_path, args):
    kw = dict(dir=tmp_path, name="b", rank=0, world_size=1, timeout_s=1.0) | args
    with pytest.raises(shardwise.InvalidArgumentError):
        shardwise.barrier(**kw)


def test_install_uninstall_and_context_manager():
    import megatron.core.dist_checkpointing as mdc
    import megatron.core.dist_checkpointing.serialization as mser

    original = mser.save
    with swm.installed(timeout_s=5):
        assert mdc.save.func is swm.dist_checkpointing_save and mser.save is mdc.save
        swm.install(timeout_s=7)  # idempotent: the original stays recorded once
        assert mdc.save.keywords == {"timeout_s": 7}
    assert mdc.save is original and mser.save is original
    swm.uninstall()  # no-op
    assert mdc.save is original


def test_drop_in_rejects_other_backends_and_other_signatures(tmp_path):
    params = [p.name for p in swm.megatron_save_parameters()]
    with pytest.raises(shardwise.InvalidArgumentError, match="zarr"):
        swm.dist_checkpointing_save({}, str(tmp_path), sharded_strategy=("zarr", 1), rank=0, world_size=1)
    if "common_strategy" in params:  # megatron-core <= 0.18
        with pytest.raises(shardwise.InvalidArgumentError, match="common_strategy"):
            swm.dist_checkpointing_save({}, str(tmp_path), common_strategy=("torch", 1), rank=0, world_size=1)
        with pytest.raises(shardwise.InvalidArgumentError, match="common_strategy"):
            swm.dist_checkpointing_save({}, str(tmp_path), None, ("torch", 1), rank=0, world_size=1)
    else:  # 0.19 has no common_strategy, as Megatron's own save
        with pytest.raises(TypeError, match="common_strategy"):
            swm.dist_checkpointing_save({}, str(tmp_path), common_strategy=("torch", 1), rank=0, world_size=1)
    with pytest.raises(TypeError, match="positional"):
        swm.dist_checkpointing_save({}, str(tmp_path), *[None] * (len(params) + 1), rank=0, world_size=1)
    with pytest.raises(TypeError, match="multiple values"):
        swm.dist_checkpointing_save({}, str(tmp_path), None, sharded_strategy=None, rank=0, world_size=1)
    assert not any(tmp_path.iterdir()), "a refused call writes nothing"


def _save_iteration(root, it, keep_last):
    """Plays ranks 1 and 0 of a 2-rank save_checkpoint in this process (rank 1 does not wait)."""
    sid = uuid.uuid4().hex
    states = [{"w": row_shard("w", r, 2), "iteration": it} for r in range(2)]
    swm.save_checkpoint(root, it, states[1], rank=1, world_size=2, timeout_s=5, save_id=sid, wait_for_commit=False)
    return swm.save_checkpoint(root, it, states[0], {"extra": it}, rank=0, world_size=2, timeout_s=5, save_id=sid, keep_last=keep_last)


def test_save_checkpoint_retention_keeps_uncommitted_and_newer(tmp_path):
    root = tmp_path / "save"
    for it in (1, 2, 3):
        _save_iteration(root, it, keep_last=None)
    (root / "iter_0000000").mkdir()  # uncommitted leftovers are never deleted
    (root / "iter_0000009").mkdir()
    report = _save_iteration(root, 4, keep_last=2)
    assert report["tracker"] == 4 and (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert report["deleted"] == [str(root / "iter_0000001"), str(root / "iter_0000002")]
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000000", "iter_0000003", "iter_0000004", "iter_0000009", "latest_checkpointed_iteration.txt",
    ]
    tensors, _ = read_all(str(root / "iter_0000004"))
    assert torch.equal(tensors["w"], torch.cat([row_shard("w", r, 2).data for r in range(2)]))
    common = torch.load(root / "iter_0000004" / "common.pt", weights_only=False)
    assert common["extra"] == 4 and common["iteration"] == 4


@pytest.mark.parametrize("kw", [dict(iteration=-1), dict(keep_last=0)])
def test_save_checkpoint_rejects_bad_input(tmp_path, kw):
    args = dict(save_root=tmp_path, iteration=1, sharded_state_dict={}, rank=0, world_size=1) | kw
    with pytest.raises(shardwise.InvalidArgumentError):
        swm.save_checkpoint(**args)
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def test_save_checkpoint_failure_leaves_tracker(tmp_path):
    _save_iteration(tmp_path, 1, keep_last=None)
    with pytest.raises(shardwise.MissingRanksError):  # rank 1 never saves iteration 2
        swm.save_checkpoint(tmp_path, 2, {"w": row_shard("w", 0, 2)}, rank=0, world_size=2, timeout_s=0.5, keep_last=1)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (tmp_path / "iter_0000001" / ".metadata").exists()


@pytest.mark.parametrize("kw", [dict(dp_size=2, dp_rank=2), dict(dp_size=0, dp_rank=0), dict(dp_size=2, dp_rank=0, expert_dp_size=2)])
def test_dp_balance_rejects_bad_input(kw):
    with pytest.raises(shardwise.InvalidArgumentError):
        swm.DPBalance(**kw)


def test_slime_hook_installs_and_checks_format(monkeypatch):
    import megatron.core.dist_checkpointing as mdc
    from types import SimpleNamespace

    from shardwise.integrations import slime

    with pytest.raises(shardwise.InvalidArgumentError, match="torch_dist"):
        slime.custom_init(SimpleNamespace(ckpt_format="torch"))
    for bad in ("nan", "inf", "-1", "1e30"):
        monkeypatch.setenv("SHARDWISE_TIMEOUT_S", bad)
        with pytest.raises(shardwise.InvalidArgumentError, match="SHARDWISE_TIMEOUT_S"):
            slime.custom_init(SimpleNamespace(ckpt_format="torch_dist"))
        assert getattr(mdc.save, "func", None) is not swm.dist_checkpointing_save, "nothing installed"
    monkeypatch.setenv("SHARDWISE_TIMEOUT_S", "12")
    try:
        slime.custom_init(SimpleNamespace(ckpt_format="torch_dist"))
        assert mdc.save.func is swm.dist_checkpointing_save and mdc.save.keywords == {"timeout_s": 12.0}
    finally:
        swm.uninstall()
