"""Reads checkpoints with plain, unmodified torch.distributed.checkpoint in one process."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata


def read_all(ckpt: str) -> tuple[dict, dict]:
    """(full tensors by key, byte objects by key as unpickled values), via ``dcp.load(no_dist=True)``."""
    md = FileSystemReader(ckpt).read_metadata()
    sd: dict = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            sd[key] = torch.full(tuple(m.size), 7, dtype=m.properties.dtype) if m.properties.dtype != torch.bool else torch.zeros(tuple(m.size), dtype=torch.bool)
        else:
            assert isinstance(m, BytesStorageMetadata)
            sd[key] = io.BytesIO()
    dcp_load(sd, storage_reader=FileSystemReader(ckpt), no_dist=True)
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
