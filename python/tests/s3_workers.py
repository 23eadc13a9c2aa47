"""Subprocess side of the object-store fault tests. Object-store clients (and their retry settings,
read from the environment) live once per process, so each scenario runs in a fresh interpreter:

    python s3_workers.py save URL SAVE_ID ROWS TIMEOUT_S

saves a 2-rank checkpoint to URL, both ranks as threads of this process (rank 0 writes ROWS x 4096
float32 rows and merges, rank 1 writes 4 rows), and prints one JSON line: per rank, the report or
the error's class and message, and the seconds it took.

    python s3_workers.py rank URL SAVE_ID ROWS TIMEOUT_S RANK

is one rank of that save as a process of its own; its JSON line also has ``called`` and
``returned`` (``time.monotonic()``, shared by the processes of a host), then it exits normally and
prints a last JSON line ``{"atexit_done": t}`` from the atexit handler that runs last (after every
other one and after Python joined its threads: what exit waits for before native teardown).

    python s3_workers.py baseline DIR ROWS

is the same as one rank saving alone (world_size 1) to the local directory DIR: how long the exit of
such a process takes here when no store stalls.
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


def rank(url: str, save_id: str, rows: int, timeout_s: float, rank: int, world_size: int = 2) -> dict:
    import shardwise.megatron as swm

    state = _state(rank, rows if rank == 0 else 4)  # imports megatron-core: before the clock starts
    out: dict = {"rank": rank, "called": time.monotonic()}
    try:
        rep = swm.save(state, url, rank=rank, world_size=world_size, save_id=save_id, timeout_s=timeout_s)
        out.update(ok=True, report=dict(rep))
    except BaseException as e:  # noqa: BLE001
        out.update(ok=False, type=type(e).__name__, error=str(e))
    out["returned"] = time.monotonic()
    return out


if __name__ == "__main__":
    import atexit

    # Registered before anything else imports: atexit handlers run last-registered first.
    atexit.register(lambda: print(json.dumps({"atexit_done": time.monotonic()}), flush=True))
    cmd = sys.argv[1]
    if cmd == "save":
        url, save_id, rows, timeout_s = sys.argv[2:6]
        print(json.dumps(save(url, save_id, int(rows), float(timeout_s))), flush=True)
    elif cmd == "rank":
        url, save_id, rows, timeout_s, r = sys.argv[2:7]
        print(json.dumps(rank(url, save_id, int(rows), float(timeout_s), int(r))), flush=True)
    else:
        assert cmd == "baseline"
        directory, rows = sys.argv[2:4]
        print(json.dumps(rank(directory, "baseline", int(rows), 60.0, 0, world_size=1)), flush=True)
