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


# --- object storage: a real S3-protocol server (moto standalone) on loopback ----------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One moto S3 server for the session (see s3_server.py). moto is a test requirement: if it is
    missing this fixture errors, it does not skip. While it runs, os.environ carries server.env() so
    that any S3 client built without an explicit endpoint talks to it, never to a real AWS host."""
    import moto  # noqa: F401  -- fail loudly, not skip, when requirements-test.txt was not installed

    from s3_server import S3Server

    srv = S3Server(log_dir=tmp_path_factory.mktemp("moto"))
    srv.start()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in srv.env().items():
            mp.setenv(k, v)
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, uniquely named bucket on the session server (restarting the server first if an
    earlier test stopped it)."""
    import uuid

    if not s3_server.running:
        s3_server.start()
    return s3_server.make_bucket(f"t-{uuid.uuid4().hex[:16]}")
