"""The cost of the non-finite scan (issue 44): two `shardwise` CLI binaries, one built without the scan
(the commit before it) and one with it, run alternately on one llama-shaped Hugging Face folder of
many small tensors and two large ones: 512 layers of hidden size 128 (4,608 tensors of 16-64 KiB)
and a 1M-row vocabulary (`embed_tokens` and `lm_head`, 256 MiB each), 656 MiB of bf16 in all,
random and finite. Each round times `from-hf --dtype bf16`, `to-hf` (bf16 as stored: the scan is
the only pass over the values besides the copy) and `to-hf --quantize fp8-block`, each as CPU time
(user + system of the process: less sensitive than wall time to other load on a shared machine)
and wall time, with the folder and the checkpoint in the page cache; medians over the rounds.

Run: python python/benchmarks/nonfinite_scan.py --dir /tmp/nfbench --base BIN --new BIN [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import time

LAYERS, HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM, VOCAB = 512, 128, 256, 4, 2, 32, 1 << 20


def build(folder: str) -> int:
    """Writes the folder (config.json, one safetensors file) without torch; returns its data bytes."""
    os.makedirs(folder, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN,
               intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=GROUPS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=64,
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_theta=10000.0,
               torch_dtype="bfloat16", hidden_act="silu")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    q, kv = HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "lm_head.weight": [VOCAB, HIDDEN],
              "model.norm.weight": [HIDDEN]}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": [q, HIDDEN], p + "self_attn.k_proj.weight": [kv, HIDDEN],
                       p + "self_attn.v_proj.weight": [kv, HIDDEN], p + "self_attn.o_proj.weight": [HIDDEN, q],
                       p + "mlp.gate_proj.weight": [FFN, HIDDEN], p + "mlp.up_proj.weight": [FFN, HIDDEN],
                       p + "mlp.down_proj.weight": [HIDDEN, FFN], p + "input_layernorm.weight": [HIDDEN],
                       p + "post_attention_layernorm.weight": [HIDDEN]})
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    finite = bytes(b & 0xBF for b in range(256))  # the exponent's top bit off: every value |x| < 2
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        left = at
        while left:
            chunk = bytearray(os.urandom(min(left, 64 << 20)))
            chunk[1::2] = bytes(chunk[1::2]).translate(finite)
            f.write(chunk)
            left -= len(chunk)
    return at


def timed(args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def round_of(binary: str, d: str, workers: int) -> dict:
    for sub in ("ck", "out", "outq"):
        shutil.rmtree(os.path.join(d, sub), ignore_errors=True)
    hf, ck, w = os.path.join(d, "hf"), os.path.join(d, "ck"), ["--workers", str(workers)]
    config = ["--hf-config", os.path.join(hf, "config.json")]
    return {
        "from-hf": timed([binary, "from-hf", hf, ck, "--dtype", "bf16", *w]),
        "to-hf": timed([binary, "to-hf", ck, os.path.join(d, "out"), *config, *w]),
        "to-hf fp8-block": timed([binary, "to-hf", ck, os.path.join(d, "outq"), *config, *w, "--quantize",
                                  "fp8-block"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--base", required=True, help="shardwise CLI without the scan")
    ap.add_argument("--new", required=True, help="shardwise CLI with the scan")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args()
    print(f"{build(os.path.join(a.dir, 'hf')) >> 20} MiB of bf16, {3 + 9 * LAYERS} tensors")
    runs: dict = {"base": [], "new": []}
    round_of(a.base, a.dir, a.workers)  # the page cache warmed
    for _ in range(a.rounds):
        for which in ("base", "new"):
            runs[which].append(round_of(getattr(a, which), a.dir, a.workers))
    print(f"{'command':18} {'CPU s base':>10} {'CPU s new':>10} {'delta':>7} {'wall s base':>11} {'wall s new':>10}")
    for command in runs["base"][0]:
        cpu = {w: statistics.median(r[command][0] for r in runs[w]) for w in runs}
        wall = {w: statistics.median(r[command][1] for r in runs[w]) for w in runs}
        print(f"{command:18} {cpu['base']:10.3f} {cpu['new']:10.3f} {cpu['new'] - cpu['base']:+7.3f} "
              f"{wall['base']:11.3f} {wall['new']:10.3f}")


if __name__ == "__main__":
    main()
