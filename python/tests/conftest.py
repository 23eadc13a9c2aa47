"""Shared, session-scoped multi-process runs: each heavy Megatron run happens once per test session
and several tests assert on its results."""

from __future__ import annotations

import os
import warnings

import pytest

import mcore_workers
from mcore import spawn

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("PYTHONWARNINGS", "ignore")


def _run(tmp_path_factory, name, fn, world, *args, timeout_s=600.0):
    base = tmp_path_factory.mktemp(name)
    results = spawn(fn, world, str(base / "out"), str(base), *args, timeout_s=timeout_s)
    failed = [r for r in results if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    return base, results


@pytest.fixture(scope="session")
def tp2dp2(tmp_path_factory):
    """4 ranks, TP=2 x DP=2: shardwise save, Megatron's own torch_dist save, Megatron load of ours."""
    return _run(tmp_path_factory, "tp2dp2", mcore_workers.tp2dp2, 4)


@pytest.fixture(scope="session")
def pp2tp2(tmp_path_factory):
    """4 ranks, PP=2 x TP=2: shardwise save and Megatron load on the same layout."""
    return _run(tmp_path_factory, "pp2tp2", mcore_workers.pp2tp2, 4)
