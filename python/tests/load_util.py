"""Helpers for the native load engine tests (``Checkpoint.load_into``): destinations, requests, the
reference load through plain torch DCP, and a shardwise checkpoint whose tensors have several
chunks each."""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_util import _load, save_ranks
from shardwise import _native

# Every dtype DCP stores (and shardwise writes).
DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]


def dcp_tensors(ckpt) -> dict:
    """Every tensor of ``ckpt``, loaded whole by plain ``torch.distributed.checkpoint`` (no_dist)."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    sd = {
        k: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    _load(sd, FileSystemReader(str(ckpt)))
    return sd


def request(key, index, like: torch.Tensor, device="cpu"):
    """(``_native.Region``, destination tensor) for region ``index`` (a tuple of slices) of ``like``, a
    full tensor of the checkpoint's shape and dtype. The destination starts as a sentinel (0xA5
    bytes) so that an unfilled byte shows."""
    offsets, sizes = [], []
    for d, n in enumerate(like.shape):
        s = index[d] if d < len(index) else slice(None)
        lo, hi, _ = s.indices(n)
        offsets.append(lo)
        sizes.append(hi - lo)
    nbytes = math.prod(sizes) * like.dtype.itemsize
    out = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)
    out = out.view(like.dtype).view(sizes)
    dev = None if out.device.type == "cpu" else out.device.index
    region = _native.Region(
        key=key, offsets=offsets, sizes=sizes, data_ptr=out.data_ptr(), nbytes=out.numel() * out.element_size(), device=dev
    )
    return region, out


def grid_states(world_rows=3, world_cols=2, rows=6, cols=10):
    """Per-rank Megatron states: for every dtype, a ``(world_rows*rows, world_cols*cols)`` tensor
    cut into a grid of ``world_rows x world_cols`` chunks (one per rank), plus a large float32
    tensor (4 MiB per chunk, so reads go straight into destinations) cut along rows."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    world = world_rows * world_cols
    states = []
    for rank in range(world):
        i, j = divmod(rank, world_cols)
        g = torch.Generator().manual_seed(rank)
        st = {}
        for dt in DTYPES:
            if dt.is_floating_point:
                x = (torch.randn(rows, cols, generator=g) * 8).to(dt)
            elif dt == torch.bool:
                x = torch.randint(0, 2, (rows, cols), generator=g).bool()
            else:
                info = torch.iinfo(dt)
                x = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), (rows, cols), generator=g).to(dt)
            name = str(dt).removeprefix("torch.")
            st[name] = ShardedTensor.from_rank_offsets(name, x, (0, i, world_rows), (1, j, world_cols), replica_id=0)
        big = torch.randn(1 << 10, 1 << 10, generator=g)
        st["big"] = ShardedTensor.from_rank_offsets("big", big, (0, rank, world), replica_id=0)
        states.append(st)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    states[0]["o"] = ShardedObject("o", {"lr": 0.5}, (1,), (0,), replica_id=0)
    return states


def save_grid(ckpt) -> None:
    save_ranks(str(ckpt), grid_states())
