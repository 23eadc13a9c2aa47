"""A stalled object store fails a save within the caller's ``timeout_s`` (plus one request timeout),
with an error naming the rank, the operation and the object, commits nothing, and lets the
processes exit at once (marin-community/marin #9209: S3 saves that stalled with no error).

Both stalling endpoints run on 127.0.0.1, started here: a TCP listener that accepts connections and
never answers, and moto's S3 server with every UploadPart held (s3_server.py). Each rank is a
process of its own (s3_workers.py ``rank``), so its exit is measured too: what exit waits for
(atexit handlers, Python's thread joins) is timed up to the last atexit handler, and the whole exit
is compared with a process making the same save to a local directory at the same time (the native
teardown of torch and megatron-core alone took 8-26 s on the loaded 2-core development machine)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from s3_server import S3Server

HERE = Path(__file__).parent
TIMEOUT_S = 10.0
# The bound: timeout_s plus one request timeout (at most timeout_s here), with slack.
FAIL_WITHIN_S = TIMEOUT_S + 15.0
EXIT_WITHIN_S = 2.0


@pytest.fixture
def silent_endpoint():
    """An HTTP endpoint that accepts every connection and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(256)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    srv.close()
    for c in held:
        c.close()


def _env(endpoint: str, **extra) -> dict:
    return {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
            "PYTHONWARNINGS": "ignore", **extra}


def _run_ranks(url: str, rows: int, env: dict, local: Path) -> tuple[list[dict], float]:
    """Both ranks as processes, plus the baseline process; returns each rank's JSON line with
    ``exited`` (monotonic time of its exit) and the baseline's exit delay in seconds."""
    cmds = [[sys.executable, str(HERE / "s3_workers.py"), "rank", url, "stall", str(rows), str(TIMEOUT_S), str(r)]
            for r in range(2)]
    cmds.append([sys.executable, str(HERE / "s3_workers.py"), "baseline", str(local), str(rows)])
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in cmds]
    exited: dict[int, float] = {}

    def wait(i: int, p: subprocess.Popen) -> None:
        p.wait(timeout=600)
        exited[i] = time.monotonic()

    waiters = [threading.Thread(target=wait, args=(i, p)) for i, p in enumerate(procs)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    lines = []
    for i, p in enumerate(procs):
        out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
        *result, last = out.strip().splitlines()
        line = {**json.loads(result[-1]), **json.loads(last), "exited": exited[i]}
        lines.append(line)
    baseline = lines.pop()
    assert baseline["ok"], baseline
    return lines, baseline["exited"] - baseline["returned"]


def _check(ranks: list[dict], baseline_exit_s: float, url: str) -> None:
    for r in ranks:
        took = r["returned"] - r["called"]
        waits_s = r["atexit_done"] - r["returned"]
        exit_s = r["exited"] - r["returned"]
        assert not r["ok"], r
        assert took <= FAIL_WITHIN_S, f"rank {r['rank']} failed after {took:.1f}s: {r['error']}"
        assert waits_s <= EXIT_WITHIN_S, f"rank {r['rank']}: exit waited {waits_s:.1f}s for atexit / threads"
        # Native teardown varies by seconds with the machine's load: only a wait as long as a
        # request timeout stands out of it.
        assert exit_s <= baseline_exit_s + TIMEOUT_S, (
            f"rank {r['rank']} took {exit_s:.1f}s to exit after the call returned (the local save's "
            f"process {baseline_exit_s:.1f}s)")
        if r["type"] == "StorageError":
            assert f"rank {r['rank']}" in r["error"], r["error"]
            assert url + "/" in r["error"], r["error"]  # the object
        else:  # a rank waiting for the commit names the rank it waited for
            assert r["type"] == "NotCommittedError" and "rank 0" in r["error"], r


def test_a_silent_endpoint_fails_both_ranks_within_the_timeout(silent_endpoint, tmp_path):
    url = "s3://bucket/ck"
    ranks, baseline = _run_ranks(url, 4, _env(silent_endpoint), tmp_path / "local")
    _check(ranks, baseline, url)
    for r in ranks:
        assert r["type"] == "StorageError", r
        # the operation and the object: every rank's first request lists the saves' state
        # (.shardwise), to decide whether the directory holds a committed checkpoint by the commit
        # records and a stat, without reading .metadata (issue 27)
        assert f"list {url}/.shardwise" in r["error"], r["error"]
        assert "nothing committed" in r["error"], r["error"]


def test_stalled_upload_parts_fail_the_save_within_the_timeout(tmp_path):
    """Rank 0's data (64 MiB) goes up as a multipart upload whose parts are never answered; rank 1's
    fits one PUT. Rank 0 fails naming its data file and the part upload; rank 1, waiting for the
    commit, learns of the failure (or times out) within the same bound; nothing is committed."""
    srv = S3Server(log_dir=tmp_path, stall_upload_part=True)
    srv.start()
    try:
        srv.make_bucket("stall")
        url = "s3://stall/ck"
        env = _env(srv.endpoint, SHARDWISE_MULTIPART_BYTES=str(8 << 20))
        ranks, baseline = _run_ranks(url, 4096, env, tmp_path / "local")
        _check(ranks, baseline, url)
        r0, r1 = ranks
        assert r0["type"] == "StorageError", r0
        assert f"upload part {url}/__0_0.distcp" in r0["error"], r0["error"]
        # rank 1 either reads rank 0's failure record or times out waiting for rank 0's part
        assert r1["type"] == "NotCommittedError", r1
        assert "merging rank 0 failed" in r1["error"] or "ranks [0]" in r1["error"], r1
        keys = [o["Key"] for o in srv.client().list_objects_v2(Bucket="stall").get("Contents", [])]
        assert "ck/.metadata" not in keys, keys
    finally:
        srv.stop()
