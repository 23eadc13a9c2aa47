"""Issue 24: through ``install()`` every error is the class Megatron raises in that situation, with the
wording its tests match on (``test_serialization.py::test_load_error_msg`` of Megatron-LM), and the
strict ``*_all`` modes return what Megatron returns, all measured against megatron-core's own
``dist_checkpointing`` in the same spawned gloo process. The direct API's errors are shardwise's
classes that are also ``CheckpointingException``s.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

import compat_workers
from conftest import _run

import shardwise
import shardwise.megatron as swm

CHECKPOINTING = "megatron.core.dist_checkpointing.core.CheckpointingException"
TORCH_CHECKPOINT = "torch.distributed.checkpoint.api.CheckpointException"


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    _, results = _run(tmp_path_factory, "error_matrix", compat_workers.error_matrix, 1)
    return results[0]["cases"]


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    return _run(tmp_path_factory, "strict_matrix", compat_workers.strict_matrix, 2)[1]


# Situations where megatron-core 0.13-0.15 raise the raw error of their own .metadata read.
_OWN_METADATA_READ = {
    "metadata_json_without_metadata": "builtins.FileNotFoundError",
    "garbage_metadata": "_pickle.UnpicklingError",
}


def _mcore_version() -> tuple:
    from megatron.core import package_info

    return tuple(int(x) for x in package_info.__version__.split("+")[0].split(".")[:2])


def _raised(case: dict, side: str) -> dict:
    out = case[side]
    assert "mro" in out, f"{side} did not raise: {out}"
    return out


@pytest.mark.parametrize(
    "situation",
    [
        "missing_dir",
        "empty_dir",
        "load_common_missing_dir",
        "missing_tensor_key",
        "missing_object_key",
        "shape_mismatch",
        "metadata_json_without_metadata",
        "truncated_data_file",
        "missing_data_file",
        "garbage_metadata",
        "raise_unexpected",
        "raise_all",
        "integrity_mismatch",
    ],
)
def test_dropin_raises_the_class_megatron_raises(errors, situation):
    """The drop-in's exception is an instance of the class Megatron's own load raised (its most
    derived class), and is an ``Exception`` exactly when Megatron's is: torch's CheckpointException
    is a ``BaseException`` only, so ``except Exception`` treats a damaged checkpoint alike."""
    if situation not in errors:
        pytest.skip("megatron-core < 0.19 has no integrity manifest")
    megatron, dropin = _raised(errors[situation], "megatron"), _raised(errors[situation], "dropin")
    if situation in _OWN_METADATA_READ and _mcore_version() < (0, 16):
        # The documented difference (shardwise/megatron_errors.py): 0.13-0.15 read .metadata
        # themselves, outside DCP, and raise its raw error; the drop-in raises what 0.16+ raise.
        assert megatron["mro"][0] == _OWN_METADATA_READ[situation] and dropin["mro"][0] == TORCH_CHECKPOINT
        return
    assert megatron["mro"][0] in dropin["mro"], (situation, megatron["mro"][0], dropin["mro"], dropin["traceback"])
    assert dropin["is_exception"] == megatron["is_exception"], situation
    if megatron["mro"][0] == TORCH_CHECKPOINT:
        # The failure inside is shardwise's, and a CheckpointingException too.
        (failure,) = dropin["failures"].values()
        assert "shardwise.ShardwiseError" in failure and CHECKPOINTING in failure, failure


def test_load_error_msg_wording(errors, tmp_path):
    """What Megatron-LM's ``test_load_error_msg`` asserts, and Megatron's own first lines."""
    for situation in ("missing_dir", "empty_dir", "load_common_missing_dir"):
        megatron, dropin = errors[situation]["megatron"], errors[situation]["dropin"]
        assert dropin["mro"][0] == CHECKPOINTING and dropin["message"] == megatron["message"].replace("/megatron/", "/dropin/")
    assert "directory " in errors["missing_dir"]["dropin"]["message"] and "does not exist" in errors["missing_dir"]["dropin"]["message"]
    assert "is not a distributed checkpoint" in errors["empty_dir"]["dropin"]["message"]
    assert "different_key" in errors["missing_tensor_key"]["dropin"]["message"]
    assert "other_object" in errors["missing_object_key"]["dropin"]["message"]
    for situation in ("raise_unexpected", "raise_all"):
        megatron, dropin = errors[situation]["megatron"], errors[situation]["dropin"]
        assert dropin["message"] == megatron["message"], situation
    if "integrity_mismatch" in errors:
        assert errors["integrity_mismatch"]["dropin"]["message"].split(":")[0] == errors["integrity_mismatch"]["megatron"][
            "message"
        ].split(":")[0].replace("/megatron/", "/dropin/")


@pytest.mark.parametrize("mode", ["return_all", "raise_all", "log_all", "ignore_all", "return_unexpected", "raise_unexpected", "log_unexpected"])
def test_strict_modes_equal_megatron(strict, mode):
    """Every strict mode, at 2 ranks that request different keys: the drop-in's outcome (value,
    missing and unexpected keys per rank, Megatron's log lines or its exception and message) equals
    Megatron's own load's. ``*_all`` find the key no rank asked for without any collective."""
    for r in strict:
        megatron, dropin = r["modes"][mode]["megatron"], r["modes"][mode]["dropin"]
        if "mro" in megatron["outcome"]:
            assert megatron["outcome"]["mro"][0] in dropin["outcome"].get("mro", []), (r["rank"], dropin)
            assert dropin["outcome"]["message"] == megatron["outcome"]["message"]
        else:
            assert dropin["outcome"] == megatron["outcome"], (r["rank"], dropin["outcome"])
            for k in ("missing", "unexpected", "values"):
                assert dropin[k] == megatron[k], (r["rank"], k, dropin[k], megatron[k])
        assert dropin["logged"] == megatron["logged"]
    if mode == "return_all":
        assert [r["modes"][mode]["dropin"]["missing"] for r in strict] == [["c"], ["c"]]
        assert [r["modes"][mode]["dropin"]["unexpected"] for r in strict] == [["extra0"], ["extra1"]]
    # The files of the key exchange are gone once every rank has read them.
    assert all(r["keys_dirs_left"] == [] for r in strict)


def test_direct_api_errors_are_both_classes(tmp_path):
    """shardwise.megatron.load/save raise shardwise's classes that are also CheckpointingExceptions,
    picklable by name; ``except`` on either catches them."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with pytest.raises(shardwise.StorageError) as e:
        swm.load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, tmp_path / "nope")
    assert isinstance(e.value, CheckpointingException)
    assert "does not exist" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is type(e.value) and str(again) == str(e.value)

    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0))}
    swm.save(sd, tmp_path / "c", rank=0, world_size=1, timeout_s=30)
    with pytest.raises(CheckpointingException) as e:
        swm.save(sd, tmp_path / "c", rank=0, world_size=1, timeout_s=30)
    assert isinstance(e.value, shardwise.CheckpointExistsError)
    with pytest.raises(swm.KeyMismatchError) as e:
        swm.load({"b": ShardedTensor.from_rank_offsets("b", torch.zeros(2))}, tmp_path / "c", strict="raise_unexpected")
    assert isinstance(e.value, shardwise.MissingKeyError) and isinstance(e.value, CheckpointingException)
    assert "Unexpected keys (for this rank): {'b'}" in str(e.value)


def test_importing_shardwise_megatron_does_not_import_megatron():
    """The Megatron-compatible classes are made on first use: ``import shardwise.megatron`` stays
    cheap (megatron-core's import takes seconds)."""
    code = "import sys, shardwise.megatron, shardwise.megatron_errors; print('megatron.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.stdout.strip() == "False", out.stderr


def test_separation_hint_is_ignored_with_a_warning(tmp_path):
    """Megatron-LM's ``test_remove_sharded_tensors`` saves with ``separation_hint`` so that the keys
    with that prefix get files of their own; shardwise writes one data file per rank, so the
    drop-in says the hint is ignored (and what that means for ``remove_sharded_tensors``), and the
    checkpoint is complete and loads."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from shardwise import dropin

    sd = {
        "a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
        "prefix_b": ShardedTensor.from_rank_offsets("prefix_b", torch.ones(3)),
    }
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="prefix")
    with pytest.warns(UserWarning, match=r"separation_hint='prefix' is ignored.*remove_sharded_tensors"):
        dropin.dist_checkpointing_save(sd, str(tmp_path / "c"), strategy, rank=0, world_size=1, timeout_s=30)
    assert [f for f in os.listdir(tmp_path / "c") if f.endswith(".distcp")] == ["__0_0.distcp"]
    out = swm.load({"prefix_b": ShardedTensor.from_rank_offsets("prefix_b", torch.zeros(3))}, tmp_path / "c")
    assert torch.equal(out["prefix_b"], torch.ones(3))


def test_common_state_is_common_pt_which_megatron_reads(tmp_path):
    """The drop-in writes the common state as ``common.pt`` under every megatron-core (0.13-0.18
    cannot read 0.19's ``common_state`` object): the installed Megatron's own
    ``load_common_state_dict`` returns it, and ``.metadata`` (what ``load_sharded_metadata`` lists)
    holds every sharded key and, unlike 0.19's own save, no ``common_state`` (Megatron-LM's
    ``TestNonStrictLoad::test_sharded_metadata`` at 8 ranks; docs/megatron.md)."""
    import megatron.core.dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    from shardwise import dropin

    sd = {
        "a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
        "o": ShardedObject("o", {"x": 1}, (1,), (0,), replica_id=0),
        "iteration": 7,
    }
    dropin.dist_checkpointing_save(sd, str(tmp_path / "c"), rank=0, world_size=1, timeout_s=30)
    assert (tmp_path / "c" / "common.pt").exists()
    assert mdc.load_common_state_dict(str(tmp_path / "c"))["iteration"] == 7
    # What Megatron's load_sharded_metadata lists (it fails on torch 2.15 itself: `strides`).
    assert set(FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata) == {"a", "o/shard_0_1"}
