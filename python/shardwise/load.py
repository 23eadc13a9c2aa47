"""Collective-free load of a Megatron-Core sharded state dict from a ``torch_dist`` checkpoint.

Each rank reads only the regions its own ``ShardedTensor``s ask for, straight from the data files
(``shardwise.megatron.load``); no ``torch.distributed`` function is called, so it works with no
process group at all and from any thread. The Megatron semantics (factories, non-persistent objects,
common state, strict modes) follow megatron-core's ``dist_checkpointing/serialization.py`` ``load``
(0.13-0.19) and reuse its own pure helpers (``load_preprocess``, ``extract_sharded_base``,
``merge``, ``apply_factory_merges``), so the returned structure is the one Megatron builds.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import math
import os
import pickle
import threading
from typing import Any, Iterable, Optional, Union

from . import _native
from ._native import InvalidArgumentError, MissingKeyError, ShardwiseError, ValidationError
from ._fs import is_url

logger = logging.getLogger(__name__)


class UnsafeObjectError(ShardwiseError, pickle.UnpicklingError):
    """A ``ShardedObject`` or the common state needs a class outside the ``weights_only`` allow-list
    (torch's own plus megatron-core's ``safe_globals.SAFE_GLOBALS``). Pass the classes you trust in
    ``safe_globals=[...]``."""


# Strict modes whose "missing keys" are the checkpoint keys no rank asked for: only an all_gather of
# every rank's request can tell (megatron-core validation.py `_determine_missing_and_unexpected_keys`).
_GLOBAL_STRICT = ("log_all", "raise_all", "return_all")

# Open checkpoints of this process, most recent last: (path) -> ((device, inode, size, mtime_ns,
# ctime_ns) of .metadata, Checkpoint). The inode and ctime tell apart a .metadata replaced by one of
# the same size whose mtime was preserved (cp -p, rsync -a): ctime cannot be set back. A parsed .metadata can hold millions of chunks; two entries cover a load of the
# latest checkpoint while the previous one is still being compared or cleaned up.
_CACHE: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
_CACHE_SIZE = 2
_CACHE_LOCK = threading.Lock()
# torch's safe_globals context manager edits a process-wide set; serialise our additions.
_UNPICKLE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Drops every open checkpoint this process cached (their mapped data files are released)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def open_cached(checkpoint_dir: str, timeout_s: Optional[float] = None):
    """The open ``_native.Checkpoint`` of ``checkpoint_dir``, parsed once per process: reused while
    ``.metadata`` keeps its size and mtime (a new save into the same directory is parsed anew).
    Object-store URLs are opened on every call (no cheap stamp to check), each request bounded by
    ``timeout_s`` seconds when given."""
    if is_url(checkpoint_dir):
        return _native.open_checkpoint(checkpoint_dir, timeout_s)
    path = os.path.abspath(checkpoint_dir)
    try:
        st = os.stat(os.path.join(path, ".metadata"))
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:
        stamp = None  # open_checkpoint raises StorageError describing the directory
    with _CACHE_LOCK:
        hit = _CACHE.get(path)
        if hit is not None and stamp is not None and hit[0] == stamp:
            _CACHE.move_to_end(path)
            return hit[1]
    ckpt = _native.open_checkpoint(path)
    if stamp is not None:
        with _CACHE_LOCK:
            _CACHE[path] = (stamp, ckpt)
            _CACHE.move_to_end(path)
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return ckpt


def _check_backend(checkpoint_dir: str, timeout_s: Optional[float] = None) -> None:
    """Refuses checkpoints whose ``metadata.json`` names another backend than ``torch_dist``
    (``zarr``, ``torch`` ``mp_rank_*`` files...), in a directory or at an object-store URL. A plain
    DCP checkpoint (``.metadata``, no ``metadata.json``) is the same format and is read."""
    path = os.path.join(checkpoint_dir, "metadata.json")
    try:
        if is_url(checkpoint_dir):
            raw = _native.read_file(checkpoint_dir, "metadata.json", timeout_s)
            if raw is None:
                return  # a missing .metadata is reported by the open that follows
            config = json.loads(raw[: 1 << 20])
        else:
            with open(path, "rb") as f:
                config = json.loads(f.read(1 << 20))
    except (FileNotFoundError, NotADirectoryError):
        if not os.path.exists(checkpoint_dir):
            raise _native.StorageError(f"checkpoint directory {checkpoint_dir} does not exist") from None
        return  # no metadata.json; a path that is no directory is named by the native open
    except (OSError, ValueError) as e:
        raise _native.CorruptFileError(f"corrupt file {path}: {e}") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        raise InvalidArgumentError(
            f"{checkpoint_dir}: sharded_backend {backend!r} in metadata.json; shardwise loads only the "
            "torch_dist format (use megatron.core.dist_checkpointing.load for others)"
        )


def _safe_globals() -> list:
    """megatron-core's allow-list (``megatron/core/safe_globals.py``, 0.14+). Releases before it
    get that list's standard-library and numpy part: the types their ``args`` and rng states hold."""
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        import argparse
        import pathlib
        import signal
        import types

        import numpy
        import torch

        return [
            types.SimpleNamespace, pathlib.PosixPath, numpy.ndarray, numpy.dtype, argparse.Namespace,
            io.BytesIO, signal.Signals, torch._C.Generator,
            numpy.core.multiarray._reconstruct, type(numpy.dtype(numpy.uint32)),
        ]
    return list(SAFE_GLOBALS)


def _unpickle(data: bytes, what: str, extra_globals: Iterable) -> Any:
    """``torch.load(weights_only=True)`` of a torch.save archive: tensors, containers, scalars and
    the allow-listed classes only; nothing in the file runs."""
    import torch

    allowed = _safe_globals() + list(extra_globals)
    with _UNPICKLE_LOCK:
        missing = [c for c in allowed if c not in torch.serialization.get_safe_globals()]
        try:
            with torch.serialization.safe_globals(missing):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a page of advice; the line naming the refused global is the point.
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            first = next((ln for ln in lines if "GLOBAL" in ln or "global" in ln), lines[0] if lines else type(e).__name__)
            raise UnsafeObjectError(
                f"{what}: {first} (shardwise unpickles with weights_only=True and megatron-core's "
                "allow-list; pass the classes you trust as safe_globals=[...])"
            ) from None


def load_common_state_dict(checkpoint_dir, *, safe_globals: Iterable = ()) -> dict:
    """The common (non-sharded) state of a checkpoint: ``common.pt`` (megatron-core <= 0.18 and
    shardwise saves), else 0.19's ``common_state`` object; ``{}`` for a plain DCP checkpoint that
    has neither. Unpickled with ``weights_only=True`` (:class:`UnsafeObjectError` otherwise).
    Routed as ``megatron.core.dist_checkpointing.load_common_state_dict`` by ``install()``."""
    checkpoint_dir = os.fsdecode(checkpoint_dir)
    _check_backend(checkpoint_dir)
    return _read_common(open_cached(checkpoint_dir), safe_globals)


def _read_common(ckpt, safe_globals) -> dict:
    common = ckpt.read_common()
    if common is None:
        return {}
    source, data = common
    value = _unpickle(data, source, safe_globals)
    # 0.19 stores torch.save([common_state_dict]) as a ShardedObject; common.pt holds the dict.
    return value if source == "common.pt" else value[0]


def load(
    sharded_state_dict: dict,
    checkpoint_dir,
    *,
    strict="assume_ok_unexpected",
    validate_access_integrity: bool = True,
    timeout_s: Optional[float] = None,
    staging_budget_bytes: Optional[int] = None,
    check_crc: bool = True,
    safe_globals: Iterable = (),
) -> Union[dict, tuple]:
    """Loads this rank's part of a Megatron sharded state dict with no collective communication.

    Returns what ``megatron.core.dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
    strict=strict)`` returns: the checkpoint's common state (``common.pt`` or 0.19's
    ``common_state``), with the request's ``LocalNonpersistentObject`` values (unwrapped), the loaded
    ``ShardedObject`` values and tensors merged in, then the ``ShardedTensorFactory`` merges
    applied (SwiGLU halves concatenated...). Plain values of the request are dropped; int keys and
    lists keep their types. Each ``ShardedTensor`` is read **in place** into its ``data`` (allocated
    as Megatron does when None), prepended axes squeezed; only the saved chunks overlapping its
    region are read. A checkpoint dtype other than the request's is cast (floating to floating,
    integer to integer, as Megatron's copy does); a cast between floating and integer/bool is
    refused. ``flattened_range`` (megatron-core <= 0.15 distributed optimizer) reads the smallest
    box holding the range, or the 0.13 flattened layout's own range. ``allow_shape_mismatch``
    tensors are zeroed, then the part inside the checkpoint's shape is read.

    No ``torch.distributed`` function is called: it needs no process group and may run in any
    thread. Only the ``torch_dist`` format is read (a plain DCP checkpoint too).

    Args:
        sharded_state_dict: Megatron sharded state dict (nested dicts/lists of ``ShardedTensor``,
            ``ShardedObject``, ``ShardedTensorFactory``, ``LocalNonpersistentObject``, other values).
        checkpoint_dir: the checkpoint directory (``str``/``bytes``/``PathLike``) or an
            object-store URL.
        strict: a megatron ``StrictHandling`` or its string. Supported: ``assume_ok_unexpected``
            (default; a requested key that the checkpoint lacks raises ``MissingKeyError``),
            ``log_unexpected``, ``raise_unexpected``, ``return_unexpected`` (returns
            ``(state_dict, set(), unexpected_keys)``) and ``ignore_all``: requested keys absent from
            the checkpoint are dropped from the request and logged / raised / returned / ignored.
            ``log_all``, ``raise_all`` and ``return_all`` raise ``InvalidArgumentError``: their
            "missing keys" are the checkpoint keys that *no rank* requests, which needs an
            all_gather of every rank's request.
        validate_access_integrity: accepted for Megatron's signature. Megatron's check (every shard
            read by exactly one main replica across ranks) needs an all_gather; instead each rank
            checks that every region it asks for is fully covered by saved chunks (always on).
        timeout_s: bound in seconds on each object-store request.
        staging_budget_bytes: pinned host memory for reads into CUDA tensors (default: the
            engine's).
        check_crc: check the CRC-32 recorded at save time of every item read (shardwise saves).
        safe_globals: extra classes that the ``ShardedObject`` values or the common state may
            contain (explicit opt-in; everything else outside the allow-list is refused).

    Raises:
        MissingKeyError: a requested key (tensor, or an object's unique key) is not in the
            checkpoint; raised before any read.
        ValidationError: a global shape or dtype kind that differs from the checkpoint's, a
            tensor requested where the checkpoint holds an object (or the reverse), a region not
            covered by saved chunks.
        CorruptFileError: a missing or truncated data file, a CRC-32 mismatch (names key, file,
            offset).
        UnsafeObjectError: an object or the common state needs a class not allowed.
        InvalidArgumentError: a global strict mode; a ``metadata.json`` naming another backend.
        StorageError: the directory or ``.metadata`` cannot be read.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base
    from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag

    checkpoint_dir = os.fsdecode(checkpoint_dir)
    strict = parse_strict_flag(strict)
    if strict.value in _GLOBAL_STRICT:
        raise InvalidArgumentError(
            f"strict={strict.value!r} is not supported by shardwise: its missing keys are the checkpoint "
            "keys no rank requests, which needs an all_gather of every rank's request; use "
            f"{strict.value.replace('_all', '_unexpected')!r} (checks this rank's own keys)"
        )
    _check_backend(checkpoint_dir, timeout_s)
    ckpt = open_cached(checkpoint_dir, timeout_s)

    _dequantize_fp8(sharded_state_dict)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    common = _read_common(ckpt, safe_globals)
    merge(common, nonpersistent)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)

    unexpected: set = set()
    if strict != StrictHandling.ASSUME_OK_UNEXPECTED:
        sharded_state_dict, unexpected = _drop_unexpected(sharded_state_dict, ckpt)
        if unexpected and strict == StrictHandling.RAISE_UNEXPECTED:
            raise MissingKeyError(f"keys not in checkpoint {checkpoint_dir}: {sorted(unexpected)}")
        if unexpected and strict == StrictHandling.LOG_UNEXPECTED:
            logger.warning("keys not in checkpoint %s (not loaded): %s", checkpoint_dir, sorted(unexpected))

    items = list(nested_values(sharded_state_dict))
    plan = _Plan(ckpt, checkpoint_dir)
    objects: dict[str, list] = {}
    for sh in items:
        if isinstance(sh, ShardedTensor):
            plan.add_tensor(sh)
        elif isinstance(sh, ShardedObject):
            plan.check_object(sh.unique_key)
            objects.setdefault(sh.unique_key, []).append(sh)
        else:
            raise InvalidArgumentError(f"unsupported sharded item {type(sh).__name__} for key {sh.key}")

    plan.run(timeout_s=timeout_s, staging_budget_bytes=staging_budget_bytes, check_crc=check_crc)
    loaded_objects = {}
    for unique_key, shs in objects.items():
        value = _unpickle(ckpt.read_bytes(unique_key), unique_key, safe_globals)
        if not isinstance(value, list) or len(value) != len(shs):
            raise ValidationError(
                f"{unique_key}: the checkpoint holds {len(value) if isinstance(value, list) else 'no list of'} "
                f"objects, the request asks for {len(shs)}"
            )
        loaded_objects[unique_key] = iter(value)

    def result(sh):
        if isinstance(sh, ShardedObject):
            return next(loaded_objects[sh.unique_key])
        return plan.result(sh)

    dict_list_map_inplace(result, sharded_state_dict)
    merge(common, sharded_state_dict)
    apply_factory_merges(common, factories)
    if strict == StrictHandling.RETURN_UNEXPECTED:
        return common, set(), unexpected
    return common


def _dequantize_fp8(sharded_state_dict) -> None:
    """Megatron's first step: TE FP8 tensors become high-precision ones (local; absent before 0.14)."""
    try:
        from megatron.core.dist_checkpointing.utils import force_all_tensors_to_non_fp8
    except ImportError:
        return
    force_all_tensors_to_non_fp8(sharded_state_dict)


def _drop_unexpected(sharded_state_dict, ckpt):
    """(request without the keys the checkpoint lacks, those keys), as megatron's
    ``adjust_non_strict_load``: an object counts as present when any shard of its key was saved."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values

    saved = set()
    for k in ckpt.keys():
        saved.add(k)
        base, sep, shard = k.rpartition("/")
        if sep and shard.startswith("shard_"):
            saved.add(base)
    unexpected = {sh.key for sh in nested_values(sharded_state_dict) if sh.key not in saved}
    if unexpected:
        _, sharded_state_dict = extract_matching_values(sharded_state_dict, lambda sh: sh.key in unexpected)
    return sharded_state_dict, unexpected


_FLOATING = ("float", "bfloat")


def _dtype_kind(name: str) -> str:
    return "floating" if name.startswith(_FLOATING) else "bool" if name == "bool" else "integer"


class _Plan:
    """This rank's reads: one request per ShardedTensor region, validated before any byte is read.

    A request reads straight into the ShardedTensor's memory when it is contiguous, in the
    checkpoint's dtype and covers the whole region; otherwise into a temporary in the checkpoint's
    dtype, finished by :meth:`result` (cast, slice, copy into the destination).
    """

    def __init__(self, ckpt, checkpoint_dir: str):
        self.ckpt = ckpt
        self.dir = checkpoint_dir
        self.entries: dict[str, dict] = {}
        self.requests: list[tuple] = []
        self.finish: dict[int, Any] = {}  # id(ShardedTensor) -> () -> loaded tensor
        self.keep_alive: list = []

    def _entry(self, key: str) -> dict:
        md = self.entries.get(key)
        if md is None:
            # describe() raises MissingKeyError; unlike metadata() it builds nothing per chunk.
            kind, dtype, global_shape = self.ckpt.describe(key)
            md = self.entries[key] = {"kind": kind, "dtype": dtype, "global_shape": global_shape}
        return md

    def check_object(self, unique_key: str) -> None:
        if self._entry(unique_key)["kind"] != "object":
            raise ValidationError(f"{unique_key}: requested as a ShardedObject, the checkpoint holds a tensor")

    def _request(self, key: str, offsets, sizes, out) -> None:
        self.requests.append((key, list(offsets), list(sizes), out))

    def add_tensor(self, sh) -> None:
        import torch

        md = self._entry(sh.key)
        if md["kind"] != "tensor":
            raise ValidationError(f"{sh.key}: requested as a ShardedTensor, the checkpoint holds a byte object")
        ckpt_dtype = getattr(torch, md["dtype"])
        if sh.data is None:
            # Megatron's mcore_to_pyt_state_dict: an empty CPU tensor (zeros when shapes may differ).
            sh.init_data("cpu", init_fn=torch.zeros if sh.allow_shape_mismatch else torch.empty)
        data = sh.data.detach()
        req_dtype = str(data.dtype).removeprefix("torch.")
        if _dtype_kind(req_dtype) != _dtype_kind(md["dtype"]):
            raise ValidationError(
                f"{sh.key}: the checkpoint holds {md['dtype']}, the request is {req_dtype}; shardwise casts "
                "only floating to floating and integer to integer"
            )
        global_shape = list(md["global_shape"])
        if sh.flattened_range is not None:
            self._add_flattened(sh, data, global_shape, ckpt_dtype)
            return
        offsets = list(sh.global_offset)
        sizes = [1] * sh.prepend_axis_num + list(sh.local_shape)
        if global_shape != list(sh.global_shape):
            if not sh.allow_shape_mismatch or len(global_shape) != len(sh.global_shape):
                raise ValidationError(
                    f"{sh.key}: global shape {list(sh.global_shape)} requested, the checkpoint holds {global_shape}"
                )
            self._add_clipped(sh, data, offsets, sizes, global_shape, ckpt_dtype)
            return
        if data.dtype == ckpt_dtype and data.is_contiguous():
            self._request(sh.key, offsets, sizes, data)
            self.finish[id(sh)] = lambda: data
            return
        tmp = torch.empty(sizes, dtype=ckpt_dtype, device=data.device)
        self._request(sh.key, offsets, sizes, tmp)

        def finish():
            data.copy_(tmp.view(data.shape))
            return data

        self.finish[id(sh)] = finish

    def _add_clipped(self, sh, data, offsets, sizes, global_shape, ckpt_dtype) -> None:
        """``allow_shape_mismatch``: Megatron zeroes the tensor and reads what lies inside the saved
        shape (the vocab padding of another TP size, for example)."""
        import torch

        hi = [min(o + s, g) for o, s, g in zip(offsets, sizes, global_shape)]
        clipped = [max(0, h - o) for o, h in zip(offsets, hi)]
        tmp = torch.empty(clipped, dtype=ckpt_dtype, device=data.device)
        if all(clipped):
            self._request(sh.key, offsets, clipped, tmp)
        index = tuple(slice(0, c) for c in clipped[sh.prepend_axis_num :])

        def finish():
            data.zero_()
            if all(clipped):
                data[index] = tmp.view(clipped[sh.prepend_axis_num :])
            return data

        self.finish[id(sh)] = finish

    def _add_flattened(self, sh, data, global_shape, ckpt_dtype) -> None:
        """``flattened_range``: ``data`` (1-D) is ``region.flatten()[start:stop]`` of the local box.

        megatron-core <= 0.13 saved such tensors reformulated as ``axis_fragmentations +
        [prod(local_shape)]`` (strategies/torch.py ``nd_flattened_tensor_reformulated_global_shape``):
        the range is then read directly. From an unflattened save the rows of the box that hold the
        range are read into a temporary and sliced.
        """
        import torch

        start, stop = sh.flattened_range.start, sh.flattened_range.stop
        local = [1] * sh.prepend_axis_num + list(sh.local_shape)
        reformulated = list(sh.axis_fragmentations) + [math.prod(local)]
        if global_shape == reformulated:
            chunk = [o // s for o, s in zip(sh.global_offset, local)]
            offsets, sizes = chunk + [start], [1] * len(chunk) + [stop - start]
            full = False
        elif global_shape == list(sh.global_shape):
            # Leading dimension rows touched by [start, stop) of the C-order box: the minimal box.
            row = math.prod(local[1:])
            first, last = start // row, (stop - 1) // row + 1
            offsets = list(sh.global_offset)
            offsets[0] += first
            sizes = [last - first] + local[1:]
            start, stop = start - first * row, stop - first * row
            full = True
        else:
            raise ValidationError(
                f"{sh.key}: global shape {list(sh.global_shape)} (flattened {reformulated}) requested, the "
                f"checkpoint holds {global_shape}"
            )
        tmp = torch.empty(sizes, dtype=ckpt_dtype, device=data.device)
        self._request(sh.key, offsets, sizes, tmp)

        def finish():
            data.copy_(tmp.view(-1)[start:stop] if full else tmp.view(-1))
            return data

        self.finish[id(sh)] = finish

    def run(self, *, timeout_s, staging_budget_bytes, check_crc) -> None:
        """Reads every request with ``Checkpoint.load_into``, which validates them all (regions,
        coverage) before the first read. One call per destination device: a CUDA device's copies are
        ordered before its current stream, so the tensors are usable on return."""
        import torch

        by_device: dict[int, list] = {}
        for key, offsets, sizes, out in self.requests:
            device = out.device.index if out.device.type == "cuda" else -1
            by_device.setdefault(device, []).append(
                (key, offsets, sizes, out.data_ptr(), out.numel() * out.element_size(), device)
            )
        for device, requests in by_device.items():
            stream = torch.cuda.current_stream(device).cuda_stream if device >= 0 else 0
            self.ckpt.load_into(
                requests,
                staging_budget_bytes=staging_budget_bytes,
                cuda_stream=stream,
                check_crc=check_crc,
                timeout_s=timeout_s,
            )

    def result(self, sh):
        return self.finish[id(sh)]()
