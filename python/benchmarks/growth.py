"""Growth of save and merge time (issue 7), with a PNG plot.

* Bytes: one process saves ``--gibs`` GiB (default 0.5 1 2 4 8) of fp32 Megatron ShardedTensors
  (64 MiB each) with ``shardwise.megatron.save`` (rank 0 of 1: write, part, merge, commit), against
  the raw sequential write + fsync of the same bytes; ``--reps`` runs each, interleaved, medians.
* Ranks: the merge of ``--ranks`` simulated parts (default 1 .. 8,192) of ``--chunks`` chunks each
  (``cargo bench --bench merge_parts -- RANKS CHUNKS``: read the parts, validate, pickle and commit
  ``.metadata``), one run each.

Prints both tables and the fitted growth exponents (time ~ size^k, least squares in log-log), and
writes the plot (default ``benches/growth.png``).

Run: python python/benchmarks/growth.py [--gibs 0.5 1 2 4 8] [--ranks 1 8 64 512 2048 8192]
         [--chunks 100] [--dir /tmp/growth] [--png benches/growth.png] [--json FILE]
Needs matplotlib for the plot (``pip install matplotlib``; not a test requirement).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def fit_exponent(xs, ys):
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def bytes_growth(gibs, reps, root):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import shardwise.megatron as swm

    piece = 64 << 20
    n_max = int(max(gibs) * (1 << 30)) // piece
    pool = [torch.rand(piece // 4) for _ in range(n_max)]
    rows = []
    for gib in gibs:
        n = int(gib * (1 << 30)) // piece
        tensors = pool[:n]
        nbytes = n * piece
        times = {"shardwise": [], "raw": []}
        first = gib == gibs[0]
        for rep in range(0 if first else 1, reps + 1):  # rep 0 (first size only) warms up, not counted
            for m in (("shardwise", "raw") if rep % 2 == 0 else ("raw", "shardwise")):
                d = os.path.join(root, f"{m}_{gib}_{rep}")
                os.makedirs(d)
                if m == "shardwise":
                    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", t, replica_id=0) for i, t in enumerate(tensors)}
                    t0 = time.monotonic()
                    swm.save(sd, d, rank=0, world_size=1, save_id=f"g{gib}-{rep}")
                else:
                    t0 = time.monotonic()
                    fd = os.open(os.path.join(d, "raw.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
                    for t in tensors:
                        mv = memoryview(t.numpy()).cast("B")
                        while mv:
                            mv = mv[os.write(fd, mv):]
                    os.fsync(fd)
                    os.close(fd)
                dt = time.monotonic() - t0
                shutil.rmtree(d)
                if rep > 0:
                    times[m].append(dt)
        row = {"gib": gib, "bytes": nbytes, **{f"{m}_s": statistics.median(v) for m, v in times.items()},
               "runs": times}
        rows.append(row)
        print(f"  {gib:>5} GiB: shardwise {row['shardwise_s']:.2f} s, raw {row['raw_s']:.2f} s", flush=True)
    return rows


def ranks_growth(ranks, chunks):
    rows = []
    for w in ranks:
        cmd = ["cargo", "bench", "-q", "--bench", "merge_parts", "--", str(w), str(chunks)]
        out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
        line = next(l for l in out.splitlines() if l.startswith("JSON "))
        row = json.loads(line[5:])
        rows.append(row)
        print(f"  {w:>5} ranks x {chunks}: merge {row['merge_s']:.3f} s "
              f"(read {row['read_s']:.3f}, validate {row['validate_s']:.3f}, pickle {row['emit_s']:.3f}), "
              f".metadata {row['metadata_bytes'] / 2**20:.1f} MiB", flush=True)
    return rows


def plot(byte_rows, rank_rows, png, chunks):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    g = [r["gib"] for r in byte_rows]
    a.plot(g, [r["shardwise_s"] for r in byte_rows], "o-", label="shardwise save (write+merge+commit)")
    a.plot(g, [r["raw_s"] for r in byte_rows], "s--", label="raw sequential write + fsync")
    a.set_xlabel("GiB saved (1 rank)")
    a.set_ylabel("seconds (median)")
    a.set_title("Save time vs bytes")
    a.grid(alpha=0.3)
    a.legend()
    w = [r["ranks"] for r in rank_rows]
    b.loglog(w, [r["merge_s"] for r in rank_rows], "o-", label="merge + validate + commit")
    b.loglog(w, [r["read_s"] for r in rank_rows], ".:", label="read parts")
    b.loglog(w, [r["validate_s"] for r in rank_rows], ".:", label="validate")
    b.loglog(w, [r["emit_s"] for r in rank_rows], ".:", label="pickle .metadata")
    b.set_xlabel(f"simulated ranks ({chunks} chunks each)")
    b.set_ylabel("seconds")
    b.set_title("Merge time vs ranks")
    b.grid(alpha=0.3, which="both")
    b.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gibs", type=float, nargs="+", default=[0.5, 1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64, 512, 2048, 8192])
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--png", default=os.path.join(REPO, "benches", "growth.png"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    root = a.dir or tempfile.mkdtemp(prefix="sw_growth_")
    os.makedirs(root, exist_ok=True)
    try:
        print("bytes:")
        byte_rows = bytes_growth(a.gibs, a.reps, root) if a.gibs else []
        print("ranks:")
        rank_rows = ranks_growth(a.ranks, a.chunks) if a.ranks else []
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if byte_rows:
        k_sw = fit_exponent([r["bytes"] for r in byte_rows], [r["shardwise_s"] for r in byte_rows])
        k_raw = fit_exponent([r["bytes"] for r in byte_rows], [r["raw_s"] for r in byte_rows])
        print(f"\n| GiB | shardwise (s) | raw (s) | shardwise GB/s | raw / shardwise |\n|---:|---:|---:|---:|---:|")
        for r in byte_rows:
            print(f"| {r['gib']} | {r['shardwise_s']:.2f} | {r['raw_s']:.2f} | {r['bytes'] / r['shardwise_s'] / 1e9:.2f} | "
                  f"{r['raw_s'] / r['shardwise_s']:.2f} |")
        print(f"growth exponent vs bytes: shardwise {k_sw:.2f}, raw {k_raw:.2f}")
    if rank_rows:
        big = [r for r in rank_rows if r["ranks"] >= 64] or rank_rows
        k_m = fit_exponent([r["ranks"] for r in big], [r["merge_s"] for r in big])
        print(f"\n| ranks | chunks | merge (s) | read (s) | validate (s) | pickle (s) | .metadata (MiB) |\n|---:|---:|---:|---:|---:|---:|---:|")
        for r in rank_rows:
            print(f"| {r['ranks']} | {r['ranks'] * r['chunks_per_rank']:,} | {r['merge_s']:.3f} | {r['read_s']:.3f} | "
                  f"{r['validate_s']:.3f} | {r['emit_s']:.3f} | {r['metadata_bytes'] / 2**20:.1f} |")
        print(f"growth exponent of merge time vs ranks (>= 64 ranks): {k_m:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bytes": byte_rows, "ranks": rank_rows}, f, indent=1)
    if byte_rows and rank_rows:
        try:
            plot(byte_rows, rank_rows, a.png, a.chunks)
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()
