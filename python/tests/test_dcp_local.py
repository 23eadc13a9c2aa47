"""torch DCP's collective-free save (``dcp.save(..., use_collectives=False)``, 4 gloo ranks) made
reshardable: ``shardwise merge`` / ``shardwise.dcp.finish`` validate the rank-local
``__{rank}.metadata`` files together and commit the global ``.metadata``; then plain, unmodified
``torch.distributed.checkpoint.load`` reads it bitwise at 1 and 2 ranks. Bad inputs (a missing
rank, two saves mixed, overlapping chunks, a foreign ``.metadata``) are refused with nothing
written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_workers
import shardwise
import shardwise.dcp
from dcp_util import bits, read_all
from mcore import spawn

STEP = 7


def cli(*args):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _spawn(fn, world, base: Path, *args):
    results = spawn(fn, world, str(base / f"out-{fn.__name__}-{world}"), *args, timeout_s=600)
    failed = [r for r in results if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    return results


@pytest.fixture(scope="module")
def rank_local(tmp_path_factory):
    """A DCP use_collectives=False save of 4 gloo ranks (no .metadata), never modified: tests copy it."""
    base = tmp_path_factory.mktemp("dcp_local")
    ckpt = base / "step"
    _spawn(dcp_workers.save, 4, base, str(ckpt), STEP)
    return ckpt


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copy2)  # keeps mtimes: a copy is not a rewrite
    return dst


def test_the_save_has_only_rank_local_metadata(rank_local):
    names = sorted(p.name for p in rank_local.iterdir())
    assert ".metadata" not in names
    assert [f"__{r}.metadata" for r in range(4)] == [n for n in names if n.endswith(".metadata")]


def test_merge_makes_it_loadable_by_plain_dcp_at_1_and_2_ranks(rank_local, tmp_path):
    ckpt = _copy(rank_local, tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    r = cli("merge", ckpt, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ranks"] == 4 and not s["already_merged"]
    # model.scale and step on ranks 1-3 are replicas of rank 0's
    assert s["replicas_dropped"] == 6, s
    assert s["keys"] == len(dcp_workers.SHAPES) + 2 + 4
    # only .metadata was added: no data or rank-local file touched
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.name != ".metadata"} == before

    # 1 rank, no process group: plain tensors
    tensors, objects = read_all(str(ckpt))
    for key in dcp_workers.SHAPES:
        assert torch.equal(bits(tensors[key]), bits(dcp_workers.full(key, STEP))), key
    assert torch.equal(tensors["model.scale"], dcp_workers.replicated(STEP))
    assert objects["step"] == STEP
    assert [objects[f"dataloader.rank{r}.pos"] for r in range(4)] == [100 * r + STEP for r in range(4)]
    # 2 ranks over gloo, DTensors resharded from 4 to 2
    results = _spawn(dcp_workers.load, 2, tmp_path, str(ckpt), STEP)
    assert [r["wrong"] for r in results] == [[], []]

    v = cli("verify", ckpt, "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["problems"] == [], v.stdout + v.stderr
    again = cli("merge", ckpt, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["already_merged"], again.stdout + again.stderr


def test_finish_from_python_with_the_world_size(rank_local, tmp_path):
    ckpt = _copy(rank_local, tmp_path / "ck")
    s = shardwise.dcp.finish(ckpt, world_size=4, timeout_s=5)
    assert s["ranks"] == 4 and not s["already_merged"]
    assert shardwise.dcp.finish(str(ckpt))["already_merged"]
    with pytest.raises(shardwise.ValidationError, match=r"ranks 4-5"):
        shardwise.dcp.finish(ckpt, world_size=6, timeout_s=0.5)
    with pytest.raises(shardwise.ValidationError, match=r"ranks 2-3 have rank-local metadata, beyond world_size 2"):
        shardwise.dcp.finish(ckpt, world_size=2)


def _refused(ckpt: Path, *match: str) -> None:
    r = cli("merge", ckpt)
    assert r.returncode == 1, r.stdout + r.stderr
    for m in match:
        assert m in r.stderr, r.stderr
    assert "nothing committed" in r.stderr, r.stderr
    assert not (ckpt / ".metadata").exists()


def test_a_missing_rank_is_refused(rank_local, tmp_path):
    ckpt = _copy(rank_local, tmp_path / "middle")
    (ckpt / "__2.metadata").unlink()
    _refused(ckpt, "ranks 2 is missing")
    last = _copy(rank_local, tmp_path / "last")
    (last / "__3.metadata").unlink()  # its data file is there: rank 3 did not finish
    _refused(last, "ranks 3 wrote data files")


def test_a_data_file_rewritten_after_its_metadata_is_refused(rank_local, tmp_path):
    """A later save that rewrote rank 1's data and died before its metadata."""
    ckpt = _copy(rank_local, tmp_path / "ck")
    data = ckpt / "__1_0.distcp"
    st = os.stat(ckpt / "__1.metadata")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    _refused(ckpt, "rank 1: __1_0.distcp was modified", "two saves mixed")


def test_a_rerun_at_another_world_size_into_the_same_directory_is_refused(rank_local, tmp_path):
    """Ranks 0 and 1 of a 2-rank save replaced their files; ranks 2 and 3 of the 4-rank save are
    left: their row chunks overlap the new ones."""
    ckpt = _copy(rank_local, tmp_path / "ck")
    _spawn(dcp_workers.save, 2, tmp_path, str(ckpt), STEP + 1)
    _refused(ckpt, "overlapping chunks")


def test_a_later_save_into_a_merged_directory_is_caught_and_finished(rank_local, tmp_path):
    """The next step saved into the same directory rewrites the data and rank-local files but not
    the merged .metadata, which torch reads first: verify reports it stale, and finish replaces it,
    after which plain DCP reads the new step's values."""
    ckpt = _copy(rank_local, tmp_path / "ck")
    assert not shardwise.dcp.finish(ckpt, world_size=4)["replaced_stale"]
    _spawn(dcp_workers.save, 4, tmp_path, str(ckpt), STEP + 1)
    v = cli("verify", ckpt, "--json")
    assert v.returncode == 1, v.stdout + v.stderr
    (problem,) = json.loads(v.stdout)["problems"]
    assert problem["key"] == ".metadata" and "stale" in problem["message"], problem
    assert "__0.metadata" in problem["message"] and "__3.metadata" in problem["message"], problem
    s = shardwise.dcp.finish(ckpt, world_size=4)
    assert s["replaced_stale"] and not s["already_merged"], s
    tensors, objects = read_all(str(ckpt))
    for key in dcp_workers.SHAPES:
        assert torch.equal(bits(tensors[key]), bits(dcp_workers.full(key, STEP + 1))), key
    assert objects["step"] == STEP + 1
    assert json.loads(cli("verify", ckpt, "--json").stdout)["problems"] == []


def test_a_foreign_metadata_is_left_alone(rank_local, tmp_path):
    ckpt = _copy(rank_local, tmp_path / "ck")
    (ckpt / ".metadata").write_bytes(b"an older save's .metadata")
    r = cli("merge", ckpt)
    assert r.returncode == 1 and "already holds a .metadata" in r.stderr, r.stderr
    assert (ckpt / ".metadata").read_bytes() == b"an older save's .metadata"


def test_a_damaged_rank_file_is_an_error_not_a_crash(rank_local, tmp_path):
    ckpt = _copy(rank_local, tmp_path / "ck")
    p = ckpt / "__1.metadata"
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(shardwise.CorruptFileError, match="__1.metadata"):
        shardwise.dcp.finish(ckpt)
    assert not (ckpt / ".metadata").exists()
