"""The Python boundary (``shardwise._native``, crates/shardwise-py/src/): typed descriptions that check themselves
when made, every bad number an ``InvalidArgumentError`` (never an ``OverflowError``, a ``TypeError``
from a conversion or a Rust panic) raised before anything is written, and reports whose dicts have
exactly the fields of the CLI's ``--json`` for the same operation."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

import shardwise
import shardwise.dcp
import shardwise.megatron as swm
from dcp_util import row_shard, tree_digest
from shardwise import _native

SHARDWISE = str(Path(sys.executable).parent / "shardwise")
# Numbers that are not a bound in seconds: NaN, infinities, negative, beyond MAX_TIMEOUT_S (1e19 and
# 1e30 panicked in Duration arithmetic before), a bool, a string.
BAD_SECONDS = [float("nan"), float("inf"), float("-inf"), -1.0, 1e9 + 1, 1e19, 1e30, True, "5"]
# Not a byte count >= 1: -1 and 2**64 raised OverflowError, 1.5 TypeError, True was taken as 1.
BAD_BYTES = [-1, 0, 2**64, 1.5, True, "1"]


def cli(*args):
    return subprocess.run([SHARDWISE, *map(str, args)], capture_output=True, text=True, timeout=120)


def state():
    return {"w": row_shard("w", 0, 1)}


def assert_nothing_written(d: Path):
    assert not d.exists() or not any(d.iterdir()), sorted(p.name for p in d.iterdir())


# --- typed descriptions ---------------------------------------------------------------------------


def chunk(**kw):
    t = kw.pop("tensor", torch.zeros(2, 3))
    args = dict(fqn="w", dtype=str(t.dtype), global_shape=[4, 3], offsets=[2, 0], sizes=[2, 3],
                data_ptr=t.data_ptr(), nbytes=t.numel() * t.element_size())
    args.update(kw)
    return _native.Chunk(**args)


def test_chunk_checks_itself_and_shows_its_fields():
    c = chunk(device=None)
    assert (c.fqn, c.dtype, c.global_shape, c.offsets, c.sizes, c.nbytes, c.device) == \
        ("w", "torch.float32", [4, 3], [2, 0], [2, 3], 24, None)
    assert repr(c).startswith("Chunk(fqn=\"w\", dtype='torch.float32', global_shape=[4, 3], offsets=[2, 0]"), repr(c)
    with pytest.raises(AttributeError):
        c.fqn = "x"  # frozen
    with pytest.raises(TypeError):
        _native.Chunk("w", "float32", [1], [0], [1], 1, 4)  # keyword-only
    cases = [
        (dict(nbytes=20), "needs Some(24) bytes, got 20"),
        (dict(sizes=[2]), "same number of dimensions"),
        (dict(data_ptr=0), "data_ptr is null"),
        (dict(data_ptr=-1), "data_ptr must be a whole number"),
        (dict(nbytes=24.0), "nbytes must be a whole number"),
        (dict(offsets=[2, -1]), "offsets must be a list of whole numbers"),
        (dict(global_shape="43"), "global_shape must be a list"),
        (dict(device=-1), "device must be a whole number"),
        (dict(device=True), "device must be a whole number"),
    ]
    for kw, msg in cases:
        with pytest.raises(shardwise.InvalidArgumentError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            chunk(**kw)
    with pytest.raises(shardwise.UnsupportedDtypeError):
        chunk(dtype="torch.complex64", tensor=torch.zeros(2, 3, dtype=torch.complex64))


def test_object_item_save_options_and_region_check_themselves():
    o = _native.ObjectItem(fqn="o/shard_0_2", data=b"xy", key="o", global_shape=[2], global_offset=[0])
    assert (o.fqn, o.key, o.nbytes) == ("o/shard_0_2", "o", 2) and "data=<2 bytes>" in repr(o)
    assert _native.ObjectItem(fqn="common", data=b"").key is None
    with pytest.raises(shardwise.InvalidArgumentError, match="all given or all None"):
        _native.ObjectItem(fqn="o", data=b"x", key="o")
    with pytest.raises(shardwise.InvalidArgumentError, match="data must be bytes"):
        _native.ObjectItem(fqn="o", data="text")

    opts = dict(checkpoint_dir="/tmp/x", rank=1, world_size=2, save_id="s", timeout_s=5, merge_rank=0)
    so = _native.SaveOptions(**opts)
    assert (so.rank, so.world_size, so.save_id, so.merge_rank, so.timeout_s, so.staging_budget_bytes) == \
        (1, 2, "s", 0, 5.0, None)
    assert "SaveOptions(checkpoint_dir=" in repr(so) and "timeout_s=5" in repr(so)
    for kw, msg in [(dict(rank=2), "rank 2 is not in"), (dict(world_size=0), "world_size must be"),
                    (dict(merge_rank=2), "merge_rank 2"), (dict(save_id="../x"), "save_id"),
                    (dict(rank=1.0), "rank must be")]:
        with pytest.raises(shardwise.InvalidArgumentError, match=msg):
            _native.SaveOptions(**{**opts, **kw})

    r = _native.Region(key="w", offsets=[0, 1], sizes=[2, 2], data_ptr=8, nbytes=16)
    assert (r.key, r.offsets, r.sizes, r.data_ptr, r.nbytes, r.device) == ("w", [0, 1], [2, 2], 8, 16, None)
    assert repr(r) == 'Region(key="w", offsets=[0, 1], sizes=[2, 2], data_ptr=0x8, nbytes=16, device=None)'
    with pytest.raises(shardwise.InvalidArgumentError, match="differ in dimensions"):
        _native.Region(key="w", offsets=[0], sizes=[2, 2], data_ptr=8, nbytes=16)
    with pytest.raises(shardwise.InvalidArgumentError, match="nbytes must be"):
        _native.Region(key="w", offsets=[0], sizes=[2], data_ptr=8, nbytes=2**64)


def test_read_into_refuses_a_cuda_region(tmp_path):
    d = tmp_path / "c"
    swm.save(state(), str(d), rank=0, world_size=1)
    ck = _native.open_checkpoint(str(d))
    out = torch.empty(1, 8)
    region = _native.Region(key="w", offsets=[0, 0], sizes=[1, 8], data_ptr=out.data_ptr(), nbytes=32, device=0)
    with pytest.raises(shardwise.InvalidArgumentError, match="use load_into"):
        ck.read_into(region)


# --- bad numbers at every entry point ---------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_save_refuses_bad_timeouts_and_budgets_before_writing(tmp_path, async_save):
    d = tmp_path / "c"
    for t in BAD_SECONDS:
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            swm.save(state(), str(d), rank=0, world_size=1, async_save=async_save, timeout_s=t)
    for b in BAD_BYTES:
        with pytest.raises(shardwise.InvalidArgumentError, match="staging_budget_bytes"):
            swm.save(state(), str(d), rank=0, world_size=1, async_save=async_save, staging_budget_bytes=b)
    for kw in (dict(rank=-1), dict(rank=True), dict(world_size=2**32), dict(merge_rank=-1)):
        with pytest.raises(shardwise.InvalidArgumentError):
            swm.save(state(), str(d), **{"rank": 0, "world_size": 1, **kw})
    assert_nothing_written(d)
    for t in BAD_SECONDS:
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            swm.save_checkpoint(str(tmp_path / "root"), 1, state(), rank=0, world_size=1, timeout_s=t)
    assert not (tmp_path / "root").exists()


def test_wait_refuses_bad_timeouts_and_the_save_still_commits(tmp_path):
    """``SaveHandle.wait(timeout_s=1e30)`` raised a PanicException ("cannot convert float seconds
    to Duration")."""
    d = tmp_path / "c"
    h = swm.save(state(), str(d), rank=0, world_size=1, async_save=True)
    for t in BAD_SECONDS:
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            h.wait(t)
    assert h.wait(60)["committed"] and h.wait()["committed"]
    ch = swm.save_checkpoint(str(tmp_path / "root"), 3, state(), rank=0, world_size=1, async_save=True)
    with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
        ch.wait(1e30)
    assert ch.wait(60)["tracker"] == 3


def test_load_merge_barrier_and_tools_refuse_bad_numbers(tmp_path):
    d = tmp_path / "c"
    swm.save(state(), str(d), rank=0, world_size=1)
    ck = _native.open_checkpoint(str(d))
    out = torch.empty(1, 8)
    region = _native.Region(key="w", offsets=[0, 0], sizes=[1, 8], data_ptr=out.data_ptr(), nbytes=32)
    request = lambda: {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 8), replica_id=0)}  # noqa: E731
    for t in BAD_SECONDS:
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            swm.load(request(), str(d), timeout_s=t)
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            ck.load_into([region], timeout_s=t)
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            shardwise.merge(str(d), "x", 1, t)
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            shardwise.barrier(tmp_path / "b", "b1", 0, 1, t)
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            _native.open_checkpoint(str(d), t)
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            _native.read_file(str(d), "metadata.json", t)
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            shardwise.dcp.finish(str(d), world_size=1, timeout_s=t)
    for b in BAD_BYTES:
        with pytest.raises(shardwise.InvalidArgumentError, match="staging_budget_bytes"):
            swm.load(request(), str(d), staging_budget_bytes=b)
        with pytest.raises(shardwise.InvalidArgumentError, match="staging_budget_bytes"):
            ck.load_into([region], staging_budget_bytes=b)
    for n in (-1, 0, 1.5, True, 2**64):
        with pytest.raises(shardwise.InvalidArgumentError, match="world_size"):
            shardwise.merge(str(d), "x", n, 1.0)
        with pytest.raises(shardwise.InvalidArgumentError, match="world_size"):
            shardwise.dcp.finish(str(d), world_size=n, timeout_s=1.0)
        with pytest.raises(shardwise.InvalidArgumentError, match="workers"):
            shardwise.to_hf(str(d), str(tmp_path / "hf"), workers=n)
        with pytest.raises(shardwise.InvalidArgumentError, match="workers"):
            shardwise.diff(str(d), str(d), workers=n)
    assert not (tmp_path / "hf").exists()
    assert _native.check_seconds("timeout_s", 2) == 2.0 and _native.MAX_TIMEOUT_S == 1e9
    # The CLI follows the same rule (timeout_from_secs) and never panics.
    r = cli("merge", d, "--save-id", "x", "--world-size", "1", "--timeout", "1e19")
    assert r.returncode == 1 and "timeout" in r.stderr and "panicked" not in r.stderr, r.stderr
    # A negative number is a bad value, refused with the rule's message (exit 1; diff's bad command
    # line is 2), not an unknown flag.
    for args, code, says in ((("merge", d, "--save-id", "x", "--world-size", "1", "--timeout", "-1"), 1, "got -1"),
                             (("verify", d, "--timeout", "-1"), 1, "got -1"),
                             (("diff", d, d, "--atol", "-1"), 2, "must be numbers >= 0")):
        r = cli(*args)
        assert r.returncode == code and says in r.stderr, (args, r.returncode, r.stderr)
        assert "unexpected argument" not in r.stderr and "panicked" not in r.stderr, (args, r.stderr)


# --- reports: one serde type each, the CLI's --json fields ------------------------------------------


def test_merge_and_save_reports_are_the_cli_json(tmp_path):
    d = tmp_path / "later"
    sid = uuid.uuid4().hex
    for r in (0, 1):
        rep = swm.save({"w": row_shard("w", r, 2)}, str(d), rank=r, world_size=2, save_id=sid, merge_rank=None)
        assert rep["commit"] is None and not rep["committed"]
    merged = shardwise.merge(str(d), sid, 2, 10.0)
    again = json.loads(cli("merge", "--json", "--save-id", sid, d).stdout)
    assert merged.keys() == again.keys() and len(merged) == 7, (merged, again)
    assert {**merged, "already_committed": True} == again and merged["already_committed"] is False

    d2 = tmp_path / "now"
    reps = [swm.save({"w": row_shard("w", r, 2)}, str(d2), rank=r, world_size=2, save_id=sid, wait_for_commit=False)
            for r in (1, 0)]
    assert reps[0]["commit"] is None and reps[1]["commit"] == {**merged, "already_committed": False}
    assert set(reps[1]) == {"rank", "save_id", "data_file", "data_bytes", "write_s", "rendezvous_s", "committed", "commit"}
    assert reps[1]["data_bytes"] < merged["data_bytes"], "data_bytes: this rank's; commit.data_bytes: all ranks'"


def test_diff_status_and_load_reports_are_plain_dicts(tmp_path):
    d = tmp_path / "c"
    swm.save(state(), str(d), rank=0, world_size=1)
    assert shardwise.diff(str(d), str(d)) == json.loads(cli("diff", "--json", d, d).stdout)

    def ageless(report):  # a part's age_s moves between the two calls
        for s in report["saves"]:
            for r in s["ranks"]:
                assert r.pop("age_s") >= 0
        return report

    st = shardwise.status(str(d))
    assert st["checkpoint"] == "committed" and st["saves"][0]["state"] == "committed"
    assert ageless(st) == ageless(json.loads(cli("status", "--json", d).stdout))
    out = torch.empty(1, 8)
    stats = _native.open_checkpoint(str(d)).load_into(
        [_native.Region(key="w", offsets=[0, 0], sizes=[1, 8], data_ptr=out.data_ptr(), nbytes=32)])
    assert set(stats) == {"bytes_read", "read_ops", "requests", "seconds", "plan_seconds", "items_checked",
                          "items_unchecked"} and stats["requests"] == 1 and stats["items_checked"] == 1


def test_a_file_given_as_the_checkpoint_dir_is_named_as_such(tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_bytes(b"x")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 8), replica_id=0)}
    with pytest.raises(shardwise.StorageError, match="is a file, not a checkpoint directory"):
        swm.load(request, str(f))
    assert f.read_bytes() == b"x"


# --- the type a Python user expects (issue 44) -------------------------------------------------------
# A wrong type is an InvalidArgumentTypeError (a TypeError), a value out of range an
# InvalidArgumentError (a ValueError); both are ShardwiseErrors and name the argument. Before: load
# took rank="0" and rank=2**70, from_hf took workers=True as 1, and diff split keys="decoder.*" into
# its characters.


def _raises(kind, name, fn, *args, **kw):
    """``fn(*args, **kw)`` raises ``kind`` (TypeError or ValueError), a ShardwiseError naming ``name``."""
    with pytest.raises(kind) as e:
        fn(*args, **kw)
    assert isinstance(e.value, shardwise.ShardwiseError) and name in str(e.value), (type(e.value), e.value)
    if kind is TypeError:
        assert isinstance(e.value, shardwise.InvalidArgumentTypeError)
    else:
        assert not isinstance(e.value, TypeError), e.value
    return e.value


def test_argument_errors_are_type_and_value_errors():
    assert issubclass(shardwise.InvalidArgumentError, ValueError)
    assert issubclass(shardwise.InvalidArgumentTypeError, TypeError)
    assert issubclass(shardwise.InvalidArgumentTypeError, shardwise.InvalidArgumentError)
    assert shardwise.InvalidArgumentTypeError.__module__ == "shardwise"
    assert _native.check_whole("n", 3, 1, 5) == 3
    _raises(TypeError, "n", _native.check_whole, "n", True)
    _raises(TypeError, "n", _native.check_whole, "n", 2.0)
    _raises(ValueError, "n", _native.check_whole, "n", 2**70)
    _raises(ValueError, "n", _native.check_whole, "n", 6, 1, 5)


def test_load_checks_rank_and_world_size_whatever_the_strict_mode(tmp_path):
    d = tmp_path / "c"
    swm.save(state(), str(d), rank=0, world_size=1)
    before = tree_digest(d)
    request = lambda: {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 8), replica_id=0)}  # noqa: E731
    for strict in ("assume_ok_unexpected", "return_all"):
        e = _raises(TypeError, "rank", swm.load, request(), str(d), strict=strict, rank="0", world_size=1)
        # Through the direct API the error is a megatron-core CheckpointingException too.
        from megatron.core.dist_checkpointing.core import CheckpointingException

        assert isinstance(e, CheckpointingException)
        _raises(ValueError, "rank", swm.load, request(), str(d), strict=strict, rank=2**70, world_size=1)
        _raises(TypeError, "rank", swm.load, request(), str(d), strict=strict, rank=True, world_size=1)
        _raises(TypeError, "world_size", swm.load, request(), str(d), strict=strict, rank=0, world_size=1.0)
        _raises(ValueError, "world_size", swm.load, request(), str(d), strict=strict, rank=0, world_size=0)
        _raises(TypeError, "check_crc", swm.load, request(), str(d), strict=strict, check_crc=1)
    _raises(ValueError, "rank", swm.load, request(), str(d), strict="return_all", rank=1, world_size=1)
    _raises(TypeError, "safe_globals", swm.load, request(), str(d), safe_globals="argparse.Namespace")
    _raises(TypeError, "safe_globals", swm.load_common_state_dict, str(d), safe_globals="argparse.Namespace")
    assert torch.equal(swm.load(request(), str(d), rank=0, world_size=1)["w"], state()["w"].data)
    assert tree_digest(d) == before


def test_from_hf_to_hf_and_diff_refuse_wrong_types_before_writing(tmp_path):
    d = tmp_path / "c"
    swm.save(state(), str(d), rank=0, world_size=1)
    hf, out = tmp_path / "hf", tmp_path / "out"
    _raises(TypeError, "workers", shardwise.from_hf, str(hf), str(out), workers=True)
    _raises(TypeError, "iteration", shardwise.from_hf, str(hf), str(out), iteration=True)
    _raises(ValueError, "iteration", shardwise.from_hf, str(hf), str(out), iteration=-1)
    _raises(ValueError, "iteration", shardwise.from_hf, str(hf), str(out), iteration=2**70)
    _raises(TypeError, "tensor_model_parallel_size", shardwise.from_hf, str(hf), str(out),
            tensor_model_parallel_size="2")
    _raises(TypeError, "make_vocab_size_divisible_by", shardwise.from_hf, str(hf), str(out),
            make_vocab_size_divisible_by=128.0)
    _raises(TypeError, "workers", shardwise.to_hf, str(d), str(out), workers=True)
    _raises(ValueError, "workers", shardwise.to_hf, str(d), str(out), workers=0)
    assert not out.exists()
    # One string is not a list of patterns (it was split into its characters: "d", "e", ...).
    _raises(TypeError, "keys", shardwise.diff, str(d), str(d), keys="decoder.*")
    _raises(TypeError, "exclude", shardwise.diff, str(d), str(d), exclude="w")
    _raises(TypeError, "keys", shardwise.diff, str(d), str(d), keys=["w", 3])
    _raises(TypeError, "atol", shardwise.diff, str(d), str(d), atol="0.1")
    _raises(TypeError, "rtol", shardwise.diff, str(d), str(d), rtol=True)
    assert shardwise.diff(str(d), str(d), keys=["w"], atol=0)["equal"] == 1
    assert shardwise.diff(str(d), str(d), keys=("w*",), exclude=iter(["x"]))["equal"] == 1


def test_save_training_and_barrier_arguments_are_typed(tmp_path):
    import numpy as np

    d = tmp_path / "c"
    _raises(TypeError, "rank", swm.save, state(), str(d), rank="0", world_size=1)
    _raises(ValueError, "rank", swm.save, state(), str(d), rank=2**70, world_size=1)
    _raises(TypeError, "DPBalance dp_size", swm.DPBalance, dp_size=True, dp_rank=0)
    _raises(ValueError, "dp_rank", swm.DPBalance, dp_size=2, dp_rank=2)
    assert not d.exists()
    root = tmp_path / "root"
    _raises(TypeError, "iteration", swm.save_checkpoint, str(root), True, state(), rank=0, world_size=1)
    _raises(ValueError, "iteration", swm.save_checkpoint, str(root), -1, state(), rank=0, world_size=1)
    _raises(ValueError, "keep_last", swm.save_checkpoint, str(root), 1, state(), rank=0, world_size=1, keep_last=0)
    _raises(TypeError, "keep_last", swm.save_checkpoint, str(root), 1, state(), rank=0, world_size=1, keep_last=True)
    assert not root.exists()
    from shardwise import training

    root.mkdir()
    _raises(TypeError, "keep", training.retain, str(root), True)
    _raises(TypeError, "iteration", training.update_tracker, str(root), True)
    _raises(TypeError, "rank", shardwise.barrier, tmp_path / "b", "b1", True, 1, 1.0)
    _raises(ValueError, "rank", shardwise.barrier, tmp_path / "b", "b1", 1, 1, 1.0)
    _raises(TypeError, "world_size", shardwise.barrier, tmp_path / "b", "b1", 0, "1", 1.0)
    _raises(TypeError, "rank", shardwise.record_phase, tmp_path / "b", True, "x")
    _raises(TypeError, "load", swm.install, load=1)
    # An index of the wrong type, as a list's: a bool is not row 1; numpy's integers are indices.
    swm.save(state(), str(d), rank=0, world_size=1)
    r = shardwise.open(d)
    _raises(TypeError, "index", r.read, "w", True)
    assert torch.equal(r.read("w", np.int64(1)), r.read("w", 1))
