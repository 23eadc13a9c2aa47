"""Rank processes for the fault tests (test_faults.py).

They are forked from a forkserver that imported this module once (torch, megatron-core and shardwise
take ~8 s to import on the 2-core test machine), so a rank process starts in milliseconds and can be
killed at any point of its save. Each rank saves plain hand-built ShardedTensors, no model.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch  # noqa: F401  (imported here so that the forkserver pays for it once)
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: F401

import shardwise
import shardwise.megatron as swm
from dcp_util import row_shard


def save_rank(ckpt: str, rank: int, world: int, save_id, rows: int, timeout_s: float, result_path: str,
              merge_rank=0, wait_for_commit=True, trap_sigint=False, offset: float = 0.0, start_after=None,
              retry_timeout_s=None, **save_kw) -> None:
    """One rank of a save: ``rows`` x 1024 float32 rows of ``w`` (4 KiB a row, plus ``offset``, so two
    attempts can save different values), plus a small ``b``. ``save_id=None`` derives the id as a
    launch would; ``save_kw`` go to ``shardwise.megatron.save``. With ``start_after`` (a path), the
    process exists at once but saves only once that file exists (a rank that is slow to reach its save),
    and never saves if it does not appear within 10 minutes (the test has ended or failed by then; on a
    loaded machine a shorter wait could let the rank save before the step it must follow).
    With ``retry_timeout_s``, a save that raises a shardwise error is retried once in the same process,
    as a training loop retries after a transient fault, with that timeout; the first error is
    recorded as ``first`` (``{"type", "error"}``).

    Writes ``{"ok", "type", "error", "report", "elapsed_s"}`` to ``result_path``. With
    ``trap_sigint``, SIGINT is recorded instead of raising KeyboardInterrupt (which could otherwise
    fire inside the ``except`` below and lose the record): ``sigint_s`` is when Python ran the
    handler and ``returned_s`` when the save call returned, both seconds after the save began.
    """
    deadline = time.monotonic() + 600
    while start_after is not None and not os.path.exists(start_after):
        if time.monotonic() > deadline:
            _write_result(result_path, {"rank": rank, "ok": False, "type": "NeverStarted", "error": start_after})
            return
        time.sleep(0.005)
    state = {"w": row_shard("w", rank, world, rows=rows, cols=1024), "b": row_shard("b", rank, world, rows=2, cols=4)}
    state["w"].data.add_(offset)
    t0 = time.monotonic()
    out: dict = {"rank": rank}
    if trap_sigint:
        signal.signal(signal.SIGINT, lambda *_: out.setdefault("sigint_s", time.monotonic() - t0))
    else:
        # A training process's own disposition, whatever this test run inherited (a shell runs
        # background jobs with SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    def save(timeout: float):
        return swm.save(state, ckpt, rank=rank, world_size=world, save_id=save_id, timeout_s=timeout,
                        merge_rank=merge_rank, wait_for_commit=wait_for_commit, **save_kw)

    try:
        try:
            out["report"] = save(timeout_s)
        except shardwise.ShardwiseError as e:
            if retry_timeout_s is None:
                raise
            out["first"] = {"type": type(e).__name__, "error": str(e)}
            out["report"] = save(retry_timeout_s)
        out["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test as data
        out.update(ok=False, type=type(e).__name__, error=str(e), shardwise_error=isinstance(e, shardwise.ShardwiseError))
    out["returned_s"] = out["elapsed_s"] = time.monotonic() - t0
    _write_result(result_path, out)


def _write_result(result_path: str, out: dict) -> None:
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, result_path)


def merge(ckpt: str, save_id: str, world: int, timeout_s: float) -> None:
    """A merger process (what ``shardwise merge`` runs), to be killed while it holds the lock."""
    shardwise.merge(ckpt, save_id, world, timeout_s)
