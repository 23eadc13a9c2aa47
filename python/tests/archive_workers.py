"""Megatron's own load of one ShardedObject, in a gloo process (test_archive_as_torch_reads.py)."""

from __future__ import annotations

from mcore import init_gloo


def megatron_load_object(rank, world, port, ckpt, key):
    init_gloo(rank, world, port)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = {key: ShardedObject(key, None, (1,), (0,), replica_id=0)}
    try:
        out = dist_checkpointing.load(sd, ckpt)
        return {"ok": True, "value": repr(out[key])}
    except Exception as e:  # noqa: BLE001 - the outcome is what the test looks at
        return {"ok": True, "error": repr(e)[:500]}
