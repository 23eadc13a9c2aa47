"""The drop-in: ``megatron.core.dist_checkpointing.save``/``load``/``load_common_state_dict`` routed
to shardwise (:func:`install`), with the installed megatron-core's own signatures
(:func:`bind_release_args`)."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any, Callable, Iterator, Optional

from . import _args
from ._fs import is_url
from ._native import InvalidArgumentError
from .load import load, load_common_state_dict
from .megatron_errors import raised_as_megatron
from .save import save


def _async_save_done() -> None:
    """The worker part of a drop-in async save: nothing (shardwise's own thread does the work).

    A module-level function rather than ``None``: Megatron's persistent checkpoint worker waits for a
    completion message that only a real ``async_fn`` run in the worker produces once that worker
    exists (``async_utils.PersistentAsyncCaller``), so ``None`` could block it forever.
    """


# Megatron's save parameters that steer only Megatron's own machinery: accepted, ignored (see
# dist_checkpointing_save). Every other parameter of the installed release must be handled below.
_IGNORED_MEGATRON_PARAMS = frozenset(
    {"validate_access_integrity", "preprocess_common_before_consistancy_check", "async_strategy"}
)
_HANDLED_MEGATRON_PARAMS = _IGNORED_MEGATRON_PARAMS | {
    "sharded_strategy",
    "common_strategy",
    "async_sharded_save",
    "content_metadata",
    "verify_integrity",
}


def _original_megatron_save():
    """The installed megatron-core's own ``save`` (the one :func:`install` replaced, if it did)."""
    import megatron.core.dist_checkpointing.serialization as mser

    return _original_megatron(mser, "save")


def _original_megatron(mod, name: str):
    """``mod.name`` as the installed megatron-core defines it (the one :func:`install` replaced)."""
    return next((orig for m, n, orig in _INSTALLED if m is mod and n == name), getattr(mod, name))


def megatron_save_parameters() -> list:
    """The parameters of the installed megatron-core's ``dist_checkpointing.save`` after
    ``sharded_state_dict`` and ``checkpoint_dir``, in order (``inspect.Parameter`` objects).

    Read from the signature of the installed release's function, not from a version table:
    0.13-0.18 take ``sharded_strategy, common_strategy, validate_access_integrity,
    async_sharded_save, preprocess_common_before_consistancy_check, content_metadata``; 0.19 dropped
    ``common_strategy`` and appended ``async_strategy, verify_integrity`` (megatron-core 0.19.2
    ``dist_checkpointing/serialization.py``), so the 4th positional argument changed meaning.
    """
    import inspect

    return list(inspect.signature(_original_megatron_save()).parameters.values())[2:]


def bind_release_args(function: str, params, args: tuple, kwargs: dict, handled) -> dict:
    """Binds ``args`` and the keywords of ``kwargs`` naming ``params`` (the installed release's
    parameters of ``megatron.core.dist_checkpointing.<function>`` after the first two) as that
    function would; the bound keywords are popped from ``kwargs``, the rest stay for shardwise.

    Raises ``TypeError`` as Megatron's own function would (too many positional arguments, one given
    both ways), and ``InvalidArgumentError`` for a parameter outside ``handled`` given with a value
    other than its default (a newer megatron-core's)."""
    name = f"megatron.core.dist_checkpointing.{function}"
    if len(args) > len(params):
        raise TypeError(f"{name} takes at most {len(params) + 2} positional arguments ({len(args) + 2} given)")
    bound = {p.name: a for p, a in zip(params, args)}
    for p in params:
        if p.name in kwargs:
            if p.name in bound:
                raise TypeError(f"{name} got multiple values for argument {p.name!r}")
            bound[p.name] = kwargs.pop(p.name)
    for p in params:
        value = bound.get(p.name, p.default)
        if p.name not in handled and not (value is p.default or value == p.default):
            raise InvalidArgumentError(
                f"{name} parameter {p.name!r} is not supported by shardwise (a megatron-core newer than 0.19?)"
            )
    return bound


def dist_checkpointing_save(sharded_state_dict: dict, checkpoint_dir: str, *args, **kwargs):
    """``megatron.core.dist_checkpointing.save`` done by shardwise, with the installed megatron-core's
    own signature (0.13-0.19): positional arguments are bound to that release's parameters in its
    order (:func:`megatron_save_parameters`), so 0.19's ``save(sd, dir, strategy,
    validate_access_integrity)`` and 0.18's ``save(sd, dir, strategy, common_strategy)`` both mean
    what they mean to Megatron.

    Writes what Megatron's ``torch_dist`` save writes (the pre-0.19 layout with ``common.pt``, which
    0.19's loader also reads) through :func:`save`, with no collective. Keyword arguments beyond
    Megatron's go to :func:`save` (``timeout_s``, ``overwrite``, ``balance_dp``, ...).

    Megatron's parameters:
        sharded_strategy: any ``torch_dist`` strategy (the fully-parallel wrapper included, whose
            distribution needs an ``all_gather``; shardwise needs none); another backend raises.
        common_strategy (<= 0.18): must be None (Megatron raises NotImplementedError otherwise).
        async_sharded_save: return an ``AsyncRequest`` (see Returns).
        content_metadata: stored in ``common.pt`` as Megatron does.
        verify_integrity (0.19): also write megatron-core 0.19's integrity manifest
            (``integrity.json``: the SHA-256 of every file of the checkpoint), which
            ``load(..., verify_integrity=True)`` checks. The digests are computed from the bytes as
            they are written, with no second read of the files (Megatron's rank 0 reads the whole
            checkpoint back for it); the manifest is written by the commit, before the save counts
            as committed.
        async_strategy (0.19): accepted, any value, and ignored. In Megatron it picks which
            machinery runs the write in the background (``"nvrx"``'s persistent worker, or
            megatron-core's own); shardwise writes from its own Rust thread whatever the value, and
            the returned request's ``async_fn`` does nothing in whichever worker runs it.
        validate_access_integrity, preprocess_common_before_consistancy_check: ignored. The merge
            validates coverage and overlaps of every chunk anyway, and the preprocessing only feeds
            Megatron's cross-rank comparison of the common dict (a ``broadcast_object_list``).

    Returns:
        None; with ``async_sharded_save=True`` a
        ``megatron.core.dist_checkpointing.strategies.async_utils.AsyncRequest`` for Megatron's async
        queue. The call returns once this rank's tensors are staged in host memory (see
        ``save(async_save=True)``); writing and the rendezvous go on in a Rust thread. The request's
        ``async_fn`` is a no-op in Megatron's worker, and its first finalize function waits for the
        save to be committed (re-raising its error), before any finalize function the caller appends.

    Raises:
        TypeError: more positional arguments than the installed release takes, or an argument given
            both by position and by name (as Megatron's own function would).
        InvalidArgumentError: ``common_strategy`` given, a ``sharded_strategy`` whose backend is not
            ``torch_dist``, or a parameter of a newer megatron-core that shardwise does not know,
            given with a value other than its default.
        Everything :func:`save` raises, as the class Megatron raises in that situation
        (:mod:`shardwise.megatron_errors`): a failed write or commit as torch's
        ``CheckpointException``, every other error as a ``CheckpointingException``.
    """
    with raised_as_megatron("save"):
        return _dist_checkpointing_save(sharded_state_dict, checkpoint_dir, args, kwargs)


def _dist_checkpointing_save(sharded_state_dict, checkpoint_dir, args, kwargs):
    megatron_args = bind_release_args("save", megatron_save_parameters(), args, kwargs, _HANDLED_MEGATRON_PARAMS)
    sharded_strategy = megatron_args.get("sharded_strategy")
    if megatron_args.get("common_strategy") is not None:
        raise InvalidArgumentError("common_strategy is not supported (megatron-core supports only the default torch one)")
    backend = sharded_strategy[0] if isinstance(sharded_strategy, tuple) else getattr(sharded_strategy, "backend", None)
    if sharded_strategy is not None and backend != "torch_dist":
        raise InvalidArgumentError(f"shardwise writes the torch_dist format; sharded_strategy has backend {backend!r}")
    hint = getattr(sharded_strategy, "separation_hint", None)
    if hint is not None:
        # Megatron writes the keys starting with the hint to files of their own, which
        # remove_sharded_tensors can delete later; shardwise writes one data file per rank.
        warnings.warn(
            f"sharded_strategy.separation_hint={hint!r} is ignored: shardwise writes one data file per rank, "
            f"so remove_sharded_tensors(..., {hint!r}) finds no file of its own to remove in {checkpoint_dir}",
            stacklevel=4,
        )
    if megatron_args.get("verify_integrity"):
        kwargs["verify_integrity"] = True
    content_metadata = megatron_args.get("content_metadata")
    if not megatron_args.get("async_sharded_save"):
        save(sharded_state_dict, checkpoint_dir, content_metadata=content_metadata, **kwargs)
        return None
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    handle = save(sharded_state_dict, checkpoint_dir, content_metadata=content_metadata, async_save=True, **kwargs)
    # Megatron runs finalize_fns in the training process once the request is done; ours comes
    # first, so the functions save_checkpoint appends (metadata, tracker) run after the commit.
    return AsyncRequest(_async_save_done, (), [functools.partial(_wait_committed, handle)])


def _wait_committed(handle) -> None:
    """An async drop-in save's first finalize function: its commit, or its error as Megatron's."""
    with raised_as_megatron("save"):
        handle.wait()


# (module, attribute, original) for every name install() replaced, in replacement order.
_INSTALLED: list[tuple[Any, str, Any]] = []


def install(*, load: bool = True, **save_kwargs) -> None:
    """Route ``megatron.core.dist_checkpointing.save`` to shardwise (:func:`dist_checkpointing_save`),
    and, unless ``load=False``, its ``load`` and ``load_common_state_dict`` (what
    ``megatron.training.checkpointing.load_checkpoint`` calls; ``load_content_metadata`` and
    ``load_plain_tensors`` call them) to :func:`dist_checkpointing_load` and
    :func:`dist_checkpointing_load_common_state_dict`. ``load=False`` keeps Megatron's own load (and
    un-routes it if an earlier call routed it).

    Replaces the names in ``megatron.core.dist_checkpointing`` (which Megatron's training code calls as
    ``dist_checkpointing.save``) and in ``megatron.core.dist_checkpointing.serialization``.
    ``save_kwargs`` are passed to :func:`save` on every call (e.g. ``timeout_s=1800``,
    ``balance_dp=...``). Idempotent: a second call only updates ``save_kwargs``. Undo with
    :func:`uninstall`. Megatron's collectives *around* the save in
    ``megatron.training.checkpointing.save_checkpoint`` remain (see docs/megatron.md). Raises
    ``InvalidArgumentTypeError`` (a ``TypeError``) for a ``load`` that is not a ``bool``.
    """
    import functools

    import megatron.core.dist_checkpointing as mdc
    import megatron.core.dist_checkpointing.serialization as mser

    _args.flag("load", load)
    replacement = functools.partial(dist_checkpointing_save, **save_kwargs)
    functools.update_wrapper(replacement, dist_checkpointing_save)
    routes: dict[str, Callable[..., Any]] = {"save": replacement}
    load_routes: dict[str, Callable[..., Any]] = {"load": dist_checkpointing_load, "load_common_state_dict": dist_checkpointing_load_common_state_dict}
    if load:
        routes.update(load_routes)
    for mod in (mdc, mser):
        for name, function in routes.items():
            if not any(m is mod and n == name for m, n, _ in _INSTALLED):
                _INSTALLED.append((mod, name, getattr(mod, name)))
            setattr(mod, name, function)
        if not load:
            for i in reversed(range(len(_INSTALLED))):
                m, n, original = _INSTALLED[i]
                if m is mod and n in load_routes:
                    setattr(mod, n, original)
                    del _INSTALLED[i]


def uninstall() -> None:
    """Restore the functions :func:`install` replaced; a no-op when nothing is installed."""
    while _INSTALLED:
        mod, name, original = _INSTALLED.pop()
        setattr(mod, name, original)


@contextlib.contextmanager
def installed(*, load: bool = True, **save_kwargs) -> Iterator[None]:
    """Context manager: :func:`install` on entry, :func:`uninstall` on exit (also on error)."""
    install(load=load, **save_kwargs)
    try:
        yield
    finally:
        uninstall()


def dist_checkpointing_load(sharded_state_dict: dict, checkpoint_dir, *args, **kwargs):
    """``megatron.core.dist_checkpointing.load`` done by :func:`load`, with the installed
    megatron-core's own signature: 0.13-0.18 ``(sharded_state_dict, checkpoint_dir,
    sharded_strategy, common_strategy, validate_access_integrity, strict)``, 0.19
    ``(..., sharded_strategy, validate_access_integrity, strict, verify_integrity, process_group)``.
    Positional arguments are bound to that release's parameters in its order.

    Megatron's own check of the directory runs first (``verify_checkpoint``, 0.19, or
    ``verify_checkpoint_and_load_strategy``): a missing directory or one without ``metadata.json``
    raises its ``CheckpointingException`` with its message. Every error is the class Megatron raises
    in that situation (:mod:`shardwise.megatron_errors`).

    sharded_strategy: None or a torch_dist strategy (the fully-parallel wrapper too: its exchange
        is not needed, every rank reads its own regions); another backend raises
        ``InvalidArgumentError``. common_strategy must be None.
    strict: every mode, with Megatron's result; the ``*_all`` modes learn every rank's requested
        keys through files, not an all_gather (:mod:`shardwise.requested_keys`).
    verify_integrity (0.19): checks the SHA-256 manifest (``integrity.json``) with megatron-core's
        own check, on every rank (Megatron hashes on rank 0 and broadcasts the outcome); a mismatch
        is its ``CheckpointingException``.
    process_group (0.19): the ranks that load together, for the ``*_all`` modes (read locally).
    Keyword arguments of :func:`load` (``timeout_s``, ``safe_globals``...) pass through.
    """
    with raised_as_megatron("load"):
        import inspect

        import megatron.core.dist_checkpointing.serialization as mser

        params = list(inspect.signature(_original_megatron(mser, "load")).parameters.values())[2:]
        bound = bind_release_args("load", params, args, kwargs, _LOAD_PARAMS)
        strategy = bound.get("sharded_strategy")
        backend = strategy[0] if isinstance(strategy, tuple) else _strategy_backend(strategy)
        if strategy is not None and backend != "torch_dist":
            raise InvalidArgumentError(f"shardwise loads the torch_dist format; sharded_strategy has backend {backend!r}")
        if bound.get("common_strategy") is not None:
            raise InvalidArgumentError("common_strategy is not supported (megatron-core supports only the default torch one)")
        _verify_checkpoint(checkpoint_dir)
        if bound.get("verify_integrity"):
            from megatron.core.dist_checkpointing.validation import _verify_integrity_manifest_impl

            _verify_integrity_manifest_impl(os.fsdecode(checkpoint_dir))
        for name in ("strict", "validate_access_integrity", "process_group"):
            if name in bound:
                kwargs[name] = bound[name]
        return load(sharded_state_dict, checkpoint_dir, **kwargs)


def dist_checkpointing_load_common_state_dict(checkpoint_dir, **kwargs) -> dict:
    """``megatron.core.dist_checkpointing.load_common_state_dict`` done by
    :func:`shardwise.load.load_common_state_dict`, after Megatron's own check of the directory (as
    :func:`dist_checkpointing_load`); errors are the classes Megatron raises."""
    with raised_as_megatron("load"):
        _verify_checkpoint(checkpoint_dir)
        return load_common_state_dict(checkpoint_dir, **kwargs)


def _verify_checkpoint(checkpoint_dir) -> None:
    """Megatron's own first step of a load: ``CheckpointingException`` "Checkpoint directory ... does
    not exist" or "... is not a distributed checkpoint" (no valid ``metadata.json``). Object-store
    URLs, which Megatron does not read, are left to shardwise's own checks."""
    from megatron.core.dist_checkpointing import validation

    if is_url(checkpoint_dir):
        return
    check = getattr(validation, "verify_checkpoint", None)  # 0.19
    if check is not None:
        check(checkpoint_dir)
    else:  # 0.13-0.18: the same checks, then the default strategies of the saved backend
        validation.verify_checkpoint_and_load_strategy(checkpoint_dir)  # type: ignore[attr-defined]


_LOAD_PARAMS = {"sharded_strategy", "common_strategy", "validate_access_integrity", "strict", "verify_integrity", "process_group"}


def _strategy_backend(strategy) -> Optional[str]:
    """The backend of a megatron load strategy; the fully-parallel wrapper's is its base strategy's.
    megatron-core 0.19's TorchDistLoadShardedStrategy has no ``backend`` attribute (torch_dist is the
    only one)."""
    if strategy is None:
        return None
    inner = getattr(strategy, "base_strategy", strategy)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    if isinstance(inner, TorchDistLoadShardedStrategy):
        return "torch_dist"
    return getattr(inner, "backend", type(inner).__name__)
