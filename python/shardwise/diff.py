"""Comparing two checkpoints key by key (``shardwise diff``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Optional

from . import _args, _native

if TYPE_CHECKING:
    from ._native import DiffReport


def diff(a, b, *, atol: float = 0.0, rtol: float = 0.0, keys: Optional[Iterable[str]] = None,
         exclude: Optional[Iterable[str]] = None, hf_config=None, arch: Optional[str] = None,
         allow_unmapped: bool = False, workers: Optional[int] = None) -> DiffReport:
    """Compares checkpoints ``a`` and ``b`` key by key, as ``shardwise diff`` does.

    Each side is a checkpoint directory or object-store URL (torch_dist / DCP, any layout: tensors
    are compared as global tensors, region by region, in bounded memory), or, for at most one side,
    a Hugging Face safetensors folder, compared through the ``to-hf`` mapping (``hf_config``
    defaults to the folder's ``config.json``). ``keys`` / ``exclude`` are glob patterns (``*``,
    ``?``). An element is within tolerance when ``|a - b| <= atol + rtol * max(|a|, |b|)``.

    Returns the report (a ``DiffReport``): ``{"a", "b", "mode", "atol", "rtol"``, the counts
    ``"equal", "close", "different", "only_in_a", "only_in_b", "unreadable", "skipped_keys"``,
    ``"exit_code", "keys": [{"key", "status", "kind", "dtype_a", "dtype_b", "shape_a", "shape_b",
    "elements", "mismatched", "max_abs", "max_rel", "message"}]}``, ``status`` being ``equal``,
    ``close``, ``different``, ``only_in_a``, ``only_in_b`` or ``unreadable`` and ``exit_code`` what
    the command would return (0 same, 1 different, 2 unreadable).

    Raises ``StorageError`` / ``CorruptFileError`` when a side cannot be opened,
    ``InvalidArgumentTypeError`` (a ``TypeError``) for an argument of the wrong type (a tolerance
    that is not a number, ``keys`` given as one string instead of a list, a ``bool`` for
    ``workers``), ``InvalidArgumentError`` (a ``ValueError``) for one out of range, the ``to-hf``
    mapping's ``ValidationError`` in HF mode.
    """
    return _native.diff(
        os.fsdecode(a), os.fsdecode(b),
        atol=_args.number("atol", atol), rtol=_args.number("rtol", rtol),
        keys=_args.names("keys", keys), exclude=_args.names("exclude", exclude),
        hf_config=None if hf_config is None else os.fspath(hf_config), arch=arch,
        allow_unmapped=allow_unmapped, workers=workers)
