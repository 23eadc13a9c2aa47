"""The megatron-core version matrix: this file runs once per release. The full suite runs it against
the primary one (python/requirements-test.txt); ``make test-matrix`` runs it again for each older
release, installed without dependencies under ``.venv/mcore/<version>`` and put first on
PYTHONPATH, with SHARDWISE_MCORE naming the release the run must find.

Per release: the drop-in save called with that release's own signature (keywords, positions,
``save_checkpoint``'s call, async), Megatron's load of every shardwise checkpoint, and shardwise
reading the checkpoint the release's own save wrote (and its golden fixture when there is one).
With megatron-core >= 0.19 also ``verify_integrity`` against Megatron's own verified load."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os

import pytest
import torch

import mcore_workers
import shardwise
from conftest import _run
from dcp_util import bits, golden, read_all

VERSION = importlib.metadata.version("megatron-core")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return _run(tmp_path_factory, "matrix", mcore_workers.drop_in_matrix, 2)


def test_runs_against_the_expected_release():
    import megatron.core

    expected = os.environ.get("SHARDWISE_MCORE")
    if expected is not None:
        assert VERSION == expected
        assert megatron.core.__file__.startswith(os.environ["PYTHONPATH"].split(os.pathsep)[0])


def test_drop_in_takes_the_release_signature_and_megatron_loads_the_result(matrix):
    base, results = matrix
    for r in results:
        assert r["installed"]
        # 0.19 dropped common_strategy: its 4th positional parameter is validate_access_integrity.
        if VERSION.startswith(("0.13.", "0.14.", "0.15.", "0.16.", "0.17.", "0.18.")):
            assert r["params"][:2] == ["sharded_strategy", "common_strategy"]
        else:
            assert r["params"][:2] == ["sharded_strategy", "validate_access_integrity"]
            assert {"async_strategy", "verify_integrity"} <= set(r["params"])
        assert r["keywords_return"] == "None" and r["async_type"] == "AsyncRequest"
        assert set(r["save_dist_calls"]) <= mcore_workers.LOCAL_ONLY, r["save_dist_calls"]
        assert r["compared"] >= 20
        for name, bad in r["not_equal"].items():
            assert bad == [], (r["rank"], name, bad)
            assert r["content_metadata"][name] == {"matrix": True}, name
    for name in ("keywords", "positional", "save_checkpoint", "async"):
        assert (base / name / ".metadata").is_file() and (base / name / "common.pt").is_file()


def test_shardwise_reads_the_release_own_checkpoint(matrix):
    """What the release's own torch_dist save wrote (0.19: no common.pt, a common_state object)
    reads through shardwise as through plain DCP."""
    base, _ = matrix
    ckpt = base / "megatron"
    tensors, objects = read_all(str(ckpt))
    r = shardwise.open(ckpt)
    assert sorted(r.keys()) == sorted([*tensors, *objects]) and len(tensors) >= 9
    for k, t in tensors.items():
        got = r.read(k)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(bits(got), bits(t)), k
    for k, o in objects.items():
        raw = r.read_bytes(k)
        assert repr(torch.load(__import__("io").BytesIO(raw), weights_only=False)) == repr(o), k


@pytest.mark.parametrize(
    "fixture",
    [p for p in golden() if p.parent.name == "megatron" and p.name.startswith(f"core-{VERSION}_")],
    ids=lambda p: p.name,
)
def test_shardwise_reads_the_release_golden_fixture(fixture):
    expected = json.loads((fixture / "expected.json").read_text())
    assert expected["env"]["megatron_core_version"] == VERSION
    r = shardwise.open(fixture)
    tensor_keys = [k for k, v in expected["keys"].items() if v["kind"] == "tensor"]
    assert sorted(tensor_keys) == sorted(expected["tensor_keys"]) and tensor_keys
    for k in tensor_keys:
        t = r.read(k)
        assert list(t.shape) == expected["keys"][k]["shape"], k
        assert hashlib.sha256(bits(t).numpy().tobytes()).hexdigest() == expected["keys"][k]["sha256"], k


def test_verify_integrity_against_megatron_verified_load(matrix):
    base, results = matrix
    if "verify_integrity" not in results[0]["params"]:
        pytest.skip(f"megatron-core {VERSION} has no verify_integrity")
    # Every drop-in call passed verify_integrity=True: the sync (direct) and async (staged) writers.
    for name in ("keywords", "positional", "save_checkpoint", "async"):
        manifest = json.loads((base / name / "integrity.json").read_text())
        files = sorted(p.name for p in (base / name).iterdir() if p.is_file() and p.name != "integrity.json")
        assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == files, name
        for f, digest in manifest["files"].items():
            assert hashlib.sha256((base / name / f).read_bytes()).hexdigest() == digest, (name, f)
    for r in results:
        assert r["verified_not_equal"] == []
        assert "__1_0.distcp: hash mismatch" in r["damaged_load"], r["damaged_load"]
