"""Parse time and peak memory of a large DCP ``.metadata``: Python's ``pickle.load`` (what torch DCP
and Megatron do on every rank) against shardwise's ``Checkpoint::open`` (``_native.open_checkpoint``,
which parses ``.metadata`` once per process).

The ``.metadata`` files are made by real torch: the ``Metadata`` object is built from torch's own
classes and pickled the way ``FileSystemWriter.finish`` does (``pickle.dump``, the default protocol).
Each rank's plan items and write results go through a pickle round trip first, as
``gather_object`` puts them, so the memo sharing is that of a real multi-rank save (class refs,
each rank's ``relative_path`` string and fqn strings are shared; chunk offsets are not shared
between ``state_dict_metadata`` and ``storage_data``). No data files are written.

Layouts:

* ``grid``: ``--tensors`` keys x ``--chunks`` chunks (rank ``r`` saves chunk ``r`` of every key, 2-D
  row shards), Megatron-style fqns, ``MetadataIndex.index`` the chunk's position as torch's planner
  sets it; 1,000 x 1,000 is the issue's case (190 MiB here: sizes as ints up to 2^31 and one fqn
  string per rank, as a gather gives).
* ``moe``: about 1M chunks of a MoE model's params and optimizer states, stacked-layer Megatron
  keys (``decoder.layers.mlp.experts.experts.linear_fc1.weight``, 4-D chunks per layer, expert and
  TP rank; dense keys 3-D per layer and TP rank), 256 ranks; ``MetadataIndex.index`` is None, as
  in Megatron's saves.

Each measurement runs in a fresh child process (peak RSS is ``ru_maxrss`` of that child; the
baseline RSS of an idle child of the same kind is printed too).

Run:
    python python/benchmarks/metadata_parse.py make --layout grid --out /tmp/md_grid
    python python/benchmarks/metadata_parse.py make --layout moe --out /tmp/md_moe
    python python/benchmarks/metadata_parse.py bench /tmp/md_grid /tmp/md_moe [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import statistics
import subprocess
import sys
import time
import uuid

LAYER_KEYS = [
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
    "self_attention.linear_qkv.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_weight",
]
STATES = ["", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.", "optimizer.state.fp32_param."]


def _torch_classes():
    import torch
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return torch, m, _StorageInfo


def _properties(torch, m, dtype):
    return m.TensorProperties.create_from_tensor(torch.empty(0, dtype=dtype))


def grid_layout(tensors, chunks):
    """(fqn, global_shape, [(rank, offsets, sizes)]) per key: rank r saves row block r."""
    rows, cols = 8, 4096
    for t in range(tensors):
        fqn = f"{STATES[t % 4]}decoder.layers.{t // (4 * len(LAYER_KEYS))}.{LAYER_KEYS[(t // 4) % len(LAYER_KEYS)]}"
        fqn = f"{fqn}.{t}"  # unique even past the layer names
        yield fqn, (rows * chunks, cols), [(r, (r * rows, 0), (rows, cols)) for r in range(chunks)]


def moe_layout(layers=64, experts=256, tp=8, ranks=256):
    """~1.06M chunks: expert weights 4-D (layer, expert, rows, cols) chunked per layer, expert and
    TP rank; dense layer weights 3-D chunked per layer and TP rank; params and 3 optimizer states."""
    rows, cols = 512, 7168
    for state in STATES:
        for name in ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"):
            chunks = [
                ((e * tp + t) % ranks, (l, e, t * rows, 0), (1, 1, rows, cols))
                for l in range(layers)
                for e in range(experts)
                for t in range(tp)
            ]
            yield f"{state}decoder.layers.{name}", (layers, experts, rows * tp, cols), chunks
        for name in LAYER_KEYS:
            chunks = [(t % ranks, (l, t * rows, 0), (1, rows, cols)) for l in range(layers) for t in range(tp)]
            yield f"{state}decoder.layers.{name}", (layers, rows * tp, cols), chunks


def make(layout, out, tensors, chunks):
    torch, m, StorageInfo = _torch_classes()
    os.makedirs(out, exist_ok=True)
    keys = list(grid_layout(tensors, chunks) if layout == "grid" else moe_layout())
    props = _properties(torch, m, torch.bfloat16)
    # Per rank, in key order: the plan items and the write results that rank would send.
    # MetadataIndex.index is the chunk's position in the global chunk list (create_global_plan
    # rewrites it so), which is rank-major.
    per_rank = {}
    for fqn, _, cl in keys:
        for rank, offs, sizes in cl:
            per_rank.setdefault(rank, []).append((fqn, offs, sizes))
    per_rank_plan, per_rank_results, offset, position = {}, {}, {}, {}
    for rank in sorted(per_rank):
        for fqn, offs, sizes in per_rank[rank]:
            chunk = m.ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes))
            per_rank_plan.setdefault(rank, []).append((fqn, chunk))
            length = 1200 + 2 * sizes[-1]
            pos = offset.get(rank, 0)
            offset[rank] = pos + length
            index = position.get(fqn, 0)
            position[fqn] = index + 1
            if layout == "moe":
                index = None  # Megatron's save leaves the hint out (its golden fixtures have None)
            idx = m.MetadataIndex(fqn=fqn, offset=torch.Size(offs), index=index)
            per_rank_results.setdefault(rank, []).append((idx, (f"__{rank}_0.distcp", pos, length)))
    # The gather: one pickle round trip per rank, as gather_object does.
    for rank in per_rank_plan:
        names = {}
        res = []
        for idx, (path, pos, length) in per_rank_results[rank]:
            path = names.setdefault(path, path)  # one string per rank file, as the writer has
            res.append((idx, StorageInfo(relative_path=path, offset=pos, length=length)))
        per_rank_plan[rank] = pickle.loads(pickle.dumps(per_rank_plan[rank]))
        per_rank_results[rank] = pickle.loads(pickle.dumps(res))
    shapes = {fqn: shape for fqn, shape, _ in keys}
    sdm = {}
    for rank in sorted(per_rank_plan):
        for fqn, chunk in per_rank_plan[rank]:
            if fqn not in sdm:
                sdm[fqn] = m.TensorStorageMetadata(properties=props, size=torch.Size(shapes[fqn]), chunks=[])
            sdm[fqn].chunks.append(chunk)
    storage_data = {}
    for rank in sorted(per_rank_results):
        storage_data.update(per_rank_results[rank])
    md = m.Metadata(state_dict_metadata=sdm, planner_data={fqn: (fqn,) for fqn in sdm}, storage_data=storage_data)
    if hasattr(m, "StorageMeta"):  # torch 2.4+
        md.storage_meta = m.StorageMeta(checkpoint_id=pathlib.PosixPath(out), save_id=str(uuid.uuid4()))
    if hasattr(md, "version"):
        md.version = "1.0.0"
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f)  # FileSystemWriter.finish
    n = sum(len(c) for _, _, c in keys)
    size = os.path.getsize(os.path.join(out, ".metadata"))
    print(json.dumps({"dir": out, "keys": len(keys), "chunks": n, "bytes": size, "torch": torch.__version__}))


CHILD = r"""
import resource, sys, time, json
which, path = sys.argv[1], sys.argv[2]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if which == "pickle":
    import pickle
    import torch.distributed.checkpoint.metadata  # the classes pickle.load resolves (imported before timing)
    import torch.distributed.checkpoint.filesystem
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with open(path + "/.metadata", "rb") as f:
        md = pickle.load(f)
    dt = time.perf_counter() - t0
    n = sum(len(v.chunks) for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
elif which == "shardwise":
    from shardwise import _native
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    ck = _native.open_checkpoint(path)
    dt = time.perf_counter() - t0
    n = len(ck)
else:
    dt, n = 0.0, 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": dt, "peak_mib": peak / 1024, "base_mib": base / 1024, "n": n}))
"""


def child(which, path, pkg_dir=None):
    env = dict(os.environ)
    if pkg_dir:  # a given build of shardwise: its directory goes first on the child's path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(pkg_dir), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", CHILD, which, path], capture_output=True, text=True, check=True, env=env)
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench(dirs, reps, builds):
    """One JSON line per directory. ``builds``: {label: directory holding a ``shardwise`` package, or
    None for the one this interpreter imports}; each label gets its own entry, speed-up and memory
    ratio against ``pickle.load`` of the same run."""
    for d in dirs:
        size = os.path.getsize(os.path.join(d, ".metadata"))
        runs = {"pickle": []} | {label: [] for label in builds}
        for _ in range(reps):  # alternate, so that load changes hit all alike
            for label in runs:
                which = "pickle" if label == "pickle" else "shardwise"
                runs[label].append(child(which, d, builds.get(label)))
        out = {"dir": d, "mib": round(size / 2**20, 1), "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
        for label, rs in runs.items():
            out[label] = {
                "s_median": round(statistics.median(r["s"] for r in rs), 3),
                "s_all": [round(r["s"], 3) for r in rs],
                "peak_mib": round(max(r["peak_mib"] for r in rs)),
                "rise_mib": round(max(r["peak_mib"] - r["base_mib"] for r in rs)),
                "n": rs[0]["n"],
            }
        for label in builds:
            suffix = "" if label == "shardwise" else f"_{label}"
            out["speedup" + suffix] = round(out["pickle"]["s_median"] / out[label]["s_median"], 1)
            out["rise_ratio" + suffix] = round(out[label]["rise_mib"] / out["pickle"]["rise_mib"], 3)
        print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--layout", choices=["grid", "moe"], default="grid")
    mk.add_argument("--out", required=True)
    mk.add_argument("--tensors", type=int, default=1000)
    mk.add_argument("--chunks", type=int, default=1000)
    b = sub.add_parser("bench")
    b.add_argument("dirs", nargs="+")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument(
        "--build",
        action="append",
        metavar="LABEL=DIR",
        help="compare builds in one run: DIR holds a built `shardwise` package (repeatable; "
        "default: the shardwise this interpreter imports, labelled 'shardwise')",
    )
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.layout, a.out, a.tensors, a.chunks)
    else:
        builds = {"shardwise": None}
        if a.build:
            builds = dict(spec.split("=", 1) for spec in a.build)
            if "pickle" in builds or any(not label for label in builds):
                ap.error("--build LABEL=DIR: LABEL must be non-empty and not 'pickle'")
        bench(a.dirs, a.reps, builds)


if __name__ == "__main__":
    main()
