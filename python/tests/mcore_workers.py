"""Worker functions run in spawned gloo processes (module-level so that ``spawn`` can pickle them)."""

from __future__ import annotations

import os
import threading
import time
import warnings

import torch

from mcore import build_gpt, init_gloo, model_tensors

warnings.filterwarnings("ignore")

# torch.distributed functions that read local state only; everything else counts as communication.
LOCAL_ONLY = {"is_available", "is_initialized", "get_rank", "get_world_size"}


class DistRecorder:
    """Records every call of a public function of ``torch.distributed`` while active."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.calls: list[str] = []
        self._saved = []
        for mod in (dist, c10d):
            for name in dir(mod):
                if name.startswith("_"):
                    continue
                obj = getattr(mod, name)
                if callable(obj) and not isinstance(obj, type) and getattr(obj, "__module__", "").startswith("torch.distributed"):
                    self._saved.append((mod, name, obj))

    def __enter__(self):
        for mod, name, obj in self._saved:
            def wrapper(*a, __name=name, __obj=obj, **k):
                self.calls.append(__name)
                return __obj(*a, **k)
            setattr(mod, name, wrapper)
        return self

    def __exit__(self, *exc):
        for mod, name, obj in self._saved:
            setattr(mod, name, obj)


def check_against_full(model, full: dict) -> list[str]:
    """Keys whose local ShardedTensor data differs from the matching slice of the full tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    bad = []
    for sh in nested_values(sd):
        if not isinstance(sh, ShardedTensor):
            continue
        sizes = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
        index = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sizes))
        if not torch.equal(full[sh.key][index].reshape(sh.data.shape), sh.data):
            bad.append(sh.key)
    return bad


def tp2dp2(rank, world, port, base):
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_gpt(1)
    with DistRecorder() as rec:
        report = swm.save(model.sharded_state_dict(), os.path.join(base, "shardwise"), timeout_s=120)
    shardwise_calls = sorted(set(rec.calls))
    os.makedirs(os.path.join(base, "megatron"), exist_ok=True)
    with DistRecorder() as control:
        dist_checkpointing.save(model.sharded_state_dict(), os.path.join(base, "megatron"))
    fresh = build_gpt(2)
    before = model_tensors(fresh)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), os.path.join(base, "shardwise"))
    fresh.load_state_dict(loaded)
    a, b = model_tensors(model), model_tensors(fresh)
    return {
        "report": dict(report),
        "shardwise_dist_calls": shardwise_calls,
        "megatron_dist_calls": sorted(set(control.calls)),
        "compared": len(a),
        "not_equal": [k for k in a if not torch.equal(a[k], b[k])],
        "differed_before_load": sum(not torch.equal(a[k], before[k]) for k in a),
    }


def pp2tp2(rank, world, port, base):
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = build_gpt(1)
    swm.save(model.sharded_state_dict(), os.path.join(base, "shardwise"), timeout_s=120)
    fresh = build_gpt(2)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), os.path.join(base, "shardwise")))
    a, b = model_tensors(model), model_tensors(fresh)
    return {"compared": len(a), "not_equal": [k for k in a if not torch.equal(a[k], b[k])]}


def reshard_tp1(rank, world, port, base, ckpt):
    """Loads a TP=2 checkpoint into a TP=1 x DP=2 model and checks it against the full tensors."""
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from dcp_util import read_all

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    fresh = build_gpt(3)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
    full, _ = read_all(ckpt)
    return {"not_equal": check_against_full(fresh, full), "keys": len(full)}


def _trainer_state(rank: int, ntrainers: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    w = torch.arange(32, dtype=torch.float32).reshape(4, 8) + 100 * rank
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, ntrainers), replica_id=0),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.ones(8, dtype=torch.bfloat16), replica_id=rank),
        "rng": ShardedObject("rng_state", {"seed": rank}, (ntrainers,), (rank,), replica_id=0),
        "iteration": 7,
    }


def world_with_rollout(rank, world, port, base, late_s, megatron_bound_s):
    """WORLD = 2 trainers + 1 rollout process that never enters the save (as in async RL jobs).

    Trainer 1 also arrives ``late_s`` seconds late. shardwise must commit; Megatron's own save, run
    afterwards on the same WORLD, must not complete successfully within ``megatron_bound_s``.
    """
    init_gloo(rank, world, port, timeout_s=megatron_bound_s / 2)
    ntrainers = world - 1
    if rank == ntrainers:  # the rollout worker: busy with other things, never saves
        time.sleep(megatron_bound_s + 15)
        return {"role": "rollout"}
    import shardwise.megatron as swm

    if rank == 1:
        time.sleep(late_s)
    t0 = time.monotonic()
    swm.save(_trainer_state(rank, ntrainers), os.path.join(base, "shardwise"), rank=rank, world_size=ntrainers, timeout_s=60)
    shardwise_s = time.monotonic() - t0

    from megatron.core import dist_checkpointing

    outcome = {"state": "hung"}

    def megatron_save():
        try:
            dist_checkpointing.save(_trainer_state(rank, ntrainers), os.path.join(base, "megatron"))
            outcome["state"] = "completed"
        except BaseException as e:  # noqa: BLE001
            outcome["state"] = f"failed: {type(e).__name__}: {str(e)[:200]}"

    os.makedirs(os.path.join(base, "megatron"), exist_ok=True)
    t = threading.Thread(target=megatron_save, daemon=True)
    t.start()
    t.join(megatron_bound_s)
    return {"role": "trainer", "shardwise_s": shardwise_s, "megatron": outcome["state"]}
