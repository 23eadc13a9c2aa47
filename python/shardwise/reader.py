"""Reading any DCP / torch_dist checkpoint as data (``.metadata`` is never unpickled by Python)."""

from __future__ import annotations

import math
import os
from typing import Optional, Union

from . import _native

Index = Union[int, slice, tuple]


class Reader:
    """An open checkpoint. Created by :func:`shardwise.open`.

    Keys are the DCP keys (Megatron ShardedTensor keys and ShardedObject unique keys).
    """

    def __init__(self, path):
        self._ckpt = _native.open_checkpoint(os.fspath(path))

    def keys(self) -> list[str]:
        """All keys, sorted."""
        return self._ckpt.keys()

    def metadata(self, key: str) -> dict:
        """``{"kind": "tensor", "dtype": str, "global_shape": [int], "chunks": [...]}`` (offsets and
        sizes in elements, ``offset``/``length`` in bytes within ``relative_path``), or
        ``{"kind": "object", ...}``. Raises ``InvalidArgumentError`` for an unknown key."""
        return self._ckpt.metadata(key)

    def read(self, key: str, index: Optional[Index] = None):
        """Reads tensor ``key`` (or ``index`` of it: ints and step-1 slices, one per leading
        dimension) into a new CPU ``torch.Tensor``, assembled from every chunk it overlaps.

        Only the chunks that overlap the request are read; memory is the size of the result.
        Raises ``IndexError`` for an index outside the shape, ``ValidationError`` when the saved
        chunks do not cover the request, ``CorruptFileError`` for damaged items."""
        import torch

        md = self._ckpt.metadata(key)
        if md["kind"] != "tensor":
            raise _native.InvalidArgumentError(f"{key} is a byte object; use read_bytes()")
        shape = md["global_shape"]
        offsets, sizes, keep = _region(shape, index)
        if math.prod(sizes) >= 1 << 62:  # a hostile .metadata's shape; torch would fail obscurely
            raise _native.InvalidArgumentError(f"{key}: region {sizes} is too large to read into memory")
        out = torch.empty(sizes, dtype=getattr(torch, md["dtype"]))
        self._ckpt.read_into(key, offsets, sizes, out.data_ptr(), out.numel() * out.element_size())
        return out.reshape([s for s, k in zip(sizes, keep) if k])

    def read_bytes(self, key: str) -> bytes:
        """The raw bytes of byte object ``key``: a torch.save archive. Unpickling it runs code
        from the file: only ``torch.load`` it when you trust the checkpoint."""
        return self._ckpt.read_bytes(key)


def _region(shape: list[int], index: Optional[Index]) -> tuple[list[int], list[int], list[bool]]:
    """(offsets, sizes, keep-dimension flags) for an index of ints and step-1 slices."""
    if index is None:
        index = ()
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for shape {shape}")
    offsets, sizes, keep = [], [], []
    for d, n in enumerate(shape):
        ix = index[d] if d < len(index) else slice(None)
        if isinstance(ix, slice):
            start, stop, step = ix.indices(n)
            if step != 1:
                raise IndexError("only step-1 slices are supported")
            offsets.append(start)
            sizes.append(max(0, stop - start))
            keep.append(True)
        elif isinstance(ix, int):
            i = ix + n if ix < 0 else ix
            if not 0 <= i < n:
                raise IndexError(f"index {ix} is out of range for dimension {d} of size {n}")
            offsets.append(i)
            sizes.append(1)
            keep.append(False)
        else:
            raise IndexError(f"unsupported index {ix!r}: use ints and slices")
    return offsets, sizes, keep


def open(path) -> Reader:  # noqa: A001 - the public name is shardwise.open
    """Opens the checkpoint at ``path`` (written by shardwise, torch DCP or Megatron): a directory or
    an object-store URL (``s3://bucket/run/iter_0000100``; items are then read by ranged GETs)."""
    return Reader(path)
