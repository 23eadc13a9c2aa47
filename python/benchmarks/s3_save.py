"""Object-store save throughput (issue 6), one process, one run, interleaved repetitions:

* ``shardwise-s3``    -- ``shardwise.megatron.save`` of a sharded state dict to ``s3://`` on a loopback
                         S3 server (multipart data object, conditional-create part and commit);
* ``dcp-s3``          -- ``torch.distributed.checkpoint.save`` with ``FsspecWriter`` (s3fs) to the
                         same server, same tensors;
* ``raw-s3``          -- the server's ceiling for one client: the same bytes as ONE object through
                         boto3's managed multipart upload (``upload_fileobj``, 8 threads, 32 MiB parts);
* ``shardwise-local`` / ``dcp-local`` -- the same saves to a local directory (fsync'd).

The server is moto's standalone server (``moto[server]``, a Python/werkzeug process: CPU-bound, the
bottleneck here), started by this script on 127.0.0.1. Numbers are GB/s of checkpoint bytes (1e9)
from call to committed return; ratios are shardwise over the peer on the same target (> 1: faster).

Run:
    python python/benchmarks/s3_save.py --mib 512 --tensors 64 --reps 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # s3_server.py
warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB (float32)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemWriter, FsspecWriter

    import shardwise
    import shardwise.megatron as swm
    from s3_server import S3Server

    n = args.mib * (1 << 20) // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    plain = {f"layer.{i}.weight": torch.randn(n, generator=g) for i in range(args.tensors)}
    nbytes = sum(t.numel() * 4 for t in plain.values())
    sharded = lambda: {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in plain.items()}  # noqa: E731

    srv = S3Server().start()
    os.environ.update(srv.env())
    bucket = srv.make_bucket("bench")
    opts = srv.fsspec_storage_options()
    local_root = tempfile.mkdtemp(prefix="s3bench-", dir=os.environ.get("BENCH_DIR"))
    blob = b"".join(t.numpy().tobytes() for t in plain.values())

    def shardwise_s3():
        swm.save(sharded(), f"s3://{bucket}/sw-{uuid.uuid4().hex}", rank=0, world_size=1, save_id="b")

    def dcp_s3():
        w = FsspecWriter(f"s3://{bucket}/dcp-{uuid.uuid4().hex}", skip_instance_cache=True, **opts)
        dcp.save(plain, storage_writer=w, no_dist=True)

    def raw_s3():
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_chunksize=32 << 20, max_concurrency=8)
        srv.client().upload_fileobj(io.BytesIO(blob), bucket, f"raw-{uuid.uuid4().hex}", Config=cfg)

    def shardwise_local():
        swm.save(sharded(), os.path.join(local_root, uuid.uuid4().hex), rank=0, world_size=1, save_id="b")

    def dcp_local():
        dcp.save(plain, storage_writer=FileSystemWriter(os.path.join(local_root, uuid.uuid4().hex)), no_dist=True)

    methods = {"shardwise-s3": shardwise_s3, "dcp-s3": dcp_s3, "raw-s3": raw_s3,
               "shardwise-local": shardwise_local, "dcp-local": dcp_local}
    times: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for rep in range(args.reps):
            for m, fn in methods.items():
                t = time.perf_counter()
                fn()
                times[m].append(time.perf_counter() - t)
                print(f"rep {rep} {m:16s} {times[m][-1]:7.2f} s  {nbytes / times[m][-1] / 1e9:.3f} GB/s", flush=True)
            # keep the server's memory flat: it holds every object in RAM
            srv.stop()
            srv.start()
            srv.make_bucket(bucket)
            shutil.rmtree(local_root, ignore_errors=True)
            os.makedirs(local_root, exist_ok=True)
    finally:
        srv.stop()
        shutil.rmtree(local_root, ignore_errors=True)

    med = {m: statistics.median(v) for m, v in times.items()}
    gbs = {m: nbytes / med[m] / 1e9 for m in med}
    print(f"\n{nbytes / 2**20:.0f} MiB in {args.tensors} float32 tensors, median of {args.reps}; "
          f"{platform.node()}, {os.cpu_count()} CPUs, shardwise {shardwise.__version__}")
    for m in methods:
        print(f"  {m:16s} {med[m]:7.2f} s  {gbs[m]:.3f} GB/s")
    print(f"  shardwise-s3 vs dcp-s3: {med['dcp-s3'] / med['shardwise-s3']:.2f}x faster; "
          f"at {med['raw-s3'] / med['shardwise-s3'] * 100:.0f}% of raw-s3; "
          f"shardwise-local vs dcp-local: {med['dcp-local'] / med['shardwise-local']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "times": times, "median_s": med, "gb_per_s": gbs}, f, indent=1)


if __name__ == "__main__":
    main()
