"""Worker functions for the integration tests (run in spawned gloo processes, see mcore.spawn)."""

from __future__ import annotations

import json
import os
import warnings

import torch

from mcore import build_gpt, build_moe, init_gloo, model_tensors
from mcore_workers import DistRecorder

warnings.filterwarnings("ignore")


def _patch_optimizer_for_cpu() -> None:
    """Lets megatron-core 0.16.1 build a DistributedOptimizer over CPU parameters (test-only shims).

    ``MegatronOptimizer.__init__`` allocates two scalars with ``device='cuda'`` and
    ``DistributedOptimizer._build_model_and_main_param_groups`` accepts only parameters whose
    ``type()`` is ``torch.cuda.*Tensor``: map the first to CPU, report CPU parameters as the CUDA type.
    """
    real_tensor = torch.tensor

    def tensor(*a, **k):
        if k.get("device") == "cuda":
            k["device"] = "cpu"
        return real_tensor(*a, **k)

    torch.tensor = tensor
    real_type = torch.Tensor.type

    def param_type(self, *a, **k):
        t = real_type(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not a and not k and self.device.type == "cpu" else t

    torch.nn.Parameter.type = param_type


def _ddp_and_optimizer(model):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DDP(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, params_dtype=torch.float32), [ddp]
    )
    return ddp, opt


def _inner(opt):
    return opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt


def _adam_step(opt, seed: int) -> None:
    """One Adam step of the DistributedOptimizer's own torch optimizer on its main-param shards, with
    random gradients: fills exp_avg/exp_avg_sq and moves the shards (Megatron's full ``step()`` needs
    apex/TE kernels for the grad norm, absent on CPU)."""
    g = torch.Generator().manual_seed(seed)
    inner = _inner(opt).optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=g)
    inner.step()


def _skip_step_on_fully_reshardable_load() -> None:
    """Works around a megatron-core 0.16.1 bug of its no-apex/TE path (test-only).

    Without apex/TE the torch Adam keeps ``step`` in each parameter's state, and
    ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every state key from the
    loaded tensors; the ``fully_reshardable`` format never stores ``step`` per parameter (it travels
    in the param groups), so the copy raises ``KeyError: 'step'``. Copy the keys that were loaded.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" in tensors:
            return real(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].pop("step", None)
        try:
            real(self, model_param, tensors)
        finally:
            if step is not None:
                self.optimizer.state[main_param]["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _param_all_gather(ddp) -> None:
    """What the DistributedOptimizer's param all-gather does after a step (DDP's coalesced GPU path
    does not run on gloo): every DP rank's updated shard of each bucket goes to all DP ranks, so
    that DP replicas hold equal weights again."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group(with_context_parallel=True)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            parts = list(bucket.param_data.view(-1).split(bucket.param_data.numel() // n))
            dist.all_gather(parts, parts[r].clone(), group=group)


def _optimizer_tensors(opt) -> dict:
    """Main-param shards and Adam state of this rank, by position (same structure on both sides)."""
    inner = _inner(opt).optimizer
    out = {}
    for gi, group in enumerate(inner.param_groups):
        for pi, p in enumerate(group["params"]):
            out[f"g{gi}.p{pi}.param"] = p.detach().clone()
            for k, v in inner.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"g{gi}.p{pi}.{k}"] = v.detach().clone()
    return out


def _rng_state(ps, with_ep: bool):
    """rng_state as megatron/training/checkpointing.py ``get_rng_state`` builds it (reference §2.5)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, pp_n = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp, tp_n = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dp, dp_n = ps.get_data_parallel_rank(with_context_parallel=True), ps.get_data_parallel_world_size(with_context_parallel=True)
    state = [{"random_rng_state": (pp, tp, dp), "torch_rng_state": torch.arange(4) + 10 * dp}]
    if with_ep:  # EP > 1: sharded over DP too, every DP rank writes its own
        return ShardedObject("rng_state", state, (pp_n, tp_n, dp_n), (pp, tp, dp), replica_id=0)
    return ShardedObject("rng_state", state, (pp_n, tp_n), (pp, tp), replica_id=dp)


def distopt(rank, world, port, base):
    """TP=2 x DP=2 GPT with DDP + DistributedOptimizer; saves through the installed drop-in
    (``dp_reshardable`` synchronously with DP balancing, ``fully_reshardable`` through Megatron's
    async queue) and loads both back with unmodified Megatron."""
    init_gloo(rank, world, port)
    _patch_optimizer_for_cpu()
    _skip_step_on_fully_reshardable_load()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

    import shardwise.megatron as swm

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ddp, opt = _ddp_and_optimizer(build_gpt(1))
    balance = swm.DPBalance.from_parallel_state()
    # Gradients equal across TP ranks (as TP-replicated weights get them in training), not across DP.
    _adam_step(opt, seed=100 + balance.dp_rank)
    _param_all_gather(ddp)
    out = {"dp_rank": balance.dp_rank}

    def state(sharding_type, loading=False):
        md = {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if sharding_type == "fully_reshardable":
            # The gloo gather to DP rank 0 (the default all_gather path moves tensors to CUDA).
            md["distrib_optim_fully_reshardable_mem_efficient"] = True
        model_sd = ddp.sharded_state_dict()
        return md, {
            "model": model_sd,
            "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading, metadata=md),
            "rng_state": _rng_state(ps, with_ep=False),
            "iteration": 5,
        }

    dirs = {t: os.path.join(base, t) for t in ("dp_reshardable", "fully_reshardable")}
    with swm.installed(timeout_s=120, balance_dp=balance):
        out["installed_is_shardwise"] = dist_checkpointing.save.func is swm.dist_checkpointing_save
        md, sd = state("dp_reshardable")
        with DistRecorder() as rec:
            ret = dist_checkpointing.save(sd, dirs["dp_reshardable"], content_metadata=md)
        out["sync_return"] = repr(ret)
        out["save_dist_calls"] = sorted(set(rec.calls))
        out["extra_state_keys"] = sum("_extra_state" in k for k in ddp.module.state_dict())

        # Only DP rank 0 holds the gathered state in this format: no balancing (DPBalance docstring).
        swm.install(timeout_s=120)
        md, sd = state("fully_reshardable")  # the optimizer's gather runs here, before the save
        request = dist_checkpointing.save(sd, dirs["fully_reshardable"], async_sharded_save=True, content_metadata=md)
        out["async_type"] = type(request).__qualname__ if not isinstance(request, AsyncRequest) else "AsyncRequest"
        metadata = os.path.join(dirs["fully_reshardable"], ".metadata")
        finalized = []
        # What save_checkpoint appends (tracker, metadata.json): it must run after the commit.
        request.add_finalize_fn(lambda: finalized.append(("iter_finalize_fn", os.path.exists(metadata))))
        queue = AsyncCallsQueue(persistent=False)
        queue.schedule_async_request(request)
        out["finalized_calls"] = queue.maybe_finalize_async_calls(blocking=True)
        out["finalize_fns_ran"] = finalized
    out["uninstalled"] = dist_checkpointing.save.__module__ == "megatron.core.dist_checkpointing.serialization"

    expected_model, expected_opt = model_tensors(ddp.module), _optimizer_tensors(opt)
    for sharding_type, path in dirs.items():
        fresh_ddp, fresh_opt = _ddp_and_optimizer(build_gpt(2))
        _adam_step(fresh_opt, seed=999)  # other state, so that a no-op load is caught
        ddp, opt = fresh_ddp, fresh_opt  # state() reads these
        differed = sum(not torch.equal(v, _optimizer_tensors(opt)[k]) for k, v in expected_opt.items())
        md_loaded = dist_checkpointing.load_content_metadata(path)
        _, sd = state(md_loaded["distrib_optim_sharding_type"], loading=True)
        loaded = dist_checkpointing.load(sd, path)
        # DDP's sharded_state_dict nests the module's under "module."; load into the module itself.
        ddp.module.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
        with torch.no_grad():  # fp32 main-param shards are views of leaf parameters
            opt.load_state_dict(loaded["optimizer"])
        got_model, got_opt = model_tensors(ddp.module), _optimizer_tensors(opt)
        out[sharding_type] = {
            "content_metadata": md_loaded,
            "model_compared": len(expected_model),
            "model_not_equal": [k for k in expected_model if not torch.equal(expected_model[k], got_model[k])],
            "opt_compared": len(expected_opt),
            "opt_differed_before_load": differed,
            "opt_not_equal": [k for k in expected_opt if not torch.equal(expected_opt[k], got_opt[k])],
            "rng_state": repr(loaded["rng_state"]),
            "iteration": loaded["iteration"],
        }
    return out


def moe_ep2(rank, world, port, base):
    """TP=1, EP=2, DP=4 MoE GPT (4 experts); three ``save_checkpoint`` calls into one save root
    (iteration 10 unbalanced, 20 and 30 balanced, keep_last=2), then a Megatron load of the last."""
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    model = build_moe(1)
    root = os.path.join(base, "save")
    balance = swm.DPBalance.from_parallel_state()
    reports = {}
    for it, bal in ((10, None), (20, balance), (30, balance)):
        sd = model.sharded_state_dict()
        sd["rng_state"] = _rng_state(ps, with_ep=True)
        r = swm.save_checkpoint(root, it, sd, {"iteration": it}, timeout_s=120, keep_last=2, balance_dp=bal)
        reports[it] = {"data_bytes": r["data_bytes"], "deleted": r.get("deleted"), "tracker": r.get("tracker")}
    expert_keys = sorted({k for k in model.sharded_state_dict() if ".experts." in k})
    replica_ids = sorted({repr(v.replica_id) for k, v in model.sharded_state_dict().items() if ".experts." in k})

    fresh = build_moe(2)
    differed = sum(not torch.equal(a, b) for a, b in zip(model_tensors(model).values(), model_tensors(fresh).values()))
    sd = fresh.sharded_state_dict()
    sd["rng_state"] = _rng_state(ps, with_ep=True)
    loaded = dist_checkpointing.load(sd, os.path.join(root, "iter_0000030"))
    rng = loaded.pop("rng_state")
    iteration = loaded.pop("iteration")
    fresh.load_state_dict(loaded)
    a, b = model_tensors(model), model_tensors(fresh)
    return {
        "dp": [balance.dp_rank, balance.dp_size], "expert_dp": [balance.expert_dp_rank, balance.expert_dp_size],
        "reports": reports, "expert_keys": expert_keys, "expert_replica_ids": replica_ids,
        "compared": len(a), "differed_before_load": differed,
        "not_equal": [k for k in a if not torch.equal(a[k], b[k])],
        "rng_state": json.loads(json.dumps(rng[0]["random_rng_state"])), "iteration": iteration,
    }
