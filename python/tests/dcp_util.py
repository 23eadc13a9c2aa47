"""Reads checkpoints with plain, unmodified torch.distributed.checkpoint in one process."""

from __future__ import annotations

import hashlib
import io
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

# The golden checkpoints that real torch and megatron-core wrote (tests/fixtures/README.md).
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"


def golden() -> list[Path]:
    """Every golden checkpoint directory (``dcp/torch-*``, ``megatron/core-*``), sorted. Raises when
    they are missing: a golden test that finds no goldens must fail, not be skipped."""
    found = sorted(d for kind in ("dcp", "megatron") for d in (FIXTURES / kind).iterdir() if (d / ".metadata").is_file())
    assert len(found) >= 8, f"golden fixtures not found under {FIXTURES}: {found}"
    return found


def _load(sd, reader) -> None:
    """``dcp.load`` in one process. torch < 2.5's public ``load`` has no ``no_dist`` and puts every
    top-level value back as it was, so byte objects never arrive; its ``_load_state_dict`` (what
    the public one calls) loads them into ``sd``."""
    import inspect

    if "no_dist" in inspect.signature(dcp_load).parameters:
        dcp_load(sd, storage_reader=reader, no_dist=True)
    else:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        _load_state_dict(sd, reader, no_dist=True)


def read_all(ckpt: str, reader=None) -> tuple[dict, dict]:
    """(full tensors by key, byte objects by key as unpickled values), via ``dcp.load(no_dist=True)``
    with ``reader`` (a ``StorageReader`` factory taking no argument; default: ``FileSystemReader(ckpt)``)."""
    reader = reader or (lambda: FileSystemReader(ckpt))
    md = reader().read_metadata()
    sd: dict = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            sd[key] = torch.full(tuple(m.size), 7, dtype=m.properties.dtype) if m.properties.dtype != torch.bool else torch.zeros(tuple(m.size), dtype=torch.bool)
        else:
            assert isinstance(m, BytesStorageMetadata)
            sd[key] = io.BytesIO()
    _load(sd, reader())
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    objects = {}
    for k, v in sd.items():
        if isinstance(v, io.BytesIO):  # torch versions differ: some fill the BytesIO, some replace it
            v.seek(0)
            v = torch.load(v, weights_only=False)
        if not isinstance(v, torch.Tensor):
            objects[k] = v
    return tensors, objects


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparison of any dtype (NaN, -0.0, float8)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def row_shard(key, rank, world, rows=4, cols=8, dtype=torch.float32, replica_id=0):
    """A Megatron ShardedTensor: rank ``rank``'s ``rows`` rows of a ``(world*rows, cols)`` tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = (torch.arange(rows * cols) + 1000 * rank).reshape(rows, cols).to(dtype)
    return ShardedTensor.from_rank_offsets(key, data, (0, rank, world), replica_id=replica_id)


def save_ranks(ckpt, states, world=None, timeout_s=5.0, **kw):
    """Plays every rank in this process: saves ranks n-1..1 without waiting, then rank 0 (the
    merger, unless ``merge_rank`` says otherwise); returns rank 0's report."""
    import shardwise.megatron as swm

    world = len(states) if world is None else world
    kw.setdefault("save_id", uuid.uuid4().hex)  # one process plays every rank: give them one id
    for rank in range(len(states) - 1, 0, -1):
        swm.save(states[rank], ckpt, rank=rank, world_size=world, timeout_s=timeout_s, wait_for_commit=False, **kw)
    return swm.save(states[0], ckpt, rank=0, world_size=world, timeout_s=timeout_s, **kw)


def tree_digest(root: Path) -> dict:
    """sha256 of every file below ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}
