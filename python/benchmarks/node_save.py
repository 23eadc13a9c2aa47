"""Node-level GPU save benchmark (issue "A full 8-GPU node"): one process per GPU with NCCL, a
hand-built sharded state dict laid out like a TP=2 x EP=N MoE model (attention TP-sharded over
pairs of ranks, one slice of the experts per rank), ``--gib`` GiB of bf16 per GPU, saved by
shardwise (sync, async), Megatron torch_dist (sync, async) and torch DCP in one run.

Per method: the stall (slowest rank), the aggregate D2H rate (all bytes / slowest stall, for the
async savers), the time until durable (all ranks done; Megatron and DCP commit collectively,
shardwise's merger commits), and the raw-write ceiling (every rank writing its bytes at once).
A sample of shardwise's output is read back and compared bitwise with the GPU tensors.

Run: python python/benchmarks/node_save.py --gib 8 --dir /tmp/node [--nproc N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")


def state(rank, world, gib):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator(device="cuda").manual_seed(rank)
    per_rank = int(gib * (1 << 30))
    attn_bytes, expert_bytes = per_rank // 4, per_rank - per_rank // 4
    tp_rank, tp = rank % 2, 2
    sd = {}
    cols = 4096
    n_attn = 8
    rows = attn_bytes // n_attn // 2 // cols
    for i in range(n_attn):  # TP-sharded (replica 0 on every rank of the pair's DP slice)
        t = torch.randn(rows, cols, device="cuda", generator=g).to(torch.bfloat16)
        sd[f"attn{i}"] = ShardedTensor.from_rank_offsets(f"decoder.layers.{i}.attn.weight", t, (0, tp_rank, tp),
                                                         replica_id=(0, 0, rank // tp))
    n_exp = 16
    erows = expert_bytes // n_exp // 2 // cols
    for i in range(n_exp):  # EP: this rank's expert slice of each expert tensor
        t = torch.randn(erows, cols, device="cuda", generator=g).to(torch.bfloat16)
        sd[f"exp{i}"] = ShardedTensor.from_rank_offsets(f"decoder.layers.{i}.mlp.experts.weight", t, (0, rank, world),
                                                        replica_id=0)
    nbytes = sum(sh.data.numel() * 2 for sh in sd.values() if _main(sh))
    return sd, nbytes


def _main(sh):
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return is_main_replica(sh.replica_id)


def timed(fn):
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stall_end, done = fn()
    t_stall = stall_end - t0
    dist.barrier()  # everyone durable
    t_done = time.perf_counter() - t0
    return t_stall, t_done


def worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import shardwise
    import shardwise.megatron as swm

    sd, nbytes = state(rank, world, args.gib)
    budget = nbytes + (256 << 20)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    warm = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(1024, device="cuda"), replica_id=0)}
    swm.save(warm, os.path.join(args.dir, f"warm{rank}"), rank=0, world_size=1, staging_budget_bytes=budget,
             overwrite=True)  # allocates the pinned pool once, as a training job would at startup
    results = {}

    def run(name, d, fn):
        shutil.rmtree(d, ignore_errors=True) if rank == 0 else None
        dist.barrier()
        os.makedirs(d, exist_ok=True)
        stall, durable = timed(lambda: fn(d))
        s = torch.tensor([stall, durable], dtype=torch.float64)
        dist.all_reduce(s, op=dist.ReduceOp.MAX)  # measurement only, outside every timed region
        results[name] = (s[0].item(), s[1].item())

    def raw(d):
        block = memoryview(torch.ones(64 << 20, dtype=torch.uint8).numpy())
        fd = os.open(os.path.join(d, f"raw{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        off = 0
        while off < nbytes:
            n = min(len(block), nbytes - off)
            os.pwrite(fd, block[:n], off)
            off += n
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter(), None

    def sw(d, async_save):
        h = swm.save(sd, d, rank=rank, world_size=world, async_save=async_save, staging_budget_bytes=budget, overwrite=True,
                     save_id=f"bench-{os.path.basename(d)}")
        t = time.perf_counter()
        if async_save:
            h.wait(3600)
        return t, None

    def meg(d, async_save):
        if async_save:
            q = AsyncCallsQueue()
            req = dist_checkpointing.save(dict(sd), d, async_sharded_save=True)
            q.schedule_async_request(req)
            t = time.perf_counter()
            q.maybe_finalize_async_calls(blocking=True)
            q.close()
            return t, None
        dist_checkpointing.save(dict(sd), d)
        return time.perf_counter(), None

    def dcp_save(d):
        import torch.distributed.checkpoint as dcp

        dcp.save({f"r{rank}.{k}": sh.data for k, sh in sd.items() if _main(sh)}, checkpoint_id=d)
        return time.perf_counter(), None

    run("raw write, all ranks at once (ceiling)", os.path.join(args.dir, "raw"), raw)
    run("shardwise sync", os.path.join(args.dir, "sw_sync"), lambda d: sw(d, False))
    run("shardwise async", os.path.join(args.dir, "sw_async"), lambda d: sw(d, True))
    # Read back a sample of shardwise's checkpoint and compare bitwise with the GPU tensors.
    if rank == 0:
        r = shardwise.open(os.path.join(args.dir, "sw_async"))
        for k in ("exp0", "attn0"):
            sh = sd[k]
            idx = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.data.shape))
            got = r.read(sh.key, idx)
            assert torch.equal(got.view(torch.int16), sh.data.cpu().view(torch.int16)), k
        results["readback"] = "bitwise equal"
    run("Megatron torch_dist sync", os.path.join(args.dir, "meg_sync"), lambda d: meg(d, False))
    run("Megatron torch_dist async", os.path.join(args.dir, "meg_async"), lambda d: meg(d, True))
    run("torch DCP save", os.path.join(args.dir, "dcp"), dcp_save)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "bytes_per_rank": nbytes, "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--dir", default="/tmp/node")
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    ap.add_argument("--out", default="/tmp/node_save.json")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    mp.spawn(worker, args=(args.nproc, 29555, args, args.out), nprocs=args.nproc)
    res = json.load(open(args.out))
    total = res["bytes_per_rank"] * res["world"]
    table = []
    ceiling = res["results"]["raw write, all ranks at once (ceiling)"][1]
    for name, v in res["results"].items():
        if name == "readback":
            continue
        stall, durable = v
        table.append({"method": name, "stall_s": round(stall, 3), "durable_s": round(durable, 2),
                      "agg_stall_GBps": round(total / stall / 1e9, 1), "durable_GBps": round(total / durable / 1e9, 2),
                      "ceiling_over_durable": round(ceiling / durable, 2)})
    print(json.dumps({"gpus": res["world"], "gpu": torch.cuda.get_device_name(0), "total_bytes": total,
                      "readback": res["results"].get("readback"), "table": table}, indent=1))


if __name__ == "__main__":
    main()
