"""The exception classes of shardwise's Megatron API: the one place that decides what is raised.

**Direct API** (:func:`shardwise.megatron.save`, ``load``, ``load_common_state_dict``,
``save_checkpoint``): every error is shardwise's own class (``shardwise.StorageError``,
``MissingKeyError``...), as an instance of a subclass that also derives from megatron-core's
``CheckpointingException`` (``megatron/core/dist_checkpointing/core.py``). Both
``except shardwise.StorageError`` and ``except CheckpointingException`` catch it. The subclasses
are this module's attributes, named as their shardwise class (``megatron_errors.StorageError``),
created on first use, so that importing shardwise never imports megatron-core.

**Drop-in** (:func:`shardwise.megatron.install`): every error is an instance of the class Megatron
raises in the same situation, with Megatron's wording where its tests or users match on it. Measured
with megatron-core 0.16.1 and 0.19.2 on torch 2.15 (``docs/compatibility.md``):

=============================================  ==============================================
Situation                                      Megatron raises / the drop-in raises
=============================================  ==============================================
directory missing; no ``metadata.json``        ``CheckpointingException`` "Checkpoint directory
                                               ... does not exist" / "... is not a distributed
                                               checkpoint": Megatron's own check runs first
integrity manifest mismatch (0.19)             ``CheckpointingException``: Megatron's own check
strict ``raise_*`` mismatch                    ``CheckpointingException`` with Megatron's message
                                               (:class:`KeyMismatchError`, built by Megatron's
                                               ``maybe_report_missing_and_unexpected_keys``)
load: a key, chunk, file or ``.metadata``      torch's ``CheckpointException`` (torch DCP wraps
missing or wrong (MissingKeyError,             every failure of its read per rank): raised with
ValidationError, CorruptFileError,             ``failures={rank: (error, frames)}``, the
StorageError)                                  shardwise error (a ``CheckpointingException`` too)
                                               as its failure and ``__cause__``
save: a rank's write or the commit failed      torch's ``CheckpointException`` likewise (DCP's
(StorageError, NotCommittedError,              write is where Megatron fails)
CorruptFileError)
anything else (InvalidArgumentError,           the direct API's class: a ``CheckpointingException``
ValidationError on save, MissingRanksError,
CheckpointExistsError, ...)
unsafe pickle in an object or the common       ``UnsafeObjectError``: a ``pickle.UnpicklingError``
state                                          as torch.load's, and a ``CheckpointingException``
=============================================  ==============================================

megatron-core 0.13-0.15 read ``.metadata`` themselves before DCP does: a missing or unreadable one
raises the raw ``FileNotFoundError`` / ``pickle.UnpicklingError`` there; the drop-in raises what
0.16-0.19 raise (torch's ``CheckpointException``) with every release.

torch's ``CheckpointException`` derives from ``BaseException`` only, as Megatron's does: code that
treats ``except CheckpointingException`` (or ``except Exception``) as "no checkpoint here, start
fresh" does not swallow a damaged checkpoint through the drop-in either.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import traceback
from typing import Any, Callable, TypeVar, cast

from . import _native
from ._native import MissingKeyError, ShardwiseError

# Errors that Megatron raises as torch's CheckpointException (DCP wraps its read and write failures
# per rank), by operation; every other error keeps the direct API's class.
_TORCH_WRAPPED = {
    "load": ("MissingKeyError", "ValidationError", "CorruptFileError", "StorageError"),
    "save": ("StorageError", "NotCommittedError", "CorruptFileError"),
}
# Raised by Megatron's own functions as its CheckpointingException, although a subclass of a name above.
_MEGATRON_OWN = ("KeyMismatchError",)

_COMPAT: dict[type, type] = {}

_F = TypeVar("_F", bound=Callable[..., Any])


class UnsafeObjectError(ShardwiseError, pickle.UnpicklingError):
    """A ``ShardedObject`` or the common state needs a class outside the ``weights_only`` allow-list
    (torch's own plus megatron-core's ``safe_globals.SAFE_GLOBALS``). Pass the classes you trust in
    ``safe_globals=[...]``."""


class KeyMismatchError(MissingKeyError):
    """``strict="raise_unexpected"``/``"raise_all"``: requested keys the checkpoint lacks
    ("unexpected"), or with ``raise_all`` checkpoint keys that no rank requests ("missing"). The
    message is Megatron's (``validation.py`` ``maybe_report_missing_and_unexpected_keys``)."""


def _known() -> dict[str, type]:
    """shardwise's error classes by name: the extension's and the Python ones."""
    named = {n: getattr(_native, n) for n in dir(_native) if n.endswith("Error")}
    named.update(UnsafeObjectError=UnsafeObjectError, KeyMismatchError=KeyMismatchError)
    return {n: c for n, c in named.items() if isinstance(c, type) and issubclass(c, _native.ShardwiseError)}


def compatible_class(cls: type) -> type:
    """The subclass of shardwise error class ``cls`` that also derives from megatron-core's
    ``CheckpointingException`` (``cls`` itself when it already does)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if issubclass(cls, CheckpointingException):
        return cls
    compat = _COMPAT.get(cls)
    if compat is None:
        compat = type(
            cls.__name__,
            (cls, CheckpointingException),
            {
                "__module__": __name__,
                "__qualname__": cls.__name__,
                "__doc__": f"{cls.__name__} raised through shardwise's Megatron API: also a megatron-core "
                "CheckpointingException.",
            },
        )
        _COMPAT[cls] = compat
    return compat


def __getattr__(name: str) -> type:
    # megatron_errors.StorageError etc., created on first use (pickle finds them by name too). Only
    # error names are looked up: the import system asks for others (__path__) while load.py loads.
    cls = _known().get(name) if name.endswith("Error") else None
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return compatible_class(cls)


def compatible(err: BaseException) -> BaseException:
    """``err`` (a shardwise error) as an instance of :func:`compatible_class` of its class, with the
    same message, attributes and traceback; anything else unchanged."""
    if not isinstance(err, _native.ShardwiseError):
        return err
    try:
        cls = compatible_class(type(err))
    except ImportError:  # no megatron-core: the error stays as it is
        return err
    if type(err) is cls:
        return err
    new = cls.__new__(cls, *err.args)
    new.args = err.args
    new.__dict__.update(getattr(err, "__dict__", {}))
    new.__cause__, new.__suppress_context__ = err.__cause__, True
    return new.with_traceback(err.__traceback__)


def megatron_compatible(function: _F) -> _F:
    """Decorator for the direct API: shardwise errors leave ``function`` as :func:`compatible` ones.
    Typed as returning ``function`` itself, so that its signature (and its overloads) stay visible
    to type checkers."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except _native.ShardwiseError as e:
            new = compatible(e)
            if new is e:
                raise
            raise new from e.__cause__

    return cast(_F, wrapper)


def as_megatron(err: BaseException, operation: str) -> BaseException:
    """What Megatron raises where shardwise raised ``err`` during ``operation`` (``"load"`` or
    ``"save"``) of the drop-in (see the module's table); ``err`` itself when it is no shardwise
    error."""
    if not isinstance(err, _native.ShardwiseError):
        return err
    new = compatible(err)
    names = {c.__name__ for c in type(err).__mro__}
    if names.isdisjoint(_TORCH_WRAPPED[operation]) or not names.isdisjoint(_MEGATRON_OWN):
        return new
    import torch.distributed as dist
    from torch.distributed.checkpoint import CheckpointException

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    wrapped = CheckpointException(str(err), {rank: (new, traceback.extract_tb(err.__traceback__))})
    wrapped.__cause__ = new
    return wrapped


@contextlib.contextmanager
def raised_as_megatron(operation: str):
    """Context of a drop-in ``operation``: a shardwise error leaves it as :func:`as_megatron`'s."""
    try:
        yield
    except _native.ShardwiseError as e:
        new = as_megatron(e, operation)
        if new is e:
            raise
        raise new from new.__cause__
