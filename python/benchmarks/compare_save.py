"""CPU save comparison (issue 7): the same real Megatron sharded state dict saved, in one run and
interleaved, by

* ``shardwise``        -- ``shardwise.megatron.save`` (no collective);
* ``megatron``         -- Megatron's own ``dist_checkpointing.save`` (``torch_dist``, its defaults),
                          on CPU with gloo through the two monkeypatches of
                          ``python/tests/mcore.py`` (``patch_cuda_for_cpu``);
* ``dcp``              -- ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` on the same
                          shards (Megatron's own conversion to torch ShardedTensors, done outside the
                          timer);
* ``raw``              -- the ceiling: every rank writes the bytes of its main-replica shards in one
                          sequential stream to a file in the same directory, then fsyncs.

Every method ends durable (fsync'd) and, for the checkpoint formats, committed. The time of a save is
from a barrier-aligned start to the moment the last rank returns (a shared monotonic clock). Peak RSS
is the largest increase of any rank's resident set over its level before the save (sampled every
5 ms). Ratios are the method's median over shardwise's median (> 1: shardwise is faster).

Two cases:

* ``--case big`` (default): a megatron-core GPTModel of ``--gib`` GiB of weights, TP=2 on 2 ranks.
* ``--case small``: the fixed-overhead case, a ~16 MiB GPT (TP=2 x DP=world/2) saved by
  ``--worlds`` ranks (default 4 8 16), shardwise vs Megatron torch_dist, time to commit.

Run:
    python python/benchmarks/compare_save.py --case big --gib 3 --reps 3
    python python/benchmarks/compare_save.py --case small --worlds 4 8 16 --reps 5
    python python/benchmarks/compare_save.py --quick          # a few seconds: the regression guard
Add ``--json FILE`` to keep the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # mcore.py: spawn, init_gloo

warnings.filterwarnings("ignore")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

BIG_METHODS = ("shardwise", "raw", "megatron", "dcp")
SMALL_METHODS = ("shardwise", "megatron")


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------

def gpt_config(gib: float, dtype_name: str, tp: int):
    """GPT layout of about ``gib`` GiB of weights: hidden 2048 (16 heads, 4 query groups, SwiGLU
    ffn 8192, vocab 32768, tied output) or, below 1 GiB, hidden 256 (ffn 1024, vocab 1024)."""
    import torch

    itemsize = 2 if dtype_name == "bf16" else 4
    if gib >= 1:
        h, ffn, vocab, heads, groups = 2048, 8192, 32768, 16, 4
    else:
        h, ffn, vocab, heads, groups = 256, 1024, 1024, 4, 2
    kv = h // heads * groups
    per_layer = h * (h + 2 * kv) + h * h + 3 * ffn * h + 2 * h
    layers = max(1, round((gib * (1 << 30) / itemsize - vocab * h) / per_layer))
    return dict(h=h, ffn=ffn, vocab=vocab, heads=heads, groups=groups, layers=layers,
                dtype=torch.bfloat16 if dtype_name == "bf16" else torch.float32)


def build_model(spec: dict, seed: int):
    """A megatron-core GPTModel (local layer spec) with weights filled with random values; every
    rank holds only its TP shard."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=spec["layers"],
        hidden_size=spec["h"],
        num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"],
        ffn_hidden_size=spec["ffn"],
        use_cpu_initialization=True,
        perform_initialization=False,  # filled below, shard by shard (a full-size CPU init is slow)
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        params_dtype=spec["dtype"],
        pipeline_dtype=spec["dtype"],
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=spec["vocab"], max_sequence_length=128)
    g = torch.Generator().manual_seed(seed + ps.get_tensor_model_parallel_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1, 1, generator=g)
    return model


def main_replica_tensors(model):
    """The tensors each method must write on this rank: main-replica shards after factories."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    sd = model.sharded_state_dict()
    apply_factories(sd)
    out = []
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            out.append(sh.data.detach().contiguous())
    return out


# ------------------------------------------------------------------------------------------------
# Methods (each called on every rank with a fresh sharded state dict and an empty directory)
# ------------------------------------------------------------------------------------------------

def run_shardwise(model, d, tag):
    import shardwise.megatron as swm

    sd = model.sharded_state_dict()
    return lambda: swm.save(sd, d, timeout_s=600, save_id=tag)


def run_megatron(model, d, tag):
    from megatron.core import dist_checkpointing

    sd = model.sharded_state_dict()
    return lambda: dist_checkpointing.save(sd, d)


def run_dcp(model, d, tag):
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sd = model.sharded_state_dict()
    apply_factories(sd)
    sharded, _ = extract_sharded_base(sd)
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)
    pyt = mcore_to_pyt_state_dict(sharded, False)
    return lambda: dcp.save(pyt, storage_writer=dcp.FileSystemWriter(d))


def run_raw(model, d, tag, _cache={}):
    import torch

    if "bufs" not in _cache:
        _cache["bufs"] = [t.view(-1).view(torch.uint8).numpy() for t in main_replica_tensors(model)]
    bufs = _cache["bufs"]

    def go():
        import torch.distributed as dist

        fd = os.open(os.path.join(d, f"raw_{dist.get_rank()}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for b in bufs:
                mv = memoryview(b)
                while mv:
                    mv = mv[os.write(fd, mv[: 1 << 30]):]
            os.fsync(fd)
        finally:
            os.close(fd)

    return go


RUNNERS = {"shardwise": run_shardwise, "megatron": run_megatron, "dcp": run_dcp, "raw": run_raw}


class PeakRss:
    """Samples this process's resident set every 5 ms while running."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _loop(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def _rmtree_contents(d):
    shutil.rmtree(d, ignore_errors=True)


def worker(rank, world, port, root, spec, methods, reps, tp, warmup):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from mcore import init_gloo

    init_gloo(rank, world, port, timeout_s=1800)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    t = time.monotonic()
    model = build_model(spec, seed=1)
    build_s = time.monotonic() - t
    nbytes = sum(t.numel() * t.element_size() for t in main_replica_tensors(model))
    times = {m: [] for m in methods}
    rss = {m: [] for m in methods}
    for rep in range(-warmup, reps):
        order = list(methods[rep % len(methods):]) + list(methods[: rep % len(methods)])
        for m in order:
            d = os.path.join(root, f"{m}_{rep}")
            if rank == 0:
                os.makedirs(d, exist_ok=True)
            dist.barrier()
            go = RUNNERS[m](model, d, f"bench-{m}-{rep}")
            dist.barrier()
            with PeakRss() as r:
                t0 = time.monotonic()
                go()
                t1 = time.monotonic()
            if rep >= 0:  # warm-up runs (imports, first-touch of code paths) are not counted
                times[m].append((t0, t1))
                rss[m].append(r.peak - r.base)
            dist.barrier()
            if rank == 0:
                _rmtree_contents(d)
            dist.barrier()
    # Megatron's writer keeps a multiprocessing Manager process (its results queue); end it, since
    # spawn's workers leave with os._exit.
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    return {"times": times, "rss": rss, "nbytes": nbytes, "build_s": build_s}


def combine(results, methods):
    """Per method: wall time of each rep (min start to max end over ranks), max peak RSS increase."""
    out = {}
    reps = len(results[0]["times"][methods[0]])
    for m in methods:
        walls = []
        for i in range(reps):
            start = min(r["times"][m][i][0] for r in results)
            end = max(r["times"][m][i][1] for r in results)
            walls.append(end - start)
        out[m] = {
            "walls": walls,
            "median_s": statistics.median(walls),
            "rss_mib": max(max(r["rss"][m]) for r in results) / (1 << 20),
        }
    return out


def machine_facts():
    import torch

    facts = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
             "torch": torch.__version__}
    try:
        import megatron.core

        facts["megatron_core"] = megatron.core.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        with open("/proc/meminfo") as f:
            facts["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except Exception:  # noqa: BLE001
        pass
    facts["loadavg"] = os.getloadavg()
    return facts


def run_case(world, tp, spec, methods, reps, root, warmup=1):
    from mcore import spawn

    os.makedirs(root, exist_ok=True)
    results = spawn(worker, world, os.path.join(root, "_out"), root, spec, list(methods), reps, tp,
                    warmup, timeout_s=3600)
    bad = [r for r in results if not r.get("ok")]
    if bad:
        raise RuntimeError("\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in bad))
    combined = combine(results, list(methods))
    nbytes = sum(r["nbytes"] for r in results if r["rank"] < tp)  # DP replicas hold copies
    return combined, nbytes, max(r["build_s"] for r in results)


def print_big(combined, nbytes, methods):
    ref = combined["shardwise"]["median_s"]
    raw = combined["raw"]["median_s"] if "raw" in combined else None
    print(f"\n{nbytes:,} bytes of weights; medians of {len(combined['shardwise']['walls'])} interleaved runs")
    print("| method | median (s) | GB/s | method / shardwise | shardwise vs ceiling | peak RSS increase (MiB) | runs (s) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for m in methods:
        c = combined[m]
        vs_ceiling = f"{raw / ref:.2f}" if (m == "raw" and raw) else ""
        print(f"| {m} | {c['median_s']:.3f} | {nbytes / c['median_s'] / 1e9:.2f} | {c['median_s'] / ref:.2f} | "
              f"{vs_ceiling} | {c['rss_mib']:.0f} | {', '.join(f'{w:.2f}' for w in c['walls'])} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("big", "small"), default="big")
    ap.add_argument("--gib", type=float, default=3.0, help="weights in GiB (big case)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of every method first")
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--small-mib", type=float, default=16.0)
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 reps, shardwise vs DCP and raw")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    root = a.dir or tempfile.mkdtemp(prefix="sw_compare_")
    os.makedirs(root, exist_ok=True)
    report = {"machine": machine_facts(), "args": vars(a)}
    try:
        if a.case == "big" or a.quick:
            gib = 1 / 16 if a.quick else a.gib
            reps = 2 if a.quick else a.reps
            methods = a.methods or (("shardwise", "raw", "dcp") if a.quick else BIG_METHODS)
            spec = gpt_config(gib, a.dtype, tp=2)
            t = time.monotonic()
            combined, nbytes, build_s = run_case(2, 2, spec, methods, reps, os.path.join(root, "big"),
                                                 warmup=a.warmup)
            report["big"] = {"spec": {k: str(v) for k, v in spec.items()}, "nbytes": nbytes,
                             "results": combined, "total_s": time.monotonic() - t, "build_s": build_s}
            print(f"GPT {spec['layers']} layers, hidden {spec['h']}, {a.dtype}, TP=2 on 2 gloo ranks "
                  f"(model built in {build_s:.1f} s)")
            print_big(combined, nbytes, methods)
        else:
            rows = []
            mib = a.small_mib
            spec = gpt_config(mib / 1024, a.dtype, tp=2)
            for world in a.worlds:
                methods = a.methods or SMALL_METHODS
                combined, nbytes, _ = run_case(world, 2, spec, methods, a.reps, os.path.join(root, f"w{world}"),
                                               warmup=a.warmup)
                rows.append((world, nbytes, combined))
                report.setdefault("small", []).append({"world": world, "nbytes": nbytes, "results": combined})
            print(f"\nGPT {spec['layers']} layers, hidden {spec['h']}, {a.dtype}, TP=2 x DP=world/2; "
                  f"medians of {a.reps} interleaved runs; time from a common start to the last rank's return")
            print("| ranks | bytes | shardwise (s) | Megatron torch_dist (s) | Megatron / shardwise | shardwise peak RSS (MiB) | Megatron peak RSS (MiB) |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for world, nbytes, c in rows:
                s, m = c["shardwise"], c["megatron"]
                print(f"| {world} | {nbytes:,} | {s['median_s']:.3f} | {m['median_s']:.3f} | "
                      f"{m['median_s'] / s['median_s']:.1f} | {s['rss_mib']:.0f} | {m['rss_mib']:.0f} |")
    finally:
        report["machine"]["loadavg_after"] = os.getloadavg()
        print(f"\nmachine: {json.dumps(report['machine'])}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
