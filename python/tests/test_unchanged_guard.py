"""The guard against saves that did not change (issue 18, item 3): `save_checkpoint` compares this
save's tensor CRC-32s with the previous committed iteration's, from the two checksum sidecars."""

from __future__ import annotations

import warnings

import pytest

import shardwise
import shardwise.megatron as swm
from dcp_util import row_shard


def state(b_offset: float = 0.0) -> dict:
    sd = {"w": row_shard("w", 0, 1), "b": row_shard("b", 0, 1)}
    sd["b"].data.add_(b_offset)
    return sd


def save(root, iteration, sd, **kw):
    return swm.save_checkpoint(str(root), iteration, sd, rank=0, world_size=1, save_id=f"it{iteration}", **kw)


def test_an_unchanged_save_warns_a_changed_one_is_silent_and_error_keeps_the_tracker(tmp_path):
    assert save(tmp_path, 1, state())["unchanged_since"] is None, "nothing to compare the first save with"
    with pytest.warns(swm.UnchangedSaveWarning, match="iteration 2 saved exactly the tensors of iteration 1"):
        report = save(tmp_path, 2, state())
    assert report["unchanged_since"] == 1 and report["tracker"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", swm.UnchangedSaveWarning)
        report = save(tmp_path, 3, state(b_offset=1e-3))  # one tensor of two changed
    assert report["unchanged_since"] is None
    with pytest.raises(shardwise.ValidationError, match="stale copy"):
        save(tmp_path, 4, state(b_offset=1e-3), on_unchanged="error")
    assert shardwise._native.is_committed(swm.checkpoint_name(str(tmp_path), 4)), "the save itself committed"
    assert swm.read_tracker(str(tmp_path)) == 3, "the tracker does not move onto a suspicious save"
    with warnings.catch_warnings():
        warnings.simplefilter("error", swm.UnchangedSaveWarning)
        assert save(tmp_path, 5, state(b_offset=1e-3), on_unchanged="ignore")["unchanged_since"] is None
    with pytest.raises(shardwise.InvalidArgumentError, match="on_unchanged"):
        save(tmp_path, 6, state(), on_unchanged="maybe")
