"""Spawned gloo workers that run one situation with Megatron's own ``dist_checkpointing`` and again
through ``shardwise.megatron.install()``, and report what each did (issue 24)."""

from __future__ import annotations

import inspect
import io
import logging
import os
import traceback
import warnings

import torch
import torch.distributed as dist

from mcore import init_gloo

warnings.filterwarnings("ignore")


def allow_megatron_strict_on_torch_215() -> None:
    """megatron-core 0.16.1-0.19.2 ``strategies/torch.py`` ``load_tensors_metadata`` passes
    ``TensorProperties.__dict__`` to ``torch.empty``; torch 2.15's new ``strides`` field makes every
    Megatron load with a strict mode other than ``assume_ok_unexpected`` a TypeError. To compare
    with Megatron's result at all, its ``torch.empty`` call drops that keyword (shardwise does not
    call it)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    if "strides" not in getattr(TensorProperties, "__dataclass_fields__", {}):
        return
    empty = torch.empty

    def empty_without_strides(*args, **kwargs):
        kwargs.pop("strides", None)
        return empty(*args, **kwargs)

    torch.empty = empty_without_strides


def outcome(fn) -> dict:
    """``{"value": repr}`` or the raised exception: its class's MRO (``module.qualname``), whether it
    is an ``Exception``, its message and, for torch's CheckpointException, the failures' classes."""
    try:
        return {"value": repr(fn())[:300]}
    except BaseException as e:  # noqa: BLE001 - what is raised is the result
        out = {
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__],
            "is_exception": isinstance(e, Exception),
            "message": str(e),
            "traceback": traceback.format_exc()[-2000:],
        }
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            out["failures"] = {r: [f"{c.__module__}.{c.__qualname__}" for c in type(x[0]).__mro__] for r, x in failures.items()}
        return out


def _tensor(key, n=4, replica_id=0):
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.arange(float(n)), replica_id=replica_id)


def _object(key, replica_id=0):
    from megatron.core.dist_checkpointing import ShardedObject

    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    return ShardedObject(key, buf, (1,), (0,), replica_id=replica_id)


def error_matrix(rank, world, port, base) -> dict:
    """One rank: each failure situation of a load (and of a save into a committed checkpoint), with
    Megatron's own functions and through the drop-in. Returns ``{situation: {"megatron": outcome,
    "dropin": outcome}}``."""
    init_gloo(rank, world, port)
    allow_megatron_strict_on_torch_215()
    import megatron.core.dist_checkpointing as mdc
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    ps.initialize_model_parallel(1, 1)
    has_integrity = "verify_integrity" in inspect.signature(mdc.load).parameters  # 0.19
    cases = {}

    def run(name, fn):
        cases.setdefault(name, {})[current] = outcome(fn)

    for current in ("megatron", "dropin"):
        if current == "dropin":
            swm.install(timeout_s=60)
        root = os.path.join(base, current)
        os.makedirs(root)

        def saved(name, **kw):
            p = os.path.join(root, name)
            os.makedirs(p)
            mdc.save({"a": _tensor("a"), "o": _object("o")}, p, **kw)
            return p

        run("missing_dir", lambda: mdc.load({"a": _tensor("a")}, os.path.join(root, "nope")))
        os.makedirs(os.path.join(root, "empty"))
        run("empty_dir", lambda: mdc.load({"a": _tensor("a")}, os.path.join(root, "empty")))
        good = saved("good")
        run("load_common_missing_dir", lambda: mdc.load_common_state_dict(os.path.join(root, "nope")))
        run("missing_tensor_key", lambda: mdc.load({"a": _tensor("different_key")}, good))
        run("missing_object_key", lambda: mdc.load({"o": _object("other_object")}, good))
        run("shape_mismatch", lambda: mdc.load({"a": _tensor("a", 5)}, good))
        run("raise_unexpected", lambda: mdc.load({"a": _tensor("a"), "x": _tensor("extra")}, good, strict="raise_unexpected"))
        run("raise_all", lambda: mdc.load({"a": _tensor("a")}, good, strict="raise_all"))
        data_file = next(f for f in os.listdir(good) if f.endswith(".distcp"))
        nometa = saved("nometa")
        os.remove(os.path.join(nometa, ".metadata"))
        run("metadata_json_without_metadata", lambda: mdc.load({"a": _tensor("a")}, nometa))
        truncated = saved("truncated")
        os.truncate(os.path.join(truncated, data_file), 3)
        run("truncated_data_file", lambda: mdc.load({"a": _tensor("a")}, truncated))
        lost = saved("lost")
        os.remove(os.path.join(lost, data_file))
        run("missing_data_file", lambda: mdc.load({"a": _tensor("a")}, lost))
        garbage = saved("garbage")
        with open(os.path.join(garbage, ".metadata"), "wb") as f:
            f.write(b"garbage")
        run("garbage_metadata", lambda: mdc.load({"a": _tensor("a")}, garbage))
        if has_integrity:
            damaged = saved("damaged", verify_integrity=True)
            with open(os.path.join(damaged, data_file), "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 1]))
            run("integrity_mismatch", lambda: mdc.load({"a": _tensor("a")}, damaged, verify_integrity=True))
    swm.uninstall()
    return {"cases": cases}


def _plain(value):
    """A loaded value as JSON (a ShardedObject's BytesIO by what it holds)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, io.BytesIO):
        return repr(torch.load(io.BytesIO(value.getvalue()), weights_only=True))
    return repr(value)


def strict_matrix(rank, world, port, base) -> dict:
    """``world`` ranks load one checkpoint (tensors a, b, c; object o) with every strict mode, with
    Megatron's own load and through the drop-in. Rank 0 asks for a, rank 1 for b and o, and each for
    a key the checkpoint lacks (extra<rank>: a ``raise_*`` mode raising on one rank only would leave
    the other in Megatron's next collective), so c is missing for all ranks. Returns per mode and implementation the
    outcome, the missing and unexpected key sets (``return_*``), the loaded values and the warnings
    Megatron's validation logger wrote (``log_*``)."""
    init_gloo(rank, world, port)
    allow_megatron_strict_on_torch_215()
    import megatron.core.dist_checkpointing as mdc
    from megatron.core import parallel_state as ps

    import shardwise.megatron as swm

    ps.initialize_model_parallel(1, 1)
    ckpt = os.path.join(base, "ckpt")
    if rank == 0:
        os.makedirs(ckpt)
    dist.barrier()
    mdc.save({k: _tensor(k, replica_id=rank) for k in "abc"} | {"o": _object("o", replica_id=rank)}, ckpt)

    def request():
        if rank == 0:
            return {"a": _tensor("a", replica_id=0), "extra": _tensor(f"extra{rank}", replica_id=0)}
        return {"b": _tensor("b", replica_id=0), "o": _object("o", replica_id=0), "extra": _tensor(f"extra{rank}")}

    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("megatron.core.dist_checkpointing.validation").addHandler(handler)
    modes = ("return_all", "raise_all", "log_all", "ignore_all", "return_unexpected", "raise_unexpected", "log_unexpected")
    result = {}
    for current in ("megatron", "dropin"):
        if current == "dropin":
            swm.install(timeout_s=60)
        for mode in modes:
            logged.clear()
            got = {}

            def load():
                r = mdc.load(request(), ckpt, strict=mode)
                state, missing, unexpected = r if isinstance(r, tuple) else (r, None, None)
                got["missing"] = sorted(missing) if missing is not None else None
                got["unexpected"] = sorted(unexpected) if unexpected is not None else None
                got["values"] = {k: _plain(v) for k, v in sorted(state.items())}
                return "loaded"

            got["outcome"] = outcome(load)
            got["logged"] = list(logged)
            result.setdefault(mode, {})[current] = got
            dist.barrier()
    swm.uninstall()
    keys_dirs = [n for n in os.listdir(base) if n.endswith(".shardwise-keys")]
    return {"modes": result, "keys_dirs_left": keys_dirs}
