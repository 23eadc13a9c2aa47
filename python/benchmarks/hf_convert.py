"""to-hf benchmark: shardwise's streaming converter against a full-load conversion (every tensor
loaded into host memory through torch DCP, then written with safetensors, as slime's
tools/convert_torch_dist_to_hf.py does), on the same llama-shaped torch_dist checkpoint, plus the
disk's sequential read+write ceiling measured in the same run. Each method runs in its own
subprocess so its peak RSS is its own.

The checkpoint is built from random weights with Megatron's key names and shapes (2 ranks, TP=2,
layer-stacked keys), written by shardwise.

Run: python python/benchmarks/hf_convert.py --dir /tmp/hfbench [--layers 20 --hidden 2048]
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


def ceiling(src_dir, out):
    """Sequential read of every checkpoint byte and write of the same amount, fsync'd."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "copy.bin"), "wb") as w:
        for name in sorted(os.listdir(src_dir)):
            p = os.path.join(src_dir, name)
            if name.endswith(".distcp"):
                with open(p, "rb") as r:
                    while chunk := r.read(64 << 20):
                        w.write(chunk)
        w.flush()
        os.fsync(w.fileno())


def child(method, ckpt, out, config):
    t0 = time.perf_counter()
    if method == "shardwise":
        import shardwise

        shardwise.to_hf(ckpt, out, hf_config=config)
    elif method == "full-load":
        full_load(ckpt, out)
    else:
        ceiling(ckpt, out)
    secs = time.perf_counter() - t0
    # Peak resident memory of this process alone (VmHWM; ru_maxrss would carry the parent's peak
    # across fork+exec).
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
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt = os.path.join(args.dir, "ckpt")
    cfg = build(ckpt, args.layers, args.hidden, args.ffn, 16, 4, args.vocab)
    config = os.path.join(args.dir, "config.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    nbytes = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt) if n.endswith(".distcp"))
    rows = []
    for method in ("ceiling", "shardwise", "full-load"):
        out = os.path.join(args.dir, f"out-{method}")
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"])
        drop_caches()
        r = subprocess.run([sys.executable, __file__, "--child", method, ckpt, out, config], stdout=subprocess.PIPE,
                           text=True, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"method": method, "seconds": round(res["seconds"], 2), "peak_rss_mib": round(res["peak_rss_kib"] / 1024)})
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"checkpoint_bytes": nbytes, "cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
