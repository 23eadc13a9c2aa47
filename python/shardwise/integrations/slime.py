"""slime hook: make the actor's Megatron checkpoint save collective-free.

Add to a slime launch (any train.py / train_async.py command line)::

    --custom-megatron-init-path shardwise.integrations.slime.custom_init

slime calls ``custom_init(args)`` in every training actor at the end of its Megatron initialisation
(``slime/backends/megatron_utils/initialize.py``: ``load_function(args.custom_megatron_init_path)(args)``,
slime ``624b824``). slime saves through ``slime.backends.megatron_utils.model.save`` ->
``megatron.training.checkpointing.save_checkpoint`` -> ``megatron.core.dist_checkpointing.save``
(reference §5); the hook routes that last call to :func:`shardwise.megatron.dist_checkpointing_save`,
so the data, ``.metadata``, ``common.pt`` and ``metadata.json`` are written without any collective,
and ``--async-save`` keeps working (an ``AsyncRequest`` is returned; the write itself is synchronous
for now). Megatron's barriers around the save in ``save_checkpoint`` remain (docs/megatron.md).

Environment knobs, read once in :func:`custom_init`:

* ``SHARDWISE_TIMEOUT_S``: bound in seconds on the rendezvous waits (default 1800).
* ``SHARDWISE_BALANCE_DP=1``: spread DP-replicated writes over the DP ranks
  (:class:`shardwise.megatron.DPBalance`), instead of DP rank 0 writing all of them.
"""

from __future__ import annotations

import os
from typing import Any

from .. import megatron as _swm
from .._native import InvalidArgumentError, check_seconds


def custom_init(args) -> None:
    """slime's ``--custom-megatron-init-path`` entry point: installs the shardwise save.

    Args:
        args: slime's argument namespace; ``args.ckpt_format`` must be ``torch_dist`` (slime's
            default), the only format shardwise writes.

    Raises:
        InvalidArgumentError: another ``--ckpt-format``, or a malformed ``SHARDWISE_*`` variable.
    """
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if fmt != "torch_dist":
        raise InvalidArgumentError(f"shardwise writes --ckpt-format torch_dist; this run uses {fmt!r}")
    kwargs: dict[str, Any] = {}
    try:
        timeout_s = float(os.environ.get("SHARDWISE_TIMEOUT_S", "1800"))
    except ValueError:
        raise InvalidArgumentError(f"SHARDWISE_TIMEOUT_S={os.environ['SHARDWISE_TIMEOUT_S']!r} is not a number") from None
    # Checked now, at start-up, rather than at the first checkpoint hours later.
    kwargs["timeout_s"] = check_seconds("SHARDWISE_TIMEOUT_S", timeout_s)
    balance = os.environ.get("SHARDWISE_BALANCE_DP", "0")
    if balance not in ("0", "1"):
        raise InvalidArgumentError(f"SHARDWISE_BALANCE_DP={balance!r} must be 0 or 1")
    if balance == "1":
        # Parallel state is initialised by the time slime calls custom_init.
        kwargs["balance_dp"] = _swm.DPBalance.from_parallel_state()
    _swm.install(**kwargs)
