"""Where a warm GPU load's time goes (issue 37, item 7): one rank, ``--gib`` GiB of bf16 tensors
saved by shardwise, then loaded warm into CUDA tensors by ``load_into`` with and without the CRC
check, beside (a) the host-side floor: 16 threads ``pread``-ing the same data file into pinned
buffers (the page cache -> pinned copy every load makes), (b) the same preads while the GPU copies as
many bytes from pinned memory (both at once, as in a load), and (c) the pinned H2D floor. Medians of
``--reps`` runs. Run on the GPU machine: ``python python/benchmarks/gpu_load_split.py --gib 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29535")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import shardwise.megatron as swm
    from shardwise import _native

    n = int(a.gib * (1 << 30)) // (2 * 4096 * 4096)
    src = {f"w{i}": torch.randn(4096, 4096, device="cuda").to(torch.bfloat16) for i in range(n)}
    nbytes = sum(t.numel() * 2 for t in src.values())
    d = tempfile.mkdtemp(dir="/tmp")
    swm.save({k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in src.items()}, d, rank=0,
             world_size=1)
    dest = {k: torch.empty_like(t) for k, t in src.items()}
    data = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".distcp")]

    def load(check_crc):
        t0 = time.perf_counter()
        ck = _native.open_checkpoint(d)
        regs = [_native.Region(key=k, offsets=[0, 0], sizes=list(t.shape), data_ptr=t.data_ptr(),
                               nbytes=t.numel() * 2, device=0) for k, t in dest.items()]
        ck.load_into(regs, cuda_stream=torch.cuda.current_stream().cuda_stream, check_crc=check_crc)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    block = 64 << 20
    pinned = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(16)]
    local = threading.local()
    free = list(range(16))
    lock = threading.Lock()
    pool = ThreadPoolExecutor(16)  # one set of threads, each keeping its pinned buffer

    def pread_all():
        jobs = [(p, off) for p in data for off in range(0, os.path.getsize(p), block)]
        fds = {p: os.open(p, os.O_RDONLY) for p in data}

        def one(job):
            if not hasattr(local, "buf"):
                with lock:
                    local.buf = memoryview(pinned[free.pop()].numpy())
            os.preadv(fds[job[0]], [local.buf], job[1])

        t0 = time.perf_counter()
        list(pool.map(one, jobs))
        took = time.perf_counter() - t0
        for fd in fds.values():
            os.close(fd)
        return took

    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev.copy_(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dev.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 4 * (1 << 30) / (time.perf_counter() - t0)
    def both():
        """The preads while the GPU copies as many bytes from pinned memory (the DMA reads host
        memory as the preads write it): done when both are."""
        t0 = time.perf_counter()
        for _ in range(round(nbytes / (1 << 30))):
            dev.copy_(big, non_blocking=True)
        pread_all()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    load(True)  # warms the page cache and the staging pool
    rows = {"load_into, CRC checked": [], "load_into, check_crc=False": [], "16 threads pread into pinned": [],
            "the same preads while as many bytes go H2D": []}
    for _ in range(a.reps):
        rows["load_into, CRC checked"].append(load(True))
        rows["load_into, check_crc=False"].append(load(False))
        rows["16 threads pread into pinned"].append(pread_all())
        rows["the same preads while as many bytes go H2D"].append(both())
    assert all(torch.equal(src[k].view(torch.int16), dest[k].view(torch.int16)) for k in src)
    floor = nbytes / h2d
    out = {"gpu": torch.cuda.get_device_name(0), "cpus": os.cpu_count(), "bytes": nbytes,
           "h2d_pinned_GBps": round(h2d / 1e9, 1), "h2d_floor_s": round(floor, 3), "rows": {}}
    for k, v in rows.items():
        m = statistics.median(v)
        out["rows"][k] = {"median_s": round(m, 3), "runs": [round(x, 3) for x in v],
                          "GBps": round(nbytes / m / 1e9, 1), "x_h2d_floor": round(m / floor, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
