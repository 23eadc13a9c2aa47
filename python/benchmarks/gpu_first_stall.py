"""First and steady-state async-save stall of one GPU rank (issue 27, item 4).

One rank holds ``--gib`` GiB of bf16 CUDA tensors (the layout of ``gpu_default_budget.py``: 32 equal
large tensors plus 256 small ones) and saves them ``--saves`` times with an async save; the stall is
the time the training loop is blocked by each call, until it may modify its tensors again. Each case
runs in a fresh process, because the first save of a process is the one that pays for pinned memory:

* ``floor``: a plain pinned device-to-host copy of the same bytes into preallocated pinned tensors
  (fastest of 3): the stall no async save can beat;
* ``shardwise``: ``shardwise.megatron.save(async_save=True)``, default staging budget;
* ``shardwise_reserved``: ``reserve_staging(state)`` right after the tensors exist, then
  ``--setup-s`` seconds of other work (the training steps before the first checkpoint), then saves;
* ``shardwise_reserved_late``: ``reserve_staging(state)`` immediately followed by the first save (the
  save uses what is pinned and pins the rest; it must never wait for the whole pool);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` with ``FileSystemWriter(
  cache_staged_state_dict=True)`` (its pinned staging kept across saves), one gloo rank;
* ``megatron``: ``megatron.core.dist_checkpointing.save(..., async_sharded_save=True)`` with the
  ``torch_dist`` strategy, scheduled on an ``AsyncCallsQueue`` (its preload, the D2H copy, runs in
  the caller); the stall is ``save`` + ``schedule_async_request``.

Every save is waited for until durable, and its directory removed, before the next one.

Run (one JSON line per case, prefixed ``RESULT``):
    python python/benchmarks/gpu_first_stall.py --gib 16 --saves 3 --dir /tmp/bench
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

# The same rank (32 large bf16 tensors + 256 small) and copy floor as the issue-14 benchmark.
from gpu_default_budget import build_state, copy_floor  # noqa: E402  (this script's directory)

CASES = ["floor", "shardwise", "shardwise_reserved", "shardwise_reserved_late", "dcp", "megatron"]


def init_gloo():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)


def saver(case: str, state):
    """A function that starts one async save into a directory and returns (stall_s, wait)."""
    import torch

    if case.startswith("shardwise"):
        import shardwise.megatron as swm

        def save(d, i):
            t0 = time.perf_counter()
            h = swm.save(state, d, rank=0, world_size=1, save_id=f"s{i}", async_save=True, timeout_s=3600)
            return time.perf_counter() - t0, lambda: h.wait(3600)

        return save
    if case == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        init_gloo()
        plain = {k: sh.data for k, sh in state.items()}

        def save(d, i):
            t0 = time.perf_counter()
            fut = dcp.async_save(plain, storage_writer=FileSystemWriter(d, cache_staged_state_dict=True))
            stall = time.perf_counter() - t0
            result = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse in newer torch
            return stall, lambda: result.result()

        return save
    if case == "megatron":
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        init_gloo()
        queue = AsyncCallsQueue()
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1)

        def save(d, i):
            os.makedirs(d, exist_ok=True)
            t0 = time.perf_counter()
            req = dist_checkpointing.save(dict(state), d, strategy, async_sharded_save=True, async_strategy="mcore")
            queue.schedule_async_request(req)
            stall = time.perf_counter() - t0
            return stall, lambda: queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

        return save
    raise SystemExit(f"unknown case {case}")


def one_case(args) -> dict:
    import torch

    torch.cuda.set_device(0)
    state, nbytes = build_state(args.gib)
    out = {"case": args.case, "bytes": nbytes, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.case == "floor":
        out["floor_s"] = round(copy_floor(state), 4)
        out["d2h_GBps"] = round(nbytes / out["floor_s"] / 1e9, 1)
        return out
    if args.case.startswith("shardwise_reserved"):
        import shardwise.megatron as swm

        t0 = time.perf_counter()
        out["reserve"] = swm.reserve_staging(state)
        out["reserve_call_s"] = round(time.perf_counter() - t0, 4)
        if args.case == "shardwise_reserved":
            time.sleep(args.setup_s)
            out["setup_s"] = args.setup_s
    save = saver(args.case, state)
    stalls, durables = [], []
    for i in range(args.saves):
        d = os.path.join(args.dir, f"{args.case}_{i}")
        shutil.rmtree(d, ignore_errors=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stall, wait = save(d, i)
        wait()
        durables.append(time.perf_counter() - t0)
        stalls.append(stall)
        shutil.rmtree(d, ignore_errors=True)
        print(f"{args.case} save {i}: stall {stall:.3f}s durable {durables[-1]:.2f}s", flush=True)
    out["stall_s"] = [round(s, 3) for s in stalls]
    out["durable_s"] = [round(s, 2) for s in durables]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--setup-s", type=float, default=20.0, help="seconds between reserve_staging and the first save")
    ap.add_argument("--case", action="append", choices=CASES, help="default: all")
    ap.add_argument("--dir", default="/tmp/shardwise_bench")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = args.case or CASES
    if args.child:
        args.case = cases[0]
        print("RESULT " + json.dumps(one_case(args)), flush=True)
        return
    results = []
    for c in cases:
        cmd = [sys.executable, __file__, "--child", "--case", c, "--gib", str(args.gib), "--saves",
               str(args.saves), "--setup-s", str(args.setup_s), "--dir", args.dir]
        p = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(p.stdout)
        if p.returncode != 0:
            sys.stdout.write(p.stderr[-3000:])
        results += [json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    floor = next((r["floor_s"] for r in results if r["case"] == "floor"), None)
    if floor:
        for r in results:
            if "stall_s" in r:
                print(f"{r['case']:>26}: first {r['stall_s'][0] / floor:6.2f}x floor, "
                      f"steady {min(r['stall_s'][1:] or r['stall_s']) / floor:6.2f}x floor")


if __name__ == "__main__":
    main()
