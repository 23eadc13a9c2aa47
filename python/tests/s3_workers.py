"""Subprocess side of the object-store fault tests. Object-store clients (and their retry settings,
read from the environment) live once per process, so each scenario runs in a fresh interpreter:

    python s3_workers.py save URL SAVE_ID ROWS TIMEOUT_S

saves a 2-rank checkpoint to URL, both ranks as threads of this process (rank 0 writes ROWS x 4096
float32 rows and merges, rank 1 writes 4 rows), and prints one JSON line: per rank, the report or
the error's class and message, and the seconds it took.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch


def _state(rank: int, rows: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(rank)
    w = torch.randn(rows, 4096, generator=g)
    return {"w": ShardedTensor.from_rank_offsets(f"w{rank}", w, replica_id=0), "iteration": 3}


def save(url: str, save_id: str, rows: int, timeout_s: float) -> dict:
    import shardwise.megatron as swm

    out: dict = {}

    def run(rank: int, n: int) -> None:
        t = time.monotonic()
        try:
            rep = swm.save(_state(rank, n), url, rank=rank, world_size=2, save_id=save_id, timeout_s=timeout_s)
            out[rank] = {"ok": True, "report": dict(rep)}
        except BaseException as e:  # noqa: BLE001 - a PanicException must be reported as a failure too
            out[rank] = {"ok": False, "type": type(e).__name__, "error": str(e)}
        out[rank]["seconds"] = time.monotonic() - t

    threads = [threading.Thread(target=run, args=(0, rows)), threading.Thread(target=run, args=(1, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


if __name__ == "__main__":
    cmd, url, save_id, rows, timeout_s = sys.argv[1:6]
    assert cmd == "save"
    print(json.dumps(save(url, save_id, int(rows), float(timeout_s))), flush=True)
