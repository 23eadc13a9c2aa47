"""CPU load benchmark (issue 17): a real megatron-core GPT checkpoint, written by Megatron's own
torch_dist save on gloo ranks at TP2 x DP(ranks/2), loaded at the same layout and resharded (TP4
with 4 ranks, TP1 with 2) by
``shardwise.megatron.load`` and by Megatron's ``dist_checkpointing.load``.

Each (loader, layout) runs in fresh processes: every rank builds the destination model, resets its
peak RSS (``/proc/self/clear_refs``), and loads ``--repeats`` times between barriers. Reported per
run: wall time of the first load (slowest rank; shardwise parses ``.metadata`` there) and the
median of the later ones, and the peak RSS a rank reached during the loads (max over ranks), with
its growth above the RSS before the first load. The page cache is warm for both (the checkpoint
was just written, and both loaders run over it alternately).

    .venv/bin/python python/benchmarks/cpu_load.py --ranks 4 --hidden 768 --layers 8 --out /tmp/cpu_load
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402

from mcore import init_gloo, spawn  # noqa: E402


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def build(args, seed: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=args["layers"], hidden_size=args["hidden"], num_attention_heads=args["heads"],
        num_query_groups=args["query_groups"], ffn_hidden_size=4 * args["hidden"], use_cpu_initialization=True,
        gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm", params_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
    )
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args["vocab"],
                    max_sequence_length=2048)


def save_worker(rank, world, port, base, args):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    init_gloo(rank, world, port, timeout_s=1800)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build(args, 1)
    path = os.path.join(base, "ckpt")
    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)
    dist.barrier()
    return {"params": sum(p.numel() for p in model.parameters())}


def load_worker(rank, world, port, base, args, loader, tp):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    init_gloo(rank, world, port, timeout_s=1800)
    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build(args, 2)
    path = os.path.join(base, "ckpt")
    load = swm.load if loader == "shardwise" else dist_checkpointing.load
    rss_before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    times = []
    for _ in range(args["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        loaded = load(model.sharded_state_dict(), path)
        times.append(time.perf_counter() - t0)
        del loaded
    dist.barrier()
    return {"times": times, "rss_before_kib": rss_before, "peak_kib": _kib("VmHWM")}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--query-groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="/tmp/shardwise_cpu_load")
    a = p.parse_args()
    args = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "query_groups", "vocab", "repeats")}
    base = a.out
    os.makedirs(base, exist_ok=True)

    def run(fn, *extra):
        results = spawn(fn, a.ranks, os.path.join(base, "out"), base, args, *extra, timeout_s=3600)
        bad = [r for r in results if not r.get("ok")]
        if bad:
            sys.exit(f"{bad[0].get('error')}\n{bad[0].get('traceback', '')}")
        return results

    if not os.path.exists(os.path.join(base, "ckpt", ".metadata")):
        t0 = time.perf_counter()
        params = run(save_worker)[0]["params"]
        print(f"saved with Megatron's torch_dist at TP2 x DP{a.ranks // 2} in {time.perf_counter() - t0:.1f} s ({params} params on rank 0)")
    size = sum(os.path.getsize(os.path.join(base, "ckpt", f)) for f in os.listdir(os.path.join(base, "ckpt")))
    print(f"checkpoint: {size / 2**20:.0f} MiB, {a.ranks} gloo ranks, torch threads 1 per rank")

    rows = []
    reshard_tp = 4 if a.ranks >= 4 else 1
    layouts = ((f"TP2 x DP{a.ranks // 2} (same)", 2), (f"TP{reshard_tp} x DP{a.ranks // reshard_tp} (resharded)", reshard_tp))
    for layout, tp in layouts:
        for loader in ("megatron", "shardwise"):
            res = run(load_worker, loader, tp)
            first = max(r["times"][0] for r in res)
            later = statistics.median(max(r["times"][i] for r in res) for i in range(1, a.repeats)) if a.repeats > 1 else first
            peak = max(r["peak_kib"] for r in res) / 1024
            growth = max(r["peak_kib"] - r["rss_before_kib"] for r in res) / 1024
            rows.append({"layout": layout, "loader": loader, "first_s": first, "warm_s": later, "peak_rss_mib": peak, "rss_growth_mib": growth})
            print(f"{layout:18} {loader:9} first {first:7.3f} s  later {later:7.3f} s  peak RSS {peak:7.0f} MiB (+{growth:.0f} MiB during the load)", flush=True)
    for layout, _ in layouts:
        m, s = (next(r for r in rows if r["layout"] == layout and r["loader"] == x) for x in ("megatron", "shardwise"))
        print(f"{layout}: shardwise {m['first_s'] / s['first_s']:.2f}x faster (first load), {m['warm_s'] / s['warm_s']:.2f}x (later loads)")
    with open(os.path.join(base, "results.json"), "w") as f:
        json.dump({"args": args, "ranks": a.ranks, "checkpoint_bytes": size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
