"""Collective-free save of a Megatron-Core sharded state dict in the ``torch_dist`` format.

The output is what ``megatron.core.dist_checkpointing.save`` writes with the default ``torch_dist``
strategy (``__{rank}_0.distcp`` data files, ``.metadata``, ``common.pt``, ``metadata.json``), and is
loaded by unmodified ``megatron.core.dist_checkpointing.load`` and ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import io
import os
import re
import shutil
import sys
import threading
import zlib
from collections import defaultdict
from typing import Any, Iterator, Optional

from . import _native
from ._native import InvalidArgumentError
from .load import load  # noqa: F401 - the collective-free load is shardwise.megatron.load

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


def is_url(checkpoint_dir) -> bool:
    """Whether ``checkpoint_dir`` names an object store (``s3://``, ``gs://``, ``az://``,
    ``memory://``...) rather than a local path (plain or ``file://``)."""
    s = os.fspath(checkpoint_dir)
    return "://" in s and not s.startswith("file://")


def default_save_id(checkpoint_dir: str) -> str:
    """Save id that every rank of one launch derives alike, without communication.

    It hashes the absolute checkpoint directory, the launch identity found in the environment
    (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, ``MASTER_ADDR``/``MASTER_PORT``, restart counts) and
    how many times this process has saved into that directory. Pass ``save_id`` explicitly when
    ranks may call :func:`save` a different number of times for the same directory.
    """
    path = os.fsdecode(checkpoint_dir)
    if not is_url(path):
        path = os.path.abspath(path)
    _ATTEMPTS[path] += 1
    h = hashlib.sha256(os.fsencode(path))  # the path's own bytes: it need not be UTF-8
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


def _chunk_memory(t):
    """``(tensor, device)``: ``t``'s elements contiguous where they are (no copy when ``t`` already
    is contiguous), and the CUDA ordinal or -1 for host memory. CUDA tensors are read by the Rust side
    through their device pointer; there is no ``.cpu()`` here."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t, (t.device.index if t.device.type == "cuda" else -1)


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
            if not isinstance(size, int) or not isinstance(rank, int) or size < 1 or not 0 <= rank < size:
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
    async_save: bool = False,
    staging_budget_bytes: Optional[int] = None,
    balance_dp: Optional[DPBalance] = None,
    verify_integrity: bool = False,
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
        checkpoint_dir: the checkpoint directory (created if absent), e.g. ``.../iter_0000100``, or
            an object-store URL (``s3://bucket/run/iter_0000100``, ``gs://``, ``az://``): data files
            stream there as multipart uploads, parts and the commit are created only-if-absent.
            Credentials and endpoints come from the cloud's usual environment variables (README).
        rank, world_size: this rank's index among the ranks that save, and their number. Default to
            the ``torch.distributed`` default group when it is initialised, else ``RANK`` and
            ``WORLD_SIZE``. When the default group also holds processes that do not save (rollout or
            inference workers), pass the saving ranks' own ``rank`` and ``world_size``.
        timeout_s: bound in seconds on every wait: the merging rank's wait for all parts, and the other
            ranks' wait for the commit. Ctrl-C ends a wait at its next poll (at most 0.5 s) with
            ``KeyboardInterrupt``; a merging rank then publishes the failure so the others stop too.
        content_metadata: stored in ``common.pt`` under ``content_metadata``, as Megatron does.
        save_id: identifies this save attempt; must be equal on every rank. Default: derived from the
            directory, the launch environment and the attempt count (:func:`default_save_id`); a
            relaunch with the same environment derives the same id again, and parts and markers
            written before this process started are then ignored as an earlier attempt's
            (``docs/guarantees.md``, "Attempts").
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
        staging_budget_bytes: host memory for staging, pinned when CUDA is there, allocated once per
            process and reused by later saves that fit. CUDA tensors and async saves go through it;
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
        StorageError: the directory or a file cannot be written (permissions, full disk, object
            store unreachable after its retries).
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
    checkpoint_dir = os.fsdecode(checkpoint_dir)  # str, bytes or PathLike; need not be UTF-8
    derived_save_id = save_id is None
    if derived_save_id:
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
                    device,
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
        async_save=async_save,
        staging_budget=staging_budget_bytes,
        caller_streams=_caller_streams(keep_alive),
        integrity=verify_integrity,
        derived_save_id=derived_save_id,
    )
    del keep_alive  # the tensors must outlive the native call, which reads their memory
    if async_save:
        _track_pending(report, checkpoint_dir, timeout_s)
    return report


# Async saves not yet waited for: (handle, checkpoint_dir, timeout_s). At interpreter exit each is
# waited for, bounded by its timeout, as concurrent.futures waits for its workers; a save that
# fails or does not finish makes the exit status 1, so a lost checkpoint is never an exit 0.
_PENDING: list = []
_PENDING_LOCK = threading.Lock()
_EXIT_FAILED = False


def _track_pending(handle, checkpoint_dir: str, timeout_s: float) -> None:
    with _PENDING_LOCK:
        _PENDING[:] = [p for p in _PENDING if not p[0].done()]
        _PENDING.append((handle, checkpoint_dir, timeout_s))


def _finish_pending_saves() -> None:
    """atexit: waits for every async save still in flight and reports failures on stderr."""
    global _EXIT_FAILED
    with _PENDING_LOCK:
        pending, _PENDING[:] = list(_PENDING), []
    for handle, checkpoint_dir, timeout_s in pending:
        if not handle.done():
            print(
                f"shardwise: waiting for the async save to {checkpoint_dir} to finish "
                f"(at most {timeout_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
        try:
            # The save's own waits are bounded by timeout_s; the extra bounds its write.
            handle.wait(timeout_s + 60.0)
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


class CheckpointHandle:
    """An asynchronous :func:`save_checkpoint` in flight.

    ``wait(timeout_s=None)`` waits for the save (seconds; None: as long as the save's own bounds
    allow), then on the merging rank moves the tracker and applies retention, and returns the
    report dict of :func:`save_checkpoint`; it raises the save's error, and the tracker stays
    where it was. ``done()`` tells whether the save itself has finished; ``stall_s`` (seconds the
    call blocked) and ``staged_bytes`` come from the save's :class:`shardwise.SaveHandle`. An
    unwaited handle is waited for at interpreter exit (see :func:`save`).
    """

    def __init__(self, handle, finish):
        self._handle = handle
        self._finish = finish
        self._report = None
        self._lock = threading.Lock()
        self.stall_s = handle.stall_s
        self.staged_bytes = handle.staged_bytes

    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout_s: Optional[float] = None) -> dict:
        with self._lock:
            if self._report is None:
                self._report = self._finish(dict(self._handle.wait(timeout_s)))
            return self._report

    def __repr__(self) -> str:
        return f"<shardwise CheckpointHandle {'done' if self.done() else 'in flight'}>"


# ---------------------------------------------------------------------------------------------
# Drop-in replacement for megatron.core.dist_checkpointing.save
# ---------------------------------------------------------------------------------------------

def _async_save_done() -> None:
    """The worker part of a drop-in async save: nothing (shardwise's own thread does the work).

    A module-level function rather than ``None``: Megatron's persistent checkpoint worker waits for a
    completion message that only a real ``async_fn`` run in the worker produces once that worker
    exists (``async_utils.PersistentAsyncCaller``), so ``None`` could block it forever.
    """


# Megatron's save parameters that steer only Megatron's own machinery: accepted, ignored (see
# dist_checkpointing_save). Every other parameter of the installed release must be handled below.
_IGNORED_MEGATRON_PARAMS = frozenset(
    {"validate_access_integrity", "preprocess_common_before_consistancy_check", "async_strategy"}
)
_HANDLED_MEGATRON_PARAMS = _IGNORED_MEGATRON_PARAMS | {
    "sharded_strategy",
    "common_strategy",
    "async_sharded_save",
    "content_metadata",
    "verify_integrity",
}


def _original_megatron_save():
    """The installed megatron-core's own ``save`` (the one :func:`install` replaced, if it did)."""
    import megatron.core.dist_checkpointing.serialization as mser

    return _original_megatron(mser, "save")


def _original_megatron(mod, name: str):
    """``mod.name`` as the installed megatron-core defines it (the one :func:`install` replaced)."""
    return next((orig for m, n, orig in _INSTALLED if m is mod and n == name), getattr(mod, name))


def megatron_save_parameters() -> list:
    """The parameters of the installed megatron-core's ``dist_checkpointing.save`` after
    ``sharded_state_dict`` and ``checkpoint_dir``, in order (``inspect.Parameter`` objects).

    Read from the signature of the installed release's function, not from a version table:
    0.13-0.18 take ``sharded_strategy, common_strategy, validate_access_integrity,
    async_sharded_save, preprocess_common_before_consistancy_check, content_metadata``; 0.19 dropped
    ``common_strategy`` and appended ``async_strategy, verify_integrity`` (megatron-core 0.19.2
    ``dist_checkpointing/serialization.py``), so the 4th positional argument changed meaning.
    """
    import inspect

    return list(inspect.signature(_original_megatron_save()).parameters.values())[2:]


def bind_release_args(function: str, params, args: tuple, kwargs: dict, handled) -> dict:
    """Binds ``args`` and the keywords of ``kwargs`` naming ``params`` (the installed release's
    parameters of ``megatron.core.dist_checkpointing.<function>`` after the first two) as that
    function would; the bound keywords are popped from ``kwargs``, the rest stay for shardwise.

    Raises ``TypeError`` as Megatron's own function would (too many positional arguments, one given
    both ways), and ``InvalidArgumentError`` for a parameter outside ``handled`` given with a value
    other than its default (a newer megatron-core's)."""
    name = f"megatron.core.dist_checkpointing.{function}"
    if len(args) > len(params):
        raise TypeError(f"{name} takes at most {len(params) + 2} positional arguments ({len(args) + 2} given)")
    bound = {p.name: a for p, a in zip(params, args)}
    for p in params:
        if p.name in kwargs:
            if p.name in bound:
                raise TypeError(f"{name} got multiple values for argument {p.name!r}")
            bound[p.name] = kwargs.pop(p.name)
    for p in params:
        value = bound.get(p.name, p.default)
        if p.name not in handled and not (value is p.default or value == p.default):
            raise InvalidArgumentError(
                f"{name} parameter {p.name!r} is not supported by shardwise (a megatron-core newer than 0.19?)"
            )
    return bound


def dist_checkpointing_save(sharded_state_dict: dict, checkpoint_dir: str, *args, **kwargs):
    """``megatron.core.dist_checkpointing.save`` done by shardwise, with the installed megatron-core's
    own signature (0.13-0.19): positional arguments are bound to that release's parameters in its
    order (:func:`megatron_save_parameters`), so 0.19's ``save(sd, dir, strategy,
    validate_access_integrity)`` and 0.18's ``save(sd, dir, strategy, common_strategy)`` both mean
    what they mean to Megatron.

    Writes what Megatron's ``torch_dist`` save writes (the pre-0.19 layout with ``common.pt``, which
    0.19's loader also reads) through :func:`save`, with no collective. Keyword arguments beyond
    Megatron's go to :func:`save` (``timeout_s``, ``overwrite``, ``balance_dp``, ...).

    Megatron's parameters:
        sharded_strategy: any ``torch_dist`` strategy (the fully-parallel wrapper included, whose
            distribution needs an ``all_gather``; shardwise needs none); another backend raises.
        common_strategy (<= 0.18): must be None (Megatron raises NotImplementedError otherwise).
        async_sharded_save: return an ``AsyncRequest`` (see Returns).
        content_metadata: stored in ``common.pt`` as Megatron does.
        verify_integrity (0.19): also write megatron-core 0.19's integrity manifest
            (``integrity.json``: the SHA-256 of every file of the checkpoint), which
            ``load(..., verify_integrity=True)`` checks. The digests are computed from the bytes as
            they are written, with no second read of the files (Megatron's rank 0 reads the whole
            checkpoint back for it); the manifest is written by the commit, before the save counts
            as committed.
        async_strategy (0.19): accepted, any value, and ignored. In Megatron it picks which
            machinery runs the write in the background (``"nvrx"``'s persistent worker, or
            megatron-core's own); shardwise writes from its own Rust thread whatever the value, and
            the returned request's ``async_fn`` does nothing in whichever worker runs it.
        validate_access_integrity, preprocess_common_before_consistancy_check: ignored. The merge
            validates coverage and overlaps of every chunk anyway, and the preprocessing only feeds
            Megatron's cross-rank comparison of the common dict (a ``broadcast_object_list``).

    Returns:
        None; with ``async_sharded_save=True`` a
        ``megatron.core.dist_checkpointing.strategies.async_utils.AsyncRequest`` for Megatron's async
        queue. The call returns once this rank's tensors are staged in host memory (see
        ``save(async_save=True)``); writing and the rendezvous go on in a Rust thread. The request's
        ``async_fn`` is a no-op in Megatron's worker, and its first finalize function waits for the
        save to be committed (re-raising its error), before any finalize function the caller appends.

    Raises:
        TypeError: more positional arguments than the installed release takes, or an argument given
            both by position and by name (as Megatron's own function would).
        InvalidArgumentError: ``common_strategy`` given, a ``sharded_strategy`` whose backend is not
            ``torch_dist``, or a parameter of a newer megatron-core that shardwise does not know,
            given with a value other than its default.
        Everything :func:`save` raises.
    """
    megatron_args = bind_release_args("save", megatron_save_parameters(), args, kwargs, _HANDLED_MEGATRON_PARAMS)
    sharded_strategy = megatron_args.get("sharded_strategy")
    if megatron_args.get("common_strategy") is not None:
        raise InvalidArgumentError("common_strategy is not supported (megatron-core supports only the default torch one)")
    backend = sharded_strategy[0] if isinstance(sharded_strategy, tuple) else getattr(sharded_strategy, "backend", None)
    if sharded_strategy is not None and backend != "torch_dist":
        raise InvalidArgumentError(f"shardwise writes the torch_dist format; sharded_strategy has backend {backend!r}")
    if megatron_args.get("verify_integrity"):
        kwargs["verify_integrity"] = True
    content_metadata = megatron_args.get("content_metadata")
    if not megatron_args.get("async_sharded_save"):
        save(sharded_state_dict, checkpoint_dir, content_metadata=content_metadata, **kwargs)
        return None
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    handle = save(sharded_state_dict, checkpoint_dir, content_metadata=content_metadata, async_save=True, **kwargs)
    # Megatron runs finalize_fns in the training process once the request is done; ours comes
    # first, so the functions save_checkpoint appends (metadata, tracker) run after the commit.
    return AsyncRequest(_async_save_done, (), [handle.wait])


# (module, attribute, original) for every name install() replaced, in replacement order.
_INSTALLED: list[tuple[Any, str, Any]] = []


def install(*, load: bool = True, **save_kwargs) -> None:
    """Route ``megatron.core.dist_checkpointing.save`` to shardwise (:func:`dist_checkpointing_save`),
    and, unless ``load=False``, its ``load`` and ``load_common_state_dict`` (what
    ``megatron.training.checkpointing.load_checkpoint`` calls; ``load_content_metadata`` and
    ``load_plain_tensors`` call them) to :func:`shardwise.load.dist_checkpointing_load` and
    :func:`shardwise.load.load_common_state_dict`. ``load=False`` keeps Megatron's own load (and
    un-routes it if an earlier call routed it).

    Replaces the names in ``megatron.core.dist_checkpointing`` (which Megatron's training code calls as
    ``dist_checkpointing.save``) and in ``megatron.core.dist_checkpointing.serialization``.
    ``save_kwargs`` are passed to :func:`save` on every call (e.g. ``timeout_s=1800``,
    ``balance_dp=...``). Idempotent: a second call only updates ``save_kwargs``. Undo with
    :func:`uninstall`. Megatron's collectives *around* the save in
    ``megatron.training.checkpointing.save_checkpoint`` remain (see the README).
    """
    import functools

    import megatron.core.dist_checkpointing as mdc
    import megatron.core.dist_checkpointing.serialization as mser

    from .load import dist_checkpointing_load, load_common_state_dict

    replacement = functools.partial(dist_checkpointing_save, **save_kwargs)
    functools.update_wrapper(replacement, dist_checkpointing_save)
    routes = {"save": replacement}
    load_routes = {"load": dist_checkpointing_load, "load_common_state_dict": load_common_state_dict}
    if load:
        routes.update(load_routes)
    for mod in (mdc, mser):
        for name, function in routes.items():
            if not any(m is mod and n == name for m, n, _ in _INSTALLED):
                _INSTALLED.append((mod, name, getattr(mod, name)))
            setattr(mod, name, function)
        if not load:
            for i in reversed(range(len(_INSTALLED))):
                m, n, original = _INSTALLED[i]
                if m is mod and n in load_routes:
                    setattr(mod, n, original)
                    del _INSTALLED[i]


def uninstall() -> None:
    """Restore the functions :func:`install` replaced; a no-op when nothing is installed."""
    while _INSTALLED:
        mod, name, original = _INSTALLED.pop()
        setattr(mod, name, original)


@contextlib.contextmanager
def installed(*, load: bool = True, **save_kwargs) -> Iterator[None]:
    """Context manager: :func:`install` on entry, :func:`uninstall` on exit (also on error)."""
    install(load=load, **save_kwargs)
    try:
        yield
    finally:
        uninstall()


# ---------------------------------------------------------------------------------------------
# A training loop's save: iter_XXXXXXX, tracker, retention
# ---------------------------------------------------------------------------------------------

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(save_root: str, iteration: int) -> str:
    """``save_root/iter_{iteration:07d}``, Megatron's ``get_checkpoint_name(..., return_base_dir=True)``."""
    return os.path.join(os.fspath(save_root), f"iter_{iteration:07d}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(save_root: str, iteration: int) -> None:
    """Atomically make ``save_root/latest_checkpointed_iteration.txt`` hold ``str(iteration)``.

    Write to a temporary file, fsync, rename over the tracker, fsync the directory: a reader sees
    the old or the new iteration, never a torn file (Megatron's reader exits on anything that is not
    an integer or ``release``, reference §1.1).

    Raises:
        StorageError: the file cannot be written.
    """
    from ._native import StorageError

    save_root = os.fspath(save_root)
    tmp = os.path.join(save_root, f".{TRACKER_FILE}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(str(int(iteration)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_root, TRACKER_FILE))
        _fsync_dir(save_root)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise StorageError(f"cannot write {TRACKER_FILE} in {save_root}: {e}") from e


def read_tracker(save_root: str) -> Optional[int]:
    """The iteration in ``save_root/latest_checkpointed_iteration.txt``, or None when the file is
    absent or does not hold an integer (Megatron's ``release`` included)."""
    try:
        with open(os.path.join(os.fspath(save_root), TRACKER_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def update_tracker(save_root: str, iteration: int) -> bool:
    """Move ``save_root/latest_checkpointed_iteration.txt`` to ``iteration``, atomically, only forward
    and only to a committed checkpoint.

    The write is :func:`write_tracker` (tmp, fsync, rename, directory fsync). Concurrent callers are
    serialised by an advisory ``flock`` on the ``save_root`` directory itself (no lock file), so the
    read-compare-rename cannot interleave and the tracker never moves backwards.

    Returns:
        True when the tracker names ``iteration`` afterwards (also when it already did); False when
        it names a later iteration, which is left as it is.

    Raises:
        InvalidArgumentError: ``iteration`` is not an integer >= 0.
        NotCommittedError: ``save_root/iter_{iteration:07d}`` holds no committed checkpoint.
        StorageError: the tracker or its lock cannot be written.
    """
    import fcntl

    from ._native import NotCommittedError, StorageError

    if not isinstance(iteration, int) or iteration < 0:
        raise InvalidArgumentError(f"iteration must be an integer >= 0, got {iteration!r}")
    save_root = os.fspath(save_root)
    ckpt = checkpoint_name(save_root, iteration)
    if not _is_committed(ckpt):
        raise NotCommittedError(f"{ckpt} holds no committed checkpoint; the tracker stays where it is")
    try:
        lock = os.open(save_root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise StorageError(f"cannot lock {TRACKER_FILE} in {save_root}: {e}") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = read_tracker(save_root)
        if current is not None and current >= iteration:
            return current == iteration
        write_tracker(save_root, iteration)
        return True
    finally:
        os.close(lock)  # releases the flock


def _is_committed(ckpt_dir: str) -> bool:
    # The one definition of "committed" (src/commit/state.rs): the commit's .metadata and every
    # file it needs are there and unchanged.
    return _native.is_committed(ckpt_dir)


def apply_retention(save_root: str, current_iteration: int, keep_last: int) -> list[str]:
    """Delete committed ``iter_*`` directories older than ``current_iteration`` beyond the newest
    ``keep_last`` (the current one counts as one). Returns the deleted paths.

    Directories without a committed checkpoint (a save in progress or a failed one) and iterations
    newer than ``current_iteration`` are left alone. Each victim is first renamed to a hidden name,
    so a crash mid-delete never leaves a partial directory that still looks like a checkpoint.

    Raises:
        InvalidArgumentError: ``keep_last`` < 1.
        StorageError: a directory cannot be renamed or deleted.
    """
    from ._native import StorageError

    if not isinstance(keep_last, int) or keep_last < 1:
        raise InvalidArgumentError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    save_root = os.fspath(save_root)
    older = []
    for name in os.listdir(save_root):
        m = _ITER_DIR.match(name)
        if m and int(m.group(1)) < current_iteration and _is_committed(os.path.join(save_root, name)):
            older.append((int(m.group(1)), name))
    older.sort()
    victims = older[: max(0, len(older) - (keep_last - 1))]
    # The iteration the tracker names is what a restart loads; it is never deleted, even when the
    # tracker lags behind (its update failed after an earlier commit).
    tracked = read_tracker(save_root)
    victims = [v for v in victims if v[0] != tracked]
    deleted = []
    for _, name in victims:
        path = os.path.join(save_root, name)
        doomed = os.path.join(save_root, f".{name}.deleting.{os.getpid()}")
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            raise StorageError(f"retention: cannot delete {path}: {e}") from e
        deleted.append(path)
    return deleted


def committed_iterations(save_root: str) -> list[int]:
    """Iterations of ``save_root/iter_*`` directories that hold a committed checkpoint, ascending."""
    save_root = os.fspath(save_root)
    found = []
    for name in os.listdir(save_root):
        m = _ITER_DIR.match(name)
        if m and _is_committed(os.path.join(save_root, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def retain(save_root: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` committed ``iter_*`` checkpoints of ``save_root``; delete older
    committed ones. Returns the deleted paths.

    Never deleted: the newest committed iteration, any iteration newer than it (an uncommitted save
    in progress), any uncommitted directory, and the iteration the tracker names. Deletion renames
    each victim to a hidden name first (:func:`apply_retention`), so a crash mid-delete leaves no
    directory that looks like a checkpoint.

    Raises:
        InvalidArgumentError: ``keep`` < 1.
        StorageError: a directory cannot be renamed or deleted.
    """
    if not isinstance(keep, int) or keep < 1:
        raise InvalidArgumentError(f"keep must be an integer >= 1, got {keep!r}")
    committed = committed_iterations(save_root)
    if not committed:
        return []
    return apply_retention(save_root, committed[-1], keep)


class UnchangedSaveWarning(UserWarning):
    """A save whose tensors all equal (by save-time CRC-32) those of the previous committed iteration."""


def _unchanged_since(save_root: str, iteration: int, on_unchanged: str) -> Optional[int]:
    """The newest committed iteration before ``iteration`` whose tensors this save repeats, acting on
    it as ``on_unchanged`` says (see :func:`save_checkpoint`)."""
    if on_unchanged == "ignore":
        return None
    earlier = [it for it in committed_iterations(save_root) if it < iteration]
    if not earlier:
        return None
    prev = earlier[-1]
    if not _native.same_tensor_crcs(checkpoint_name(save_root, prev), checkpoint_name(save_root, iteration)):
        return None
    msg = (
        f"iteration {iteration} saved exactly the tensors of iteration {prev} (every tensor's save-time "
        "CRC-32 is equal): were the weights updated, or is a stale copy being saved?"
    )
    if on_unchanged == "error":
        from ._native import ValidationError

        raise ValidationError(msg + f" The checkpoint is committed; the tracker stays at {read_tracker(save_root)}.")
    import warnings

    warnings.warn(msg, UnchangedSaveWarning, stacklevel=4)
    return prev


def save_checkpoint(
    save_root: str,
    iteration: int,
    sharded_state_dict: dict,
    common_state: Optional[dict] = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_s: float = 600.0,
    keep_last: Optional[int] = None,
    merge_rank: int = 0,
    on_unchanged: str = "warn",
    **save_kwargs,
) -> dict:
    """One training-loop checkpoint, collective-free: ``save_root/iter_{iteration:07d}``, then the
    tracker, then retention, in that order (Megatron's order, reference §1.1/§1.7).

    Every rank calls it with its own sharded state dict. The merging rank, after committing
    ``.metadata``, writes ``latest_checkpointed_iteration.txt`` atomically (:func:`write_tracker`) and
    then, with ``keep_last``, deletes older committed iterations (:func:`apply_retention`). Other ranks
    return once the save is committed (the tracker may lag by a few milliseconds).

    Args:
        save_root: Megatron's ``--save`` directory (created if absent).
        iteration: the iteration number, >= 0.
        sharded_state_dict: as for :func:`save`.
        common_state: extra common values merged into the top level of the state dict, e.g. what
            Megatron's loader reads from ``common.pt`` (``iteration``, ``checkpoint_version``,
            ``args``, ``opt_param_scheduler``); nothing is added implicitly.
        rank, world_size, timeout_s: as for :func:`save` (seconds).
        keep_last: keep this many newest committed ``iter_*`` directories (>= 1), None keeps all.
        merge_rank: the rank that commits, writes the tracker and applies retention.
        on_unchanged: what the merging rank does when every tensor of this save has the same
            save-time CRC-32 as in the newest earlier committed iteration of ``save_root`` (same keys
            and chunks; compared from the two checksum sidecars, no data read): ``"warn"`` (default:
            a :class:`UnchangedSaveWarning`; a frozen model saved without optimizer state is a
            legitimate case), ``"error"`` (raise ``ValidationError`` after the commit, and leave the
            tracker where it was), or ``"ignore"``. Such saves are how a training loop that keeps
            saving a stale copy of its weights shows (NeMo-RL #3312).
        save_kwargs: passed to :func:`save` (``balance_dp``, ``content_metadata``, ``save_id``...).

    Returns:
        :func:`save`'s report, plus ``checkpoint_dir``, and on the merging rank ``tracker`` (the
        iteration written), ``deleted`` (paths removed by retention) and ``unchanged_since`` (the
        earlier iteration whose tensors this save repeats, or None). With
        ``async_save=True``: a :class:`CheckpointHandle` as soon as this rank's tensors are staged;
        its ``wait()`` returns that report once the save committed and the tracker moved.

    Raises:
        InvalidArgumentError: negative ``iteration``, ``keep_last`` < 1, or ``common_state`` keys
            that collide with the sharded state dict.
        Everything :func:`save` raises; on any error the tracker is not moved and nothing is deleted.
    """
    if not isinstance(iteration, int) or iteration < 0:
        raise InvalidArgumentError(f"iteration must be an integer >= 0, got {iteration!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise InvalidArgumentError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    if on_unchanged not in ("warn", "error", "ignore"):
        raise InvalidArgumentError(f"on_unchanged must be 'warn', 'error' or 'ignore', got {on_unchanged!r}")
    if common_state:
        clash = sorted(set(common_state) & set(sharded_state_dict))
        if clash:
            raise InvalidArgumentError(f"common_state keys also in the sharded state dict: {clash}")
        sharded_state_dict = {**sharded_state_dict, **common_state}
    if is_url(save_root):
        raise InvalidArgumentError(
            f"save_checkpoint keeps Megatron's tracker file and retention on a filesystem; for an object "
            f"store ({save_root}) call save() with the iteration's URL"
        )
    rank, world_size = _rank_and_world(rank, world_size)
    os.makedirs(os.fspath(save_root), exist_ok=True)
    ckpt = checkpoint_name(save_root, iteration)
    result = save(
        sharded_state_dict,
        ckpt,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        merge_rank=merge_rank,
        **save_kwargs,
    )

    def finish(report: dict) -> dict:
        report["checkpoint_dir"] = ckpt
        if rank == merge_rank:
            report["unchanged_since"] = _unchanged_since(save_root, iteration, on_unchanged)
            update_tracker(save_root, iteration)
            report["tracker"] = read_tracker(save_root)
            report["deleted"] = apply_retention(save_root, iteration, keep_last) if keep_last is not None else []
        return report

    if not save_kwargs.get("async_save"):
        return finish(dict(result))
    handle = CheckpointHandle(result, finish)
    with _PENDING_LOCK:  # the tracker must move at exit too: wait for this handle, not the save's
        _PENDING[:] = [p for p in _PENDING if p[0] is not result]
    _track_pending(handle, ckpt, timeout_s)
    return handle
