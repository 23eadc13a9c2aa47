"""Object storage against a real S3 HTTP server on loopback (moto's standalone server, see
s3_server.py): a 2-rank TP=2 save of a real megatron-core GPTModel straight to ``s3://``, committed
by ``shardwise merge``, verified, loaded by unmodified torch DCP through fsspec/s3fs, converted to HF
and run by transformers; racing mergers; the server dying mid-save; stores that cannot create
only-if-absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import hf_workers
import shardwise
import shardwise.megatron as swm
from dcp_util import bits, read_all, row_shard
from mcore import spawn
from s3_server import S3Server

HERE = Path(__file__).parent


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def s3_llama(s3_server, tmp_path_factory):
    """The llama-shaped GPTModel of the to-hf tests, 2 ranks at TP=2, saved by shardwise both to a
    local directory and to s3:// (parts only), then committed with `shardwise merge <url>`."""
    bucket = s3_server.make_bucket(f"llama-{uuid.uuid4().hex[:12]}")
    url = f"s3://{bucket}/run/iter_0000001"
    base = tmp_path_factory.mktemp("s3_llama")
    results = spawn(hf_workers.save_and_forward, 2, str(base / "out"), str(base), "llama", url, timeout_s=600)
    failed = [r for r in results if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}" for r in failed)
    before_merge = cli("status", url)
    merged = cli("merge", url, "--json")
    return url, base, before_merge, merged


def test_save_to_s3_then_merge_and_verify(s3_llama, s3_server):
    url, base, before, merged = s3_llama
    assert before.returncode == 1 and before.stderr == "", before.stderr  # 1: not committed
    assert "not committed (.metadata is absent)" in before.stdout and "2 of 2 rank parts" in before.stdout
    assert merged.returncode == 0, merged.stderr
    summary = json.loads(merged.stdout)
    assert summary["already_committed"] is False and summary["keys"] > 10
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=url.split("/")[2])["Contents"]}
    prefix = "/".join(url.split("/")[3:])
    assert {f"{prefix}/.metadata", f"{prefix}/metadata.json", f"{prefix}/common.pt",
            f"{prefix}/__0_0.distcp", f"{prefix}/__1_0.distcp"} <= keys
    v = cli("verify", url, "--json")
    assert v.returncode == 0, v.stdout + v.stderr
    report = json.loads(v.stdout)
    assert report["problems"] == [] and report["sidecar_checked"] == report["items"] > 0
    assert "committed" in cli("status", url).stdout
    assert cli("merge", url).returncode == 0  # idempotent


def test_torch_dcp_loads_the_s3_checkpoint_through_fsspec(s3_llama, s3_server):
    """Unmodified torch.distributed.checkpoint (FsspecReader over s3fs) reads every tensor and byte
    object of the S3 checkpoint, bitwise equal to the same save on the local filesystem."""
    from torch.distributed.checkpoint import FsspecReader

    url, base, _, _ = s3_llama
    opts = s3_server.fsspec_storage_options()
    remote, remote_objects = read_all(url, reader=lambda: FsspecReader(url, skip_instance_cache=True, **opts))
    local, local_objects = read_all(str(base / "shardwise"))
    assert sorted(remote) == sorted(local) and len(remote) >= 5
    assert [k for k in local if not torch.equal(bits(remote[k]), bits(local[k]))] == []
    assert remote_objects.keys() == local_objects.keys()
    # and our own reader, through ranged GETs
    r = shardwise.open(url)
    assert all(torch.equal(bits(r.read(k)), bits(local[k])) for k in local)


def test_to_hf_from_s3_matches_megatron_logits(s3_llama, tmp_path):
    from test_hf import _hf_logits

    url, base, _, _ = s3_llama
    out = tmp_path / "hf"
    summary = shardwise.to_hf(url, str(out), hf_config=str(base / "hf_config" / "config.json"))
    assert summary["tensors"] > 10
    local = tmp_path / "hf_local"
    shardwise.to_hf(str(base / "shardwise"), str(local), hf_config=str(base / "hf_config" / "config.json"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in local.iterdir()}
    torch.testing.assert_close(_hf_logits(out), torch.load(base / "logits.pt"), rtol=1e-5, atol=1e-5)


def test_racing_mergers_commit_exactly_once(s3_bucket):
    url = f"s3://{s3_bucket}/race"
    sid = uuid.uuid4().hex
    for r in range(3):
        swm.save({"w": row_shard("w", r, 3)}, url, rank=r, world_size=3, save_id=sid, merge_rank=None)
    assert shardwise.status(url)["checkpoint"] == "not_committed"  # readable before the commit
    results, errors = [], []
    go = threading.Barrier(6)

    def merger():
        go.wait()
        try:
            results.append(shardwise.merge(url, sid, 3, 10.0))
        except shardwise.ShardwiseError as e:
            errors.append(e)

    threads = [threading.Thread(target=merger) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(r["already_committed"] for r in results) == [False] + [True] * 5
    assert torch.equal(shardwise.open(url).read("w"), torch.cat([row_shard("w", r, 3).data for r in range(3)]))


def test_async_save_to_s3_through_staging(s3_bucket):
    """async_save stages every byte in host buffers and returns; the upload, the parts and the
    commit run in the background. Staging buffers of any size are gathered into parts of at least
    SHARDWISE_MULTIPART_BYTES (5 MiB minimum on S3)."""
    url = f"s3://{s3_bucket}/async"
    sid = uuid.uuid4().hex
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    full = torch.randn(8, 1 << 20)  # 32 MiB
    states = [{"w": ShardedTensor.from_rank_offsets("w", full[4 * r:4 * r + 4].clone(), (0, r, 2), replica_id=0)}
              for r in range(2)]
    h1 = swm.save(states[1], url, rank=1, world_size=2, save_id=sid, async_save=True, wait_for_commit=False)
    h0 = swm.save(states[0], url, rank=0, world_size=2, save_id=sid, async_save=True, timeout_s=60)
    for st in states:
        st["w"].data.zero_()  # the caller may reuse its tensors once save returned
    assert h1.wait(120)["data_bytes"] > 16 << 20
    assert h0.wait(120)["committed"]
    assert torch.equal(shardwise.open(url).read("w"), full)
    assert cli("verify", url).returncode == 0


def _ranks_result(stdout: str) -> dict:
    """The per-rank JSON line of ``s3_workers.py save`` (its atexit handler prints one more line)."""
    lines = [json.loads(line) for line in stdout.strip().splitlines() if line.startswith("{")]
    return {int(k): v for k, v in next(d for d in lines if "atexit_done" not in d).items()}


def test_server_stopped_mid_save_fails_clearly_and_a_rerun_succeeds(tmp_path):
    """The S3 server is killed while rank 0 is uploading: every rank fails within its bounds with an
    error that names the rank and the object, nothing is committed, and once the server is back
    the same save run again commits."""
    srv = S3Server(log_dir=tmp_path)
    srv.start()
    try:
        srv.make_bucket("outage")
        url = "s3://outage/ck"
        env = {**os.environ, **srv.env(), "SHARDWISE_RETRY_TIMEOUT_S": "3", "SHARDWISE_MULTIPART_BYTES": str(5 << 20),
               "SHARDWISE_MULTIPART_CONCURRENCY": "2", "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, str(HERE / "s3_workers.py"), "save", url, "attempt1", "8192", "8"]  # 128 MiB
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        # wait until rank 1 has published its part and rank 0 is uploading its 256 MiB, then kill
        deadline = time.monotonic() + 120
        uploads, part1 = [], False
        while time.monotonic() < deadline and proc.poll() is None and not (uploads and part1):
            got = srv.client().list_objects_v2(Bucket="outage", Prefix="ck/.shardwise/attempt1/")
            part1 = any(o["Key"].endswith("/1.part") for o in got.get("Contents", []))
            uploads = srv.client().list_multipart_uploads(Bucket="outage").get("Uploads", [])
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        metadata_before = srv.client().list_objects_v2(Bucket="outage", Prefix="ck/.metadata").get("KeyCount")
        srv.stop()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 0, err
        res = _ranks_result(out)
        assert uploads, "rank 0 was mid-upload when the server stopped"
        assert metadata_before == 0
        assert not res[0]["ok"] and res[0]["type"] == "StorageError", res[0]
        assert "rank 0" in res[0]["error"] and "nothing committed" in res[0]["error"], res[0]["error"]
        assert "s3://outage/ck/__0_0.distcp" in res[0]["error"], res[0]["error"]
        assert not res[1]["ok"] and res[1]["type"] == "NotCommittedError", res[1]
        assert elapsed < 60, f"the failure took {elapsed:.0f}s to surface"

        srv.start()
        srv.make_bucket("outage")  # moto keeps its state in memory: a restarted server is empty
        again = subprocess.run(cmd[:4] + ["attempt2", "2048", "60"], capture_output=True, text=True, env=env, timeout=300)
        res = _ranks_result(again.stdout)
        assert res[0]["ok"] and res[1]["ok"], res
        assert res[0]["report"]["committed"] and res[0]["report"]["commit"]["keys"] == 2
        assert cli("verify", url, env=env).returncode == 0
    finally:
        srv.stop()


def test_store_without_conditional_put_is_refused(s3_bucket, tmp_path):
    """With conditional put turned off (AWS_CONDITIONAL_PUT=disabled, as for a store that cannot do
    it), parts and the commit cannot be created only-if-absent: the save fails clearly and writes
    no part."""
    code = (
        "import shardwise, shardwise.megatron as swm, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from dcp_util import row_shard\n"
        "try:\n"
        "    swm.save({'w': row_shard('w', 0, 1)}, sys.argv[1], rank=0, world_size=1, save_id='x')\n"
        "except shardwise.InvalidArgumentError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {**os.environ, "AWS_CONDITIONAL_PUT": "disabled", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", code, f"s3://{s3_bucket}/nocas", str(HERE)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert "REFUSED" in r.stdout and "conditional put" in r.stdout, r.stdout + r.stderr
    st = shardwise.status(f"s3://{s3_bucket}/nocas")  # readable: nothing committed, no part
    assert st["checkpoint"] == "not_committed" and st["saves"] == [], st


def test_bad_urls_are_clear_errors(s3_server):
    with pytest.raises(shardwise.InvalidArgumentError, match="unsupported URL scheme"):
        shardwise.open("ftp://host/ck")
    with pytest.raises(shardwise.StorageError, match="s3://no-such-bucket-here/ck/.metadata"):
        shardwise.open("s3://no-such-bucket-here/ck")
    with pytest.raises(shardwise.StorageError):
        swm.save({"w": row_shard("w", 0, 1)}, "s3://no-such-bucket-here/ck", rank=0, world_size=1, save_id="y",
                 timeout_s=5)
    with pytest.raises(shardwise.InvalidArgumentError, match="object store"):
        swm.save_checkpoint("s3://b/run", 1, {"w": row_shard("w", 0, 1)}, rank=0, world_size=1)
    # keys are literal: URLs a parser would rewrite (and save elsewhere than s3fs reads) are refused
    for url in ("s3://b/exp#2/iter_1", "s3://b/ck?v=2", "s3://b/a%20b", "s3://b/a/../c", "s3://b/a b", "s3://",
                "s3:///x"):
        with pytest.raises(shardwise.InvalidArgumentError):
            swm.save({"w": row_shard("w", 0, 1)}, url, rank=0, world_size=1, save_id="z")
    with pytest.raises(shardwise.InvalidArgumentError, match="local directory"):
        shardwise.to_hf("s3://b/ck", "s3://b/hf")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_overwrite_needs_a_new_save_id_and_a_filesystem(where, tmp_path, s3_bucket):
    """overwrite=True replaces a committed checkpoint only where it can switch atomically (a local
    directory) and only with a save id other than the committed one's (a relaunch derives a new one
    or ignores the old one's markers); otherwise it is refused before anything is written, and the
    committed checkpoint is untouched."""
    url = str(tmp_path / "ck") if where == "local" else f"s3://{s3_bucket}/ow"
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    old, new = torch.zeros(4, 8), torch.arange(32.0).reshape(4, 8)
    swm.save({"w": ShardedTensor.from_rank_offsets("w", old, replica_id=0)}, url, rank=0, world_size=1, save_id="same")
    refused = "refused on object stores" if where == "s3" else "needs a different save id"
    with pytest.raises(shardwise.InvalidArgumentError, match=refused):
        swm.save({"w": ShardedTensor.from_rank_offsets("w", new, replica_id=0)}, url, rank=0, world_size=1,
                 save_id="same", overwrite=True)
    assert torch.equal(shardwise.open(url).read("w"), old)
    if where == "local":
        rep = swm.save({"w": ShardedTensor.from_rank_offsets("w", new, replica_id=0)}, url, rank=0, world_size=1,
                       save_id="other", overwrite=True)
        assert rep["committed"] and rep["commit"]["keys"] == 1
        assert torch.equal(shardwise.open(url).read("w"), new)
    assert cli("verify", url).returncode == 0
    zero = cli("merge", url, "--world-size", "0", "--save-id", "same")
    assert zero.returncode == 1 and "world_size 0 is not in 1..=" in zero.stderr


def test_load_refuses_another_backend_on_s3_as_locally(s3_bucket, s3_server):
    """metadata.json naming another backend is refused up front at an s3:// URL, as in a directory."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    url = f"s3://{s3_bucket}/zarr"
    w = torch.arange(8.0).reshape(2, 4)
    swm.save({"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}, url, rank=0, world_size=1, save_id="z")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), replica_id=0)}
    assert torch.equal(swm.load(request, url, timeout_s=30)["w"], w)
    s3_server.client().put_object(Bucket=s3_bucket, Key="zarr/metadata.json",
                                  Body=json.dumps({"sharded_backend": "zarr"}).encode())
    with pytest.raises(shardwise.InvalidArgumentError, match="sharded_backend 'zarr'"):
        swm.load(request, url, timeout_s=30)
