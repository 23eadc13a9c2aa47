"""Async stall with the default staging budget (issue 14, "Async staging budget by default").

One rank, ``--gib`` GiB of bf16 CUDA tensors (32 equal large ones plus 256 small ones, as in
``gpu_save.py``), saved with ``async_save=True``:

* the copy floor: a plain pinned device-to-host copy of the same bytes into preallocated pinned
  tensors (fastest of 3), in the same process;
* ``--budget default``: no ``staging_budget_bytes`` (``staging::default_budget``: the rank's bytes
  plus one buffer, within half of ``MemTotal``);
* ``--budget N``: ``staging_budget_bytes = N GiB``.

The staging pool is allocated once per process and reused by later saves that fit in it, so each
budget runs in its own process (``--budget`` is that process's); the first save of a process
allocates the pool and is reported apart (``first_stall_s``). Every save is waited for until
durable, and its directory removed, before the next one.

Run (one JSON line per budget, prefixed ``RESULT``):
    python python/benchmarks/gpu_default_budget.py --gib 16 --budget default --budget 4 --reps 2 --dir /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def build_state(gib: float, n_big: int = 32):
    import torch
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


def copy_floor(state) -> float:
    """Seconds of a pinned D2H copy of every tensor (preallocated destinations), fastest of 3."""
    import torch

    outs = [torch.empty(sh.data.shape, dtype=sh.data.dtype, pin_memory=True) for sh in state.values()]
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for o, sh in zip(outs, state.values()):
            o.copy_(sh.data, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del outs
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give the pinned pages back before shardwise pins its pool
    return best


def one_budget(args) -> dict:
    import torch
    import shardwise.megatron as swm

    torch.cuda.set_device(0)
    state, nbytes = build_state(args.gib)
    floor = copy_floor(state)
    budget = None if args.budget == "default" else int(float(args.budget) * (1 << 30))
    mem_before = mem_total_bytes()
    stalls, durables = [], []
    for rep in range(args.reps + 1):
        d = os.path.join(args.dir, f"b{args.budget}_{rep}")
        shutil.rmtree(d, ignore_errors=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = swm.save(state, d, rank=0, world_size=1, save_id=f"s{rep}", async_save=True,
                     staging_budget_bytes=budget)
        stall = time.perf_counter() - t0
        h.wait(3600)
        durable = time.perf_counter() - t0
        shutil.rmtree(d, ignore_errors=True)
        stalls.append(stall)
        durables.append(durable)
        print(f"budget {args.budget} rep {rep}: stall {stall:.3f}s (handle {h.stall_s:.3f}s) "
              f"durable {durable:.2f}s", flush=True)
    timed = stalls[1:]
    return {
        "budget": args.budget,
        "bytes": nbytes,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "mem_total_before_GiB": round(mem_before / (1 << 30), 1),
        "mem_total_after_GiB": round(mem_total_bytes() / (1 << 30), 1),
        "copy_floor_s": round(floor, 4),
        "d2h_GBps": round(nbytes / floor / 1e9, 1),
        "first_stall_s": round(stalls[0], 3),
        "stall_s": [round(s, 3) for s in timed],
        "stall_min_s": round(min(timed), 3),
        "stall_over_floor": round(min(timed) / floor, 2),
        "durable_s": [round(s, 2) for s in durables[1:]],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--budget", action="append", help="'default' or GiB; repeat for several")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/shardwise_bench")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    budgets = args.budget or ["default"]
    if args.child:
        args.budget = budgets[0]
        print("RESULT " + json.dumps(one_budget(args)), flush=True)
        return
    for b in budgets:
        cmd = [sys.executable, __file__, "--child", "--gib", str(args.gib), "--budget", b,
               "--reps", str(args.reps), "--dir", args.dir]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
