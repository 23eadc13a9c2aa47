"""Filesystem helpers shared by the training-loop bookkeeping and the barriers."""

from __future__ import annotations

import contextlib
import os
import threading


def is_url(checkpoint_dir) -> bool:
    """Whether ``checkpoint_dir`` names an object store (``s3://``, ``gs://``, ``az://``,
    ``memory://``...) rather than a local path (plain or ``file://``)."""
    s = os.fspath(checkpoint_dir)
    return "://" in s and not s.startswith("file://")


def fsync_dir(path: str) -> None:
    """fsync the directory ``path``, so that a rename or a new entry in it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Make ``path`` hold ``data``: a reader sees the whole old or the whole new content, never a
    torn file, and the new content survives a crash once this returns.

    Writes a hidden temporary file beside ``path`` (``.{name}.tmp.{pid}.{thread}``: unique per
    writer), fsyncs it, renames it over ``path`` and fsyncs the directory. On error the temporary
    file is removed.

    Raises:
        OSError: the file cannot be written (the caller wraps it in its own error).
    """
    path = os.fspath(path)
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, f".{name}.tmp.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(parent or ".")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
