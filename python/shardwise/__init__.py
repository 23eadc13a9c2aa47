"""shardwise: collective-free saves of Megatron-Core ``torch_dist`` (PyTorch DCP) checkpoints.

Each rank writes its own main-replica shards and a small metadata part; the global ``.metadata`` is
merged from the parts through a file-based rendezvous in the checkpoint directory, never through a
``torch.distributed`` collective. See :func:`shardwise.megatron.save`.

Every error raised by shardwise is a subclass of :class:`ShardwiseError`.
"""

from ._native import (
    CheckpointExistsError,
    CorruptFileError,
    GpuError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MissingKeyError,
    MissingRanksError,
    NotCommittedError,
    ShardwiseError,
    StorageError,
    UnsupportedDtypeError,
    SaveHandle,
    ValidationError,
    __version__,
    cuda_available,
    from_hf,
    merge,
    status,
    to_hf,
)
from .barriers import BarrierTimeoutError, barrier, record_phase
from .diff import diff
from .reader import Reader, open

__all__ = [
    "BarrierTimeoutError",
    "barrier",
    "record_phase",
    "CheckpointExistsError",
    "CorruptFileError",
    "GpuError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "MissingKeyError",
    "MissingRanksError",
    "NotCommittedError",
    "ShardwiseError",
    "StorageError",
    "UnsupportedDtypeError",
    "SaveHandle",
    "ValidationError",
    "cuda_available",
    "__version__",
    "merge",
    "from_hf",
    "status",
    "to_hf",
    "diff",
    "open",
    "Reader",
]
