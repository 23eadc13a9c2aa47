"""torch 2.15's `.metadata` (TensorProperties as a 6-tuple with strides, StorageMeta) cannot be read
by torch <= 2.14: ``shardwise verify --torch-compat 2.X`` says so and why, ``shardwise
rewrite-metadata --torch-compat 2.X`` rewrites `.metadata` into the older form (data files
untouched), and then the real torch 2.3.1 (the side venv of test_torch231.py) loads bitwise what
torch 2.15 loads. shardwise's own reader reads both forms."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

import shardwise
from dcp_util import bits, read_all
from test_torch231 import SCRIPT, TESTS, TORCH231


def cli(*args):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(6, 5, generator=g),
        "wt": torch.randn(5, 6, generator=g).t(),  # strided: 2.15 records strides (1, 6)
        "h": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "i": torch.arange(-5, 7, dtype=torch.int64),
        "step": 12,
        "sched": {"lr": 0.5},
    }


def test_a_torch_2_15_checkpoint_rewritten_loads_in_torch_2_3(tmp_path):
    ck = tmp_path / "ck"
    dcp.save(_state(), checkpoint_id=str(ck), no_dist=True)
    data_before = {p.name: p.read_bytes() for p in ck.iterdir() if p.name != ".metadata"}
    want_tensors, want_objects = read_all(str(ck))

    old = subprocess.run([str(TORCH231), "-c", SCRIPT, str(TESTS), str(ck)], capture_output=True, text=True,
                         timeout=300)
    assert old.returncode != 0 and "too many values to unpack" in old.stderr + old.stdout, old.stderr[-2000:]

    v = cli("verify", ck, "--torch-compat", "2.3", "--json")
    assert v.returncode == 1, v.stdout + v.stderr
    reasons = [p["message"] for p in json.loads(v.stdout)["problems"]]
    assert any("6-tuples" in r for r in reasons) and any("StorageMeta" in r for r in reasons), reasons
    v14 = cli("verify", ck, "--torch-compat", "2.14", "--json")
    only = [p["message"] for p in json.loads(v14.stdout)["problems"]]
    assert len(only) == 1 and "6-tuples" in only[0] and "torch 2.14" in only[0], only
    ok = cli("verify", ck, "--torch-compat", "2.15")
    assert ok.returncode == 0 and "torch 2.15 reads" in ok.stdout, ok.stdout + ok.stderr

    r = cli("rewrite-metadata", ck, "--torch-compat", "2.3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert not out["unchanged"] and len(out["removed"]) == 2, out
    assert {p.name: p.read_bytes() for p in ck.iterdir() if p.name != ".metadata"} == data_before
    assert cli("verify", ck, "--torch-compat", "2.3").returncode == 0

    new = subprocess.run([str(TORCH231), "-c", SCRIPT, str(TESTS), str(ck)], capture_output=True, text=True,
                         timeout=300)
    assert new.returncode == 0, new.stderr[-3000:]
    got = json.loads(new.stdout.strip().splitlines()[-1])
    assert got["torch"].startswith("2.3.1")
    import hashlib

    assert got["tensors"] == {k: [str(t.dtype), list(t.shape), hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()]
                              for k, t in want_tensors.items()}
    assert set(got["objects"]) == set(want_objects)
    # torch 2.15 and shardwise's own reader still read it, the same tensors
    tensors, objects = read_all(str(ck))
    assert all(torch.equal(bits(tensors[k]), bits(want_tensors[k])) for k in want_tensors) and objects == want_objects
    reader = shardwise.open(str(ck))
    assert all(torch.equal(bits(reader.read(k)), bits(want_tensors[k])) for k in want_tensors)
    again = cli("rewrite-metadata", ck, "--torch-compat", "2.3")
    assert again.returncode == 0 and "nothing rewritten" in again.stdout


def test_what_no_rewrite_fixes_is_refused(tmp_path):
    """uint16 tensors load in no torch 2.4-2.5 whatever `.metadata` says: said, and nothing is written."""
    ck = tmp_path / "ck"
    dcp.save({"u": torch.arange(4, dtype=torch.int32).to(torch.uint16), "w": torch.ones(2)}, checkpoint_id=str(ck), no_dist=True)
    before = (ck / ".metadata").read_bytes()
    v = cli("verify", ck, "--torch-compat", "2.5")
    assert v.returncode == 1 and "uint16" in v.stdout and "no rewrite" in v.stdout, v.stdout + v.stderr
    r = cli("rewrite-metadata", ck, "--torch-compat", "2.5")
    assert r.returncode == 1 and "uint16" in r.stderr, r.stderr
    assert (ck / ".metadata").read_bytes() == before
