"""GPU load benchmark (issue 17): one rank reads ``--gib`` GiB of Llama-8B-shaped bf16 tensors from a
torch_dist checkpoint into preallocated CUDA tensors, with shardwise's native ``load_into`` and its
``shardwise.megatron.load``, with torch DCP's ``load`` and with Megatron's
``dist_checkpointing.load``, warm (page cache full; each also as a multiple of the pinned
host-to-device copy floor, the bytes over the H2D rate measured in the run) and cold
(page cache dropped before each method), next to the raw sequential read ceiling of the same files
on the same disk measured in the same run (the faster of one stream of 64 MiB reads and 8 threads
of 64 MiB preads, each after dropping the cache).

The checkpoint is saved once by shardwise (the Megatron torch_dist layout: DCP files, metadata.json,
common.pt), so all three loaders read the same bytes. Every loaded tensor is compared bitwise with
the saved one.

Run: python python/benchmarks/gpu_load.py --gib 16 --dir /tmp/bench_load [--reps 2] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256


def llama_shapes(gib: float):
    """Llama-3-8B parameter shapes (Megatron names, fused QKV and SwiGLU fc1), as many layers as fit
    in ``gib`` GiB of bf16 next to the embedding and output layer."""
    kv = HIDDEN // HEADS * KV_HEADS
    layer = {
        "self_attention.linear_qkv.weight": (HIDDEN + 2 * kv, HIDDEN),
        "self_attention.linear_qkv.layer_norm_weight": (HIDDEN,),
        "self_attention.linear_proj.weight": (HIDDEN, HIDDEN),
        "mlp.linear_fc1.weight": (2 * FFN, HIDDEN),
        "mlp.linear_fc1.layer_norm_weight": (HIDDEN,),
        "mlp.linear_fc2.weight": (HIDDEN, FFN),
    }
    fixed = {
        "embedding.word_embeddings.weight": (VOCAB, HIDDEN),
        "decoder.final_layernorm.weight": (HIDDEN,),
        "output_layer.weight": (VOCAB, HIDDEN),
    }
    numel = lambda shapes: sum(torch.Size(s).numel() for s in shapes.values())  # noqa: E731
    layers = max(1, int((gib * (1 << 30) / 2 - numel(fixed)) // numel(layer)))
    shapes = dict(fixed)
    for i in range(layers):
        shapes.update({f"decoder.layers.{i}.{k}": s for k, s in layer.items()})
    return shapes, layers


def data_files(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".distcp"))


def cached_kib():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Cached:"))


def drop_cache(d, how: dict):
    """Empties the page cache of the checkpoint's files: /proc/sys/vm/drop_caches when writable,
    and posix_fadvise(DONTNEED) per file in any case. Records in ``how`` what was tried and what
    each did to the ``Cached:`` of /proc/meminfo."""
    os.sync()
    before = cached_kib()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how.setdefault("drop_caches", []).append(round((before - cached_kib()) / 2**20, 2))
    except OSError as e:
        how["drop_caches"] = f"refused: {e}"
    mid = cached_kib()
    for p in data_files(d) + [os.path.join(d, ".metadata")]:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    how.setdefault("fadvise_dontneed", []).append(round((mid - cached_kib()) / 2**20, 2))


def raw_read(d, threads: int):
    """Seconds to read every data file from host memory into a 64 MiB buffer per thread:
    ``threads`` = 1 is one sequential stream; more are positioned reads of 64 MiB blocks."""
    block = 64 << 20
    files = data_files(d)
    t0 = time.perf_counter()
    if threads == 1:
        buf = bytearray(block)
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    else:
        jobs = [(p, off) for p in files for off in range(0, os.path.getsize(p), block)]
        fds = {p: os.open(p, os.O_RDONLY) for p in files}
        bufs = {}

        def one(job):
            p, off = job
            import threading

            b = bufs.setdefault(threading.get_ident(), bytearray(block))
            os.preadv(fds[p], [b], off)

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, jobs))
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - t0


def load_shardwise(d, dest, budget):
    from shardwise import _native

    t0 = time.perf_counter()
    ck = _native.open_checkpoint(d)
    reqs = [_native.Region(key=k, offsets=[0] * t.dim(), sizes=list(t.shape), data_ptr=t.data_ptr(),
                           nbytes=t.numel() * 2, device=0) for k, t in dest.items()]
    stats = ck.load_into(reqs, staging_budget_bytes=budget, cuda_stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, stats


def load_megatron_api(d, dest):
    """``shardwise.megatron.load`` of ShardedTensors over the destinations, as a resume calls it
    (the open checkpoint is cached per process, so a later call skips parsing ``.metadata``)."""
    import shardwise.megatron as swm
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in dest.items()}
    t0 = time.perf_counter()
    out = swm.load(sd, d)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    moved = [k for k, t in dest.items() if out[k].data_ptr() != t.data_ptr()]
    assert not moved, f"not loaded in place: {moved[:3]}"
    return took, None


def load_dcp(d, dest):
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.load(dict(dest), checkpoint_id=d)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, None


def load_megatron(d, dest):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in dest.items()}
    t0 = time.perf_counter()
    out = dist_checkpointing.load(sd, d)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    for k, t in dest.items():  # Megatron may return new tensors rather than fill ours
        if out[k].data_ptr() != t.data_ptr():
            t.copy_(out[k])
    return took, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--dir", default="/tmp/shardwise_bench_load")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget", type=int, default=None, help="staging_budget_bytes (default: the engine's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    import shardwise.megatron as swm
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shapes, layers = llama_shapes(args.gib)
    g = torch.Generator(device="cuda").manual_seed(0)
    src = {k: torch.randn(s, device="cuda", generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    nbytes = sum(t.numel() * 2 for t in src.values())
    d = os.path.join(args.dir, "ckpt")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    t0 = time.perf_counter()
    swm.save({k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in src.items()}, d, rank=0,
             world_size=1)
    facts = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "tensors": len(src),
        "llama_layers": layers,
        "bytes": nbytes,
        "save_s": round(time.perf_counter() - t0, 2),
        "data_files": [os.path.getsize(p) for p in data_files(d)],
    }
    try:
        import megatron.core

        facts["megatron_core"] = megatron.core.__version__
    except Exception:  # noqa: BLE001
        pass
    dest = {k: torch.empty_like(t) for k, t in src.items()}
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    facts["h2d_pinned_GBps"] = round(4 * (1 << 30) / (time.perf_counter() - t0) / 1e9, 1)
    del pinned, dev
    # The pinned staging pool is allocated once per process: reported, not counted.
    t0 = time.perf_counter()
    k0 = next(iter(dest))
    from shardwise import _native

    _native.open_checkpoint(d).load_into(
        [_native.Region(key=k0, offsets=[0] * dest[k0].dim(), sizes=list(dest[k0].shape),
                        data_ptr=dest[k0].data_ptr(), nbytes=dest[k0].numel() * 2, device=0)],
        staging_budget_bytes=args.budget)
    facts["pool_alloc_s"] = round(time.perf_counter() - t0, 2)

    def check(name):
        bad = [k for k in src if not torch.equal(src[k].view(torch.int16), dest[k].view(torch.int16))]
        assert not bad, f"{name}: {len(bad)} tensors differ, e.g. {bad[:3]}"
        for t in dest.values():
            t.zero_()

    methods = {
        "shardwise load_into": lambda: load_shardwise(d, dest, args.budget),
        "shardwise.megatron.load": lambda: load_megatron_api(d, dest),
        "torch DCP load": lambda: load_dcp(d, dest),
        "Megatron dist_checkpointing.load": lambda: load_megatron(d, dest),
    }
    rows: dict = {}
    stats_of: dict = {}
    raw_read(d, 8)  # fill the page cache
    for rep in range(args.reps):
        for name, fn in methods.items():
            took, stats = fn()
            check(name)
            rows.setdefault(("warm", name), []).append(took)
            if stats:
                stats_of[("warm", name)] = stats
            print(f"warm {name}: {took:.2f}s ({nbytes / took / 1e9:.2f} GB/s)", flush=True)
    how: dict = {}
    cold = {"raw read, 1 stream": lambda: (raw_read(d, 1), None), "raw read, 8 threads": lambda: (raw_read(d, 8), None)}
    cold.update(methods)
    for name, fn in cold.items():
        drop_cache(d, how)
        took, stats = fn()
        if not name.startswith("raw"):
            check(name)
        rows[("cold", name)] = [took]
        if stats:
            stats_of[("cold", name)] = stats
        print(f"cold {name}: {took:.2f}s ({nbytes / took / 1e9:.2f} GB/s)", flush=True)
    facts["page_cache_drop_GiB_freed"] = how
    ceiling = min(rows[("cold", "raw read, 1 stream")][0], rows[("cold", "raw read, 8 threads")][0])
    table = []
    for (mode, name), ts in rows.items():
        t = statistics.median(ts)
        row = {"mode": mode, "method": name, "seconds": round(t, 3), "GBps": round(nbytes / t / 1e9, 2),
               "runs": [round(x, 3) for x in ts]}
        if mode == "cold":
            row["fraction_of_ceiling"] = round(ceiling / t, 3)
        if (mode, name) in stats_of:
            s = stats_of[(mode, name)]
            row["plan_s"] = round(s["plan_seconds"], 3)
            row["read_ops"] = s["read_ops"]
            row["items_checked"] = s["items_checked"]
        table.append(row)
    # The floor of a warm load: every byte crosses PCIe once, at the pinned H2D rate measured above.
    floor = nbytes / (facts["h2d_pinned_GBps"] * 1e9)
    facts["h2d_floor_s"] = round(floor, 3)
    for row in table:
        if row["mode"] == "warm":
            row["vs_h2d_floor"] = round(row["seconds"] / floor, 2)
    sw = statistics.median(rows[("warm", "shardwise load_into")])
    facts["warm_speedup_vs_dcp"] = round(statistics.median(rows[("warm", "torch DCP load")]) / sw, 2)
    facts["warm_speedup_vs_megatron"] = round(statistics.median(rows[("warm", "Megatron dist_checkpointing.load")]) / sw, 2)
    result = {"facts": facts, "table": table}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
