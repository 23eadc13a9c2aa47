"""Bad input gets a clear ShardwiseError, commits nothing and leaves other directories untouched.

shardwise needs no process group, so several ranks are simulated in one process by calling
``save`` once per rank (ranks that do not merge are run with ``wait_for_commit=False`` or in threads).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

import shardwise
import shardwise.megatron as swm
from dcp_util import bits, read_all, row_shard, save_ranks, tree_digest


@pytest.fixture()
def earlier(tmp_path):
    """A committed checkpoint in a sibling directory, to prove failed saves never touch it."""
    ckpt = tmp_path / "iter_0000001"
    save_ranks(str(ckpt), [{"w": row_shard("w", r, 2)} for r in range(2)])
    return ckpt, tree_digest(ckpt)


def assert_not_committed(ckpt: Path):
    assert not (ckpt / ".metadata").exists()
    assert not (ckpt / "metadata.json").exists()


def test_all_dtypes_zero_d_and_empty_round_trip_through_plain_dcp(tmp_path):
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    g = torch.Generator().manual_seed(0)
    states = [{}, {}]
    expected = {}
    for dt in dtypes:
        if dt == torch.bool:
            full = torch.randint(0, 2, (2, 24), generator=g).bool()
        elif dt.is_floating_point and dt.itemsize == 1:  # every float8 bit pattern, NaNs included
            full = torch.randint(0, 256, (2, 24), dtype=torch.uint8, generator=g).view(dt)
        else:
            full = torch.randint(-100, 100, (2, 24), generator=g).to(dt)
        key = f"t_{str(dt).split('.')[1]}"
        expected[key] = full
        for r in range(2):
            states[r][key] = ShardedTensor.from_rank_offsets(key, full[r : r + 1].clone(), (0, r, 2), replica_id=0)
    expected["scalar"] = torch.tensor(2.5)
    states[0]["scalar"] = ShardedTensor("scalar", torch.tensor(2.5), torch.float32, (), (), (), None)
    expected["empty"] = torch.zeros(0, 4)
    states[1]["empty"] = ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 4), replica_id=0)
    states[0]["obj"] = ShardedObject("obj", {"step": 3}, (1,), (0,), replica_id=0)
    save_ranks(str(tmp_path), states)
    tensors, objects = read_all(str(tmp_path))
    assert sorted(tensors) == sorted(expected)
    for k, v in expected.items():
        assert tensors[k].dtype == v.dtype and tensors[k].shape == v.shape, k
        assert torch.equal(bits(tensors[k]), bits(v)), k
    assert objects == {"obj/shard_0_1": [{"step": 3}]}


def test_unsupported_dtype(tmp_path, earlier):
    ckpt = tmp_path / "bad"
    with pytest.raises(shardwise.UnsupportedDtypeError, match="complex64"):
        swm.save({"c": ShardedTensor.from_rank_offsets("c", torch.zeros(2, dtype=torch.complex64), replica_id=0)},
                 str(ckpt), rank=0, world_size=1)
    assert_not_committed(ckpt)
    assert not list(ckpt.glob("*.distcp")), "nothing is written before the input is checked"
    assert tree_digest(earlier[0]) == earlier[1]


def test_two_ranks_claim_the_same_chunk(tmp_path, earlier):
    ckpt = str(tmp_path / "dup")
    errors = {}

    def rank1():
        try:
            swm.save({"w": row_shard("w", 0, 2)}, ckpt, rank=1, world_size=2, timeout_s=10, save_id="s")
        except shardwise.ShardwiseError as e:
            errors[1] = e

    t = threading.Thread(target=rank1)
    t.start()
    with pytest.raises(shardwise.ValidationError, match=r"key w: rank \d and rank \d both save the same chunk"):
        swm.save({"w": row_shard("w", 0, 2)}, ckpt, rank=0, world_size=2, timeout_s=10, save_id="s")
    t.join(20)
    assert isinstance(errors.get(1), shardwise.NotCommittedError), "the waiting rank learns of the failure"
    assert "both save the same chunk" in str(errors[1])
    assert_not_committed(Path(ckpt))
    assert tree_digest(earlier[0]) == earlier[1]


def test_coverage_gap(tmp_path):
    states = [{"w": row_shard("w", 0, 3)}, {"w": row_shard("w", 1, 3)}]  # rows 8..12 of 12 never saved
    with pytest.raises(shardwise.ValidationError, match=r"key w: the saved chunks cover 64 of 96 elements"):
        save_ranks(str(tmp_path), states)
    assert_not_committed(tmp_path)


@pytest.mark.parametrize("what", ["dtype", "shape"])
def test_global_shape_or_dtype_disagree(tmp_path, what):
    other = row_shard("w", 1, 2, dtype=torch.bfloat16) if what == "dtype" else row_shard("w", 1, 2, cols=4)
    with pytest.raises(shardwise.ValidationError, match=r"key w: rank \d saves it as"):
        save_ranks(str(tmp_path), [{"w": row_shard("w", 0, 2)}, {"w": other}])
    assert_not_committed(tmp_path)


def test_world_size_disagrees(tmp_path):
    swm.save({"w": row_shard("w", 1, 2)}, str(tmp_path), rank=1, world_size=3, timeout_s=5, wait_for_commit=False, save_id="s")
    with pytest.raises(shardwise.ValidationError, match="world_size disagrees across ranks: rank 1 saved with world_size 3"):
        swm.save({"w": row_shard("w", 0, 2)}, str(tmp_path), rank=0, world_size=2, timeout_s=5, save_id="s")
    assert_not_committed(tmp_path)


def test_missing_rank_times_out_naming_it(tmp_path, earlier):
    import time

    swm.save({"w": row_shard("w", 1, 3)}, str(tmp_path), rank=1, world_size=3, timeout_s=1, wait_for_commit=False, save_id="s")
    t0 = time.monotonic()
    with pytest.raises(shardwise.MissingRanksError, match=r"parts of ranks \[2\] \(world_size 3"):
        swm.save({"w": row_shard("w", 0, 3)}, str(tmp_path), rank=0, world_size=3, timeout_s=1.0, save_id="s")
    assert time.monotonic() - t0 < 10
    assert_not_committed(tmp_path)
    assert tree_digest(earlier[0]) == earlier[1]
    # The late rank shows up afterwards: `shardwise merge` finishes the save.
    swm.save({"w": row_shard("w", 2, 3)}, str(tmp_path), rank=2, world_size=3, timeout_s=1, wait_for_commit=False, save_id="s")
    from shardwise import _native

    assert _native.cli_main(["shardwise", "merge", str(tmp_path)]) == 0
    tensors, _ = read_all(str(tmp_path))
    assert tensors["w"].shape == (12, 8)


def test_stale_parts_of_a_crashed_attempt_are_never_merged(tmp_path):
    # Attempt A: only rank 1 got as far as publishing its part.
    swm.save({"w": row_shard("w", 1, 2)}, str(tmp_path), rank=1, world_size=2, save_id="attemptA", wait_for_commit=False)
    # Attempt B: rank 1 has not arrived yet; rank 0 must not pick up attempt A's part.
    with pytest.raises(shardwise.MissingRanksError, match=r"ranks \[1\]"):
        swm.save({"w": row_shard("w", 0, 2)}, str(tmp_path), rank=0, world_size=2, save_id="attemptB", timeout_s=0.5)
    assert_not_committed(tmp_path)
    # Attempt C with both ranks commits; the state of A and B is removed at the commit.
    save_ranks(str(tmp_path), [{"w": row_shard("w", r, 2)} for r in range(2)], save_id="attemptC")
    assert sorted(p.name for p in (tmp_path / ".shardwise").iterdir() if p.is_dir()) == ["attemptC"]
    assert read_all(str(tmp_path))[0]["w"].shape == (8, 8)


def test_directory_cannot_be_written(tmp_path, earlier):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(shardwise.StorageError, match="create directory"):
        swm.save({"w": row_shard("w", 0, 1)}, str(blocker / "ckpt"), rank=0, world_size=1)
    assert tree_digest(earlier[0]) == earlier[1]


def test_a_file_given_as_the_checkpoint_directory_is_named_as_such(tmp_path):
    """A file where a checkpoint directory belongs (issue 25): every entry point says it is not a
    directory, as a StorageError (as for a missing directory), and the file is left as it was."""
    f = tmp_path / "model.pt"
    f.write_bytes(b"not a checkpoint")
    calls = {
        "save": lambda: swm.save({"w": row_shard("w", 0, 1)}, str(f), rank=0, world_size=1),
        "open": lambda: shardwise.open(f),
        "load": lambda: swm.load({"w": row_shard("w", 0, 1)}, str(f)),
        "load_common_state_dict": lambda: swm.load_common_state_dict(str(f)),
    }
    for name, call in calls.items():
        with pytest.raises(shardwise.StorageError, match="not a (checkpoint )?directory") as e:
            call()
        assert "common.pt" not in str(e.value), (name, e.value)
    assert f.read_bytes() == b"not a checkpoint"


def test_committed_checkpoint_is_not_overwritten_by_default(tmp_path, earlier):
    ckpt, digest = earlier
    with pytest.raises(shardwise.CheckpointExistsError):
        swm.save({"w": row_shard("w", 0, 1)}, str(ckpt), rank=0, world_size=1)
    assert tree_digest(ckpt) == digest
    swm.save({"w": row_shard("w", 0, 1, rows=2)}, str(ckpt), rank=0, world_size=1, overwrite=True)
    tensors, _ = read_all(str(ckpt))
    assert tensors["w"].shape == (2, 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), "rank 2 is not in"),
        (dict(rank=0, world_size=1, save_id="../x"), "save_id"),
        (dict(rank=0, world_size=1, timeout_s=float("nan")), "timeout_s"),
        (dict(rank=0, world_size=1, merge_rank=3), "merge_rank 3"),
    ],
)
def test_invalid_arguments(tmp_path, kwargs, match):
    with pytest.raises(shardwise.InvalidArgumentError, match=match):
        swm.save({"w": row_shard("w", 0, 1)}, str(tmp_path / "x"), **kwargs)
    assert_not_committed(tmp_path / "x")


def test_non_main_replicas_are_not_written(tmp_path):
    states = [{"w": row_shard("w", 0, 1), "b": row_shard("b", 0, 1, replica_id=(0, 0, 0))},
              {"w": row_shard("w", 0, 1, replica_id=1), "b": row_shard("b", 0, 1, replica_id=(0, 1, 0))}]
    save_ranks(str(tmp_path), states)
    assert [p.name for p in tmp_path.glob("*.distcp")] == ["__0_0.distcp"]


def test_absurd_staging_budget_is_an_error_not_an_abort(tmp_path):
    # 1 << 62 bytes asked for 2**36 buffer slots: the bookkeeping allocation aborted the process.
    import subprocess
    import sys

    ck = tmp_path / "ck"
    save_ranks(str(ck), [{"w": row_shard("w", 0, 1)}])
    code = (
        "import sys, torch, shardwise, shardwise.megatron as swm\n"
        "from megatron.core.dist_checkpointing.mapping import ShardedTensor\n"
        "md = shardwise.open(sys.argv[1]).metadata('w')\n"
        "t = torch.empty(md['global_shape'], dtype=getattr(torch, md['dtype']))\n"
        "try:\n"
        "    swm.load({'w': ShardedTensor.from_rank_offsets('w', t, replica_id=0)}, sys.argv[1], staging_budget_bytes=1 << 62)\n"
        "except shardwise.InvalidArgumentError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "cannot be allocated" in out.stdout, out.stdout
