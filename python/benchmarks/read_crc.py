"""Cost of the CRC-32 check on reads: ``shardwise.open(...).read`` / ``read_bytes`` of the same
checkpoint with the check (shardwise's checksum sidecar present) and without it (a twin directory
whose data files are hard links to the same inodes, without the sidecar, as a torch- or
Megatron-written checkpoint reads). The page cache is warm and shared by both, so the numbers are
the worst case for the check: no disk time hides it.

Each repetition opens the checkpoint afresh (the reader hashes an item once per open checkpoint);
the two variants alternate and the median is reported.

Run: python python/benchmarks/read_crc.py --dir /tmp/readcrc [--big-mib 64 --big 16 --small 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import uuid


def build(ckpt, big, big_mib, small, small_kib):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import shardwise.megatron as swm

    g = torch.Generator().manual_seed(0)
    sd = {}
    rows = big_mib * (1 << 20) // (4 * 1024)
    for i in range(big):
        sd[f"big.{i}"] = ShardedTensor.from_rank_offsets(f"big.{i}", torch.randn(rows, 1024, generator=g), replica_id=0)
    n = small_kib * 1024 // 4
    for i in range(small):
        sd[f"small.{i}"] = ShardedTensor.from_rank_offsets(f"small.{i}", torch.randn(n, generator=g), replica_id=0)
    for i in range(small // 10):
        sd[f"obj.{i}"] = ShardedObject(f"obj.{i}", {"step": i, "blob": bytes(256)}, (1,), (0,), replica_id=0)
    swm.save(sd, ckpt, rank=0, world_size=1, save_id=uuid.uuid4().hex, timeout_s=60)


def twin_without_sidecar(ckpt, twin):
    os.makedirs(twin)
    for name in os.listdir(ckpt):
        src = os.path.join(ckpt, name)
        if os.path.isfile(src):
            os.link(src, os.path.join(twin, name))  # same inodes: the same cached pages


def run(path, keys_big, keys_small, keys_obj):
    import shardwise

    r = shardwise.open(path)
    t0 = time.perf_counter()
    nbytes = 0
    for k in keys_big:
        nbytes += r.read(k).numel() * 4
    t_big = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys_small:
        r.read(k)
    t_small = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys_obj:
        r.read_bytes(k)
    t_obj = time.perf_counter() - t0
    return {"big_gb_s": nbytes / t_big / 1e9, "small_reads_s": len(keys_small) / t_small,
            "object_reads_s": len(keys_obj) / t_obj}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--big", type=int, default=16)
    ap.add_argument("--big-mib", type=int, default=64)
    ap.add_argument("--small", type=int, default=4000)
    ap.add_argument("--small-kib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    checked, unchecked = os.path.join(a.dir, "checked"), os.path.join(a.dir, "unchecked")
    build(checked, a.big, a.big_mib, a.small, a.small_kib)
    twin_without_sidecar(checked, unchecked)
    import shardwise

    r = shardwise.open(checked)
    keys = r.keys()
    big = [k for k in keys if k.startswith("big.")]
    small = [k for k in keys if k.startswith("small.")]
    obj = [k for k in keys if k.startswith("obj.")]
    run(unchecked, big, small, obj)  # warm the page cache
    res = {"checked": [], "unchecked": []}
    for _ in range(a.reps):
        for name, path in (("unchecked", unchecked), ("checked", checked)):
            res[name].append(run(path, big, small, obj))
    med = {name: {m: statistics.median(x[m] for x in runs) for m in runs[0]} for name, runs in res.items()}
    med["ratio_checked_over_unchecked"] = {m: med["checked"][m] / med["unchecked"][m] for m in med["checked"]}
    med["setup"] = {"big": a.big, "big_mib": a.big_mib, "small": a.small, "small_kib": a.small_kib,
                    "objects": len(obj), "reps": a.reps, "cpus": os.cpu_count()}
    print(json.dumps(med, indent=2))


if __name__ == "__main__":
    main()
