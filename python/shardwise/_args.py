"""Argument checks of the Python side, by the rule of the Rust side (crates/shardwise-py/src/args.rs,
whose :func:`_native.check_whole` and :func:`_native.check_seconds` these call): a value of the
wrong type is an ``InvalidArgumentTypeError`` (a ``TypeError``), one out of range an
``InvalidArgumentError`` (a ``ValueError``), each naming the argument. ``bool`` is not an ``int``
here: ``True`` is never a meant rank or count."""

from __future__ import annotations

from typing import Any, Optional

from . import _native
from ._native import InvalidArgumentTypeError


def _kind(value: Any) -> str:
    return f"{value!r} of type {type(value).__name__}"


def whole(name: str, value: Any, min: int = 0, max: Optional[int] = None) -> int:
    """``value`` as an ``int`` in ``min..=max`` (an ``int`` or numpy integer, not a ``bool``)."""
    return _native.check_whole(name, value, min, max)


def opt_whole(name: str, value: Any, min: int = 0, max: Optional[int] = None) -> Optional[int]:
    """:func:`whole`, None staying None."""
    return None if value is None else whole(name, value, min, max)


def flag(name: str, value: Any) -> bool:
    """``value``, a ``bool`` (``1`` or ``"yes"`` are refused: they are not meant flags)."""
    if not isinstance(value, bool):
        raise InvalidArgumentTypeError(f"{name} must be True or False, got {_kind(value)}")
    return value


def number(name: str, value: Any) -> float:
    """``value`` as a ``float``: an ``int`` or a ``float``, not a ``bool`` or a ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentTypeError(f"{name} must be a number (an int or a float), got {_kind(value)}")
    return float(value)


def items(name: str, value: Any) -> list:
    """``value``, an iterable, as a list; a ``str`` or ``bytes`` is refused, not split into its
    characters."""
    if isinstance(value, (str, bytes)):
        raise InvalidArgumentTypeError(f"{name} must be a list, not one string: {name}=[{value!r}] for one, "
                                       f"got {_kind(value)}")
    try:
        return list(value)
    except TypeError:
        raise InvalidArgumentTypeError(f"{name} must be a list, got {_kind(value)}") from None


def names(name: str, value: Any) -> list[str]:
    """``value``, an iterable of ``str`` (None: none), as a list (:func:`items`)."""
    if value is None:
        return []
    found = items(name, value)
    for item in found:
        if not isinstance(item, str):
            raise InvalidArgumentTypeError(f"{name} must be a list of strings, got an element {_kind(item)}")
    return found
