"""A training loop's save: ``save_root/iter_XXXXXXX``, the tracker file, retention, and the guard
against saving unchanged tensors (:func:`save_checkpoint`)."""

from __future__ import annotations

import os
import re
import shutil
import threading
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union, cast, overload

from . import _args, _native
from ._fs import atomic_write, fsync_dir, is_url
from ._native import InvalidArgumentError
from .megatron_errors import megatron_compatible
from .save import _rank_and_world, _replace_pending, save

if TYPE_CHECKING:
    from ._native import CheckpointReport, SaveHandle, SaveReport

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(save_root: str, iteration: int) -> str:
    """``save_root/iter_{iteration:07d}``, Megatron's ``get_checkpoint_name(..., return_base_dir=True)``."""
    return os.path.join(os.fspath(save_root), f"iter_{iteration:07d}")


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
    try:
        atomic_write(os.path.join(save_root, TRACKER_FILE), str(int(iteration)).encode())
    except OSError as e:
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
        InvalidArgumentTypeError: ``iteration`` is not an ``int`` (a ``bool`` among them).
        InvalidArgumentError: ``iteration`` is negative.
        NotCommittedError: ``save_root/iter_{iteration:07d}`` holds no committed checkpoint.
        StorageError: the tracker or its lock cannot be written.
    """
    import fcntl

    from ._native import NotCommittedError, StorageError

    _args.whole("iteration", iteration)
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
        InvalidArgumentTypeError: ``current_iteration`` or ``keep_last`` is not an ``int``.
        InvalidArgumentError: ``keep_last`` < 1, a negative ``current_iteration``.
        StorageError: a directory cannot be renamed or deleted.
    """
    from ._native import StorageError

    _args.whole("current_iteration", current_iteration)
    _args.whole("keep_last", keep_last, 1)
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
            # The rename must be durable before anything inside goes: otherwise a power loss may
            # keep the removals and lose the rename, leaving a partial iter_* in sight that
            # retention (committed checkpoints only) never removes (python/tests/test_crashpoints.py).
            fsync_dir(save_root)
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
        InvalidArgumentTypeError: ``keep`` is not an ``int`` (a ``bool`` among them).
        InvalidArgumentError: ``keep`` < 1.
        StorageError: a directory cannot be renamed or deleted.
    """
    _args.whole("keep", keep, 1)
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


# The report, or with async_save=True (one of save_kwargs) a CheckpointHandle: told apart for type
# checkers by the literal.
@overload
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
    async_save: Literal[False] = False,
    **save_kwargs: Any,
) -> CheckpointReport: ...
@overload
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
    async_save: Literal[True],
    **save_kwargs: Any,
) -> CheckpointHandle: ...
@overload
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
    async_save: bool = False,
    **save_kwargs: Any,
) -> Union[CheckpointReport, CheckpointHandle]: ...


@megatron_compatible
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
    **save_kwargs: Any,
) -> Union[CheckpointReport, CheckpointHandle]:
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
        earlier iteration whose tensors this save repeats, or None): a ``CheckpointReport``. With
        ``async_save=True``: a :class:`CheckpointHandle` as soon as this rank's tensors are staged;
        its ``wait()`` returns that report once the save committed and the tracker moved.

    Raises:
        InvalidArgumentTypeError: ``iteration`` or ``keep_last`` that is not an ``int`` (a ``bool``
            among them), ``timeout_s`` that is not a number.
        InvalidArgumentError: negative ``iteration``, ``keep_last`` < 1, ``timeout_s`` not a finite
            number of seconds in ``0..1e9``, or ``common_state`` keys that collide with the sharded
            state dict.
        Everything :func:`save` raises; on any error the tracker is not moved and nothing is deleted.
    """
    _args.whole("iteration", iteration)
    _args.opt_whole("keep_last", keep_last, 1)
    if on_unchanged not in ("warn", "error", "ignore"):
        raise InvalidArgumentError(f"on_unchanged must be 'warn', 'error' or 'ignore', got {on_unchanged!r}")
    _native.check_seconds("timeout_s", timeout_s)  # before the save root is created
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

    def finish(saved: SaveReport) -> CheckpointReport:
        report = cast("CheckpointReport", saved)
        report["checkpoint_dir"] = ckpt
        if rank == merge_rank:
            report["unchanged_since"] = _unchanged_since(save_root, iteration, on_unchanged)
            update_tracker(save_root, iteration)
            report["tracker"] = read_tracker(save_root)
            report["deleted"] = apply_retention(save_root, iteration, keep_last) if keep_last is not None else []
        return report

    if not save_kwargs.get("async_save"):
        return finish(cast("SaveReport", result).copy())
    handle = CheckpointHandle(cast("SaveHandle", result), finish)
    # The tracker must move at exit too: wait for this handle, not the save's.
    _replace_pending(result, handle, ckpt, timeout_s)
    return handle


class CheckpointHandle:
    """An asynchronous :func:`save_checkpoint` in flight.

    ``wait(timeout_s=None)`` waits for the save (seconds; None: as long as the save's own bounds
    allow), then on the merging rank moves the tracker and applies retention, and returns the
    report dict of :func:`save_checkpoint`; it raises the save's error, and the tracker stays
    where it was. ``done()`` tells whether the save itself has finished; ``stall_s`` (seconds the
    call blocked) and ``staged_bytes`` come from the save's :class:`shardwise.SaveHandle`. An
    unwaited handle is waited for at interpreter exit (see :func:`save`).
    """

    def __init__(self, handle: SaveHandle, finish: Callable[[SaveReport], CheckpointReport]):
        self._handle = handle
        self._finish = finish
        self._report: Optional[CheckpointReport] = None
        self._lock = threading.Lock()
        self.stall_s = handle.stall_s
        self.staged_bytes = handle.staged_bytes

    def done(self) -> bool:
        return self._handle.done()

    @property
    def outcome_delivered(self) -> bool:
        """Whether a ``wait`` returned this save's report or raised its error to the caller."""
        return self._report is not None or self._handle.outcome_delivered

    @megatron_compatible
    def wait(self, timeout_s: Optional[float] = None) -> CheckpointReport:
        with self._lock:
            if self._report is None:
                self._report = self._finish(self._handle.wait(timeout_s).copy())
            return self._report

    def __repr__(self) -> str:
        return f"<shardwise CheckpointHandle {'done' if self.done() else 'in flight'}>"
