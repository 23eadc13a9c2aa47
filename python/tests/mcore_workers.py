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


def drop_in_matrix(rank, world, port, base):
    """TP=2 GPT on 2 ranks, run once per installed megatron-core (test_megatron_versions.py).

    Through the installed drop-in, the release's own ``save`` is called the ways its callers call
    it: every parameter by keyword, every parameter by position (in that release's order, which
    0.19 changed), as its ``save_checkpoint`` does (strategy by position, the rest by keyword; 0.19
    always passes ``async_strategy`` and ``verify_integrity``), and async through Megatron's queue.
    Then the release's own torch_dist save, and Megatron loads of every shardwise checkpoint; with
    0.19 also ``load(..., verify_integrity=True)`` of an intact and of a damaged copy.
    """
    import shutil

    import torch.distributed as dist

    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import shardwise.megatron as swm

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_gpt(1)
    params = [p.name for p in swm.megatron_save_parameters()]
    verify = "verify_integrity" in params
    md = {"matrix": True}
    chosen = {
        "sharded_strategy": None, "common_strategy": None, "validate_access_integrity": True,
        "async_sharded_save": False, "preprocess_common_before_consistancy_check": None,
        "content_metadata": md, "async_strategy": "nvrx", "verify_integrity": verify,
    }
    by_name = {p.name: chosen.get(p.name, p.default) for p in swm.megatron_save_parameters()}
    dirs = {k: os.path.join(base, k) for k in ("keywords", "positional", "save_checkpoint", "async", "megatron")}
    save_checkpoint_kw = dict(async_sharded_save=False, validate_access_integrity=True, content_metadata=md)
    if verify:
        save_checkpoint_kw.update(async_strategy="nvrx", verify_integrity=True)
    out = {"params": params}
    with swm.installed(timeout_s=120):
        out["installed"] = dist_checkpointing.save.func is swm.dist_checkpointing_save
        with DistRecorder() as rec:
            out["keywords_return"] = repr(dist_checkpointing.save(model.sharded_state_dict(), dirs["keywords"], **by_name))
            dist_checkpointing.save(model.sharded_state_dict(), dirs["positional"], *by_name.values())
            dist_checkpointing.save(
                model.sharded_state_dict(), dirs["save_checkpoint"], get_default_save_sharded_strategy(), **save_checkpoint_kw
            )
        out["save_dist_calls"] = sorted(set(rec.calls))
        request = dist_checkpointing.save(model.sharded_state_dict(), dirs["async"], **{**by_name, "async_sharded_save": True})
        out["async_type"] = type(request).__name__
        queue = AsyncCallsQueue(persistent=False)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    os.makedirs(dirs["megatron"], exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), dirs["megatron"])

    expected = model_tensors(model)
    out["not_equal"], out["content_metadata"] = {}, {}
    for name in ("keywords", "positional", "save_checkpoint", "async"):
        fresh = build_gpt(2)
        loaded = dist_checkpointing.load(fresh.sharded_state_dict(), dirs[name])
        loaded.pop("content_metadata", None)
        fresh.load_state_dict(loaded)
        got = model_tensors(fresh)
        out["not_equal"][name] = [k for k in expected if not torch.equal(expected[k], got[k])]
        out["content_metadata"][name] = dist_checkpointing.load_content_metadata(dirs[name])
    out["compared"] = len(expected)
    if verify:
        from megatron.core.dist_checkpointing.core import CheckpointingException

        fresh = build_gpt(2)
        loaded = dist_checkpointing.load(fresh.sharded_state_dict(), dirs["save_checkpoint"], verify_integrity=True)
        loaded.pop("content_metadata", None)
        fresh.load_state_dict(loaded)
        got = model_tensors(fresh)
        out["verified_not_equal"] = [k for k in expected if not torch.equal(expected[k], got[k])]
        damaged = os.path.join(base, "damaged")
        if rank == 0:
            shutil.copytree(dirs["save_checkpoint"], damaged)
            with open(os.path.join(damaged, "__1_0.distcp"), "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0x01]))
        dist.barrier()
        try:
            dist_checkpointing.load(build_gpt(3).sharded_state_dict(), damaged, verify_integrity=True)
            out["damaged_load"] = "loaded"
        except CheckpointingException as e:
            out["damaged_load"] = str(e)
    return out


def tp1_with_ulp(rank, world, port, base, nudged_key):
    """One rank, TP=1: the model of ``tp2dp2`` (same seed, CPU initialisation: the same global
    weights) saved by shardwise, and again with one element of ``nudged_key`` moved by one ulp."""
    init_gloo(rank, world, port)
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import shardwise.megatron as swm

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_gpt(1)
    swm.save(model.sharded_state_dict(), os.path.join(base, "tp1"), timeout_s=120)
    sd = model.sharded_state_dict()
    st = sd[nudged_key] if nudged_key in sd else next(v for v in sd.values() if isinstance(v, ShardedTensor) and v.key == nudged_key)
    flat = st.data.view(-1)
    with torch.no_grad():
        flat[7] = torch.nextafter(flat[7], torch.tensor(float("inf")))
    swm.save(sd, os.path.join(base, "tp1_ulp"), timeout_s=120)
    return {}
