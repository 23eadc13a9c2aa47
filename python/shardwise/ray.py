"""Conversions split over a Ray cluster: each part of ``to-hf``/``from-hf --part i/n`` is one Ray task.

``--part i/n`` already splits a conversion over processes that share the storage: every part
computes the same plan, writes its own files, publishes a marker, and the part that finds all n
published commits (the files are byte-identical to a one-process conversion, whatever the split).
Here each part is a Ray task, scheduled on whichever node has a CPU free; every node must see the
checkpoint and the output folder at the same path (a shared filesystem). Ray retries a task whose
worker died (``max_retries``); a retried part rewrites its own files and publishes again, so a
part killed mid-write still gives the same folder.

``ray`` is an optional dependency: ``pip install ray``. Without a running cluster, ``ray.init()`` is
called with Ray's defaults (a local cluster)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import _args, _native

if TYPE_CHECKING:
    from ._native import FromHfSummary, ToHfSummary


def _parts(parts: int) -> int:
    return _args.whole("parts", parts, 1)


def _to_hf_part(src: str, dst: str, **options) -> ToHfSummary:
    return _native.to_hf(src, dst, **options)


def _from_hf_part(src: str, dst: str, **options) -> FromHfSummary:
    return _native.from_hf(src, dst, **options)


def _run(convert: Callable[..., Any], src: str, dst: str, parts: int, max_retries: int,
         options: dict[str, Any]) -> list[Any]:
    import ray

    if "part" in options:
        raise _native.InvalidArgumentError("part is chosen per task; pass parts=N instead")
    n = _parts(parts)
    if not ray.is_initialized():
        ray.init()
    task = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(convert)
    refs = [task.remote(src, dst, part=f"{i}/{n}", **options) for i in range(n)]
    return ray.get(refs)


def to_hf(ckpt_dir: str, out_dir: str, *, parts: int, max_retries: int = 3, **options) -> list[ToHfSummary]:
    """``shardwise.to_hf(ckpt_dir, out_dir, part=f"{i}/{parts}", **options)`` for every ``i``, each a
    Ray task (``num_cpus=1``; a task whose worker dies is retried up to ``max_retries`` times).

    Returns the parts' summaries, in part order; exactly one part, or none if an earlier run had
    finished, commits (``committed`` is true in every summary once the index is written).
    Raises what ``shardwise.to_hf`` raises (through ``ray.exceptions.RayTaskError``, whose
    ``cause`` is the ShardwiseError) and ``InvalidArgumentError`` for ``parts`` < 1 or a ``part``
    option. Requires ``ray``."""
    return _run(_to_hf_part, str(ckpt_dir), str(out_dir), parts, max_retries, options)


def from_hf(hf_dir: str, ckpt_dir: str, *, parts: int, max_retries: int = 3, **options) -> list[FromHfSummary]:
    """``shardwise.from_hf(hf_dir, ckpt_dir, part=f"{i}/{parts}", **options)`` for every ``i``, each a
    Ray task, as :func:`to_hf` does. Returns the parts' summaries in part order."""
    return _run(_from_hf_part, str(hf_dir), str(ckpt_dir), parts, max_retries, options)
