"""Reading any DCP / torch_dist checkpoint as data (``.metadata`` is never unpickled by Python)."""

from __future__ import annotations

import operator
import os
from typing import TYPE_CHECKING, Optional, Union

from . import _native

if TYPE_CHECKING:
    from ._native import KeyMetadata

Index = Union[int, slice, tuple]


class Reader:
    """An open checkpoint. Created by :func:`shardwise.open`.

    Keys are the DCP keys (Megatron ShardedTensor keys and ShardedObject unique keys):
    ``len(r)`` counts them, ``key in r`` tests one, ``for key in r`` iterates them sorted.
    ``with shardwise.open(path) as r: ...`` closes it (unmaps its data files) on exit; any use
    after :meth:`close` raises ``InvalidArgumentError``.
    """

    def __init__(self, path):
        # os.fsdecode: a bytes path (or a str one holding surrogate escapes) reaches Rust as the
        # original bytes, so directories whose names are not UTF-8 open too.
        self.path = os.fsdecode(path)
        self._native_ckpt = _native.open_checkpoint(self.path)

    @property
    def _ckpt(self):
        if self._native_ckpt is None:
            raise _native.InvalidArgumentError(f"checkpoint {self.path!r} is closed")
        return self._native_ckpt

    def close(self) -> None:
        """Releases the checkpoint's mapped data files. Idempotent."""
        self._native_ckpt = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._ckpt)

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and key in self._ckpt

    def __iter__(self):
        return iter(self.keys())

    def __repr__(self) -> str:
        if self._native_ckpt is None:
            return f"<shardwise.Reader {self.path!r} (closed)>"
        n = len(self._native_ckpt)
        return f"<shardwise.Reader {self.path!r}: {n} key{'' if n == 1 else 's'}, {self._native_ckpt.format_name()}>"

    def keys(self) -> list[str]:
        """All keys, sorted."""
        return self._ckpt.keys()

    def metadata(self, key: str) -> KeyMetadata:
        """``{"kind": "tensor", "dtype": str, "global_shape": [int], "chunks": [...]}`` (offsets and
        sizes in elements, ``offset``/``length`` in bytes within ``relative_path``), or
        ``{"kind": "object", ...}``. Raises ``InvalidArgumentError`` for an unknown key."""
        return self._ckpt.metadata(key)

    def read(self, key: str, index: Optional[Index] = None):
        """Reads tensor ``key`` (or ``index`` of it: ints and step-1 slices, one per leading
        dimension) into a new CPU ``torch.Tensor``, assembled from every chunk it overlaps.

        Only the chunks that overlap the request are read; memory is the size of the result.
        Raises ``MissingKeyError`` for a key the checkpoint lacks, ``IndexError`` for an index
        outside the shape, ``InvalidArgumentTypeError`` (a ``TypeError``, as a list's index of
        another type) for an index that is not an ``int`` (a ``bool`` among them) or a slice,
        ``ValidationError`` when the saved chunks do not cover the request
        (checked before the result is allocated), ``InvalidArgumentError`` when it does not fit in
        memory, ``CorruptFileError`` for damaged items. On checkpoints
        shardwise wrote, every item read is checked against the CRC-32 recorded at save time
        (the whole item, even for a partial read; once per item per open checkpoint); a mismatch
        is a ``CorruptFileError`` naming the key, the file and the item's offset. Without that
        record (no ``.shardwise/`` sidecar), a chunk read whole is checked against the CRC-32 its
        torch.save archive records for its tensor data, with the same error; a slice is not."""
        import torch

        md = self._ckpt.metadata(key)
        if md["kind"] != "tensor":
            raise _native.InvalidArgumentError(f"{key} is a byte object; use read_bytes()")
        shape = md["global_shape"]
        offsets, sizes, keep = _region(shape, index)
        # Coverage first: a hostile .metadata's [3, 4e11] is refused here, before any allocation.
        self._ckpt.check_region(key, offsets, sizes)
        try:
            out = torch.empty(sizes, dtype=getattr(torch, md["dtype"]))
        except (RuntimeError, MemoryError) as e:  # torch's allocation failure
            raise _native.InvalidArgumentError(f"{key}: region {sizes} does not fit in memory: {e}") from None
        region = _native.Region(
            key=key, offsets=offsets, sizes=sizes, data_ptr=out.data_ptr(), nbytes=out.numel() * out.element_size()
        )
        self._ckpt.read_into(region)
        return out.reshape([s for s, k in zip(sizes, keep) if k])

    def read_common(self) -> Optional[tuple[str, bytes]]:
        """The common (non-sharded) state a Megatron loader reads, as ``(source, raw bytes)``:
        ``common.pt`` (megatron-core <= 0.18 layout), else the ``common_state`` byte object of
        megatron-core 0.19 (``source`` is its key); None when there is neither. The bytes are a
        torch.save archive whose zip records passed their CRC-32s; unpickling it runs code from
        the file, so only ``torch.load`` it when you trust the checkpoint.
        Raises ``CorruptFileError`` naming the file when it is damaged."""
        return self._ckpt.read_common()

    def read_bytes(self, key: str) -> bytes:
        """The raw bytes of byte object ``key``: a torch.save archive. Unpickling it runs code
        from the file: only ``torch.load`` it when you trust the checkpoint. Checked against the
        save-time CRC-32 as :meth:`read` is (``CorruptFileError`` naming key, file and offset)."""
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
        elif not isinstance(ix, bool) and hasattr(type(ix), "__index__"):  # ints, numpy's integers
            ix = operator.index(ix)
            i = ix + n if ix < 0 else ix
            if not 0 <= i < n:
                raise IndexError(f"index {ix} is out of range for dimension {d} of size {n}")
            offsets.append(i)
            sizes.append(1)
            keep.append(False)
        else:
            # As a list's index: an index of another type (a bool among them) is a TypeError.
            raise _native.InvalidArgumentTypeError(
                f"index {ix!r} of type {type(ix).__name__}: use ints (not bools) and step-1 slices"
            )
    return offsets, sizes, keep


def open(path) -> Reader:  # noqa: A001 - the public name is shardwise.open
    """Opens the checkpoint at ``path`` (written by shardwise, torch DCP or Megatron): a directory
    (``str``, ``bytes`` or ``os.PathLike``; the name need not be UTF-8) or an object-store URL
    (``s3://bucket/run/iter_0000100``; items are then read by ranged GETs). Use it as a context
    manager to release the mapped files at the end of the ``with`` block.

    Raises ``StorageError`` when ``.metadata`` cannot be read (the message says what the directory
    holds instead: a save root's ``iter_*`` directories, an uncommitted save), ``CorruptFileError``
    when it is not DCP metadata."""
    return Reader(path)
