"""Ctrl-C during a save's write stops the save before anything is published (docs/guarantees.md,
"SIGINT / KeyboardInterrupt"): the save raises KeyboardInterrupt saying nothing was committed, and
leaves neither `.metadata` nor its partial data file; a rerun into the same directory commits.

The save runs in a real child process (SIGINT to a process started in the background by a shell
would be ignored), signalled as soon as its data file appears, so the write of 1 GiB is under way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import shardwise

SAVE = """
import sys, torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
import shardwise.megatron as swm
d, mib = sys.argv[1], int(sys.argv[2])
sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((mib << 18,), float(i)))
      for i in range(8)}
print("saving", flush=True)
try:
    swm.save(sd, d, rank=0, world_size=1)
except KeyboardInterrupt as e:
    print("KeyboardInterrupt:", e, flush=True)
else:
    print("saved", flush=True)
"""


def start_save(tmp_path: Path, ckpt: Path, mib: int) -> subprocess.Popen:
    """A child process that saves 8 tensors of `mib` MiB each into `ckpt` as rank 0 of 1."""
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    return subprocess.Popen([sys.executable, str(script), str(ckpt), str(mib)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_ctrl_c_during_the_write_stops_the_save_and_a_rerun_commits(tmp_path):
    ckpt = tmp_path / "c"
    data = ckpt / "__0_0.distcp"
    p = start_save(tmp_path, ckpt, 128)
    assert p.stdout.readline().strip() == "saving", p.stderr.read()
    deadline = time.monotonic() + 60
    while not data.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.002)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.startswith("KeyboardInterrupt:") and "nothing committed" in out, (out, err)
    assert not (ckpt / ".metadata").exists(), "nothing committed"
    assert not data.exists(), "the partial data file was removed"

    rerun = start_save(tmp_path, ckpt, 1)
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0 and out.splitlines() == ["saving", "saved"], (out, err)
    assert (ckpt / ".metadata").exists()
    assert torch.equal(shardwise.open(ckpt).read("w3"), torch.full((1 << 18,), 3.0))
