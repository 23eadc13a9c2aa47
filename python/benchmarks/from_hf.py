"""from-hf benchmark: `shardwise from-hf` on a llama-shaped Hugging Face folder (safetensors shards of
random weights, transformers' names) against the disk's read+write ceiling measured in the same run
(`hf_convert.ceiling`: every input byte read and the same amount written, 64 MiB pread/pwrite,
fsync'd). Each method runs in its own subprocess, so its peak RSS (VmHWM) is its own; the page cache
is dropped before each where the machine allows it.

Run: python python/benchmarks/from_hf.py --dir /tmp/fhbench [--layers 22 --dtype fp32]
     --methods ceiling:1,ceiling:2,shardwise:1,shardwise:2,parts:2

`shardwise:N` is `from-hf --workers N` (output dtype = input dtype, so bytes in = bytes out plus the
vocabulary padding); `parts:N` is `from-hf --part i/N` as N concurrent processes of cpus/N workers
each into one folder (the last part commits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from hf_convert import ceiling, drop_caches  # noqa: E402


def build(folder, layers, hidden, ffn, heads, groups, vocab, dtype):
    """A llama HF folder: config.json, one safetensors file per layer pair plus one for the
    embeddings, and the index."""
    import torch
    from safetensors.torch import save_file

    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    hd = hidden // heads
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(tdtype)

    os.makedirs(folder, exist_ok=True)
    files = []
    weight_map = {}

    def flush(tensors):
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in tensors})

    flush({"model.embed_tokens.weight": t(vocab, hidden), "lm_head.weight": t(vocab, hidden),
           "model.norm.weight": torch.ones(hidden, dtype=tdtype)})
    for l0 in range(0, layers, 2):
        shard = {}
        for l in range(l0, min(l0 + 2, layers)):
            p = f"model.layers.{l}."
            shard.update({
                p + "self_attn.q_proj.weight": t(heads * hd, hidden),
                p + "self_attn.k_proj.weight": t(groups * hd, hidden),
                p + "self_attn.v_proj.weight": t(groups * hd, hidden),
                p + "self_attn.o_proj.weight": t(hidden, heads * hd),
                p + "mlp.gate_proj.weight": t(ffn, hidden),
                p + "mlp.up_proj.weight": t(ffn, hidden),
                p + "mlp.down_proj.weight": t(hidden, ffn),
                p + "input_layernorm.weight": torch.ones(hidden, dtype=tdtype),
                p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=tdtype),
            })
        flush(shard)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                       hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=groups, head_dim=hd,
                       intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-5,
                       max_position_embeddings=4096), f)
    return total


def parts(hf, out, dtype, n):
    w = max(1, (os.cpu_count() or 1) // n)
    procs = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", "from-hf", hf, out, "--dtype", dtype,
                               "--transformer-impl", "local", "--part", f"{i}/{n}", "--workers", str(w), "--json"],
                              stdout=subprocess.DEVNULL) for i in range(n)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a part failed")
    assert os.path.exists(os.path.join(out, ".metadata"))


def child(method, hf, out, dtype):
    t0 = time.perf_counter()
    kind, _, n = method.partition(":")
    n = int(n or 1)
    if kind == "shardwise":
        import shardwise

        shardwise.from_hf(hf, out, dtype=dtype, transformer_impl="local", workers=n)
    elif kind == "parts":
        parts(hf, out, dtype, n)
    else:
        ceiling(hf, out, n, suffix=".safetensors")
    secs = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": secs, "peak_rss_kib": hwm}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/fhbench")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--child", nargs=4)
    ap.add_argument("--methods", default="ceiling:1,shardwise:1",
                    help="comma-separated: ceiling[:threads], shardwise[:workers], parts:N")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    shutil.rmtree(args.dir, ignore_errors=True)
    hf = os.path.join(args.dir, "hf")
    t0 = time.perf_counter()
    nbytes = build(hf, args.layers, args.hidden, args.ffn, 16, 4, args.vocab, args.dtype)
    print(f"built {nbytes / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    rows = []
    for method in [m for m in args.methods.split(",") for _ in range(args.repeat)]:
        out = os.path.join(args.dir, f"out-{method.replace(':', '-')}")
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"])
        drop_caches()
        r = subprocess.run([sys.executable, __file__, "--child", method, hf, out, args.dtype], stdout=subprocess.PIPE,
                           text=True, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"method": method, "seconds": round(res["seconds"], 2),
                     "gb_per_s": round(nbytes / res["seconds"] / 1e9, 3),
                     "peak_rss_mib": round(res["peak_rss_kib"] / 1024)})
        print(json.dumps(rows[-1]), file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"input_bytes": nbytes, "cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
