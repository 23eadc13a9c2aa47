"""Type stubs of ``shardwise._native``, the Rust extension module (crates/shardwise-py/src/*.rs).

Every function, class, attribute and exception the module exports is declared here, with the
signature its ``#[pyo3(signature = ...)]`` gives it (``mypy.stubtest`` checks the two agree:
python/tests/test_typing.py). Every report a function returns as a dict has a ``TypedDict`` below
with the report's real fields: the serde form of its Rust struct (crates/shardwise-py/src/report.rs), which is
also what the CLI's ``--json`` prints for the same operation (docs/cli.md, "JSON output").

The ``TypedDict`` classes exist for type checkers only: the extension module does not define them,
so import them under ``if typing.TYPE_CHECKING:`` (``from shardwise._native import StatusReport``)
and use them in annotations; importing them at run time raises ``ImportError``.

Numbers that the Rust side reads as whole numbers (offsets, sizes, byte counts, ranks, device
ordinals) accept any ``SupportsIndex`` (``int``, numpy's integers) except ``bool``; seconds accept
``int`` or ``float`` in ``0..=MAX_TIMEOUT_S``. Paths are ``str`` or ``os.PathLike[str]`` (a
non-UTF-8 path as a ``str`` with surrogate escapes, as ``os.fsdecode`` gives it), or an
object-store URL where the docstring says so.
"""

import os
from collections.abc import Sequence
from typing import Literal, SupportsIndex, TypedDict, final

from typing_extensions import NotRequired, TypeAlias

_Path: TypeAlias = str | os.PathLike[str]

# What the module exports (pyo3 fills the runtime's __all__ in registration order); the report
# TypedDicts below are stub-only and not in it.
__all__ = [
    "is_committed",
    "process_start_ns",
    "same_tensor_crcs",
    "__version__",
    "save_rank",
    "reserve_staging",
    "Chunk",
    "ObjectItem",
    "SaveOptions",
    "Region",
    "check_seconds",
    "check_whole",
    "MAX_TIMEOUT_S",
    "merge",
    "merge_rank_local",
    "read_file",
    "cli_main",
    "open_checkpoint",
    "Checkpoint",
    "ShardwiseError",
    "UnsupportedDtypeError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "MissingKeyError",
    "ValidationError",
    "MissingRanksError",
    "NotCommittedError",
    "CheckpointExistsError",
    "StorageError",
    "CorruptFileError",
    "GpuError",
    "SaveHandle",
    "cuda_available",
    "to_hf",
    "from_hf",
    "diff",
    "status",
]

__version__: str
MAX_TIMEOUT_S: float
"""The largest bound in seconds any wait accepts (1e9)."""

# --- exceptions (crates/shardwise-py/src/lib.rs; their __module__ is "shardwise") -----------------------------

class ShardwiseError(Exception):
    """Base class of every shardwise error."""

class UnsupportedDtypeError(ShardwiseError):
    """A tensor dtype the DCP writer does not support."""

class InvalidArgumentError(ShardwiseError, ValueError):
    """Arguments out of range or that contradict themselves (a ValueError); an argument of the wrong
    type is an InvalidArgumentTypeError."""

class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a TypeError, and an InvalidArgumentError): a ``bool`` where a
    count or rank is meant, a ``str`` where a list of names is."""

class MissingKeyError(ShardwiseError):
    """A requested key is not in the checkpoint."""

class ValidationError(ShardwiseError):
    """Inputs that do not fit together: a save's parts (nothing was committed), a region the chunks
    do not cover, a to-hf config."""

class MissingRanksError(ShardwiseError):
    """Ranks did not publish their parts within the timeout."""

class NotCommittedError(ShardwiseError):
    """The save was not committed (merger failed or timed out)."""

class CheckpointExistsError(ShardwiseError):
    """The directory already holds a committed checkpoint."""

class StorageError(ShardwiseError):
    """An I/O operation failed."""

class GpuError(ShardwiseError):
    """The CUDA driver is missing or a CUDA call failed."""

class CorruptFileError(ShardwiseError):
    """A shardwise or checkpoint file is malformed."""

# --- reports ------------------------------------------------------------------------------------

class CommitSummary(TypedDict):
    """The commit of a save (``merge``, ``shardwise merge --json``, a save report's ``commit``);
    sizes in bytes (``crate::commit::record::CommitSummary``)."""

    already_committed: bool
    """The save had already been committed (by a racing merger or an earlier merge); the counts
    are then that commit's."""
    keys: int
    tensor_chunks: int
    byte_objects: int
    data_bytes: int
    metadata_bytes: int
    took_over_dead_merger: bool
    """The ``COMMITTING`` lock of a merger that had died was taken over."""

class SaveReport(TypedDict):
    """One rank's save (``save_rank``, ``SaveHandle.wait``, ``shardwise.megatron.save``); sizes in
    bytes, times in seconds (``crate::save::SaveReport``)."""

    rank: int
    save_id: str
    """The attempt's id (``<base>.<n>`` for a derived save id)."""
    data_file: str | None
    data_bytes: int
    """This rank's bytes."""
    write_s: float
    rendezvous_s: float
    committed: bool
    commit: CommitSummary | None
    """On the merging rank the merge's report, else None."""

class CheckpointReport(SaveReport):
    """``shardwise.megatron.save_checkpoint``'s report (and ``CheckpointHandle.wait``'s): the save's
    report plus the training-loop bookkeeping. ``tracker``, ``deleted`` and ``unchanged_since`` are
    there on the merging rank only."""

    checkpoint_dir: str
    tracker: NotRequired[int | None]
    """The iteration the tracker file names after the save."""
    deleted: NotRequired[list[str]]
    """Directories removed by retention."""
    unchanged_since: NotRequired[int | None]
    """The earlier iteration whose tensors this save repeats, or None."""

class RankLocalMergeSummary(TypedDict):
    """The merge of a torch DCP ``use_collectives=False`` save's rank-local metadata
    (``merge_rank_local``, ``shardwise.dcp.finish``; ``crate::dcp_local::Summary``)."""

    ranks: int
    """Ranks whose ``__{rank}.metadata`` was merged."""
    keys: int
    tensor_chunks: int
    byte_objects: int
    replicas_dropped: int
    """Exact replicas written by more than one rank, kept once."""
    metadata_bytes: int
    already_merged: bool
    """``.metadata`` was already there, byte-identical to the merge."""
    replaced_stale: bool
    """A stale ``.metadata`` (an earlier save's) was replaced."""

class StagingReservation(TypedDict):
    """``reserve_staging``'s answer; sizes in bytes."""

    pinned: bool
    """False without a CUDA device or driver: nothing was done."""
    rank_bytes: int
    budget_bytes: int
    buffer_bytes: int
    buffers: int
    """The pool's capacity in buffers."""

class LoadStats(TypedDict):
    """What ``Checkpoint.load_into`` did (``crate::load::LoadStats``)."""

    bytes_read: int
    """Bytes read from storage, item probes included."""
    read_ops: int
    requests: int
    seconds: float
    plan_seconds: float
    items_checked: int
    """Items whose bytes read were checked against save-time CRC-32s."""
    items_unchecked: int
    """Items with a recorded CRC-32 only partly needed (older saves), so not checked."""

class ToHfSummary(TypedDict):
    """What ``to_hf`` wrote (``shardwise to-hf --json``; ``crate::hf::HfSummary``)."""

    tensors: int
    """HF tensors written by this process (all of them, or this part's)."""
    bytes: int
    files: int
    """Shard files written by this process."""
    seconds: float
    gb_per_s: float
    skipped_keys: int
    """Checkpoint keys not converted: optimizer state, extra state, objects."""
    args_check: str
    """``"passed"`` or ``"skipped: no args stored"``."""
    args_unchecked: list[str]
    warnings: list[str]
    padding_rows_dropped: int
    config_written: bool
    mtp_layers: int
    vision_tensors: int
    """Vision tensors copied from ``base_hf``."""
    quantized: int
    """HF tensors of the whole conversion written quantized."""
    tokenizer_files: int
    nonfinite: dict[str, int]
    """HF tensors written by this process holding NaN or infinities: name -> how many (in the
    output dtype; a quantized one only with ``allow_nonfinite``, else the conversion raises)."""
    part: str | None
    """``"i/n"`` for one part of a split conversion."""
    committed: bool
    """The index is written (for a part: every part has published its shards)."""

class FromHfSummary(TypedDict):
    """What ``from_hf`` wrote (``shardwise from-hf --json``; ``crate::hf::from_hf::FromHfSummary``)."""

    chunks: int
    """Megatron tensor chunks written by this process."""
    keys: int
    """Megatron keys of the whole checkpoint."""
    bytes: int
    files: int
    """Data files written by this process."""
    seconds: float
    gb_per_s: float
    hf_tensors: int
    """HF tensors read (quantized pairs counted once)."""
    dequantized: int
    skipped: list[str]
    """HF tensors no rule reads, skipped with ``allow_unmapped``."""
    mtp_layers: int
    dropped_mtp: int
    vision_tensors: int
    vision_prefix: str | None
    warnings: list[str]
    nonfinite: dict[str, int]
    """HF tensors read holding NaN or infinities: name -> how many (in the output dtype, after
    dequantization); reported, not refused."""
    stacked_layers: bool
    padded_vocab_size: int
    iteration: int
    part: str | None
    committed: bool
    tracker: str | None
    """The tracker file written, if any."""

DiffStatus: TypeAlias = Literal["equal", "close", "different", "only_in_a", "only_in_b", "unreadable"]

class KeyDiff(TypedDict):
    """The comparison of one key (``crate::diff::KeyDiff``)."""

    key: str
    status: DiffStatus
    kind: Literal["tensor", "object"]
    """For A, or B when the key is only in B."""
    dtype_a: str | None
    dtype_b: str | None
    shape_a: list[int] | None
    shape_b: list[int] | None
    elements: int
    """Elements compared."""
    mismatched: int
    """Elements outside atol/rtol."""
    max_abs: float | None
    max_rel: float | None
    message: str | None
    """Why it differs, or the read error."""

class DiffReport(TypedDict):
    """What ``diff`` found (``shardwise diff --json``; ``crate::diff::DiffReport``)."""

    a: str
    b: str
    mode: Literal["checkpoints", "hf"]
    atol: float
    rtol: float
    equal: int
    close: int
    different: int
    only_in_a: int
    only_in_b: int
    unreadable: int
    skipped_keys: int
    """Checkpoint keys the to-hf mapping skips (HF mode)."""
    exit_code: int
    """0 same, 1 different, 2 unreadable: the exit status of ``shardwise diff``."""
    keys: list[KeyDiff]
    """Every compared key, sorted."""

class RankStatus(TypedDict):
    """One rank's part of a save, in a ``SaveStatus``."""

    rank: int
    age_s: float
    tensor_chunks: int
    byte_objects: int
    bytes: int
    files: list[str]
    common: bool
    """It wrote ``common.pt``."""
    error: str | None
    """Why its part is unreadable, else None."""

class KeyLayout(TypedDict):
    """A tensor key as the parts of a save describe it (``status(keys=True)``)."""

    key: str
    dtype: str
    global_shape: list[int]
    chunks: int
    ranks: list[int]

class SaveStatus(TypedDict):
    """One save under ``.shardwise/``, in a ``StatusReport``."""

    save_id: str
    state: Literal["committed", "merging", "interrupted", "failed", "incomplete"]
    detail: str
    """The state in words, with what to do."""
    world_size: int
    present: int
    missing: list[int]
    ranks: list[RankStatus]
    key_count: int
    keys: list[KeyLayout]
    """Filled only with ``status(..., keys=True)``; empty otherwise."""

class StatusReport(TypedDict):
    """The state of a checkpoint and of each save in it (``status``, ``shardwise status --json``)."""

    dir: str
    checkpoint: Literal["committed", "not_committed", "damaged"]
    reason: str | None
    """Why it is not committed or damaged; None when committed."""
    orphaned_data_files: list[str]
    saves: list[SaveStatus]

class ChunkMetadata(TypedDict):
    """One saved chunk of a tensor, in a ``TensorMetadata``: ``offsets``/``sizes`` in elements,
    ``offset``/``length`` in bytes within ``relative_path``."""

    offsets: list[int]
    sizes: list[int]
    relative_path: str
    offset: int
    length: int

class TensorMetadata(TypedDict):
    """``Checkpoint.metadata`` of a tensor key."""

    kind: Literal["tensor"]
    dtype: str
    """The torch dtype name without ``torch.``, e.g. ``"bfloat16"``."""
    global_shape: list[int]
    chunks: list[ChunkMetadata]

class ObjectMetadata(TypedDict):
    """``Checkpoint.metadata`` of a byte-object key."""

    kind: Literal["object"]
    relative_path: str
    offset: int
    length: int

KeyMetadata: TypeAlias = TensorMetadata | ObjectMetadata

# --- one rank's save (crates/shardwise-py/src/save.rs) -------------------------------------------------------

@final
class Chunk:
    """One chunk of a tensor that this rank writes, described by where its memory is."""

    def __new__(
        cls,
        *,
        fqn: str,
        dtype: str,
        global_shape: Sequence[SupportsIndex],
        offsets: Sequence[SupportsIndex],
        sizes: Sequence[SupportsIndex],
        data_ptr: SupportsIndex,
        nbytes: SupportsIndex,
        device: SupportsIndex | None = None,
    ) -> Chunk: ...
    @property
    def fqn(self) -> str: ...
    @property
    def dtype(self) -> str:
        """The torch dtype name, e.g. ``"torch.bfloat16"``."""
    @property
    def global_shape(self) -> list[int]: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def sizes(self) -> list[int]: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> int | None: ...

@final
class ObjectItem:
    """One byte object: ``data`` (the ``torch.save`` bytes) under DCP key ``fqn``, with a Megatron
    ``ShardedObject``'s position (``key``, ``global_shape``, ``global_offset``: all or none)."""

    def __new__(
        cls,
        *,
        fqn: str,
        data: bytes,
        key: str | None = None,
        global_shape: Sequence[SupportsIndex] | None = None,
        global_offset: Sequence[SupportsIndex] | None = None,
    ) -> ObjectItem: ...
    @property
    def fqn(self) -> str: ...
    @property
    def key(self) -> str | None:
        """The ShardedObject's base key, or None."""
    @property
    def nbytes(self) -> int:
        """Size of ``data`` in bytes."""

@final
class SaveOptions:
    """How this rank saves (see ``shardwise.megatron.save``)."""

    def __new__(
        cls,
        *,
        checkpoint_dir: _Path,
        rank: SupportsIndex,
        world_size: SupportsIndex,
        save_id: str,
        timeout_s: float,
        merge_rank: SupportsIndex | None,
        wait_for_commit: bool = True,
        overwrite: bool = False,
        async_save: bool = False,
        staging_budget_bytes: SupportsIndex | None = None,
        integrity: bool = False,
        derived_save_id: bool = False,
        megatron: bool = True,
    ) -> SaveOptions: ...
    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint directory or URL."""
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def save_id(self) -> str: ...
    @property
    def merge_rank(self) -> int | None: ...
    @property
    def timeout_s(self) -> float:
        """The bound of every wait, in seconds."""
    @property
    def async_save(self) -> bool: ...
    @property
    def staging_budget_bytes(self) -> int | None: ...

@final
class SaveHandle:
    """An asynchronous save in flight (``save_rank`` with ``options.async_save``)."""

    @property
    def stall_s(self) -> float:
        """Seconds the caller was blocked: from the call until every byte was staged."""
    @property
    def staged_bytes(self) -> int:
        """Payload bytes staged (tensor bytes of this rank's main replicas)."""
    @property
    def outcome_delivered(self) -> bool:
        """Whether a ``wait`` has returned this save's outcome (its report, or raised its error)."""
    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
    def wait(self, timeout_s: float | None = None) -> SaveReport:
        """Waits up to ``timeout_s`` seconds and returns the save's report; raises the save's error,
        or ``NotCommittedError`` when it is still in flight at ``timeout_s``."""

def save_rank(
    options: SaveOptions,
    chunks: Sequence[Chunk],
    objects: Sequence[ObjectItem],
    common: bytes | None,
    *,
    caller_streams: dict[int, int] | None = None,
) -> SaveReport | SaveHandle:
    """Saves this rank's chunks and objects as ``options`` say: the report, or with
    ``options.async_save`` a ``SaveHandle`` once every byte is staged."""

def reserve_staging(
    *,
    rank_bytes: SupportsIndex,
    device: SupportsIndex | None = None,
    staging_budget_bytes: SupportsIndex | None = None,
) -> StagingReservation:
    """Starts pinning the process's staging pool in a background thread; returns at once."""

# --- an open checkpoint (crates/shardwise-py/src/checkpoint.rs) ----------------------------------------------

@final
class Region:
    """A region of a tensor (``sizes`` elements at ``offsets``) and the memory it is read into."""

    def __new__(
        cls,
        *,
        key: str,
        offsets: Sequence[SupportsIndex],
        sizes: Sequence[SupportsIndex],
        data_ptr: SupportsIndex,
        nbytes: SupportsIndex,
        device: SupportsIndex | None = None,
    ) -> Region: ...
    @property
    def key(self) -> str: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def sizes(self) -> list[int]: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> int | None: ...

@final
class Checkpoint:
    """An open checkpoint (any DCP / torch_dist checkpoint), parsed as data. Made by
    ``open_checkpoint``; not constructible."""

    def __len__(self) -> int: ...
    def __contains__(self, key: str, /) -> bool: ...
    def format_name(self) -> str:
        """``"PyTorch DCP"`` or ``"Megatron-Core torch_dist"``."""
    def keys(self) -> list[str]:
        """Sorted keys (tensor fqns and byte-object keys)."""
    def describe(
        self, key: str
    ) -> tuple[Literal["tensor"], str, list[int]] | tuple[Literal["object"], None, None]:
        """``("tensor", dtype, global_shape)`` or ``("object", None, None)``; ``MissingKeyError``
        for a key the checkpoint does not hold."""
    def metadata(self, key: str) -> KeyMetadata: ...
    def read_into(self, region: Region) -> None: ...
    def check_region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> None: ...
    def load_into(
        self,
        regions: Sequence[Region],
        *,
        staging_budget_bytes: SupportsIndex | None = None,
        cuda_stream: int = 0,
        check_crc: bool = True,
        timeout_s: float | None = None,
    ) -> LoadStats: ...
    def read_common(self) -> tuple[str, bytes] | None:
        """``(source, torch.save bytes)`` of the common state, or None."""
    def read_bytes(self, key: str) -> bytes: ...

def open_checkpoint(path: _Path, timeout_s: float | None = None) -> Checkpoint: ...

# --- whole-checkpoint operations (crates/shardwise-py/src/tools.rs) ------------------------------------------

def to_hf(
    checkpoint_dir: _Path,
    out_dir: _Path,
    *,
    hf_config: _Path | None = None,
    arch: str | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    workers: SupportsIndex | None = None,
    allow_unmapped: bool = False,
    overwrite: bool = False,
    part: str | None = None,
    base_hf: _Path | None = None,
    text_only: bool = False,
    drop_mtp: bool = False,
    tokenizer: _Path | None = None,
    quantize: str | None = None,
    quantize_format: str | None = None,
    allow_config_mismatch: Sequence[str] | None = None,
    allow_nonfinite: bool = False,
) -> ToHfSummary:
    """Converts checkpoint ``checkpoint_dir`` to HF safetensors in ``out_dir``; see
    ``shardwise to-hf``. ``allow_config_mismatch``: config fields (a list of str) whose
    disagreement with the stored args converts with a warning (``--allow-config-mismatch``)."""

def from_hf(
    hf_dir: _Path,
    ckpt_dir: _Path,
    *,
    arch: str | None = None,
    dtype: str = "bf16",
    transformer_impl: str = "transformer_engine",
    moe_grouped_gemm: bool = False,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
    iteration: int = 0,
    tracker: bool = False,
    workers: int | None = None,
    max_file_size: str = "auto",
    part: str | None = None,
    overwrite: bool = False,
    allow_unmapped: bool = False,
    drop_mtp: bool = False,
) -> FromHfSummary:
    """Converts the Hugging Face folder ``hf_dir`` into a torch_dist checkpoint in ``ckpt_dir``;
    see ``shardwise from-hf``."""

def diff(
    a: _Path,
    b: _Path,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    keys: Sequence[str] = ...,
    exclude: Sequence[str] = ...,
    hf_config: _Path | None = None,
    arch: str | None = None,
    allow_unmapped: bool = False,
    workers: SupportsIndex | None = None,
) -> DiffReport:
    """Compares checkpoints ``a`` and ``b``; see ``shardwise diff`` and ``shardwise.diff``."""

def status(checkpoint_dir: _Path, keys: bool = False) -> StatusReport:
    """The state of a checkpoint and of each save in it, as ``shardwise status --json``."""

def merge(
    checkpoint_dir: _Path, save_id: str, world_size: SupportsIndex, timeout_s: float
) -> CommitSummary:
    """Merges the parts of save ``save_id`` and commits ``.metadata``; see ``shardwise merge``."""

def merge_rank_local(
    checkpoint_dir: _Path,
    world_size: SupportsIndex | None = None,
    timeout_s: float | None = None,
) -> RankLocalMergeSummary:
    """Merges a torch DCP ``use_collectives=False`` save's rank-local metadata (``shardwise.dcp.finish``)."""

def read_file(checkpoint_dir: _Path, rel: str, timeout_s: float | None = None) -> bytes | None:
    """The whole file ``rel`` of the checkpoint, or None when it does not exist."""

def cli_main(argv: Sequence[str]) -> int:
    """Runs the ``shardwise`` command line with ``argv`` (program name first); returns the exit code."""

def cuda_available() -> bool:
    """Whether a CUDA driver can be loaded here. Never raises."""

def is_committed(checkpoint_dir: _Path) -> bool:
    """Whether ``checkpoint_dir`` holds a committed, whole checkpoint. Never raises."""

def same_tensor_crcs(a: _Path, b: _Path) -> bool | None:
    """Whether two checkpoints hold the same tensors by their save-time CRC-32s; None when either
    was not saved by shardwise."""

def process_start_ns() -> int:
    """Wall-clock start of this process, ns since the Unix epoch."""

def check_seconds(name: str, value: float) -> float:
    """Checks a bound in seconds by the rule of every wait; returns it as a float."""

def check_whole(name: str, value: SupportsIndex, min: int = 0, max: int | None = None) -> int:
    """Checks a whole-number argument (``min..=max``; not a ``bool``) by the rule of every other;
    returns it as an ``int``."""
