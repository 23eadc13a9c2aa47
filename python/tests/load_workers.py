"""Workers of the collective-free load tests (issue 17): one 4-rank gloo run saves a GPT (SwiGLU,
GQA) at TP2 x DP2 with Megatron's own save and with shardwise, a DistributedOptimizer state in both
formats and an EP=2 MoE, then loads each at several layouts with ``shardwise.megatron.load`` and with
Megatron's own ``dist_checkpointing.load`` and compares the two results bitwise."""

from __future__ import annotations

import os
import time
import warnings

import torch

from mcore import build_gpt, build_moe, init_gloo, model_tensors
from mcore_workers import DistRecorder

warnings.filterwarnings("ignore")

# Load layouts of the TP2 x DP2 checkpoint (world 4): (name, tp, pp).
LAYOUTS = (("tp2dp2", 2, 1), ("tp1dp4", 1, 1), ("pp2tp2", 2, 2), ("tp4", 4, 1))


def snapshot(x):
    """A copy of a load result whose tensors no later in-place load can change."""
    if isinstance(x, dict):
        return {k: snapshot(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(snapshot(v) for v in x)
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


def differences(a, b, path: str = "") -> list[str]:
    """Where two load results differ: container types, key types, tensor dtype/shape/bits, values."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        ka, kb = {(type(k).__name__, repr(k)) for k in a}, {(type(k).__name__, repr(k)) for k in b}
        if ka != kb:
            return [f"{path}: keys {sorted(ka ^ kb)[:6]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k!r}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"]
        bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
        return [] if torch.equal(bits(a), bits(b)) else [f"{path}: values differ"]
    return [] if repr(a) == repr(b) else [f"{path}: {repr(a)[:80]} != {repr(b)[:80]}"]


def count_tensors(x) -> int:
    if isinstance(x, dict):
        return sum(count_tensors(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(count_tensors(v) for v in x)
    return int(isinstance(x, torch.Tensor))


def compare(make_sd, ckpt: str, observe) -> dict:
    """shardwise's load of ``make_sd()`` first (recording torch.distributed calls; ``observe()``, the
    destination's tensors, must change), then Megatron's into a fresh request over the same tensors;
    the two results must be equal."""
    from megatron.core import dist_checkpointing

    import shardwise.megatron as swm

    before = snapshot(observe())
    t0 = time.monotonic()
    request = make_sd()  # building a request reads parallel_state; the load itself must not
    with DistRecorder() as rec:
        ours = snapshot(swm.load(request, ckpt))
    shardwise_s = time.monotonic() - t0
    after = observe()
    t0 = time.monotonic()
    theirs = dist_checkpointing.load(make_sd(), ckpt)
    return {
        "diff": differences(theirs, ours)[:10],
        "tensors": count_tensors(ours),
        "dist_calls": sorted(set(rec.calls)),
        "changed": sum(not torch.equal(before[k], after[k]) for k in before),
        "observed": len(before),
        "shardwise_s": shardwise_s,
        "megatron_s": time.monotonic() - t0,
    }


def _model_case(model, ckpt: str) -> dict:
    return compare(model.sharded_state_dict, ckpt, lambda: model_tensors(model))


def _reinit(ps, tp=1, pp=1, ep=1) -> None:
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )




def load_matrix(rank, world, port, base):
    """The whole issue-17 matrix in one 4-rank run; returns {case: compare() result}."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    out = {}
    t_start = time.monotonic()
    heads = dict(heads=8, query_groups=4)  # GQA that TP4 can split (query groups divisible by TP)
    ckpts = {src: os.path.join(base, f"gpt_{src}") for src in ("megatron", "shardwise")}

    _reinit(ps, tp=2)
    model = build_gpt(1, **heads)
    swm.save(model.sharded_state_dict(), ckpts["shardwise"], timeout_s=120)
    os.makedirs(ckpts["megatron"], exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpts["megatron"])
    dist.barrier()
    out["saved_s"] = time.monotonic() - t_start

    for name, tp, pp in LAYOUTS:
        _reinit(ps, tp=tp, pp=pp)
        for src, ckpt in ckpts.items():
            fresh = build_gpt(2, **heads)
            out[f"gpt_{src}_{name}"] = _model_case(fresh, ckpt)
            dist.barrier()

    # MoE, EP=2 x expert-DP 2, saved and loaded at the same layout.
    _reinit(ps, tp=1, ep=2)
    moe = build_moe(1, gated=True)
    moe_ckpts = {src: os.path.join(base, f"moe_{src}") for src in ("megatron", "shardwise")}
    swm.save(moe.sharded_state_dict(), moe_ckpts["shardwise"], timeout_s=120)
    os.makedirs(moe_ckpts["megatron"], exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(moe.sharded_state_dict(), moe_ckpts["megatron"])
    dist.barrier()
    for src, ckpt in moe_ckpts.items():
        out[f"moe_ep2_{src}"] = _model_case(build_moe(2, gated=True), ckpt)
        dist.barrier()

    out.update(_distopt(ps, base))
    out["total_s"] = time.monotonic() - t_start
    return out


def _distopt_formats() -> tuple:
    """The DistributedOptimizer formats of the installed megatron-core: 0.14 replaced
    ``fully_sharded_model_space`` (ShardedTensors with ``flattened_range``) and
    ``dp_zero_gather_scatter`` by ``dp_reshardable`` and ``fully_reshardable``."""
    from megatron.core.package_info import __version__

    if tuple(int(x) for x in __version__.split(".")[:2]) >= (0, 14):
        return ("dp_reshardable", "fully_reshardable")
    return ("fully_sharded_model_space", "dp_zero_gather_scatter")


def _distopt(ps, base) -> dict:
    """DDP + DistributedOptimizer at TP2 x DP2, saved by Megatron in both formats
    (``dp_reshardable`` and ``fully_reshardable``), loaded both ways into a fresh optimizer."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import integration_workers as iw

    import numpy as np

    if "product" not in np.__dict__:  # megatron-core 0.13's flattened-range validation predates numpy 2
        np.product = np.prod
    iw._patch_optimizer_for_cpu()
    iw._skip_step_on_fully_reshardable_load()
    _reinit(ps, tp=2)
    ddp, opt = iw._ddp_and_optimizer(build_gpt(1))
    iw._adam_step(opt, seed=100 + ps.get_data_parallel_rank())
    iw._param_all_gather(ddp)

    def state(ddp, opt, sharding_type, loading=False):
        md = {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if sharding_type == "fully_reshardable":
            md["distrib_optim_fully_reshardable_mem_efficient"] = True  # the gloo gather path
        model_sd = ddp.sharded_state_dict()
        return {
            "model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading, metadata=md),
            "rng_state": iw._rng_state(ps, with_ep=False),
            "iteration": 5,
        }, md

    out = {}
    for fmt in _distopt_formats():
        path = os.path.join(base, f"distopt_{fmt}")
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        sd, md = state(ddp, opt, fmt)
        dist_checkpointing.save(sd, path, content_metadata=md)
        dist.barrier()
        fresh_ddp, fresh_opt = iw._ddp_and_optimizer(build_gpt(2))
        iw._adam_step(fresh_opt, seed=999)
        out[f"distopt_{fmt}"] = compare(
            lambda: state(fresh_ddp, fresh_opt, fmt, loading=True)[0], path, lambda: iw._optimizer_tensors(fresh_opt)
        )
        dist.barrier()
    return out
