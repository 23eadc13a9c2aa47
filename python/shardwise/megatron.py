"""Collective-free save and load of Megatron-Core sharded state dicts in the ``torch_dist`` format.

The output is what ``megatron.core.dist_checkpointing.save`` writes with the default ``torch_dist``
strategy (``__{rank}_0.distcp`` data files, ``.metadata``, ``common.pt``, ``metadata.json``), and is
loaded by unmodified ``megatron.core.dist_checkpointing.load`` and ``torch.distributed.checkpoint``.

This module is the public face; the work is done in one module per job:

* :mod:`shardwise.save`: :func:`save`, :func:`default_save_id`, :class:`DPBalance`, async saves;
* :mod:`shardwise.load`: :func:`load`, :func:`load_common_state_dict`;
* :mod:`shardwise.dropin`: :func:`install`, :func:`uninstall`, :func:`installed` and the routed
  functions :func:`dist_checkpointing_save`, :func:`dist_checkpointing_load`,
  :func:`dist_checkpointing_load_common_state_dict`;
* :mod:`shardwise.megatron_errors`: which exception class each error is raised as (the direct API's
  classes also derive from megatron-core's ``CheckpointingException``; the drop-in raises Megatron's);
* :mod:`shardwise.requested_keys`: every rank's requested keys through files (strict ``*_all``);
* :mod:`shardwise.training`: :func:`save_checkpoint`, the tracker file, retention and the
  unchanged-save guard.
"""

from __future__ import annotations

from ._fs import is_url
from .dropin import (
    bind_release_args,
    dist_checkpointing_load,
    dist_checkpointing_load_common_state_dict,
    dist_checkpointing_save,
    install,
    installed,
    megatron_save_parameters,
    uninstall,
)
from .load import load, load_common_state_dict
from .megatron_errors import KeyMismatchError, UnsafeObjectError
from .save import DPBalance, default_save_id, save
from .training import (
    TRACKER_FILE,
    CheckpointHandle,
    UnchangedSaveWarning,
    apply_retention,
    checkpoint_name,
    committed_iterations,
    read_tracker,
    retain,
    save_checkpoint,
    update_tracker,
    write_tracker,
)

__all__ = [
    "CheckpointHandle",
    "DPBalance",
    "TRACKER_FILE",
    "UnchangedSaveWarning",
    "KeyMismatchError",
    "UnsafeObjectError",
    "apply_retention",
    "bind_release_args",
    "checkpoint_name",
    "committed_iterations",
    "default_save_id",
    "dist_checkpointing_load",
    "dist_checkpointing_load_common_state_dict",
    "dist_checkpointing_save",
    "install",
    "installed",
    "is_url",
    "load",
    "load_common_state_dict",
    "megatron_save_parameters",
    "read_tracker",
    "retain",
    "save",
    "save_checkpoint",
    "uninstall",
    "update_tracker",
    "write_tracker",
]
