"""Stress: N simulated rank processes save M times into fresh directories while a background process
loads memory and the disk; every save must commit and pass ``shardwise verify``.

    python python/benchmarks/stress_save.py --ranks 64 --saves 50 --root /tmp/stress

Each rank process holds a ``rows x 1024`` float32 row shard of ``w`` (4 KiB a row) and a small
ShardedObject, and calls ``shardwise.megatron.save`` once per save with an explicit save id (rank 0
merges; the others wait for the commit, which is what paces them). Processes come from a forkserver
that imported torch, megatron-core and shardwise once. Prints one JSON line: saves, failures,
verify failures, and per-save seconds (rank 0's write + rendezvous) p50/p99/max; exit 1 on any
failure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time


def rank_main(root: str, rank: int, world: int, saves: int, rows: int, timeout_s: float, out: str) -> None:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import shardwise.megatron as swm

    data = (torch.arange(rows * 1024, dtype=torch.float32) + rank).reshape(rows, 1024)
    results = []
    for i in range(saves):
        state = {
            "w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world), replica_id=0),
            "step": ShardedObject("step", {"i": i}, (world,), (rank,), replica_id=0),
        }
        t0 = time.monotonic()
        try:
            rep = swm.save(state, os.path.join(root, f"save_{i:04d}"), rank=rank, world_size=world,
                           save_id=f"stress{i}", timeout_s=timeout_s)
            results.append({"i": i, "ok": bool(rep["committed"]), "s": time.monotonic() - t0})
        except Exception as e:  # noqa: BLE001 - counted and reported
            results.append({"i": i, "ok": False, "s": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"})
    with open(out, "w") as f:
        json.dump(results, f)


def load_main(scratch: str, mem_mb: int, disk_mb: int, stop_path: str) -> None:
    """Background load: keeps ``mem_mb`` MiB resident (touched every round) and rewrites and fsyncs a
    ``disk_mb`` MiB file in a loop until ``stop_path`` exists."""
    hog = bytearray(mem_mb << 20)
    block = os.urandom(1 << 20)
    path = os.path.join(scratch, "disk_load.bin")
    while not os.path.exists(stop_path):
        for k in range(0, len(hog), 4096):
            hog[k] = (hog[k] + 1) & 0xFF
        with open(path, "wb") as f:
            for _ in range(disk_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    os.unlink(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="scratch directory (created; save_* dirs are removed after verify)")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--rows", type=int, default=64, help="rows of 4 KiB per rank")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds, every wait of a save")
    ap.add_argument("--load-mem-mb", type=int, default=1024)
    ap.add_argument("--load-disk-mb", type=int, default=256)
    args = ap.parse_args(argv)

    os.makedirs(args.root, exist_ok=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megatron.core.dist_checkpointing.mapping", "shardwise.megatron"])
    stop = os.path.join(args.root, "STOP")
    loader = ctx.Process(target=load_main, args=(args.root, args.load_mem_mb, args.load_disk_mb, stop))
    loader.start()
    t0 = time.monotonic()
    procs = [ctx.Process(target=rank_main, args=(args.root, r, args.ranks, args.saves, args.rows, args.timeout,
                                                 os.path.join(args.root, f"rank{r}.json")))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    wall = time.monotonic() - t0
    open(stop, "w").close()
    loader.join()
    os.unlink(stop)

    from shardwise import _native

    failures, verify_failures, per_save = [], [], []
    for r, p in enumerate(procs):
        path = os.path.join(args.root, f"rank{r}.json")
        if not os.path.exists(path):
            failures.append(f"rank {r}: no result (exit code {p.exitcode})")
            continue
        with open(path) as f:
            res = json.load(f)
        failures += [f"rank {r} save {x['i']}: {x.get('error')}" for x in res if not x["ok"]]
        if r == 0:
            per_save = [x["s"] for x in res if x["ok"]]
        os.unlink(path)
    for i in range(args.saves):
        d = os.path.join(args.root, f"save_{i:04d}")
        if _native.cli_main(["shardwise", "verify", d]) != 0:
            verify_failures.append(d)
        else:
            shutil.rmtree(d)
    q = statistics.quantiles(per_save, n=100, method="inclusive") if len(per_save) >= 2 else [float("nan")] * 99
    print(json.dumps({
        "ranks": args.ranks, "saves": args.saves, "bytes_per_rank": args.rows * 4096,
        "committed": len(per_save), "failures": len(failures), "verify_failures": len(verify_failures),
        "save_s_p50": round(q[49], 3), "save_s_p99": round(q[98], 3),
        "save_s_max": round(max(per_save), 3) if per_save else None, "wall_s": round(wall, 1),
        "first_failures": failures[:5],
    }))
    return 0 if not failures and not verify_failures and len(per_save) == args.saves else 1


if __name__ == "__main__":
    sys.exit(main())
