"""shardwise output loaded by plain torch.distributed.checkpoint of torch 2.3.1 (the oldest torch the
max-compat profile targets), in the side venv the Makefile installs (``.venv/torch231``), compared
bitwise with what torch 2.15's DCP loads from the same checkpoint."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

from dcp_util import bits, read_all, row_shard, save_ranks

TORCH231 = Path(sys.prefix) / "torch231" / "bin" / "python"
TESTS = Path(__file__).resolve().parent

# Run by torch 2.3.1: loads with dcp_util.read_all (plain DCP, one process) and prints, per key,
# dtype, shape and the sha256 of the raw bytes (tensors) or the repr (objects).
SCRIPT = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
import torch
from dcp_util import bits, read_all
tensors, objects = read_all(sys.argv[2])
print(json.dumps({
    "torch": torch.__version__,
    "tensors": {k: [str(t.dtype), list(t.shape), hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()] for k, t in tensors.items()},
    "objects": {k: repr(o) for k, o in objects.items()},
}))
"""


def _summary(ckpt: str) -> dict:
    tensors, objects = read_all(ckpt)
    return {
        "tensors": {k: [str(t.dtype), list(t.shape), hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()] for k, t in tensors.items()},
        "objects": {k: repr(o) for k, o in objects.items()},
    }


def _load_with_torch231(ckpt) -> dict:
    assert TORCH231.exists(), f"{TORCH231} is missing: run `make setup`"
    out = subprocess.run([str(TORCH231), "-c", SCRIPT, str(TESTS), str(ckpt)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch231_loads_a_megatron_gpt_saved_by_shardwise(tp2dp2):
    base, _ = tp2dp2
    got = _load_with_torch231(base / "shardwise")
    assert got["torch"].startswith("2.3.1")
    want = _summary(str(base / "shardwise"))
    assert len(want["tensors"]) >= 10 and len(want["objects"]) >= 4
    assert got["tensors"] == want["tensors"] and got["objects"] == want["objects"]


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool]


def test_torch231_loads_every_dtype(tmp_path):
    states = [{f"w{i}": row_shard(f"w{i}", r, 2, dtype=d) for i, d in enumerate(DTYPES)} for r in range(2)]
    save_ranks(str(tmp_path / "ckpt"), states)
    got = _load_with_torch231(tmp_path / "ckpt")
    assert got["tensors"] == _summary(str(tmp_path / "ckpt"))["tensors"]
    assert [got["tensors"][f"w{i}"][:2] for i in range(len(DTYPES))] == [[str(d), [8, 8]] for d in DTYPES]
