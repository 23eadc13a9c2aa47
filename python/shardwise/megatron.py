"""Collective-free save of a Megatron-Core sharded state dict in the ``torch_dist`` format.

The output is what ``megatron.core.dist_checkpointing.save`` writes with the default ``torch_dist``
strategy (``__{rank}_0.distcp`` data files, ``.metadata``, ``common.pt``, ``metadata.json``), and is
loaded by unmodified ``megatron.core.dist_checkpointing.load`` and ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections import defaultdict
from typing import Any, Optional

from . import _native
from ._native import InvalidArgumentError

# Per-process count of saves into each directory. All ranks of an SPMD job call save() the same
# number of times, so the count is part of a save id every rank derives alike, and a retry into
# the same directory gets a new id, which keeps parts of a crashed attempt out of the merge.
_ATTEMPTS: dict[str, int] = defaultdict(int)

# Environment values that are equal on every rank of one launch and differ between launches.
_LAUNCH_ENV = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def default_save_id(checkpoint_dir: str) -> str:
    """Save id that every rank of one launch derives alike, without communication.

    It hashes the absolute checkpoint directory, the launch identity found in the environment
    (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, ``MASTER_ADDR``/``MASTER_PORT``, restart counts) and
    how many times this process has saved into that directory. Pass ``save_id`` explicitly when
    ranks may call :func:`save` a different number of times for the same directory.
    """
    path = os.path.abspath(os.fspath(checkpoint_dir))
    _ATTEMPTS[path] += 1
    h = hashlib.sha256(path.encode())
    for name in _LAUNCH_ENV:
        h.update(f"\0{name}={os.environ.get(name, '')}".encode())
    h.update(f"\0attempt={_ATTEMPTS[path]}".encode())
    return h.hexdigest()[:24]


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Reading the rank and size of the default group is local; no collective runs.
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            try:
                rank = int(os.environ["RANK"]) if rank is None else rank
                world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
            except (KeyError, ValueError) as e:
                raise InvalidArgumentError(
                    "rank and world_size are not given, torch.distributed is not initialised and "
                    f"RANK/WORLD_SIZE are not set to integers ({e})"
                ) from None
    return int(rank), int(world_size)


def _torch_save_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _host_tensor(t):
    """A contiguous CPU tensor holding ``t``'s elements (no copy when ``t`` already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # GPU tensors are staged through torch until the direct GPU path lands.
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def save(
    sharded_state_dict: dict,
    checkpoint_dir: str,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_s: float = 600.0,
    content_metadata: Optional[dict] = None,
    save_id: Optional[str] = None,
    merge_rank: Optional[int] = 0,
    wait_for_commit: bool = True,
    overwrite: bool = False,
) -> dict:
    """Save this rank's part of a Megatron sharded state dict, with no collective communication.

    Accepts what ``megatron.core.dist_checkpointing.save`` accepts: ``ShardedTensor`` (including
    ``prepend_axis_num`` and several local chunks of one key), ``ShardedTensorFactory``,
    ``ShardedObject`` and ``LocalNonpersistentObject``, in nested dicts and lists; every other value is
    common state, which rank 0 writes to ``common.pt`` with ``torch.save`` as Megatron does. Only main
    replicas (``replica_id`` all zeros) are written. No ``torch.distributed`` function is called,
    except ``get_rank``/``get_world_size`` when ``rank``/``world_size`` are not given.

    Args:
        sharded_state_dict: the Megatron sharded state dict (factories are applied in place).
        checkpoint_dir: the checkpoint directory (created if absent), e.g. ``.../iter_0000100``.
        rank, world_size: this rank's index among the ranks that save, and their number. Default to
            the ``torch.distributed`` default group when it is initialised, else ``RANK`` and
            ``WORLD_SIZE``. When the default group also holds processes that do not save (rollout or
            inference workers), pass the saving ranks' own ``rank`` and ``world_size``.
        timeout_s: bound in seconds on every wait: the merging rank's wait for all parts, and the other
            ranks' wait for the commit.
        content_metadata: stored in ``common.pt`` under ``content_metadata``, as Megatron does.
        save_id: identifies this save attempt; must be equal on every rank. Default: derived from the
            directory, the launch environment and the attempt count (:func:`default_save_id`).
        merge_rank: the rank that merges the parts and commits ``.metadata``; ``None`` leaves the
            commit to ``shardwise merge``.
        wait_for_commit: other ranks return only once the save is committed.
        overwrite: replace a committed checkpoint in ``checkpoint_dir`` instead of raising.

    Returns:
        A dict report: ``rank``, ``save_id``, ``data_file``, ``data_bytes`` (bytes), ``write_s`` and
        ``rendezvous_s`` (seconds), ``committed``; on the merging rank also ``keys``,
        ``tensor_chunks``, ``byte_objects`` and ``metadata_bytes``.

    Raises:
        UnsupportedDtypeError: a tensor dtype DCP cannot store here (complex, uint16, ...).
        ValidationError: two ranks save the same main-replica chunk, chunks leave a coverage gap, or
            global shape, dtype or world_size disagree across ranks.
        MissingRanksError: (merging rank) a rank's part is still missing at ``timeout_s``; names it.
        NotCommittedError: (other ranks) the merger failed, or no commit within ``timeout_s``.
        CheckpointExistsError: ``checkpoint_dir`` holds a committed checkpoint and not ``overwrite``.
        StorageError: the directory or a file cannot be written (permissions, full disk).
        InvalidArgumentError: rank/world_size/save_id/timeout out of range, unsupported tensors.

    A failed save never writes ``.metadata`` and touches no other directory.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    rank, world_size = _rank_and_world(rank, world_size)
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is not in 0..world_size ({world_size})")
    checkpoint_dir = os.fspath(checkpoint_dir)
    if save_id is None:
        save_id = default_save_id(checkpoint_dir)

    if content_metadata is not None:
        content_metadata = {k: v for k, v in content_metadata.items() if k != "dp_cp_group"}
        sharded_state_dict["content_metadata"] = content_metadata
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)

    tensors = []  # (fqn, dtype, global_shape, offsets, sizes, data_ptr, nbytes)
    keep_alive = []
    objects_by_key: dict[str, list] = {}
    for sh in nested_values(sharded_part):
        if not is_main_replica(sh.replica_id):
            continue
        if isinstance(sh, ShardedTensor):
            if sh.flattened_range is not None:
                raise InvalidArgumentError(
                    f"{sh.key}: ShardedTensor.flattened_range is not supported (megatron-core >= 0.16 "
                    "rejects it too); use the dp_reshardable or fully_reshardable optimizer format"
                )
            t = _host_tensor(sh.data)
            keep_alive.append(t)
            sizes = (1,) * sh.prepend_axis_num + tuple(t.shape)
            tensors.append(
                (
                    sh.key,
                    str(t.dtype),
                    list(sh.global_shape),
                    list(sh.global_offset),
                    list(sizes),
                    t.data_ptr(),
                    t.numel() * t.element_size(),
                )
            )
        elif isinstance(sh, ShardedObject):
            objects_by_key.setdefault(sh.unique_key, []).append(sh)
        else:
            raise InvalidArgumentError(f"unsupported sharded item {type(sh).__name__} for key {sh.key}")

    # A byte object is torch.save of the list of all local main-replica data with that unique key
    # (megatron strategies/torch.py `_mcore_to_torch_sharded_object`).
    objects = [
        (
            unique_key,
            _torch_save_bytes([o.data for o in objs]),
            (objs[0].key, list(objs[0].global_shape), list(objs[0].global_offset)),
        )
        for unique_key, objs in objects_by_key.items()
    ]
    common = _torch_save_bytes(common_state_dict) if rank == 0 else None

    report = _native.save_rank(
        checkpoint_dir,
        rank,
        world_size,
        save_id,
        tensors,
        objects,
        common,
        True,
        merge_rank,
        float(timeout_s),
        wait_for_commit,
        overwrite,
    )
    del keep_alive  # the tensors must outlive the native call, which reads their memory
    return report
