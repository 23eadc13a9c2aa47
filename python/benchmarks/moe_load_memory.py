"""Extra memory of a resharded CPU load of many MoE-like ShardedTensors (issue 37 item 2):
``shardwise.megatron.load`` beside megatron-core's ``dist_checkpointing.load`` on the same request.

2 gloo ranks save ``--tensors`` expert weights of ``rows x cols`` fp32 each, split by rows (rank r
holds rows r*rows/2...); the load asks for them split by columns, so no saved chunk is a contiguous
part of a destination and every byte passes through the loader's buffers. Each loader runs in fresh
processes (alternating, ``--runs`` each); every rank allocates its destinations, resets its peak
RSS (``/proc/self/clear_refs``) and loads once. Reported: the peak RSS growth during the load (max
over ranks), also as a fraction of the bytes a rank requested.

    .venv/bin/python python/benchmarks/moe_load_memory.py --out /tmp/moe_load_memory
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402

from mcore import init_gloo, spawn  # noqa: E402


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def _state(rank: int, args: dict, save: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows, cols = args["rows"], args["cols"]
    out = {}
    for i in range(args["tensors"]):
        key = f"decoder.layers.{i // 64}.mlp.experts.local_experts.{i % 64}.linear_fc1.weight"
        if save:
            data = torch.full((rows // 2, cols), float(i), dtype=torch.float32)
            out[key] = ShardedTensor.from_rank_offsets(key, data, (0, rank, 2))
        else:
            data = torch.full((rows, cols // 2), -1.0, dtype=torch.float32)  # touched: resident before the load
            out[key] = ShardedTensor.from_rank_offsets(key, data, (1, rank, 2))
    return out


def save_worker(rank, world, port, base, args):
    import shardwise.megatron as swm

    init_gloo(rank, world, port, timeout_s=1800)
    swm.save(_state(rank, args, True), os.path.join(base, "ckpt"), rank=rank, world_size=world, timeout_s=600)
    return {}


def load_worker(rank, world, port, base, args, loader):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import shardwise.megatron as swm

    init_gloo(rank, world, port, timeout_s=1800)
    state = _state(rank, args, False)
    requested = sum(t.data.numel() * 4 for t in state.values())
    load = swm.load if loader == "shardwise" else dist_checkpointing.load
    dist.barrier()
    rss_before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    loaded = load(state, os.path.join(base, "ckpt"))
    seconds = time.perf_counter() - t0
    ok = all(bool((v == float(i)).all()) for i, v in enumerate(loaded.values()))
    dist.barrier()
    return {"seconds": seconds, "growth_kib": _kib("VmHWM") - rss_before, "requested": requested, "equal": ok}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=3072)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=672)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="/tmp/shardwise_moe_load_memory")
    a = p.parse_args()
    args = {k: getattr(a, k) for k in ("tensors", "rows", "cols")}
    base = a.out
    os.makedirs(base, exist_ok=True)

    def run(fn, *extra):
        results = spawn(fn, 2, os.path.join(base, "out"), base, args, *extra, timeout_s=3600)
        bad = [r for r in results if not r.get("ok")]
        if bad:
            raise SystemExit(f"failed: {bad}")
        return results

    if not os.path.exists(os.path.join(base, "ckpt", ".metadata")):  # an earlier run's is reused
        run(save_worker)
    growth: dict[str, list[float]] = {"shardwise": [], "megatron": []}
    seconds: dict[str, list[float]] = {"shardwise": [], "megatron": []}
    requested = 0
    for _ in range(a.runs):
        for loader in ("megatron", "shardwise"):
            res = run(load_worker, loader)
            assert all(r["equal"] for r in res), f"{loader} loaded wrong values"
            requested = res[0]["requested"]
            growth[loader].append(max(r["growth_kib"] for r in res) * 1024)
            seconds[loader].append(max(r["seconds"] for r in res))
    mib = requested / 2**20
    print(f"{a.tensors} tensors of {a.rows} x {a.cols} fp32, saved split by rows on 2 ranks, loaded split by "
          f"columns: {mib:.0f} MiB requested per rank; {a.runs} runs each, fresh processes")
    for loader in ("megatron", "shardwise"):
        g = statistics.median(growth[loader])
        print(f"{loader:9s}  extra peak RSS median {g / 2**20:6.0f} MiB = {g / requested:.3f}x of the request "
              f"(runs: {', '.join(f'{x / 2**20:.0f}' for x in growth[loader])} MiB); load "
              f"{statistics.median(seconds[loader]):.2f} s")


if __name__ == "__main__":
    main()
