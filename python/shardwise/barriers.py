"""A collective-free, diagnosable barrier on a shared filesystem.

Each rank announces itself by atomically writing small files; nothing goes through
``torch.distributed``, so a missing or stuck rank cannot hang the others: after ``timeout_s`` every
waiting rank raises :class:`BarrierTimeoutError` naming the ranks that did not arrive and the last
phase each of them reported (reference §6: "bounded waits ... error names the missing ranks and their
last reported stage").

Layout under ``dir``::

    phases/rank{r}.json        last phase rank r reported: {"phase", "time" (Unix s), "host", "pid"}
    barriers/{name}/rank{r}    rank r arrived at barrier ``name``
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Optional

from ._fs import atomic_write
from . import _args
from ._native import InvalidArgumentError, InvalidArgumentTypeError, MissingRanksError, check_seconds

# Barrier names become directory names.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class BarrierTimeoutError(MissingRanksError):
    """Ranks missing at a :func:`barrier`'s timeout.

    Attributes:
        name: the barrier name.
        missing: the ranks that had not arrived, sorted.
        last_phases: ``{rank: (phase, seconds since it was reported)}`` for each missing rank;
            ``(None, None)`` when the rank never reported anything.
    """

    def __init__(self, message: str, name: str, missing: list[int], last_phases: dict):
        super().__init__(message)
        self.name = name
        self.missing = missing
        self.last_phases = last_phases


def _check_rank(rank: int, world_size: int) -> None:
    _args.whole("world_size", world_size, 1)
    _args.whole("rank", rank, 0, world_size - 1)


def record_phase(dir: str, rank: int, phase: str) -> None:
    """Record that ``rank`` reached ``phase`` (free text, e.g. ``"update_weights:start"``).

    Cheap (one small file written and renamed); call it at every step a hang could stop in, so that a
    barrier timeout on another rank can say where this one is.

    Raises:
        InvalidArgumentTypeError: a rank that is not an ``int`` (a ``bool`` among them), a phase
            that is not a ``str``.
        InvalidArgumentError: a negative rank.
        OSError: ``dir`` cannot be written.
    """
    _args.whole("rank", rank)
    if not isinstance(phase, str):
        raise InvalidArgumentTypeError(f"phase must be a string, got {type(phase).__name__}")
    phases = os.path.join(os.fspath(dir), "phases")
    os.makedirs(phases, exist_ok=True)
    record = {"phase": phase, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    atomic_write(os.path.join(phases, f"rank{rank}.json"), json.dumps(record).encode())


def last_phases(dir: str, ranks) -> dict:
    """``{rank: (phase, age in seconds)}`` from the phase files; ``(None, None)`` for ranks without one."""
    now = time.time()
    out = {}
    for r in ranks:
        try:
            with open(os.path.join(os.fspath(dir), "phases", f"rank{r}.json")) as f:
                rec = json.load(f)
            out[r] = (rec["phase"], max(0.0, now - rec["time"]))
        except (OSError, ValueError, KeyError):
            out[r] = (None, None)
    return out


def barrier(
    dir: str,
    name: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    phase: Optional[str] = None,
) -> float:
    """Wait until ranks ``0..world_size-1`` have all arrived at barrier ``name``, or ``timeout_s``.

    Collective-free: arrival is a file in ``dir`` (which every rank must see, e.g. a shared
    filesystem or one node's local disk). ``name`` must be unique for each use within ``dir``
    (include an iteration or step counter): arrival files are never removed, so a reused name passes
    at once. Use a fresh ``dir`` per job launch for the same reason.

    Args:
        dir: the directory of the barrier files (created if absent).
        name: this barrier's name: letters, digits, ``_.-``, at most 200 characters.
        rank, world_size: this rank and the number of ranks that must arrive.
        timeout_s: bound on the wait, in seconds: a finite number in ``0..1e9``.
        phase: recorded as this rank's phase before waiting (:func:`record_phase`); default
            ``"barrier:{name}"``.

    Returns:
        The seconds this rank waited.

    Raises:
        BarrierTimeoutError (a ``MissingRanksError``, hence a ``ShardwiseError``): ranks still missing
            at the timeout; the message names them and the last phase each reported and how long ago.
        InvalidArgumentTypeError: a rank or world_size that is not an ``int`` (a ``bool`` among
            them), a name that is not a ``str``, a timeout that is not a number.
        InvalidArgumentError: a rank, world_size, name or timeout out of range.
    """
    _check_rank(rank, world_size)
    if not isinstance(name, str):
        raise InvalidArgumentTypeError(f"barrier name must be a string, got {type(name).__name__}")
    if not _NAME.match(name):
        raise InvalidArgumentError(f"barrier name {name!r} must match {_NAME.pattern}")
    timeout_s = check_seconds("timeout_s", timeout_s)  # the rule of every shardwise wait
    dir = os.fspath(dir)
    record_phase(dir, rank, f"barrier:{name}" if phase is None else phase)
    arrivals = os.path.join(dir, "barriers", name)
    os.makedirs(arrivals, exist_ok=True)
    atomic_write(os.path.join(arrivals, f"rank{rank}"), b"")

    start = time.monotonic()
    deadline = start + float(timeout_s)
    pause = 0.001
    while True:
        present = {e for e in os.listdir(arrivals) if ".tmp." not in e}
        missing = [r for r in range(world_size) if f"rank{r}" not in present]
        if not missing:
            return time.monotonic() - start
        now = time.monotonic()
        if now >= deadline:
            break
        # Back off to 50 ms: quick when ranks arrive together, cheap on the filesystem otherwise.
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.05)

    phases = last_phases(dir, missing)
    described = ", ".join(
        f"rank {r}: " + ("never reported a phase" if p is None else f"last phase {p!r} ({age:.1f} s ago)")
        for r, (p, age) in phases.items()
    )
    raise BarrierTimeoutError(
        f"barrier {name!r} in {dir}: {len(missing)} of {world_size} ranks missing after {timeout_s} s "
        f"(ranks {missing}); {described}",
        name,
        missing,
        phases,
    )
