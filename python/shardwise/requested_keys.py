"""Every rank's requested keys, with no collective: what the strict ``*_all`` modes of a load need.

Megatron's ``log_all``/``raise_all``/``return_all`` report as *missing* the checkpoint keys that no
rank requests; Megatron learns every rank's request with an ``all_gather_object``
(megatron-core ``validation.py`` ``determine_global_metadata``). Here each rank publishes the keys
it requests in a file beside the checkpoint and reads everyone's:

    <parent>/.<name>.shardwise-keys/<load id>/rank<r>    rank r's keys (zlib-compressed JSON)
    <parent>/.<name>.shardwise-keys/<load id>/done<r>    rank r has read every rank's keys

* **Load id.** Every rank derives it alike, without talking (:func:`shardwise.save.derived_id`): the
  checkpoint directory, the launch environment, how many such loads of that directory this process
  made, and the group's ranks. All ranks must make the same ``*_all`` loads in the same order, as
  Megatron's collective requires too.
* **Freshness.** A file written before this process started belongs to an earlier launch that
  derived the same id (a relaunch with a static environment) and is waited past, as a save's parts
  are (``docs/guarantees.md``, "Attempts"); the writer's clock stamps it.
* **Bounded wait.** ``timeout_s`` bounds it; then :class:`shardwise.MissingRanksError` names the
  ranks whose keys are missing and those whose file is an earlier launch's. Ctrl-C ends it.
* **Cleanup.** A rank writes its ``done`` marker once it has read every file, or has given up
  waiting; the rank that then finds every rank's marker (of this launch) removes the load's
  directory, and ``.<name>.shardwise-keys`` when it is empty. A rank killed mid-load leaves its
  files; a relaunch deriving the same id replaces and removes them, otherwise delete them freely
  while no load of that checkpoint runs.

The files are written atomically (temporary file, fsync, rename), so a reader never sees a torn
one; every rank must see the checkpoint's parent directory (it sees the checkpoint already).
``SHARDWISE_KEYS_DIR`` names another directory for them (a read-only checkpoint location).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import zlib
from typing import Iterable, Optional

from . import _native
from ._fs import atomic_write
from ._native import CorruptFileError, InvalidArgumentError, MissingRanksError, StorageError, ValidationError

ENV_DIR = "SHARDWISE_KEYS_DIR"


def keys_root(checkpoint_dir: str) -> str:
    """Where the loads of ``checkpoint_dir`` publish their keys: ``$SHARDWISE_KEYS_DIR/<name>`` when
    that is set, else ``.<name>.shardwise-keys`` beside the checkpoint."""
    path = os.path.abspath(checkpoint_dir)
    parent, name = os.path.split(path.rstrip(os.sep) or os.sep)
    override = os.environ.get(ENV_DIR)
    if override:
        return os.path.join(override, name)
    return os.path.join(parent, f".{name}.shardwise-keys")


def gather(
    checkpoint_dir: str,
    keys: Iterable[str],
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    group: str = "",
    what: str = "a strict load",
) -> set:
    """The union of the keys every rank ``0..world_size-1`` requests, ``keys`` being this rank's.

    Args:
        checkpoint_dir: the local checkpoint directory being loaded.
        keys: the keys (``ShardedBase.key``) this rank requests.
        rank, world_size: this rank among the ranks that load together, and their number.
        timeout_s: bound on the wait for the other ranks' keys, in seconds.
        group: identifies the ranks taking part when they are not the whole job (their global
            ranks), so that two groups loading one checkpoint at once use different files.
        what: the operation, for messages (``"strict='return_all'"``).

    Raises:
        MissingRanksError: ranks had not published their keys at ``timeout_s``; names them.
        ValidationError: a rank published a different ``world_size``.
        CorruptFileError: a rank's file of this launch is not what this module writes.
        StorageError: the keys directory cannot be written (read-only location: set
            ``SHARDWISE_KEYS_DIR``).
        InvalidArgumentError: ``rank``/``world_size``/``timeout_s`` out of range.
    """
    from .save import derived_id

    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{what}: rank {rank!r} is not in 0..world_size ({world_size!r})")
    if not timeout_s >= 0:
        raise InvalidArgumentError(f"{what}: timeout_s must be >= 0, got {timeout_s!r}")
    root = keys_root(checkpoint_dir)
    load_id = derived_id(checkpoint_dir, "load-keys", f"{world_size}:{group}")
    folder = os.path.join(root, load_id)
    since_ns = _native.process_start_ns()
    record = {
        "rank": rank,
        "world_size": world_size,
        "written_ns": time.time_ns(),
        "process": f"{socket.gethostname()}:{os.getpid()}",
        "keys": sorted(set(keys)),
    }
    _publish(folder, f"rank{rank}", _encode(record), what)
    try:
        return _wait_all(folder, world_size, since_ns, timeout_s, what, checkpoint_dir)
    finally:
        # Read everything or gave up: this rank needs the files no more.
        with contextlib.suppress(OSError):
            _publish(folder, f"done{rank}", _encode({"written_ns": time.time_ns()}), what)
            _remove_when_all_done(root, folder, world_size, since_ns)


def _publish(folder: str, name: str, data: bytes, what: str) -> None:
    for attempt in range(3):
        try:
            os.makedirs(folder, exist_ok=True)
            atomic_write(os.path.join(folder, name), data)
            return
        except FileNotFoundError:
            # Another rank removed an emptied keys directory between makedirs and the write.
            if attempt == 2:
                raise
        except OSError as e:
            raise StorageError(
                f"{what}: cannot publish this rank's requested keys in {folder}: {e} (set {ENV_DIR} to a "
                "directory every rank can write)"
            ) from None


def _encode(record: dict) -> bytes:
    return zlib.compress(json.dumps(record).encode())


def _read(path: str) -> Optional[dict]:
    """A published record, or None when the file is not there (yet)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e}") from None
    try:
        record = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError) as e:
        raise CorruptFileError(f"corrupt file {path}: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("written_ns"), int):
        raise CorruptFileError(f"corrupt file {path}: not a shardwise keys record")
    return record


def _wait_all(folder: str, world_size: int, since_ns: int, timeout_s: float, what: str, checkpoint_dir: str) -> set:
    union: set = set()
    pending = set(range(world_size))
    stale: dict[int, str] = {}
    deadline = time.monotonic() + float(timeout_s)
    pause = 0.001
    while True:
        for r in sorted(pending):
            record = _read(os.path.join(folder, f"rank{r}"))
            if record is None:
                continue
            if record["written_ns"] < since_ns:
                stale[r] = f"written by {record.get('process')} before this process started (an earlier launch)"
                continue
            keys = record.get("keys")
            if record.get("world_size") != world_size or record.get("rank") != r:
                raise ValidationError(
                    f"{what} of {checkpoint_dir}: rank {r} loads with world_size {record.get('world_size')!r}, "
                    f"this rank with {world_size}"
                )
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise CorruptFileError(f"corrupt file {os.path.join(folder, f'rank{r}')}: keys are not strings")
            union.update(keys)
            pending.discard(r)
            stale.pop(r, None)
        if not pending:
            return union
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(pause, deadline - now))  # Ctrl-C raises KeyboardInterrupt here
        pause = min(pause * 2, 0.05)
    missing = sorted(pending)
    old = "".join(f"; rank {r}'s file was {why}" for r, why in sorted(stale.items()) if r in pending)
    raise MissingRanksError(
        f"{what} of {checkpoint_dir}: timed out after {timeout_s:g} s waiting for the requested keys of ranks "
        f"{missing} (world_size {world_size}) in {folder}{old}; every rank must make this load"
    )


def _remove_when_all_done(root: str, folder: str, world_size: int, since_ns: int) -> None:
    names = set(os.listdir(folder))
    if not all(f"done{r}" in names for r in range(world_size)):
        return
    for r in range(world_size):
        record = _read(os.path.join(folder, f"done{r}"))
        if record is None or record["written_ns"] < since_ns:
            return  # an earlier launch's marker: that rank of this launch still reads
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(root)  # only when no other load's files are in it
