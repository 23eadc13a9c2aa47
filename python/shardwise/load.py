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

from . import _args, _native, requested_keys
from ._fs import is_url
from ._native import InvalidArgumentError, ValidationError
from .megatron_errors import KeyMismatchError, UnsafeObjectError, megatron_compatible

logger = logging.getLogger(__name__)


# Strict modes whose "missing keys" are the checkpoint keys no rank asked for: only every rank's
# request can tell (megatron-core validation.py `_determine_missing_and_unexpected_keys`), which
# requested_keys gathers through files. ignore_all needs none: it reports nothing.
_GLOBAL_STRICT = ("log_all", "raise_all", "return_all")
# Megatron 0.19's own common state object; its load leaves it out of the strict key checks.
_COMMON_STATE_KEY = "common_state"
_DEFAULT_KEYS_TIMEOUT_S = 600.0

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
    except FileNotFoundError:
        if not os.path.isdir(checkpoint_dir):
            raise _native.StorageError(f"checkpoint directory {checkpoint_dir} does not exist") from None
        return
    except NotADirectoryError:
        # Before the OSError below: a file given as the directory is not a corrupt checkpoint.
        raise _native.StorageError(f"{checkpoint_dir} is a file, not a checkpoint directory") from None
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


@megatron_compatible
def load_common_state_dict(checkpoint_dir, *, safe_globals: Iterable = ()) -> dict:
    """The common (non-sharded) state of a checkpoint: ``common.pt`` (megatron-core <= 0.18 and
    shardwise saves), else 0.19's ``common_state`` object; ``{}`` for a plain DCP checkpoint that
    has neither. Unpickled with ``weights_only=True`` (:class:`UnsafeObjectError` otherwise).
    Routed as ``megatron.core.dist_checkpointing.load_common_state_dict`` by ``install()``.
    ``safe_globals`` given as one string raises ``InvalidArgumentTypeError`` (a ``TypeError``)."""
    checkpoint_dir = os.fsdecode(checkpoint_dir)
    safe_globals = _args.items("safe_globals", safe_globals)
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


@megatron_compatible
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
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    process_group=None,
    hybrid_layer_pattern: Optional[str] = None,
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

    No ``torch.distributed`` collective is called: it needs no process group and may run in any
    thread. Only the ``torch_dist`` format is read (a plain DCP checkpoint too).

    Args:
        sharded_state_dict: Megatron sharded state dict (nested dicts/lists of ``ShardedTensor``,
            ``ShardedObject``, ``ShardedTensorFactory``, ``LocalNonpersistentObject``, other values).
        checkpoint_dir: the checkpoint directory (``str``/``bytes``/``PathLike``) or an
            object-store URL.
        strict: a megatron ``StrictHandling`` or its string, with Megatron's meaning. With
            ``assume_ok_unexpected`` (default) a requested key that the checkpoint lacks raises
            ``MissingKeyError``. Every other mode drops such "unexpected" keys from the request;
            ``*_all`` modes also find the "missing" keys, the checkpoint keys that *no rank*
            requests: every rank publishes its requested keys in files beside the checkpoint and
            reads the others' (:mod:`shardwise.requested_keys`; all ranks must make the load, each
            with its ``rank``). Then ``raise_*`` raises :class:`KeyMismatchError`, ``log_*`` logs
            (both with Megatron's own report, ``maybe_report_missing_and_unexpected_keys``),
            ``return_*`` returns ``(state_dict, missing_keys, unexpected_keys)`` (``missing_keys``
            empty for ``return_unexpected``) and ``ignore_all`` ignores them.
        validate_access_integrity: accepted for Megatron's signature. Megatron's check (every shard
            read by exactly one main replica across ranks) needs an all_gather; instead each rank
            checks that every region it asks for is fully covered by saved chunks (always on).
        timeout_s: bound in seconds on each object-store request (None: the store's own retry
            timeout), and on the wait for the other ranks' requested keys (``*_all`` modes;
            default 600 s); a finite number in ``0..1e9``.
        staging_budget_bytes: host memory for reads in flight, in bytes, a whole number >= 1
            (default 2 GiB, thirty-two 64 MiB buffers; a read holds one buffer, so it also bounds
            the reads in flight). Into CUDA tensors the buffers are pinned, kept by the process and
            reused by later loads and saves; into CPU tensors they are plain memory, taken only as
            reads need them and freed when the load returns.
        check_crc: check the CRC-32 recorded at save time of every item read (shardwise saves).
        safe_globals: extra classes that the ``ShardedObject`` values or the common state may
            contain (explicit opt-in; everything else outside the allow-list is refused).
        rank, world_size, process_group: who loads together, for the ``*_all`` modes only: this
            rank among them and their number. Default: this rank in ``process_group`` (the
            ``torch.distributed`` default group when None; read locally, nothing is exchanged), else
            ``RANK``/``WORLD_SIZE``.
        hybrid_layer_pattern: the pattern the requesting HybridModel was built with
            (``model.hybrid_layer_pattern``, e.g. ``"*-*-"``). When the checkpoint was saved by a
            GPTModel, the request is first retargeted at the GPT keys by megatron-core's own
            ``gpt_checkpoint_interop`` (0.19+), as Megatron-LM's ``load_checkpoint`` does: the i-th
            attention ('*') and the i-th MLP ('-' or 'E') layer read GPT layer i, ``decoder.final_norm``
            reads ``decoder.final_layernorm``, Mamba ('M') layers keep their values. A checkpoint whose
            stored args have a hybrid pattern (or, without args, which holds ``decoder.final_norm``)
            is read as is. Without it, a HybridModel request against a GPT checkpoint is refused.

    Every error below is also a megatron-core ``CheckpointingException``
    (:mod:`shardwise.megatron_errors`).

    Raises:
        MissingKeyError: a requested key (tensor, or an object's unique key) is not in the
            checkpoint; raised before any read.
        ValidationError: a global shape or dtype kind that differs from the checkpoint's, a
            tensor requested where the checkpoint holds an object (or the reverse), a region not
            covered by saved chunks.
        CorruptFileError: a missing or truncated data file, a CRC-32 mismatch (names key, file,
            offset).
        UnsafeObjectError: an object or the common state needs a class not allowed.
        KeyMismatchError: ``raise_unexpected``/``raise_all`` found keys that do not match.
        MissingRanksError: (``*_all``) ranks had not published their requested keys in time.
        InvalidArgumentTypeError: (a ``TypeError``) ``rank``, ``world_size``,
            ``staging_budget_bytes`` that is not an ``int`` (a ``bool`` among them), ``timeout_s``
            that is not a number, ``check_crc`` or ``validate_access_integrity`` that is not a
            ``bool``; checked before anything is read, whatever ``strict`` is.
        InvalidArgumentError: (a ``ValueError``) a ``metadata.json`` naming another backend;
            ``*_all`` with an object-store URL, or without a rank and world size; a ``rank``,
            ``world_size``, ``timeout_s`` or ``staging_budget_bytes`` out of range; a HybridModel request against a GPT checkpoint
            without ``hybrid_layer_pattern``, or with a pattern Megatron's interop cannot pair with
            GPT layers (or a megatron-core without it).
        ValidationError: also a GPT checkpoint whose stored ``num_layers`` differs from the
            pattern's attention layers.
        StorageError: the directory or ``.metadata`` cannot be read; (``*_all``) the requested keys
            cannot be published beside the checkpoint (set ``SHARDWISE_KEYS_DIR``).
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base
    from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag

    checkpoint_dir = os.fsdecode(checkpoint_dir)
    # Checked before any read, also when the strict mode does not use them.
    if timeout_s is not None:
        _native.check_seconds("timeout_s", timeout_s)
    _args.opt_whole("rank", rank)
    _args.opt_whole("world_size", world_size, 1)
    _args.flag("check_crc", check_crc)
    _args.flag("validate_access_integrity", validate_access_integrity)
    safe_globals = _args.items("safe_globals", safe_globals)
    strict = parse_strict_flag(strict)
    _check_backend(checkpoint_dir, timeout_s)

    # The hybrid retarget needs the stored args and renames the request's keys: it runs on the raw
    # request, before preprocessing and before the *_all modes share the (GPT) key names.
    ckpt = open_cached(checkpoint_dir, timeout_s)
    _dequantize_fp8(sharded_state_dict)
    common = _read_common(ckpt, safe_globals)
    _retarget_hybrid_request(sharded_state_dict, ckpt, checkpoint_dir, common.get("args"), hybrid_layer_pattern)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    everyone = None
    if strict.value in _GLOBAL_STRICT:
        everyone = _everyones_keys(
            sharded_state_dict, checkpoint_dir, strict.value, rank, world_size, process_group, timeout_s
        )
    merge(common, nonpersistent)

    missing: set = set()
    unexpected: set = set()
    if strict != StrictHandling.ASSUME_OK_UNEXPECTED:
        sharded_state_dict, missing, unexpected = _strict_keys(sharded_state_dict, ckpt, strict, everyone)

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
    if strict in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL):
        return common, missing, unexpected
    return common


def _is_gpt_checkpoint(ckpt, args) -> Optional[bool]:
    """Whether a GPTModel saved the checkpoint: Megatron-LM's test (``_maybe_setup_gpt_to_hybrid_load``:
    no ``hybrid_layer_pattern`` / ``hybrid_override_pattern`` in the stored args); without args, by its
    final norm (``decoder.final_layernorm`` GPT, ``decoder.final_norm`` hybrid). None: cannot tell."""
    if args is not None:
        return not (getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None))
    if "decoder.final_norm.weight" in ckpt:
        return False
    if "decoder.final_layernorm.weight" in ckpt:
        return True
    return None


def _retarget_hybrid_request(sharded_state_dict, ckpt, checkpoint_dir: str, args, pattern: Optional[str]) -> None:
    """Points a HybridModel's request at a GPT checkpoint's keys, in place, with megatron-core's own
    translation (see ``load``'s ``hybrid_layer_pattern``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    gpt = _is_gpt_checkpoint(ckpt, args)
    if pattern is None:
        hybrid_keys = [sh.key for sh in nested_values(sharded_state_dict)
                       if getattr(sh, "key", "").startswith("decoder.final_norm.")]
        if gpt and hybrid_keys and hybrid_keys[0] not in ckpt:
            raise InvalidArgumentError(
                f"{checkpoint_dir} was saved by a GPTModel and the request is a HybridModel's "
                f"({hybrid_keys[0]}): pass hybrid_layer_pattern=model.hybrid_layer_pattern to load it through "
                "megatron-core's GPT -> hybrid translation"
            )
        return
    if gpt is None:
        raise InvalidArgumentError(
            f"{checkpoint_dir}: no stored args and neither decoder.final_layernorm.weight (GPTModel) nor "
            "decoder.final_norm.weight (HybridModel): cannot tell whether hybrid_layer_pattern applies"
        )
    if not gpt:
        return
    try:
        from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
            gpt_compatible_layer_maps,
            retarget_sharded_state_dict_to_gpt_checkpoint,
        )
    except ImportError:
        raise InvalidArgumentError(
            "loading a GPT checkpoint into a HybridModel needs megatron-core 0.19 or later "
            "(megatron.core.dist_checkpointing.gpt_checkpoint_interop)"
        ) from None
    try:
        maps = gpt_compatible_layer_maps(pattern)
    except ValueError as e:
        raise InvalidArgumentError(f"cannot load the GPT checkpoint {checkpoint_dir} into this hybrid model: {e}") from None
    layers = getattr(args, "num_layers", None)
    if layers is not None and layers != maps.num_gpt_layers:
        raise ValidationError(
            f"hybrid layer pattern {pattern!r} pairs with a GPT checkpoint of {maps.num_gpt_layers} layers; "
            f"{checkpoint_dir} has num_layers={layers}"
        )
    retarget_sharded_state_dict_to_gpt_checkpoint(sharded_state_dict, maps)


def _dequantize_fp8(sharded_state_dict) -> None:
    """Megatron's first step: TE FP8 tensors become high-precision ones (local; absent before 0.14)."""
    try:
        from megatron.core.dist_checkpointing.utils import force_all_tensors_to_non_fp8
    except ImportError:
        return
    force_all_tensors_to_non_fp8(sharded_state_dict)


def _everyones_keys(sharded_state_dict, checkpoint_dir, mode, rank, world_size, process_group, timeout_s) -> set:
    """The keys that the ranks loading together request (:func:`requested_keys.gather`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from .save import _rank_and_world

    what = f"strict={mode!r}"
    if is_url(checkpoint_dir) and not os.environ.get(requested_keys.ENV_DIR):
        raise InvalidArgumentError(
            f"{what}: the ranks publish their requested keys beside the checkpoint, which needs a filesystem "
            f"path; {checkpoint_dir} is an object store (set {requested_keys.ENV_DIR} to a shared directory)"
        )
    group = ""
    if process_group is not None and (rank is None or world_size is None):
        import torch.distributed as dist

        # Local reads of the group's layout, no collective.
        rank = dist.get_rank(process_group) if rank is None else rank
        world_size = dist.get_world_size(process_group) if world_size is None else world_size
        group = ",".join(map(str, dist.get_process_group_ranks(process_group)))
    rank, world_size = _rank_and_world(rank, world_size)
    return requested_keys.gather(
        checkpoint_dir,
        (sh.key for sh in nested_values(sharded_state_dict)),
        rank=rank,
        world_size=world_size,
        timeout_s=_DEFAULT_KEYS_TIMEOUT_S if timeout_s is None else timeout_s,
        group=group,
        what=what,
    )


def _saved_keys(ckpt) -> set:
    """The checkpoint's keys as Megatron's strict checks name them (``load_sharded_metadata``): tensor
    fqns and ``ShardedObject`` keys (a byte object's key before ``/shard_...``), without 0.19's
    ``common_state``."""
    saved = set()
    for k in ckpt.keys():
        if ckpt.describe(k)[0] == "object":
            base, sep, shard = k.rpartition("/")
            k = base if sep and shard.startswith("shard_") else k
        saved.add(k)
    saved.discard(_COMMON_STATE_KEY)
    return saved


def _strict_keys(sharded_state_dict, ckpt, strict, everyone):
    """Megatron's ``validate_integrity_and_strict_load`` without its collective: (the request without
    the keys the checkpoint lacks, missing keys, unexpected keys), reported as ``strict`` says.
    ``everyone``: every rank's requested keys (``*_all`` modes), else None."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
    from megatron.core.dist_checkpointing.validation import StrictHandling, maybe_report_missing_and_unexpected_keys

    saved = _saved_keys(ckpt)
    unexpected = {sh.key for sh in nested_values(sharded_state_dict) if sh.key not in saved}
    missing = saved - everyone if everyone is not None else set()
    if unexpected:
        _, sharded_state_dict = extract_matching_values(sharded_state_dict, lambda sh: sh.key in unexpected)
    if strict == StrictHandling.IGNORE_ALL:
        return sharded_state_dict, set(), set()
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        try:
            maybe_report_missing_and_unexpected_keys(missing, unexpected, True)
        except CheckpointingException as e:
            raise KeyMismatchError(str(e)) from None
    elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        maybe_report_missing_and_unexpected_keys(missing, unexpected, False)
    return sharded_state_dict, missing, unexpected


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

        by_device: dict[Optional[int], list] = {}
        for key, offsets, sizes, out in self.requests:
            device = out.device.index if out.device.type == "cuda" else None
            by_device.setdefault(device, []).append(
                _native.Region(
                    key=key,
                    offsets=offsets,
                    sizes=sizes,
                    data_ptr=out.data_ptr(),
                    nbytes=out.numel() * out.element_size(),
                    device=device,
                )
            )
        for device, regions in by_device.items():
            stream = 0 if device is None else torch.cuda.current_stream(device).cuda_stream
            self.ckpt.load_into(
                regions,
                staging_budget_bytes=staging_budget_bytes,
                cuda_stream=stream,
                check_crc=check_crc,
                timeout_s=timeout_s,
            )

    def result(self, sh):
        return self.finish[id(sh)]()
