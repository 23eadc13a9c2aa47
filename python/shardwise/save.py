"""Collective-free save of a Megatron-Core sharded state dict in the ``torch_dist`` format.

The output is what ``megatron.core.dist_checkpointing.save`` writes with the default ``torch_dist``
strategy (``__{rank}_0.distcp`` data files, ``.metadata``, ``common.pt``, ``metadata.json``), and is
loaded by unmodified ``megatron.core.dist_checkpointing.load`` and ``torch.distributed.checkpoint``.

This module: the save id every rank derives alike, the state dict turned into native chunk and
object descriptions, DP write balancing, and the lifetime of async saves (waited for at exit).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import io
import os
import sys
import threading
import zlib
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Literal, Optional, Union, overload

from . import _args, _native
from ._fs import is_url
from ._native import InvalidArgumentError
from .megatron_errors import megatron_compatible

if TYPE_CHECKING:
    from typing import TypeAlias

    from ._native import SaveHandle, SaveReport, StagingReservation

    # A checkpoint directory as save() takes it: os.fsdecode'd, so it need not be UTF-8.
    _PathArg: TypeAlias = Union[str, bytes, os.PathLike[str], os.PathLike[bytes]]


# Per-process count of strict *_all loads of each directory. All ranks of an SPMD job make the same
# calls the same number of times, so the count is part of an id every rank derives alike. Saves
# are not counted: a rank that missed a failed attempt, or a process started before it, would count
# differently; the save numbers its attempts from what the directory holds instead (Rust:
# commit::attempt::join).
_ATTEMPTS: dict[tuple[str, str], int] = defaultdict(int)

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

    It hashes the absolute checkpoint directory and the launch identity found in the environment
    (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, ``MASTER_ADDR``/``MASTER_PORT``, restart counts). It
    is the base of the attempts' ids: a save with it joins the newest attempt ``<base>.<n>`` in the
    directory, or begins the next one when that attempt failed or committed (docs/guarantees.md,
    "Attempts"), so a retry after a failure needs no id, whichever ranks saw the failure.
    """
    return derived_id(checkpoint_dir, "save")


def derived_id(checkpoint_dir, purpose: str, group: str = "") -> str:
    """An id of the ``purpose`` operation on ``checkpoint_dir`` that every rank of one launch derives
    alike (see :func:`default_save_id`): the directory, the launch environment, and, except for
    ``"save"`` (whose attempts are numbered from the directory), how many times this process did
    ``purpose`` on that directory and ``group`` (the ranks taking part, when not all)."""
    path = os.fsdecode(checkpoint_dir)
    if not is_url(path):
        path = os.path.abspath(path)
    h = hashlib.sha256(os.fsencode(path))  # the path's own bytes: it need not be UTF-8
    for name in _LAUNCH_ENV:
        h.update(f"\0{name}={os.environ.get(name, '')}".encode())
    if purpose != "save":
        _ATTEMPTS[purpose, path] += 1
        h.update(f"\0attempt={_ATTEMPTS[purpose, path]}".encode())
        h.update(f"\0purpose={purpose}\0group={group}".encode())
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
    return rank, world_size


def _torch_save_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# torch.save([None] * n) by n. A linear's ``_extra_state`` ShardedObject holds None (megatron-core's
# local linears; TE ones without fp8 state), so a GPT has a few such objects per layer, all
# pickled alike: one torch.save each cost 60 us, 40 ms of a 600 MB save's critical path on the rank
# that writes them (BENCHMARKS.md, "CPU save at the disk's speed"). The bytes differ between calls
# only in the archive's ``.data/serialization_id`` record, which torch.load merely logs
# (torch/serialization.py, ``torch.load.metadata``), so one call's bytes serve every object.
_NONE_LISTS: dict[int, bytes] = {}


def _object_bytes(datas: list) -> bytes:
    """The item of a ShardedObject key: torch.save of the list of its local shards' data."""
    if any(d is not None for d in datas):
        return _torch_save_bytes(datas)
    n = len(datas)
    if n not in _NONE_LISTS:
        _NONE_LISTS[n] = _torch_save_bytes(datas)
    return _NONE_LISTS[n]


def _chunk_memory(t):
    """``(tensor, device)``: ``t``'s elements contiguous where they are (no copy when ``t`` already
    is contiguous), and the CUDA ordinal or None for host memory. CUDA tensors are read by the Rust
    side through their device pointer; there is no ``.cpu()`` here."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t, (t.device.index if t.device.type == "cuda" else None)


def _caller_streams(tensors) -> dict:
    """The current CUDA stream of each device holding ``tensors``: shardwise's copies start after
    the work already queued there, so a kernel still writing a tensor finishes first."""
    import torch

    devices = {t.device.index for t in tensors if t.device.type == "cuda"}
    return {d: torch.cuda.current_stream(d).cuda_stream for d in devices}


@dataclasses.dataclass(frozen=True)
class DPBalance:
    """How to spread the writes of DP-replicated tensors over the DP ranks, without communication.

    A ``ShardedTensor`` counts as replicated across DP when its ``replica_id`` is a tuple
    ``(0, ..., 0, c)`` with ``c`` equal to this rank's DP coordinate and its grid is regular
    (``axis_fragmentations`` set). That is how megatron-core marks model weights (``(0, 0, dp_rank)``
    for TP-sharded weights, and for TP-replicated ones on TP rank 0; reference §2.2) and the
    ``fully_reshardable`` optimizer state, which copies the weights' replica ids (with
    ``distrib_optim_fully_reshardable_mem_efficient`` only DP rank 0 holds that state, so balancing
    fails there with ``ValidationError``). The distributed
    optimizer's ``dp_reshardable`` buckets are DP-*sharded*: replica ``(0, 0, 0)`` on every DP rank and
    ``axis_fragmentations=None`` (``distrib_optimizer.py`` ``sharded_param_state_dp_reshardable``), so
    they keep the default rule. Such a shard ``s`` is written by the DP rank ``c`` with
    ``crc32(key, global_offset) % size == c``: every replica computes the same owner from local facts.

    Routed-expert tensors (keys containing ``.experts.``, reference §2.7) are replicated across the
    expert-DP group instead; they are balanced with ``expert_dp_size``/``expert_dp_rank``, or left to
    the default rule (expert-DP rank 0 writes) when those are None.

    Every failure of these assumptions (a shard written twice or by nobody) is caught by the merge
    validation, which then raises ``ValidationError`` and commits nothing.
    """

    dp_size: int
    dp_rank: int
    expert_dp_size: Optional[int] = None
    expert_dp_rank: Optional[int] = None

    def __post_init__(self):
        for size, rank, what in (
            (self.dp_size, self.dp_rank, "dp"),
            (self.expert_dp_size, self.expert_dp_rank, "expert_dp"),
        ):
            if size is None and rank is None and what == "expert_dp":
                continue
            _args.whole(f"DPBalance {what}_size", size, 1)
            _args.whole(f"DPBalance {what}_rank", rank)
            if not rank < size:
                raise InvalidArgumentError(f"DPBalance: {what}_rank {rank!r} is not in 0..{what}_size ({size!r})")

    @classmethod
    def from_parallel_state(cls) -> "DPBalance":
        """Sizes and ranks of the DP x CP group and the expert-DP group from
        ``megatron.core.parallel_state`` (local reads, no collective)."""
        from megatron.core import parallel_state as ps

        return cls(
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            expert_dp_size=ps.get_expert_data_parallel_world_size(),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
        )

    def writes(self, sh) -> Optional[bool]:
        """Whether this rank writes DP-replicated ``sh``; None when ``sh`` is not DP-replicated."""
        rid = sh.replica_id
        if not isinstance(rid, tuple) or len(rid) < 2 or any(r != 0 for r in rid[:-1]):
            return None
        if sh.axis_fragmentations is None:
            return None
        if ".experts." in sh.key:
            size, rank = self.expert_dp_size, self.expert_dp_rank
            if size is None:
                return None
        else:
            size, rank = self.dp_size, self.dp_rank
        if rid[-1] != rank:
            return None
        ident = f"{sh.key}\0{tuple(sh.global_offset)}".encode()
        return zlib.crc32(ident) % size == rank


# The report, or with async_save=True a SaveHandle: told apart for type checkers by the literal.
@overload
def save(
    sharded_state_dict: dict,
    checkpoint_dir: _PathArg,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_s: float = 600.0,
    content_metadata: Optional[dict] = None,
    save_id: Optional[str] = None,
    merge_rank: Optional[int] = 0,
    wait_for_commit: bool = True,
    overwrite: bool = False,
    async_save: Literal[False] = False,
    staging_budget_bytes: Optional[int] = None,
    balance_dp: Optional[DPBalance] = None,
    verify_integrity: bool = False,
) -> SaveReport: ...
@overload
def save(
    sharded_state_dict: dict,
    checkpoint_dir: _PathArg,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_s: float = 600.0,
    content_metadata: Optional[dict] = None,
    save_id: Optional[str] = None,
    merge_rank: Optional[int] = 0,
    wait_for_commit: bool = True,
    overwrite: bool = False,
    async_save: Literal[True],
    staging_budget_bytes: Optional[int] = None,
    balance_dp: Optional[DPBalance] = None,
    verify_integrity: bool = False,
) -> SaveHandle: ...
@overload
def save(
    sharded_state_dict: dict,
    checkpoint_dir: _PathArg,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_s: float = 600.0,
    content_metadata: Optional[dict] = None,
    save_id: Optional[str] = None,
    merge_rank: Optional[int] = 0,
    wait_for_commit: bool = True,
    overwrite: bool = False,
    async_save: bool = False,
    staging_budget_bytes: Optional[int] = None,
    balance_dp: Optional[DPBalance] = None,
    verify_integrity: bool = False,
) -> Union[SaveReport, SaveHandle]: ...


@megatron_compatible
def save(
    sharded_state_dict: dict,
    checkpoint_dir: _PathArg,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_s: float = 600.0,
    content_metadata: Optional[dict] = None,
    save_id: Optional[str] = None,
    merge_rank: Optional[int] = 0,
    wait_for_commit: bool = True,
    overwrite: bool = False,
    async_save: bool = False,
    staging_budget_bytes: Optional[int] = None,
    balance_dp: Optional[DPBalance] = None,
    verify_integrity: bool = False,
) -> Union[SaveReport, SaveHandle]:
    """Save this rank's part of a Megatron sharded state dict, with no collective communication.

    Accepts what ``megatron.core.dist_checkpointing.save`` accepts: ``ShardedTensor`` (including
    ``prepend_axis_num`` and several local chunks of one key), ``ShardedTensorFactory``,
    ``ShardedObject`` and ``LocalNonpersistentObject``, in nested dicts and lists; every other value is
    common state, which rank 0 writes to ``common.pt`` with ``torch.save`` as Megatron does. Only main
    replicas (``replica_id`` all zeros) are written. No ``torch.distributed`` function is called,
    except ``get_rank``/``get_world_size`` when ``rank``/``world_size`` are not given.

    Args:
        sharded_state_dict: the Megatron sharded state dict (factories are applied in place).
        checkpoint_dir: the checkpoint directory (created if absent), e.g. ``.../iter_0000100``, or
            an object-store URL (``s3://bucket/run/iter_0000100``, ``gs://``, ``az://``): data files
            stream there as multipart uploads, parts and the commit are created only-if-absent.
            Credentials and endpoints come from the cloud's usual environment variables (docs/object-storage.md).
        rank, world_size: this rank's index among the ranks that save, and their number. Default to
            the ``torch.distributed`` default group when it is initialised, else ``RANK`` and
            ``WORLD_SIZE``. When the default group also holds processes that do not save (rollout or
            inference workers), pass the saving ranks' own ``rank`` and ``world_size``.
        timeout_s: bound in seconds on every wait: the merging rank's wait for all parts, and the other
            ranks' wait for the commit. Ctrl-C ends a wait at its next poll (at most 0.5 s), and a
            synchronous save's write at its next piece, with ``KeyboardInterrupt`` and nothing
            committed; a merging rank then publishes the failure so the others stop too.
        content_metadata: stored in ``common.pt`` under ``content_metadata``, as Megatron does.
        save_id: identifies this save attempt; must be equal on every rank. Default: derived from the
            directory and the launch environment (:func:`default_save_id`), and the attempt numbered
            from the directory: a retry after a failed attempt, by any process, begins the next
            one; a relaunch with the same environment joins an attempt that did not end, and parts
            and markers written before this process started are then ignored as an earlier
            launch's (``docs/guarantees.md``, "Attempts"). The report's ``save_id`` is the
            attempt's.
        merge_rank: the rank that merges the parts and commits ``.metadata``; ``None`` leaves the
            commit to ``shardwise merge``.
        wait_for_commit: other ranks return only once the save is committed.
        overwrite: replace a committed checkpoint in ``checkpoint_dir`` instead of raising (local
            directories only; refused on object stores). The new data goes to file names the old
            checkpoint does not use, so the old one stays loadable until the new ``.metadata``
            replaces it; its files are removed after the commit. A failed save leaves it intact.
        async_save: return a :class:`shardwise.SaveHandle` as soon as every tensor byte of this rank
            is staged in host memory (the caller may then modify its tensors); writing, fsync and the
            rendezvous go on in a Rust thread. ``handle.wait(timeout_s)`` returns the report or
            raises the save's error; ``handle.done()``; ``handle.stall_s`` (seconds blocked) and
            ``handle.staged_bytes``. A second save on this rank waits for the first to finish.
        staging_budget_bytes: host memory for staging, pinned when CUDA is there: 64 MiB buffers,
            pinned as staging needs them (or ahead of need by :func:`reserve_staging`), kept by the
            process and reused by later saves. CUDA tensors and async saves go through it;
            when a rank's bytes exceed it, staging waits for writes to free buffers (the stall
            grows). Default: this rank's bytes plus one 64 MiB buffer (so an async save stalls only
            for the copy), at least 4 GiB and at most half of the machine's memory divided by
            ``LOCAL_WORLD_SIZE`` (``SHARDWISE_STAGING_MAX_BYTES`` overrides that bound).
        balance_dp: spread the writes of DP-replicated tensors over the DP ranks by a stable hash
            (see :class:`DPBalance`) instead of DP rank 0 writing them all. Default: off.
        verify_integrity: also write megatron-core 0.19's ``integrity.json`` (SHA-256 of every file
            of the checkpoint, computed from the bytes as they are written), which
            ``dist_checkpointing.load(..., verify_integrity=True)`` checks. Every rank must agree.

    Returns:
        A dict report (a ``SaveReport``): ``rank``, ``save_id``, ``data_file``, ``data_bytes`` (this
        rank's bytes), ``write_s`` and ``rendezvous_s`` (seconds), ``committed``, and ``commit``: on
        the merging rank the merge's report, with the fields of ``shardwise merge --json``
        (``already_committed``, ``keys``, ``tensor_chunks``, ``byte_objects``, ``data_bytes`` and
        ``metadata_bytes`` of the whole checkpoint, ``took_over_dead_merger``), None on the other
        ranks. With ``async_save=True`` a :class:`shardwise.SaveHandle`, whose ``wait()`` returns
        that report.

    Raises:
        UnsupportedDtypeError: a tensor dtype DCP cannot store here (complex, uint16, ...).
        ValidationError: two ranks save the same main-replica chunk, chunks leave a coverage gap, or
            global shape, dtype or world_size disagree across ranks.
        MissingRanksError: (merging rank) a rank's part is still missing at ``timeout_s``; names it.
        NotCommittedError: (other ranks) the merger failed, or no commit within ``timeout_s``.
        CheckpointExistsError: ``checkpoint_dir`` holds a committed checkpoint and not ``overwrite``.
        StorageError: the directory or a file cannot be written (permissions, full disk, object
            store unreachable after its retries).
        InvalidArgumentError: rank, world_size, merge_rank or save_id out of range; ``timeout_s``
            not a finite number of seconds in ``0..1e9`` (``shardwise._native.MAX_TIMEOUT_S``);
            ``staging_budget_bytes`` not a whole number >= 1 (``-1``, ``2**64``, ``1.5`` and
            ``True`` are refused); unsupported tensors. Raised before any file is written.

    Every error above is also a megatron-core ``CheckpointingException`` (:mod:`shardwise.megatron_errors`;
    not those of an async save's ``handle.wait()``). A failed save never writes ``.metadata`` and
    touches no other directory.
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
    checkpoint_dir = os.fsdecode(checkpoint_dir)  # str, bytes or PathLike; need not be UTF-8
    derived_save_id = save_id is None
    if save_id is None:
        save_id = default_save_id(checkpoint_dir)
    # Every argument is checked here, before the state dict is touched or a file written.
    options = _native.SaveOptions(
        checkpoint_dir=checkpoint_dir,
        rank=rank,
        world_size=world_size,
        save_id=save_id,
        timeout_s=timeout_s,
        merge_rank=merge_rank,
        wait_for_commit=wait_for_commit,
        overwrite=overwrite,
        async_save=async_save,
        staging_budget_bytes=staging_budget_bytes,
        integrity=verify_integrity,
        derived_save_id=derived_save_id,
        megatron=True,
    )

    if content_metadata is not None:
        content_metadata = {k: v for k, v in content_metadata.items() if k != "dp_cp_group"}
        sharded_state_dict["content_metadata"] = content_metadata
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)

    chunks = []
    keep_alive = []
    objects_by_key: dict[str, list] = {}
    for sh in nested_values(sharded_part):
        balanced = balance_dp.writes(sh) if balance_dp is not None and isinstance(sh, ShardedTensor) else None
        if not (is_main_replica(sh.replica_id) if balanced is None else balanced):
            continue
        if isinstance(sh, ShardedTensor):
            if sh.flattened_range is not None:
                raise InvalidArgumentError(
                    f"{sh.key}: ShardedTensor.flattened_range is not supported (megatron-core >= 0.16 "
                    "rejects it too); use the dp_reshardable or fully_reshardable optimizer format"
                )
            t, device = _chunk_memory(sh.data)
            keep_alive.append(t)
            chunks.append(
                _native.Chunk(
                    fqn=sh.key,
                    dtype=str(t.dtype),
                    global_shape=list(sh.global_shape),
                    offsets=list(sh.global_offset),
                    sizes=[1] * sh.prepend_axis_num + list(t.shape),
                    data_ptr=t.data_ptr(),
                    nbytes=t.numel() * t.element_size(),
                    device=device,
                )
            )
        elif isinstance(sh, ShardedObject):
            objects_by_key.setdefault(sh.unique_key, []).append(sh)
        else:
            raise InvalidArgumentError(f"unsupported sharded item {type(sh).__name__} for key {sh.key}")

    # A byte object is torch.save of the list of all local main-replica data with that unique key
    # (megatron strategies/torch.py `_mcore_to_torch_sharded_object`).
    objects = [
        _native.ObjectItem(
            fqn=unique_key,
            data=_object_bytes([o.data for o in objs]),
            key=objs[0].key,
            global_shape=list(objs[0].global_shape),
            global_offset=list(objs[0].global_offset),
        )
        for unique_key, objs in objects_by_key.items()
    ]
    common = _torch_save_bytes(common_state_dict) if rank == 0 else None

    report = _native.save_rank(options, chunks, objects, common, caller_streams=_caller_streams(keep_alive))
    del keep_alive  # the tensors must outlive the native call, which reads their memory
    if async_save:
        _track_pending(report, checkpoint_dir, options.timeout_s)
    return report


def reserve_staging(
    rank_bytes_or_state_dict, *, staging_budget_bytes: Optional[int] = None
) -> StagingReservation:
    """Start pinning this process's staging pool now, in a background thread, so that the first
    ``save(async_save=True)`` stalls only for its copies (issue 27: pinning ~0.75 s per GiB made the
    first async save of a 16 GiB rank stall 12.2 s, 37x the device-to-host copy). Returns at once.

    Call it as soon as the model and optimizer exist, e.g. with the sharded state dict the training
    loop will save. A save that arrives before the pool is complete uses the buffers pinned so far
    and pins the rest itself; it never waits for the whole pool. Later saves reuse the pool.

    Args:
        rank_bytes_or_state_dict: this rank's bytes to save (an int), or a Megatron sharded state
            dict, whose main-replica ``ShardedTensor`` (and factory) bytes are counted; the dict is
            not modified (factories are not applied).
        staging_budget_bytes: the pool's size in bytes, as ``save``'s argument of that name. Default:
            what ``save`` uses by default for those bytes (the bytes plus one 64 MiB buffer, within
            the host bound).

    Returns:
        A dict (a ``StagingReservation``): ``pinned`` (False when there is no CUDA device: host saves
        need no reservation, and nothing is done), ``rank_bytes`` (counted), ``budget_bytes``,
        ``buffer_bytes``, ``buffers`` (the pool's capacity).

    Raises:
        InvalidArgumentError: a negative or non-integer byte count or budget.
        GpuError: pinned memory cannot be allocated at all.
    """
    device = None
    if isinstance(rank_bytes_or_state_dict, dict):
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

        rank_bytes = 0
        for sh in nested_values(rank_bytes_or_state_dict):
            # A tensor whose data is None (not allocated yet) has nothing to stage.
            data = sh.data if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) else None
            if data is not None and is_main_replica(sh.replica_id):
                rank_bytes += data.numel() * data.element_size()
                if device is None and data.device.type == "cuda":
                    device = data.device.index
    else:
        rank_bytes = rank_bytes_or_state_dict
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.current_device()
    return _native.reserve_staging(rank_bytes=rank_bytes, device=device, staging_budget_bytes=staging_budget_bytes)


# Async saves not yet waited for: (handle, checkpoint_dir, timeout_s). At interpreter exit each is
# waited for, bounded by its timeout, as concurrent.futures waits for its workers; a save that
# fails or does not finish makes the exit status 1, so a lost checkpoint is never an exit 0. A save
# whose outcome a wait() already gave the caller (its report, or its error: the caller saw it, and
# may have saved again since) is skipped.
_PENDING: list = []
_PENDING_LOCK = threading.Lock()
_EXIT_FAILED = False


def _track_pending(handle, checkpoint_dir: str, timeout_s: float) -> None:
    with _PENDING_LOCK:
        # Kept until a wait() gave its outcome to the caller: a save that failed unwaited while later
        # ones ran still makes the exit status 1.
        _PENDING[:] = [p for p in _PENDING if not p[0].outcome_delivered]
        _PENDING.append((handle, checkpoint_dir, timeout_s))


def _finish_pending_saves() -> None:
    """atexit: waits for every async save still in flight and reports failures on stderr."""
    global _EXIT_FAILED
    with _PENDING_LOCK:
        pending, _PENDING[:] = list(_PENDING), []
    for handle, checkpoint_dir, timeout_s in pending:
        if handle.outcome_delivered:
            continue
        if not handle.done():
            print(
                f"shardwise: waiting for the async save to {checkpoint_dir} to finish "
                f"(at most {timeout_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
        try:
            # The save's own waits are bounded by timeout_s; the extra bounds its write.
            handle.wait(min(timeout_s + 60.0, _native.MAX_TIMEOUT_S))
        except BaseException as e:  # noqa: BLE001 - reported, then the exit status says so
            _EXIT_FAILED = True
            print(f"shardwise: the async save to {checkpoint_dir} FAILED at exit: {e}", file=sys.stderr, flush=True)


def _exit_status_on_failure() -> None:
    """atexit, registered first so it runs last: exit 1 when a pending save failed."""
    if _EXIT_FAILED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_exit_status_on_failure)
atexit.register(_finish_pending_saves)


def _replace_pending(old, new, checkpoint_dir: str, timeout_s: float) -> None:
    """Track ``new`` at exit in place of ``old`` (a handle that wraps ``old`` and must finish too)."""
    with _PENDING_LOCK:
        _PENDING[:] = [p for p in _PENDING if p[0] is not old]
    _track_pending(new, checkpoint_dir, timeout_s)
