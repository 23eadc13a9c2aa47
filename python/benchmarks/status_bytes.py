"""Bytes that ``shardwise status`` reads on a committed save, against the size of its ``.metadata``
(issue 37 item 3), and what ``committed_iterations`` (retention) reads on the same save.

``make`` saves one committed checkpoint of ``--chunks`` tensor chunks: ``--ranks`` ranks played by
this process (the way the tests do), every key row-split over all ranks, 1 x 1 float32 chunks, so
the save is all metadata. ``bench`` measures, in this process, the bytes read through read(2) and
its kin (``rchar`` of ``/proc/self/io``) by one call of each function after a first call (imports,
first-use costs). ``shardwise status`` (the CLI) runs the same Rust function as
``shardwise.status``.

Run (any shardwise build can ``bench`` a save another made, to compare releases):
    python python/benchmarks/status_bytes.py make /tmp/status37/iter_0000001 --chunks 300000
    python python/benchmarks/status_bytes.py bench /tmp/status37/iter_0000001
"""

from __future__ import annotations

import argparse
import os
import time
import uuid


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def make(ckpt: str, chunks: int, ranks: int) -> None:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import shardwise.megatron as swm

    keys = chunks // ranks
    sid = uuid.uuid4().hex
    t0 = time.perf_counter()
    for rank in range(ranks - 1, -1, -1):  # the merging rank 0 last, as a launch's ranks would end
        state = {f"decoder.layers.{i}.mlp.weight": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.mlp.weight", torch.full((1, 1), float(rank)), (0, rank, ranks))
            for i in range(keys)}
        swm.save(state, ckpt, rank=rank, world_size=ranks, save_id=sid, timeout_s=600,
                 wait_for_commit=False)
    print(f"saved {keys * ranks:,} chunks ({keys:,} keys x {ranks} ranks) in {time.perf_counter() - t0:.1f} s")


def bench(ckpt: str) -> None:
    import shardwise
    import shardwise.megatron as swm

    meta = os.path.getsize(os.path.join(ckpt, ".metadata"))
    parts = sum(e.stat().st_size for d in os.scandir(os.path.join(ckpt, ".shardwise")) if d.is_dir()
                for e in os.scandir(d.path) if e.name.endswith(".part"))
    root = os.path.dirname(os.path.abspath(ckpt))
    calls = {
        "shardwise.status(d)": lambda: shardwise.status(ckpt),
        "shardwise.status(d, keys=True)": lambda: shardwise.status(ckpt, keys=True),
        "committed_iterations(root)": lambda: swm.committed_iterations(root),
    }
    print(f".metadata {meta / 2**20:.2f} MiB, parts {parts / 2**20:.2f} MiB")
    for name, call in calls.items():
        try:
            call()
        except TypeError as e:  # a build without keys=
            print(f"{name}: {e}")
            continue
        before = bytes_read()
        call()
        read = bytes_read() - before
        print(f"{name}: {read / 2**20:.3f} MiB ({read:,} B, {100 * read / meta:.2f} % of .metadata)")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("ckpt")
    m.add_argument("--chunks", type=int, default=300_000)
    m.add_argument("--ranks", type=int, default=4)
    b = sub.add_parser("bench")
    b.add_argument("ckpt")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.ckpt, a.chunks, a.ranks)
    else:
        bench(a.ckpt)


if __name__ == "__main__":
    main()
