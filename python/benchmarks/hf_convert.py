"""to-hf benchmark: shardwise's streaming converter against a full-load conversion (every tensor
loaded into host memory through torch DCP, then written with safetensors, as slime's
tools/convert_torch_dist_to_hf.py does), on the same llama-shaped torch_dist checkpoint, plus the
disk's sequential read+write ceiling measured in the same run. Each method runs in its own
subprocess so its peak RSS is its own.

The checkpoint is built from random weights with Megatron's key names and shapes (2 ranks, TP=2,
layer-stacked keys), written by shardwise.

Run: python python/benchmarks/hf_convert.py --dir /tmp/hfbench [--layers 20 --hidden 2048]

Quantized conversion (issues 22 and 38): `--methods bf16:2,fp8:2,nvfp4:2,mxfp8:2` runs `to-hf --dtype
bf16` and the same with `--quantize fp8-block`, `nvfp4` or `mxfp8` (quantization inside the streaming
pass).

Parallel conversion (issue 16): `--methods ceiling:1,ceiling:4,shardwise:1,shardwise:4,parts:4` runs
the read+write ceiling with N threads (pread/pwrite of 64 MiB blocks, fsync'd), `to-hf --workers N`,
and `to-hf --part i/N` as N concurrent processes (each with cpus/N workers), as several machines
sharing the storage would. `--builder dcp` writes the checkpoint with torch DCP alone (one process,
layer-stacked keys; no megatron-core needed, as on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid


def build(ckpt, layers, hidden, ffn, heads, groups, vocab):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import shardwise.megatron as swm

    hd = hidden // heads
    qkv_rows = groups * (heads // groups + 2) * hd
    sid = uuid.uuid4().hex
    for rank in (1, 0):  # TP=2: each rank holds half the rows (columns for row-parallel weights)
        g = torch.Generator().manual_seed(rank)
        def t(*shape):
            return torch.randn(*shape, generator=g) * 0.02
        sd = {}
        def stacked(key, per_layer_local, axis):
            for l, local in enumerate(per_layer_local):
                sd[f"{key}.{l}"] = ShardedTensor.from_rank_offsets(
                    key, local, (0, l, layers), *([(axis + 1, rank, 2)] if axis is not None else []),
                    replica_id=0 if (axis is not None or rank == 0) else 1, prepend_axis_num=1)
        stacked("decoder.layers.self_attention.linear_qkv.weight", [t(qkv_rows // 2, hidden) for _ in range(layers)], 0)
        stacked("decoder.layers.self_attention.linear_proj.weight", [t(hidden, hidden // 2) for _ in range(layers)], 1)
        stacked("decoder.layers.mlp.linear_fc1.weight", [t(ffn, hidden) for _ in range(layers)], 0)
        stacked("decoder.layers.mlp.linear_fc2.weight", [t(hidden, ffn // 2) for _ in range(layers)], 1)
        stacked("decoder.layers.input_layernorm.weight", [torch.ones(hidden) for _ in range(layers)], None)
        stacked("decoder.layers.pre_mlp_layernorm.weight", [torch.ones(hidden) for _ in range(layers)], None)
        sd["emb"] = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", t(vocab // 2, hidden), (0, rank, 2), replica_id=0)
        sd["out"] = ShardedTensor.from_rank_offsets("output_layer.weight", t(vocab // 2, hidden), (0, rank, 2), replica_id=0)
        sd["norm"] = ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", torch.ones(hidden), replica_id=rank)
        swm.save(sd, ckpt, rank=rank, world_size=2, save_id=sid, wait_for_commit=False)
    # SwiGLU: the per-rank fc1 above is [gate_shard; up_shard] laid out as Megatron's global [gate; up]
    # only approximately (random data): the benchmark measures bytes moved, not values.
    return dict(model_type="llama", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=groups, head_dim=hd, intermediate_size=ffn, vocab_size=vocab,
                tie_word_embeddings=False, rms_norm_eps=1e-5)


def build_dcp(ckpt, layers, hidden, ffn, heads, groups, vocab):
    """The same model with torch DCP alone: one process, full tensors, layer-stacked keys."""
    import torch
    import torch.distributed.checkpoint as dcp

    hd = hidden // heads
    qkv_rows = groups * (heads // groups + 2) * hd
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    sd = {
        "decoder.layers.self_attention.linear_qkv.weight": t(layers, qkv_rows, hidden),
        "decoder.layers.self_attention.linear_proj.weight": t(layers, hidden, hidden),
        "decoder.layers.mlp.linear_fc1.weight": t(layers, 2 * ffn, hidden),
        "decoder.layers.mlp.linear_fc2.weight": t(layers, hidden, ffn),
        "decoder.layers.input_layernorm.weight": torch.ones(layers, hidden),
        "decoder.layers.pre_mlp_layernorm.weight": torch.ones(layers, hidden),
        "embedding.word_embeddings.weight": t(vocab, hidden),
        "output_layer.weight": t(vocab, hidden),
        "decoder.final_layernorm.weight": torch.ones(hidden),
    }
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt, thread_count=4), no_dist=True)
    return dict(model_type="llama", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=groups, head_dim=hd, intermediate_size=ffn, vocab_size=vocab,
                tie_word_embeddings=False, rms_norm_eps=1e-5)


def full_load(ckpt, out):
    """The peer: DCP-load every tensor into memory, split the layer axis, save with safetensors."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(ckpt).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    load(sd, storage_reader=FileSystemReader(ckpt), no_dist=True)
    flat = {}
    for k, v in sd.items():
        if k.startswith("decoder.layers."):
            for l in range(v.shape[0]):
                flat[f"{k}.{l}"] = v[l].contiguous()
        else:
            flat[k] = v
    os.makedirs(out, exist_ok=True)
    save_file(flat, os.path.join(out, "model.safetensors"))


def ceiling(src_dir, out, threads=1, suffix=".distcp"):
    """Every byte of the `suffix` files in `src_dir` read and the same amount written (64 MiB
    blocks, `threads` at once, pread/pwrite), fsync'd: the disk's read+write ceiling for this much
    data."""
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(out, exist_ok=True)
    blocks = []
    for name in sorted(os.listdir(src_dir)):
        if name.endswith(suffix):
            p = os.path.join(src_dir, name)
            size = os.path.getsize(p)
            blocks += [(p, off, min(64 << 20, size - off)) for off in range(0, size, 64 << 20)]
    total = sum(b[2] for b in blocks)
    fd = os.open(os.path.join(out, "copy.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(fd, 0, total)
    starts, at = [], 0
    for b in blocks:
        starts.append(at)
        at += b[2]

    def copy(i):
        p, off, n = blocks[i]
        with open(p, "rb") as r:
            os.pwrite(fd, os.pread(r.fileno(), n, off), starts[i])

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(copy, range(len(blocks))))
    os.fsync(fd)
    os.close(fd)


def parts(ckpt, out, config, n):
    """`to-hf --part i/n` as n concurrent processes, each with cpus/n workers."""
    w = max(1, (os.cpu_count() or 1) // n)
    procs = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", "to-hf", ckpt, out, "--hf-config", config,
                               "--part", f"{i}/{n}", "--workers", str(w), "--json"], stdout=subprocess.DEVNULL)
             for i in range(n)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a part failed")
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))


# Method kind -> to-hf's `quantize` (None: the plain bf16 conversion).
QUANTIZE = {"bf16": None, "fp8": "fp8-block", "nvfp4": "nvfp4", "mxfp8": "mxfp8"}


def child(method, ckpt, out, config):
    t0 = time.perf_counter()
    kind, _, n = method.partition(":")
    n = int(n or 1)
    if kind == "shardwise":
        import shardwise

        shardwise.to_hf(ckpt, out, hf_config=config, workers=n)
    elif kind in QUANTIZE:
        # The bf16 conversion, and the same with a quantization in its streaming pass.
        import shardwise

        shardwise.to_hf(ckpt, out, hf_config=config, workers=n, dtype="bf16", quantize=QUANTIZE[kind])
    elif kind == "parts":
        parts(ckpt, out, config, n)
    elif kind == "full-load":
        full_load(ckpt, out)
    else:
        ceiling(ckpt, out, n)
    secs = time.perf_counter() - t0
    # Peak resident memory of this process alone (VmHWM; ru_maxrss would carry the parent's peak
    # across fork+exec); for parts, the parent's only.
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": secs, "peak_rss_kib": hwm}))


def drop_caches():
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/hfbench")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", nargs=4)
    ap.add_argument("--methods", default="ceiling,shardwise,full-load",
                    help="comma-separated: ceiling[:threads], shardwise[:workers], parts:N, full-load, "
                         "bf16[:workers] (to-hf --dtype bf16), fp8[:workers] (the same with --quantize fp8-block)")
    ap.add_argument("--builder", choices=["shardwise", "dcp"], default="shardwise")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt = os.path.join(args.dir, "ckpt")
    t0 = time.perf_counter()
    cfg = (build if args.builder == "shardwise" else build_dcp)(ckpt, args.layers, args.hidden, args.ffn, 16, 4,
                                                                args.vocab)
    print(f"built in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    config = os.path.join(args.dir, "config.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    nbytes = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt) if n.endswith(".distcp"))
    rows = []
    for method in [m for m in args.methods.split(",") for _ in range(args.repeat)]:
        out = os.path.join(args.dir, f"out-{method.replace(':', '-')}")
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"])
        drop_caches()
        r = subprocess.run([sys.executable, __file__, "--child", method, ckpt, out, config], stdout=subprocess.PIPE,
                           text=True, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"method": method, "seconds": round(res["seconds"], 2), "gb_per_s": round(nbytes / res["seconds"] / 1e9, 3),
                     "peak_rss_mib": round(res["peak_rss_kib"] / 1024)})
        print(json.dumps(rows[-1]), file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"checkpoint_bytes": nbytes, "cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
