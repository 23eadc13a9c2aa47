"""Plain torch DCP checkpoints: make a collective-free save reshardable.

``torch.distributed.checkpoint.save(state_dict, checkpoint_id=dir, use_collectives=False)`` (torch
>= 2.9) saves without gathering the plan: each rank writes its data files and its own
``__{rank}.metadata``, and no rank writes the global ``.metadata``. torch then loads such a
checkpoint only at the same world size and sharding (each rank reads its own rank-local file).
:func:`finish` merges the rank-local files, validated together, into the global ``.metadata``, with
no collective, after which plain ``torch.distributed.checkpoint.load`` reads the checkpoint at any
world size::

    dcp.save(state_dict, checkpoint_id=step_dir, use_collectives=False)
    shardwise.dcp.finish(step_dir)          # on any rank, or on every rank

The command line does the same: ``shardwise merge STEP_DIR``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from . import _native

if TYPE_CHECKING:
    from ._native import RankLocalMergeSummary

__all__ = ["finish"]


def finish(
    checkpoint_id, *, world_size: Optional[int] = None, timeout_s: float = 600.0
) -> RankLocalMergeSummary:
    """Commits the global ``.metadata`` of a ``use_collectives=False`` DCP save in
    ``checkpoint_id`` (a directory or an object-store URL).

    Every ``__{rank}.metadata`` is read as data (never unpickled by Python) and the ranks are
    validated together as shardwise's merger validates its own saves: the same dtype and global
    shape on every rank, every chunk inside its tensor, no two chunks overlapping, every tensor
    fully covered, every item inside its data file, and no data file rewritten after its rank's
    metadata. Items every rank saved in full (replicated tensors, step counters) are kept once,
    from the lowest rank, as DCP's own dedup does. ``.metadata`` is created only if absent: every
    rank may call this at once (one creates it, the others find the identical file). A
    ``.metadata`` older than every rank-local file (a merge of an earlier save into the same
    directory, whose data files this save rewrote) is replaced.

    Args:
        checkpoint_id: the directory passed to ``dcp.save`` (``str``/``PathLike``), or a URL.
        world_size: number of ranks that saved; default ``torch.distributed.get_world_size()``
            when a process group is initialized, else the ranks whose files are there. With it,
            the merge waits for every rank's file.
        timeout_s: bound in seconds on that wait and on each object-store request.

    Returns:
        A dict (a ``RankLocalMergeSummary``): ``ranks``, ``keys``, ``tensor_chunks``,
        ``byte_objects``, ``replicas_dropped``,
        ``metadata_bytes`` (bytes), ``already_merged`` (the same ``.metadata`` was there) and
        ``replaced_stale`` (an earlier save's ``.metadata`` was replaced).

    Raises:
        ValidationError: a rank's file is missing (or its data files exist without it), two saves
            are mixed, chunks overlap or leave a gap, ranks disagree on a dtype or shape, a
            ``.metadata`` with other content, not older than the rank-local files, is already there.
            Nothing is written.
        CorruptFileError: a rank-local file is not DCP metadata.
        InvalidArgumentError: no rank-local metadata in ``checkpoint_id``; a ``world_size`` that
            is not a whole number >= 1; a ``timeout_s`` that is not a finite number of seconds in
            ``0..=MAX_TIMEOUT_S``.
        StorageError: the directory or an object cannot be read or written.
    """
    if world_size is None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                world_size = dist.get_world_size()
        except ImportError:
            pass
    return _native.merge_rank_local(os.fsdecode(checkpoint_id), world_size, timeout_s)
