"""GPU save benchmark (issue "Straight from GPU memory"): one rank, the same sharded state dict of
``--gib`` GiB of bf16 CUDA tensors, saved in one run by shardwise (sync and async), by
torch.distributed.checkpoint (save and async_save) and by Megatron's torch_dist (sync and async,
when megatron-core is importable), plus the raw sequential write of the same bytes to the same disk
(the ceiling: the faster of one stream and eight threads of 64 MiB positioned writes) and the
pinned/pageable D2H bandwidth.

For each method: the stall (seconds the training loop is blocked), the time until the save is
durable (fsync'd and committed), and the D2H bandwidth where it applies.

Run: python python/benchmarks/gpu_save.py --gib 8 --dir /tmp/bench [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def build_state(gib: float, n_big: int = 32):
    """bf16 CUDA tensors: ``n_big`` equal large ones making up ``gib`` GiB, plus 256 small ones."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    total = int(gib * (1 << 30))
    per = total // n_big // 2  # bf16 elements per big tensor
    cols = 4096
    rows = per // cols
    state = {}
    for i in range(n_big):
        t = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda").normal_()
        state[f"big{i}"] = ShardedTensor.from_rank_offsets(f"big{i}", t, replica_id=0)
    for i in range(256):
        t = torch.empty(1024, dtype=torch.bfloat16, device="cuda").normal_()
        state[f"small{i}"] = ShardedTensor.from_rank_offsets(f"small{i}", t, replica_id=0)
    nbytes = sum(sh.data.numel() * 2 for sh in state.values())
    return state, nbytes


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def raw_write(path, nbytes, threads):
    """The ceiling: ``nbytes`` written from host memory in 64 MiB positioned writes by ``threads``
    threads (1 = one sequential stream), then fsync. The faster of 1 and 8 threads is the ceiling."""
    from concurrent.futures import ThreadPoolExecutor

    block = 64 << 20
    buf = memoryview(torch.ones(block, dtype=torch.uint8).numpy())
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    offsets = range(0, nbytes, block)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda off: os.pwrite(fd, buf[: min(block, nbytes - off)], off), offsets))
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def d2h(nbytes_each, state, pinned: bool):
    outs = [torch.empty(sh.data.shape, dtype=sh.data.dtype, pin_memory=pinned) for sh in state.values()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for o, sh in zip(outs, state.values()):
        o.copy_(sh.data, non_blocking=pinned)
    torch.cuda.synchronize()
    return nbytes_each / (time.perf_counter() - t0) / 1e9


def run_shardwise(state, d, async_save, budget):
    import shardwise.megatron as swm

    t0 = time.perf_counter()
    out = swm.save(state, d, rank=0, world_size=1, async_save=async_save, staging_budget_bytes=budget, overwrite=True)
    stall = time.perf_counter() - t0
    if async_save:
        out.wait(3600)
    return stall, time.perf_counter() - t0


def run_dcp(state, d, async_save):
    import torch.distributed.checkpoint as dcp

    sd = {sh.key: sh.data for sh in state.values()}
    t0 = time.perf_counter()
    if async_save:
        fut = dcp.async_save(sd, checkpoint_id=d)
        stall = time.perf_counter() - t0
        fut.result()
    else:
        dcp.save(sd, checkpoint_id=d)
        stall = time.perf_counter() - t0
    return stall, time.perf_counter() - t0


def run_megatron(state, d, async_save):
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    if async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        q = AsyncCallsQueue()
        req = dist_checkpointing.save(dict(state), d, async_sharded_save=True)
        q.schedule_async_request(req)
        stall = time.perf_counter() - t0
        q.maybe_finalize_async_calls(blocking=True)
        q.close()
    else:
        dist_checkpointing.save(dict(state), d)
        stall = time.perf_counter() - t0
    return stall, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--dir", default="/tmp/shardwise_bench")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    # DCP's async_save needs a CPU backend next to NCCL.
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    state, nbytes = build_state(args.gib)
    budget = nbytes + (256 << 20)
    facts = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "bytes": nbytes,
    }
    try:
        import megatron.core

        facts["megatron_core"] = megatron.core.__version__
        have_megatron = True
    except Exception:  # noqa: BLE001
        have_megatron = False
    facts["d2h_pinned_GBps"] = round(d2h(nbytes, state, True), 1)
    facts["d2h_pageable_GBps"] = round(d2h(nbytes, state, False), 1)
    # Warm the staging pool once (allocation is a one-time cost, reported separately).
    import shardwise.megatron as swm
    t0 = time.perf_counter()
    warm = {"w": next(iter(state.values()))}
    swm.save(warm, os.path.join(args.dir, "warm"), rank=0, world_size=1, staging_budget_bytes=budget, overwrite=True)
    facts["pool_alloc_s"] = round(time.perf_counter() - t0, 2)
    shutil.rmtree(os.path.join(args.dir, "warm"))

    methods = [
        ("raw write, 1 stream", 1),
        ("raw write, 8 threads", 8),
        ("shardwise sync", lambda d: run_shardwise(state, d, False, budget)),
        ("shardwise async", lambda d: run_shardwise(state, d, True, budget)),
        ("torch DCP save", lambda d: run_dcp(state, d, False)),
        ("torch DCP async_save", lambda d: run_dcp(state, d, True)),
    ]
    if have_megatron:
        methods += [
            ("Megatron torch_dist sync", lambda d: run_megatron(state, d, False)),
            ("Megatron torch_dist async", lambda d: run_megatron(state, d, True)),
        ]
    rows = {}
    for rep in range(args.reps):
        for name, fn in methods:
            d = os.path.join(args.dir, f"m{rep}")
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, exist_ok=True)
            torch.cuda.synchronize()
            if isinstance(fn, int):
                t = raw_write(os.path.join(d, "raw.bin"), nbytes, fn)
                stall, durable = t, t
            else:
                stall, durable = fn(d)
                fsync_tree(d)  # no-op cost for methods that already fsync'd
            rows.setdefault(name, []).append((stall, durable))
            shutil.rmtree(d, ignore_errors=True)
            print(f"{name}: stall {stall:.2f}s durable {durable:.2f}s", flush=True)
    ceiling = min(statistics.median(r[1] for r in rows[k]) for k in ("raw write, 1 stream", "raw write, 8 threads"))
    table = []
    for name, rs in rows.items():
        stall = statistics.median(r[0] for r in rs)
        durable = statistics.median(r[1] for r in rs)
        table.append({
            "method": name,
            "stall_s": round(stall, 3),
            "durable_s": round(durable, 3),
            "durable_GBps": round(nbytes / durable / 1e9, 2),
            "fraction_of_ceiling": round(ceiling / durable, 2),
        })
    result = {"facts": facts, "table": table}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
