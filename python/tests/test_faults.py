"""Faults during a save, with real processes: a rank killed (SIGKILL, SIGTERM) at a random point of
its save, a merger killed while it holds the commit lock, racing CLI mergers, a full disk, SIGINT.

The promise under test: a save is either committed and whole, or not committed with an error that
names the cause; a rerun into the same directory succeeds; the previous checkpoint and the tracker
are byte-for-byte unchanged. Rank processes are forked from a forkserver that has already imported
torch, megatron-core and shardwise (fault_workers.py), so each trial costs milliseconds of startup.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import shardwise
import shardwise.megatron as swm
from dcp_util import read_all, row_shard, save_ranks, tree_digest

WORLD = 3
ROWS = 16384  # 64 MiB of w per rank: the write lasts long enough to be killed in the middle of it
TIMEOUT_S = 5.0  # generous: 3 ranks start and write 64 MiB each on a 2-core machine, maybe loaded
CLI = [sys.executable, "-m", "shardwise.cli"]


def cli(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["fault_workers"])
    return c


def start_ranks(ctx, ckpt: Path, save_id: str, out: Path, ranks=range(WORLD), timeout_s=TIMEOUT_S, **kw):
    import fault_workers

    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for r in ranks:
        p = ctx.Process(target=fault_workers.save_rank,
                        args=(str(ckpt), r, WORLD, save_id, ROWS, timeout_s, str(out / f"{save_id}.{r}.json")), kwargs=kw)
        p.start()
        procs[r] = p
    return procs


def finish(procs, out: Path, save_id: str, bound_s: float = 60.0) -> dict:
    deadline = time.monotonic() + bound_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in procs.items() if p.is_alive()]
    for r in hung:
        procs[r].kill()
    assert not hung, f"ranks {hung} still running after {bound_s} s: a wait is unbounded"
    results = {}
    for r in procs:
        path = out / f"{save_id}.{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())
    return results


def wait_for(path: Path, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.0005)


def assert_committed_and_whole(ckpt: Path) -> None:
    assert (ckpt / ".metadata").is_file() and (ckpt / "metadata.json").is_file()
    out = cli("verify", ckpt)
    assert out.returncode == 0, out.stdout + out.stderr
    r = shardwise.open(ckpt)
    w = r.read("w")
    expect = torch.cat([row_shard("w", k, WORLD, rows=ROWS, cols=1024).data for k in range(WORLD)])
    assert torch.equal(w, expect)
    leftovers = [p.name for p in ckpt.iterdir() if ".tmp." in p.name]
    assert not leftovers, f"temporary files left after the commit: {leftovers}"
    assert sorted(p.name for p in (ckpt / ".shardwise").iterdir() if p.is_dir()) == [
        json.loads(cli("status", ckpt, "--json").stdout)["saves"][0]["save_id"]
    ], "state of failed attempts is removed at the commit"


@pytest.fixture(scope="module")
def earlier(ctx, tmp_path_factory):
    """save_root with a committed iter_0000001 and the tracker on it, saved by the same rank
    processes; plus the merging rank's write time (s), used to aim the kills."""
    root = tmp_path_factory.mktemp("faults")
    ckpt = root / "iter_0000001"
    procs = start_ranks(ctx, ckpt, "first", root / "out")
    results = finish(procs, root / "out", "first")
    assert all(r["ok"] for r in results.values()), results
    assert swm.update_tracker(str(root), 1)
    # Aim within the shortest write seen (capped: a loaded machine must not push kills past the end).
    write_s = min(min(r["report"]["write_s"] for r in results.values()), 0.5)
    return root, write_s


def frozen(root: Path) -> dict:
    """Digest of everything a failed save must not touch: the earlier checkpoint and the tracker."""
    d = {f"iter_0000001/{k}": v for k, v in tree_digest(root / "iter_0000001").items()}
    d["tracker"] = (root / swm.TRACKER_FILE).read_text()
    return d


def test_killed_rank_at_random_points(ctx, earlier):
    """SIGKILL or SIGTERM one rank at a random moment of its data write, 3 times (each victim rank
    once, both signals; SHARDWISE_FAULT_KILLS=N for a longer stress run): every time the survivors
    fail within the timeout naming the dead rank, nothing is committed, the rerun into the same
    directory commits a whole checkpoint, and the earlier checkpoint and tracker are intact. A kill
    that lands after the victim published its part must end in a whole commit instead."""
    root, write_s = earlier
    before = frozen(root)
    rng = random.Random(int(os.environ.get("SHARDWISE_FAULT_SEED", "8")))
    outcomes = []
    trial = 0
    kills = int(os.environ.get("SHARDWISE_FAULT_KILLS", "3"))
    while sum(o == "killed before publishing" for o in outcomes) < kills:
        assert trial < 2 * kills + 2, f"kills kept landing after publication: {outcomes}"
        victim = [1, 2, 0][trial % 3]
        sig = signal.SIGKILL if trial % 2 == 0 else signal.SIGTERM
        ckpt = root / f"iter_{100 + trial:07d}"
        sid = f"trial{trial}"
        out = root / "out"
        t0 = time.monotonic()
        procs = start_ranks(ctx, ckpt, sid, out)
        wait_for(ckpt / f"__{victim}_0.distcp")
        time.sleep(rng.uniform(0, 0.8 * write_s))
        try:
            os.kill(procs[victim].pid, sig)
        except ProcessLookupError:
            pass  # it finished its whole save before the kill: checked below like a late kill
        results = finish(procs, out, sid)
        elapsed = time.monotonic() - t0
        published = (ckpt / ".shardwise" / sid / f"{victim}.part").exists()
        if not published:
            assert victim not in results, "the victim died before reporting"
            outcomes.append("killed before publishing")
            for r, res in results.items():
                assert not res["ok"] and res["shardwise_error"], (r, res)
                assert re.search(rf"ranks \[{victim}\]", res["error"]), (r, res["error"])
                assert res["type"] == ("MissingRanksError" if r == 0 else "NotCommittedError"), (r, res)
            # Bounded, not hung; the margin covers process start-up on a loaded 2-core machine.
            assert elapsed < TIMEOUT_S + 60, elapsed
            assert not (ckpt / ".metadata").exists()
            st = json.loads(cli("status", ckpt, "--json").stdout)
            assert st["checkpoint"] == "not_committed" and victim in st["saves"][0]["missing"]
            if victim != 0:
                assert st["saves"][0]["state"] == "failed"
        elif victim != 0:
            outcomes.append("killed after publishing")  # the save is complete without the victim's process
            assert all(res["ok"] for res in results.values()), results
        else:
            outcomes.append("merger killed after publishing")  # `shardwise merge` finishes its job
            assert cli("merge", ckpt).returncode == 0
        if outcomes[-1] != "killed after publishing" and outcomes[-1] != "merger killed after publishing":
            # The rerun into the same directory: a new attempt, all ranks alive.
            procs = start_ranks(ctx, ckpt, sid + "-rerun", out)
            results = finish(procs, out, sid + "-rerun")
            assert all(res["ok"] for res in results.values()), results
        assert_committed_and_whole(ckpt)
        assert frozen(root) == before
        shutil.rmtree(ckpt)
        trial += 1
    print(f"kill trials: {outcomes}")


def test_merger_killed_holding_the_lock_is_taken_over(ctx, earlier, tmp_path):
    """The merger dies (SIGKILL) while it holds COMMITTING and waits for a late rank: waiting ranks
    name the dead merger, `shardwise status` shows the save as merging, and `shardwise merge` takes
    the dead merger's lock over and commits once the late rank has published."""
    import fault_workers

    root, _ = earlier
    before = frozen(root)
    ckpt, sid, out = tmp_path / "c", "lockdeath", tmp_path / "out"
    # Rank 1's bound must outlast the merger's start-up on a loaded machine (it reports the dead
    # merger when its bound expires).
    procs = start_ranks(ctx, ckpt, sid, out, ranks=[1], timeout_s=15.0)
    merger = ctx.Process(target=fault_workers.merge, args=(str(ckpt), sid, WORLD, 60.0))
    wait_for(ckpt / ".shardwise" / sid / "1.part")
    merger.start()
    lock = ckpt / ".shardwise" / sid / "COMMITTING"
    wait_for(lock)
    # The holder records itself (pid, host) right after taking the flock; an empty lock file is one
    # a contender may still be about to take, so only a recorded holder counts as a dead merger.
    deadline = time.monotonic() + 60
    while lock.stat().st_size == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    merger.kill()
    merger.join()
    results = finish(procs, out, sid)
    assert results[1]["type"] == "NotCommittedError" and "died while holding the COMMITTING lock" in results[1]["error"]
    assert json.loads(cli("status", ckpt, "--json").stdout)["saves"][0]["detail"].startswith("interrupted: its merger (pid ")
    for r in (0, 2):
        finish(start_ranks(ctx, ckpt, sid, out, ranks=[r], merge_rank=None), out, sid)
    merged = cli("merge", ckpt, "--json")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert json.loads(merged.stdout)["took_over_dead_merger"] is True
    assert_committed_and_whole(ckpt)
    assert frozen(root) == before


def test_cli_mergers_race_commit_once_with_identical_metadata(ctx, tmp_path):
    """Four `shardwise merge` processes race on each of two copies of one uncommitted save: in each
    race exactly one commits and all exit 0, and `.metadata` is byte-identical whoever won."""
    src, sid, out = tmp_path / "src", "race", tmp_path / "out"
    finish(start_ranks(ctx, src, sid, out, merge_rank=None), out, sid)
    metas = []
    for copy in ("a", "b"):
        d = tmp_path / copy
        shutil.copytree(src, d)
        racers = [subprocess.Popen([*CLI, "merge", str(d), "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(4)]
        outs = [(p.wait(120), p.stdout.read() + p.stderr.read()) for p in racers]
        assert all(rc == 0 for rc, _ in outs), outs
        assert sum("committed save" in o for _, o in outs) == 1, outs
        assert_committed_and_whole(d)
        metas.append((d / ".metadata").read_bytes())
    assert metas[0] == metas[1]


@pytest.fixture()
def small_fs(tmp_path):
    """A 4 MiB tmpfs (the tests run as root); skipped where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_full_names_rank_and_cause_and_leaves_nothing(small_fs, tmp_path):
    """Rank 1 fills the disk first; rank 0's data file does not fit: StorageError naming rank 0 and
    ENOSPC, no commit, no partial data file, no temporary file. With space freed, a rerun commits."""
    outside = tmp_path / "outside"
    save_ranks(str(outside), [{"w": row_shard("w", r, 2)} for r in range(2)])
    digest = tree_digest(outside)
    ckpt = small_fs / "iter_0000002"
    big = [{"w": row_shard("w", r, 2, rows=400, cols=1024)} for r in range(2)]  # 1.6 MB per rank
    (small_fs / "filler").write_bytes(b"\0" * (1 << 20))
    swm.save(big[1], str(ckpt), rank=1, world_size=2, save_id="full", wait_for_commit=False)
    with pytest.raises(shardwise.StorageError, match=r"rank 0: allocate .*__0_0\.distcp: No space left on device"):
        swm.save(big[0], str(ckpt), rank=0, world_size=2, save_id="full", timeout_s=1)
    assert not (ckpt / ".metadata").exists()
    assert not (ckpt / "__0_0.distcp").exists(), "the partial data file is removed"
    assert not [p for p in ckpt.rglob("*") if ".tmp." in p.name]
    (small_fs / "filler").unlink()
    save_ranks(str(ckpt), big)
    assert torch.equal(read_all(str(ckpt))[0]["w"], torch.cat([s["w"].data for s in big]))
    assert tree_digest(outside) == digest


def test_disk_full_at_part_publication_removes_the_data_file(small_fs):
    """The data file fits but the metadata part does not: StorageError naming the rank; the data
    file and common.pt this rank wrote are removed again, so a failed rank leaves no partial save."""
    ckpt = small_fs / "c"
    ckpt.mkdir()
    state = {"w": row_shard("w", 0, 1, rows=200, cols=1024)}
    probe = swm.save(dict(state), str(small_fs / "probe"), rank=0, world_size=1, save_id="probe")
    shutil.rmtree(small_fs / "probe")
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    # Leave room for the data file and common.pt (page-rounded) but not for the part.
    need = -(-probe["data_bytes"] // 4096) * 4096 + 4096
    (small_fs / "filler").write_bytes(b"\0" * (free - need))
    with pytest.raises(shardwise.StorageError, match=r"rank 0: .*No space left on device"):
        swm.save(state, str(ckpt), rank=0, world_size=1, save_id="p")
    assert sorted(p.name for p in ckpt.iterdir()) == [".shardwise"]
    # Only the merging rank's notice to the other ranks (FAILED, when it still fits) is left.
    assert [p.name for p in ckpt.rglob("*") if p.is_file()] in ([], ["FAILED"])


def _committed_iters(root: Path, iters, uncommitted=()):
    for it in iters:
        save_ranks(swm.checkpoint_name(str(root), it), [{"w": row_shard("w", r, 2)} for r in range(2)])
    for it in uncommitted:  # a save in progress: one part, no commit
        swm.save({"w": row_shard("w", 1, 2)}, swm.checkpoint_name(str(root), it), rank=1, world_size=2,
                 save_id="inflight", wait_for_commit=False)


def test_update_tracker_is_forward_only_and_needs_a_commit(tmp_path):
    _committed_iters(tmp_path, [10, 20], uncommitted=[30])
    assert swm.update_tracker(str(tmp_path), 20) is True
    assert swm.read_tracker(str(tmp_path)) == 20
    assert swm.update_tracker(str(tmp_path), 10) is False, "never backwards"
    assert swm.update_tracker(str(tmp_path), 20) is True, "idempotent"
    assert (tmp_path / swm.TRACKER_FILE).read_text() == "20"
    with pytest.raises(shardwise.NotCommittedError, match="iter_0000030 holds no committed checkpoint"):
        swm.update_tracker(str(tmp_path), 30)
    with pytest.raises(shardwise.NotCommittedError):
        swm.update_tracker(str(tmp_path), 40)
    with pytest.raises(shardwise.InvalidArgumentError):
        swm.update_tracker(str(tmp_path), -1)
    assert (tmp_path / swm.TRACKER_FILE).read_text() == "20"
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]


def test_update_tracker_races_never_move_it_backwards(tmp_path):
    import threading

    _committed_iters(tmp_path, range(1, 9))
    order = list(range(1, 9))
    random.Random(3).shuffle(order)
    threads = [threading.Thread(target=swm.update_tracker, args=(str(tmp_path), it)) for it in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert swm.read_tracker(str(tmp_path)) == 8


def test_retain_keeps_newest_committed_newer_and_tracked(tmp_path):
    _committed_iters(tmp_path, [1, 2, 3, 4, 5], uncommitted=[6])
    swm.update_tracker(str(tmp_path), 2)  # a lagging tracker: what a restart would load
    deleted = swm.retain(str(tmp_path), keep=2)
    assert sorted(Path(p).name for p in deleted) == ["iter_0000001", "iter_0000003"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000005", "iter_0000006"]
    assert swm.retain(str(tmp_path), keep=1) == [str(tmp_path / "iter_0000004")]
    assert (tmp_path / "iter_0000005" / ".metadata").exists() and (tmp_path / "iter_0000006").exists()
    with pytest.raises(shardwise.InvalidArgumentError):
        swm.retain(str(tmp_path), keep=0)
    assert not [p for p in tmp_path.iterdir() if ".deleting." in p.name]


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and its kin so far (Linux /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_commit_state_reads_no_metadata_bytes(tmp_path):
    """Issue 27: status, is_committed and retention of committed saves decide from each COMMITTED
    record and a stat of .metadata (the stamp the commit recorded), so their cost does not grow
    with .metadata: at 1M+ chunks a .metadata is GBs, and retention looks at every iteration."""
    root = str(tmp_path)
    many = lambda r: {f"layer{i}.w": row_shard(f"layer{i}.w", r, 2, rows=1, cols=1) for i in range(2000)}
    iters = [1, 2, 3, 4, 5]
    for it in iters:
        save_ranks(swm.checkpoint_name(root, it), [many(r) for r in range(2)])
    metas = [Path(swm.checkpoint_name(root, it)) / ".metadata" for it in iters]
    meta_bytes = sum(m.stat().st_size for m in metas)
    # Parts and records are what status may read (the per-rank layout it reports).
    state_bytes = sum(p.stat().st_size for it in iters
                      for p in Path(swm.checkpoint_name(root, it), ".shardwise").rglob("*") if p.is_file())

    def state_calls():
        assert swm.committed_iterations(root) == iters
        for it in iters:
            assert shardwise.status(swm.checkpoint_name(root, it))["checkpoint"] == "committed"

    state_calls()  # imports and first-use costs
    before = _bytes_read()
    state_calls()
    read = _bytes_read() - before
    assert read < state_bytes + (1 << 16) < meta_bytes, (read, state_bytes, meta_bytes)

    before = _bytes_read()
    deleted = swm.retain(root, keep=2)
    assert _bytes_read() - before < state_bytes + (1 << 16)
    assert sorted(Path(p).name for p in deleted) == ["iter_0000001", "iter_0000002", "iter_0000003"]

    # The measure sees .metadata reads: a .metadata whose mtime changed (copied without its
    # timestamps, touched) no longer has its recorded stamp, so it is read and CRC'd whole.
    os.utime(metas[-1])
    before = _bytes_read()
    assert swm.committed_iterations(root) == [4, 5]
    assert _bytes_read() - before >= metas[-1].stat().st_size


def test_status_of_a_committed_save_reads_its_record_not_its_parts(tmp_path):
    """Issue 37 item 3: status (Python and CLI, one function) of a committed save reads what it
    prints from the COMMITTED record: under 1 % of .metadata's bytes, where reading the parts (as
    `--keys` does, and as status did) costs about a fifth of it. What the record says equals what
    the parts say."""
    d = tmp_path / "c"
    keys = 15_000  # x 2 ranks = 30,000 chunks
    save_ranks(str(d), [{f"layer{i}.w": row_shard(f"layer{i}.w", r, 2, rows=1, cols=1) for i in range(keys)}
                        for r in range(2)])
    meta_bytes = (d / ".metadata").stat().st_size
    part_bytes = sum(p.stat().st_size for p in (d / ".shardwise").glob("*/*.part"))
    shardwise.status(str(d))  # imports and first-use costs
    before = _bytes_read()
    st = shardwise.status(str(d))
    read = _bytes_read() - before
    assert read < meta_bytes / 100, (read, meta_bytes)

    before = _bytes_read()
    full = shardwise.status(str(d), keys=True)
    assert _bytes_read() - before >= part_bytes, "the measure sees the parts being read"
    assert st["checkpoint"] == full["checkpoint"] == "committed"
    (s,), (f,) = st["saves"], full["saves"]
    assert s["keys"] == [] and len(f["keys"]) == s["key_count"] == f["key_count"] == keys
    assert [{k: v for k, v in r.items() if k != "age_s"} for r in s["ranks"]] == \
        [{k: v for k, v in r.items() if k != "age_s"} for r in f["ranks"]]
    assert [r["tensor_chunks"] for r in s["ranks"]] == [keys, keys] and s["present"] == s["world_size"] == 2
    text = cli("status", d).stdout
    assert f"rank 1: {keys} tensor chunks" in text and f"  {keys} tensor keys" in text, text


@pytest.mark.parametrize("finish_with", ["merge", "rerun"])
def test_metadata_without_committed_marker_is_not_a_checkpoint(tmp_path, finish_with):
    """A merger killed between `.metadata` and COMMITTED leaves `.metadata` without the marker: status
    says not committed, `shardwise merge` completes that save, and a rerun into the directory is not
    refused as an existing checkpoint."""
    d = tmp_path / "c"
    sid = "interrupted"
    save_ranks(str(d), [{"w": row_shard("w", r, 2)} for r in range(2)], save_id=sid)
    (d / ".shardwise" / sid / "COMMITTED").unlink()
    (d / "metadata.json").unlink()
    st = json.loads(cli("status", d, "--json").stdout)
    assert st["checkpoint"] == "not_committed" and st["saves"][0]["state"] == "incomplete"
    if finish_with == "merge":
        out = cli("merge", d)
        assert out.returncode == 0 and f"committed save {sid}" in out.stdout, out.stdout + out.stderr
    else:
        save_ranks(str(d), [{"w": row_shard("w", r, 2, rows=3)} for r in range(2)], save_id="again")
        assert read_all(str(d))[0]["w"].shape == (6, 8)
    assert (d / "metadata.json").exists() and cli("verify", d).returncode == 0
    assert json.loads(cli("status", d, "--json").stdout)["checkpoint"] == "committed"
