"""Attempts, relaunches and outcomes, replayed the way they happen in real jobs (issue 14).

Every rank is a real process (forked from the forkserver of test_faults.py, so the launch environment
is identical from one attempt to the next: a relaunch with a static ``MASTER_ADDR``/``MASTER_PORT``
and no ``TORCHELASTIC_RUN_ID`` derives the same default save id again). Each test names the case of
issue 14 it replays; docs/guarantees.md has a row per case.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardwise
import shardwise.megatron as swm
from dcp_util import row_shard, save_ranks
from test_faults import CLI, ROWS, WORLD, cli, ctx, finish, start_ranks, wait_for  # noqa: F401 (ctx: fixture)

TESTS_DIR = Path(__file__).parent


def expected_w(offsets) -> torch.Tensor:
    """``w`` as ranks 0..WORLD-1 save it (test_faults' worker), rank r's rows plus ``offsets[r]``."""
    return torch.cat([row_shard("w", r, WORLD, rows=ROWS, cols=1024).data + offsets[r] for r in range(WORLD)])


def wait_for_parts(ckpt: Path, ranks, attempt=None) -> None:
    """Until each of ``ranks`` published a part (of attempt ``n`` of the derived id, when given)."""
    deadline = time.monotonic() + 60
    saves = "*" if attempt is None else f"*.{attempt}"
    while not all(list((ckpt / ".shardwise").glob(f"{saves}/{r}.part")) for r in ranks):
        assert time.monotonic() < deadline, f"parts of ranks {list(ranks)} never appeared"
        time.sleep(0.01)


def kill_all(procs) -> None:
    for p in procs.values():
        p.kill()
    for p in procs.values():
        p.join(10)


def assert_holds(ckpt: Path, offsets) -> None:
    """Committed, whole (verify checks every item CRC), and holding exactly these values."""
    assert shardwise._native.is_committed(str(ckpt))
    out = cli("verify", ckpt)
    assert out.returncode == 0, out.stdout + out.stderr
    assert torch.equal(shardwise.open(ckpt).read("w"), expected_w(offsets))


def test_relaunch_never_merges_an_earlier_attempts_part(ctx, tmp_path):
    """Case 1. Attempt 1: ranks 1 and 2 publish their parts, the merging rank 0 dies before it
    publishes; the launcher ends the job. Attempt 2, same environment so the same derived save id:
    rank 0 first, ranks 1 and 2 three seconds late with new values. The merger must not take the
    parts of attempt 1 (a checkpoint mixing both attempts, which verify would call OK); every rank
    succeeds and the checkpoint holds attempt 2's values only."""
    ckpt, out = tmp_path / "iter_0000010", tmp_path / "out"
    first = start_ranks(ctx, ckpt, None, out / "a1", ranks=[1, 2], timeout_s=30.0, offset=1.0)
    wait_for_parts(ckpt, [1, 2])
    kill_all(first)
    procs = start_ranks(ctx, ckpt, None, out / "a2", ranks=[0], timeout_s=30.0, offset=2.0)
    time.sleep(3.0)
    procs.update(start_ranks(ctx, ckpt, None, out / "a2", ranks=[1, 2], timeout_s=30.0, offset=2.0))
    results = finish(procs, out / "a2", "None")
    assert all(r["ok"] for r in results.values()), results
    assert_holds(ckpt, [2.0, 2.0, 2.0])


def test_rerun_after_a_failed_attempt_gives_every_rank_the_same_outcome(ctx, tmp_path):
    """Case 2. Attempt 1 fails (rank 2 never comes; the merger publishes FAILED). The rerun derives
    the same id; a non-merging rank arrives first and must not take attempt 1's FAILED for its own:
    the merger commits attempt 2 and every rank says so."""
    ckpt, out = tmp_path / "c", tmp_path / "out"
    first = finish(start_ranks(ctx, ckpt, None, out / "a1", ranks=[0, 1], timeout_s=1.0), out / "a1", "None")
    assert first[0]["type"] == "MissingRanksError" and first[1]["type"] == "NotCommittedError", first
    assert list((ckpt / ".shardwise").glob("*/FAILED"))
    procs = start_ranks(ctx, ckpt, None, out / "a2", ranks=[1, 2], timeout_s=30.0, offset=1.0)
    time.sleep(2.0)
    procs.update(start_ranks(ctx, ckpt, None, out / "a2", ranks=[0], timeout_s=30.0, offset=1.0))
    results = finish(procs, out / "a2", "None")
    assert all(r["ok"] for r in results.values()), results
    assert_holds(ckpt, [1.0, 1.0, 1.0])


def test_a_rerun_rank_started_before_a_dead_publishers_part_replaces_it(ctx, tmp_path):
    """Case 2b (issue 25). A rank process of the rerun exists before attempt 1's process for the same
    rank publishes its part (launcher restarts overlap); that publisher, on this host, is then killed.
    Its liveness is known here, so the part is attempt 1's leftover however recently it was published:
    the rerun replaces it and commits, instead of refusing it as a second live process saving as the
    same rank (the time rule is for publishers on other hosts)."""
    ckpt, out, go = tmp_path / "c", tmp_path / "out", tmp_path / "go"
    # The rerun's ranks 0 and 2 import torch after `go` is touched; on a loaded machine that
    # alone takes 30 s, so rank 1's wait for their commit is bounded generously.
    slow = start_ranks(ctx, ckpt, None, out / "a2", ranks=[1], timeout_s=180.0, offset=2.0, start_after=str(go))
    first = start_ranks(ctx, ckpt, None, out / "a1", ranks=[1], timeout_s=30.0, offset=1.0)
    wait_for_parts(ckpt, [1])
    kill_all(first)
    # The rest of the rerun starts after attempt 1's part, so the merger takes it for an earlier one.
    procs = {**slow, **start_ranks(ctx, ckpt, None, out / "a2", ranks=[0, 2], timeout_s=180.0, offset=2.0)}
    go.touch()
    results = finish(procs, out / "a2", "None", bound_s=240.0)
    assert all(r["ok"] for r in results.values()), results
    assert_holds(ckpt, [2.0, 2.0, 2.0])


def test_racing_cli_merges_after_a_failed_merge_all_succeed(ctx, tmp_path):
    """Case 3. Every part is there, an earlier merge failed (it expected a 4th rank) and left FAILED;
    six `shardwise merge` processes then race: exactly one commits and all six exit 0."""
    ckpt, out = tmp_path / "c", tmp_path / "out"
    parts = finish(start_ranks(ctx, ckpt, "race", out, timeout_s=60.0, merge_rank=None, wait_for_commit=False), out, "race")
    assert all(r["ok"] for r in parts.values()), parts
    failed = cli("merge", ckpt, "--save-id", "race", "--world-size", "4")
    assert failed.returncode == 1 and (ckpt / ".shardwise" / "race" / "FAILED").is_file(), failed.stderr
    mergers = [subprocess.Popen([*CLI, "merge", str(ckpt), "--save-id", "race", "--json"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(6)]
    done = [(m.wait(120), *m.communicate()) for m in mergers]
    assert [code for code, _, _ in done] == [0] * 6, [err for _, _, err in done]
    summaries = [json.loads(o) for _, o, _ in done]
    assert sum(not s["already_committed"] for s in summaries) == 1
    assert all(s["keys"] == 2 and s["tensor_chunks"] == 2 * WORLD for s in summaries), "every merger reports the commit"
    assert_holds(ckpt, [0.0] * WORLD)


def test_a_second_process_saving_as_the_same_rank_is_refused(ctx, tmp_path):
    """Case 4. Rank 1 has published and waits for the commit; a second process then saves as rank 1
    of the same save. It is refused before it writes anything (on a filesystem too, not only on
    object stores), and the save commits the first process's data."""
    ckpt, out = tmp_path / "c", tmp_path / "out"
    p1 = start_ranks(ctx, ckpt, "dup", out / "p1", ranks=[1], timeout_s=60.0, offset=1.0)
    wait_for(ckpt / ".shardwise" / "dup" / "1.part")
    second = finish(start_ranks(ctx, ckpt, "dup", out / "p2", ranks=[1], timeout_s=60.0, offset=2.0), out / "p2", "dup")
    assert second[1]["type"] == "ValidationError" and "two processes save as the same rank" in second[1]["error"], second
    rest = start_ranks(ctx, ckpt, "dup", out / "p1", ranks=[0, 2], timeout_s=60.0)
    results = finish({**p1, **rest}, out / "p1", "dup")
    assert all(r["ok"] for r in results.values()), results
    assert_holds(ckpt, [0.0, 1.0, 0.0])


def top_level_digest(ckpt: Path, names) -> dict:
    return {n: (ckpt / n).read_bytes() for n in names}


def test_overwrite_keeps_the_old_checkpoint_until_the_new_one_commits(ctx, tmp_path):
    """Case 5. overwrite=True with a rank missing fails, and the committed checkpoint is untouched:
    same bytes, committed, verified, loaded by plain DCP. With every rank the overwrite commits new
    data under new file names and removes the old files."""
    from dcp_util import read_all

    ckpt, out = tmp_path / "c", tmp_path / "out"
    first = finish(start_ranks(ctx, ckpt, "old", out, timeout_s=60.0, offset=1.0), out, "old")
    assert all(r["ok"] for r in first.values()), first
    old_files = sorted(p.name for p in ckpt.iterdir() if p.is_file())
    before = top_level_digest(ckpt, old_files)
    failed = finish(start_ranks(ctx, ckpt, "new", out, ranks=[0, 1], timeout_s=1.0, offset=2.0, overwrite=True),
                    out, "new")
    assert failed[0]["type"] == "MissingRanksError", failed
    assert top_level_digest(ckpt, old_files) == before, "a failed overwrite changed the committed checkpoint"
    assert_holds(ckpt, [1.0, 1.0, 1.0])
    assert torch.equal(read_all(ckpt)[0]["w"], expected_w([1.0, 1.0, 1.0])), "plain torch DCP still loads the old save"
    st = json.loads(cli("status", ckpt, "--json").stdout)
    assert st["checkpoint"] == "committed", st

    done = finish(start_ranks(ctx, ckpt, "new2", out, timeout_s=60.0, offset=2.0, overwrite=True), out, "new2")
    assert all(r["ok"] for r in done.values()), done
    assert_holds(ckpt, [2.0, 2.0, 2.0])
    assert torch.equal(read_all(ckpt)[0]["w"], expected_w([2.0, 2.0, 2.0]))
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == [f"__{r}_1.distcp" for r in range(WORLD)]
    assert [p.name for p in (ckpt / ".shardwise").iterdir() if p.is_dir()] == ["new2"]


def test_merging_rank_failing_early_fails_the_others_within_seconds(ctx, tmp_path):
    """Case 12. The merging rank cannot write its own data file (here a directory is in the way; a
    full disk behaves alike). The other ranks learn it at their next poll, with the merger's error,
    instead of waiting out their 60 s timeout."""
    ckpt, out = tmp_path / "c", tmp_path / "out"
    (ckpt / "__0_0.distcp").mkdir(parents=True)
    results = finish(start_ranks(ctx, ckpt, "early", out, timeout_s=60.0), out, "early", bound_s=40.0)
    assert results[0]["type"] == "StorageError" and "rank 0" in results[0]["error"], results[0]
    for r in (1, 2):
        assert results[r]["type"] == "NotCommittedError", results[r]
        assert "the merging rank 0 failed" in results[r]["error"] and results[r]["elapsed_s"] < 15, results[r]
    assert not (ckpt / ".metadata").exists()


def test_status_says_a_failed_save_would_now_commit_and_names_orphaned_files(ctx, tmp_path):
    """Case 13. The merger gave up on rank 2, which published later: status says `merge` would now
    commit (and it does). Data files that no part names (ranks killed before publishing) are listed
    instead of "no shardwise saves"."""
    ckpt, out = tmp_path / "c", tmp_path / "out"
    gave_up = finish(start_ranks(ctx, ckpt, "late", out, ranks=[0, 1], timeout_s=1.0), out, "late")
    assert gave_up[0]["type"] == "MissingRanksError", gave_up
    late = finish(start_ranks(ctx, ckpt, "late", out / "late", ranks=[2], timeout_s=60.0, wait_for_commit=False), out / "late", "late")
    assert late[2]["ok"], late
    st = cli("status", ckpt)
    assert "every rank's part is now present: `shardwise merge` would commit it" in st.stdout, st.stdout
    assert json.loads(cli("status", ckpt, "--json").stdout)["saves"][0]["state"] == "failed"
    assert cli("merge", ckpt).returncode == 0
    assert_holds(ckpt, [0.0] * WORLD)

    orphaned = tmp_path / "orphaned"
    orphaned.mkdir()
    shutil.copy(ckpt / "__1_0.distcp", orphaned / "__1_0.distcp")  # what a rank killed mid-save leaves
    st = cli("status", orphaned)
    assert st.returncode == 1 and "1 data file that no part names" in st.stdout and "__1_0.distcp" in st.stdout, st.stdout
    assert json.loads(cli("status", orphaned, "--json").stdout)["orphaned_data_files"] == ["__1_0.distcp"]


def failed_markers(ckpt: Path) -> list:
    return list((ckpt / ".shardwise").glob("*/FAILED"))


def one_retry_id(results: dict) -> str:
    """The save id every rank's report names: the second attempt of the derived id."""
    ids = {r["report"]["save_id"] for r in results.values()}
    assert len(ids) == 1 and ids.pop().endswith(".2"), results
    return next(iter(results.values()))["report"]["save_id"]


def test_a_retry_by_processes_started_before_the_failure_commits(ctx, tmp_path):
    """Case 14 (issue 37). The retry's rank processes exist before attempt 1 fails (a pool of
    workers, a launcher that starts the next ranks early). Attempt 1: rank 2 is SIGKILLed before it
    publishes, the merger times out and writes FAILED after the retry's processes started. The
    retry must not take that FAILED for its own: every rank begins attempt 2 and it commits."""
    ckpt, out, go = tmp_path / "c", tmp_path / "out", tmp_path / "go"
    retry = start_ranks(ctx, ckpt, None, out / "a2", timeout_s=30.0, offset=2.0, start_after=str(go))
    kill_all(start_ranks(ctx, ckpt, None, out / "dead", ranks=[2], start_after=str(tmp_path / "never")))
    # 3 s: on a loaded machine rank 1 must still join attempt 1 before the merger gives up on it.
    first = finish(start_ranks(ctx, ckpt, None, out / "a1", ranks=[0, 1], timeout_s=3.0, offset=1.0), out / "a1", "None")
    assert first[0]["type"] == "MissingRanksError" and first[1]["type"] == "NotCommittedError", first
    go.touch()
    results = finish(retry, out / "a2", "None")
    assert all(r["ok"] for r in results.values()), results
    assert_holds(ckpt, [2.0, 2.0, 2.0])
    one_retry_id(results)


def test_a_rank_that_missed_the_failed_attempt_saves_once_into_the_retry(ctx, tmp_path):
    """Case 15 (issue 37). Rank 1 is busy and makes no call in attempt 1; the merger times out
    (FAILED), rank 2 learns it, and ranks 0 and 2 retry in their processes. Rank 1 then makes its
    first call, with the same iteration's state: it joins the retry instead of taking attempt 1's
    failure, and the retry commits. (Rank 2 waits longer than the merger, so that its attempt ends
    by the merger's FAILED: a rank that gives up first and retries at once joins the same attempt,
    which has not ended.)"""
    ckpt, out, go = tmp_path / "c", tmp_path / "out", tmp_path / "go"
    busy = start_ranks(ctx, ckpt, None, out / "late", ranks=[1], timeout_s=30.0, offset=1.0, start_after=str(go))
    # 3 s: on a loaded machine rank 2 must still join attempt 1 before the merger gives up on it.
    retrying = {**start_ranks(ctx, ckpt, None, out / "a", ranks=[0], timeout_s=3.0, offset=1.0, retry_timeout_s=30.0),
                **start_ranks(ctx, ckpt, None, out / "a", ranks=[2], timeout_s=30.0, offset=1.0, retry_timeout_s=30.0)}
    deadline = time.monotonic() + 60
    while not failed_markers(ckpt):
        assert time.monotonic() < deadline, "attempt 1 never failed"
        time.sleep(0.01)
    go.touch()
    results = {**finish(retrying, out / "a", "None"), **finish(busy, out / "late", "None")}
    assert all(r["ok"] for r in results.values()), results
    assert results[0]["first"]["type"] == "MissingRanksError" and "ranks [1" in results[0]["first"]["error"], results
    assert results[2]["first"]["type"] == "NotCommittedError" and "first" not in results[1], results
    assert_holds(ckpt, [1.0, 1.0, 1.0])
    one_retry_id(results)


def test_a_retry_while_a_straggler_of_the_failed_attempt_still_publishes(ctx, tmp_path):
    """Case 16 (issue 37). Rank 2 of attempt 1 is stopped (SIGSTOP) in the middle of its save;
    attempt 1 fails (rank 1 never comes). The retry's processes, started before the failure, save
    and rank 2's retry publishes; only then does the straggler go on (SIGCONT): it writes the rest
    of its data file and publishes its part. The retry commits its own data only: the straggler's
    part lies under attempt 1's id, and its writes go to the file the retry unlinked, not to the
    retry's. The straggler gets attempt 1's error."""
    ckpt, out, go = tmp_path / "c", tmp_path / "out", tmp_path / "go"
    retry = start_ranks(ctx, ckpt, None, out / "a2", timeout_s=30.0, offset=2.0, start_after=str(go))
    straggler = start_ranks(ctx, ckpt, None, out / "s", ranks=[2], timeout_s=5.0, offset=1.0)
    wait_for(ckpt / "__2_0.distcp")
    os.kill(straggler[2].pid, signal.SIGSTOP)
    try:
        first = finish(start_ranks(ctx, ckpt, None, out / "a1", ranks=[0], timeout_s=1.0, offset=1.0), out / "a1", "None")
        assert first[0]["type"] == "MissingRanksError" and "ranks [1" in first[0]["error"], first
        go.touch()
        wait_for_parts(ckpt, [2], attempt=2)
    finally:
        os.kill(straggler[2].pid, signal.SIGCONT)
    late = finish(straggler, out / "s", "None")
    results = finish(retry, out / "a2", "None")
    assert all(r["ok"] for r in results.values()), results
    assert late[2]["type"] == "NotCommittedError" and ".1 " in late[2]["error"], late
    assert_holds(ckpt, [2.0, 2.0, 2.0])
    one_retry_id(results)


# ---------------------------------------------------------------------------------------------
# One definition of "committed" (case 6), in-process saves
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def committed(tmp_path):
    ckpt = tmp_path / "iter_0000007"
    save_ranks(str(ckpt), [{"w": row_shard("w", r, 2), "b": row_shard("b", r, 2)} for r in range(2)])
    return tmp_path, ckpt


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shardwise-pwned",))


DAMAGE = {
    "random .metadata": lambda c: (c / ".metadata").write_bytes(os.urandom(4096)),
    "hostile pickle .metadata": lambda c: (c / ".metadata").write_bytes(pickle.dumps(Boom())),
    "data file missing": lambda c: (c / "__1_0.distcp").unlink(),
    "data file truncated": lambda c: os.truncate(c / "__0_0.distcp", 100),
    ".metadata removed": lambda c: (c / ".metadata").unlink(),
    "common.pt replaced": lambda c: (c / "common.pt").write_bytes(b"not the committed common state"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_committed_means_whole_for_rust_cli_and_python(committed, damage):
    """Case 6: the save, `status`, the tracker and retention share one definition. A `.metadata` of
    random bytes or a hostile pickle (never executed), a missing or truncated data file, a removed
    `.metadata`, a replaced `common.pt`: not committed anywhere."""
    root, ckpt = committed
    assert shardwise._native.is_committed(str(ckpt)) and json.loads(cli("status", ckpt, "--json").stdout)["checkpoint"] == "committed"
    DAMAGE[damage](ckpt)
    assert not shardwise._native.is_committed(str(ckpt))
    st = json.loads(cli("status", ckpt, "--json").stdout)
    assert st["checkpoint"] == "damaged", st
    with pytest.raises(shardwise.NotCommittedError):
        swm.update_tracker(str(root), 7)
    assert swm.committed_iterations(str(root)) == []
    assert not Path("/tmp/shardwise-pwned").exists(), "a pickle was executed"
    with pytest.raises(shardwise.InvalidArgumentError, match="damaged checkpoint"):
        save_ranks(str(ckpt), [{"w": row_shard("w", r, 2)} for r in range(2)])


@pytest.mark.parametrize("damage", ["random .metadata", ".metadata removed", "hostile pickle .metadata"])
def test_merge_repair_rebuilds_a_damaged_metadata_from_the_parts(committed, damage):
    root, ckpt = committed
    DAMAGE[damage](ckpt)
    st = cli("status", ckpt)
    assert "DAMAGED" in st.stdout and "shardwise merge --repair" in st.stdout, st.stdout
    fixed = cli("merge", ckpt, "--repair")
    assert fixed.returncode == 0, fixed.stderr
    assert shardwise._native.is_committed(str(ckpt)) and cli("verify", ckpt).returncode == 0
    assert torch.equal(shardwise.open(ckpt).read("w"), torch.cat([row_shard("w", r, 2).data for r in range(2)]))
    assert cli("merge", ckpt, "--repair").returncode == 1, "a whole checkpoint has nothing to repair"


def test_a_torch_written_checkpoint_is_committed_by_its_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    dcp.save({"x": torch.arange(10.0)}, storage_writer=dcp.FileSystemWriter(str(d)))
    assert shardwise._native.is_committed(str(d))
    (d / "__0_0.distcp").write_bytes(b"")
    assert not shardwise._native.is_committed(str(d)), "a torch checkpoint whose data file is empty is not whole"


# ---------------------------------------------------------------------------------------------
# The Python API (cases 7-11)
# ---------------------------------------------------------------------------------------------


def test_save_checkpoint_async_returns_a_handle_that_moves_the_tracker(tmp_path):
    """Case 7: `save_checkpoint(..., async_save=True)` returns a handle; its wait() returns the report
    once the save committed and the tracker moved."""
    h = swm.save_checkpoint(str(tmp_path), 5, {"w": row_shard("w", 0, 1)}, rank=0, world_size=1,
                            save_id="async", async_save=True)
    assert isinstance(h, swm.CheckpointHandle) and h.staged_bytes > 0
    report = h.wait(60)
    assert report["tracker"] == 5 and report["committed"] and swm.read_tracker(str(tmp_path)) == 5
    assert h.done() and h.wait() is report


EXIT_SCRIPT = """
import sys
import shardwise.megatron as swm
from dcp_util import row_shard
ckpt, world, rows, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
swm.save({"w": row_shard("w", 0, world, rows=rows, cols=1024)}, ckpt, rank=0, world_size=world,
         save_id="exit", timeout_s=timeout, async_save=True)
print("staged", flush=True)
"""


def run_exit_script(ckpt: Path, world: int, rows: int, timeout_s: float):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(ckpt), str(world), str(rows), str(timeout_s)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_interpreter_exit_waits_for_pending_async_saves_and_reports_failures(tmp_path):
    """Case 8: a script that returns right after an async save: the interpreter waits for the save
    (bounded by its timeout) and the checkpoint is committed; a save that fails makes the exit status
    1 with the error on stderr, instead of a silent exit 0."""
    ok = run_exit_script(tmp_path / "ok", 1, 65536, 60.0)  # 256 MiB: still in flight at exit
    assert ok.returncode == 0 and "staged" in ok.stdout, ok.stderr
    assert shardwise._native.is_committed(str(tmp_path / "ok")), ok.stderr
    bad = run_exit_script(tmp_path / "bad", 2, 16, 1.0)  # rank 1 never comes
    assert bad.returncode == 1, bad.stderr
    assert "FAILED at exit" in bad.stderr and "ranks [1]" in bad.stderr, bad.stderr


@pytest.mark.parametrize("async_save", [False, True])
def test_argument_errors_are_raised_by_save_itself(tmp_path, async_save):
    """Cases 9 and 10: a zero staging budget or an absurd timeout is an InvalidArgumentError from the
    call itself (never a handle that fails later, never a Rust panic), and nothing is written."""
    d = tmp_path / "c"
    state = lambda: {"w": row_shard("w", 0, 1)}  # noqa: E731
    with pytest.raises(shardwise.InvalidArgumentError, match="staging_budget_bytes"):
        swm.save(state(), str(d), rank=0, world_size=1, async_save=async_save, staging_budget_bytes=0)
    for t in (1e300, float("nan"), float("inf"), -1.0):
        with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
            swm.save(state(), str(d), rank=0, world_size=1, async_save=async_save, timeout_s=t)
    assert not d.exists() or not any(d.iterdir())
    with pytest.raises(shardwise.InvalidArgumentError):
        shardwise.merge(str(d), "x", 1, 1e300)
    out = cli("merge", d, "--save-id", "x", "--world-size", "1", "--timeout", "1e300")
    assert out.returncode == 1 and "invalid argument" in out.stderr and "panicked" not in out.stderr, out.stderr


def test_ctrl_c_stops_a_cli_merge_within_a_poll(ctx, tmp_path):
    """Case 11 (CLI): SIGINT to `shardwise merge --timeout 60` waiting for a missing rank: exit 130
    within a poll interval, nothing committed."""
    ckpt, out = tmp_path / "c", tmp_path / "out"
    assert finish(start_ranks(ctx, ckpt, "int", out, ranks=[0, 1], timeout_s=60.0, merge_rank=None, wait_for_commit=False),
                  out, "int")[0]["ok"]
    # SIGINT as a terminal gives it, whatever this test run inherited (background jobs ignore it).
    merger = subprocess.Popen([*CLI, "merge", str(ckpt), "--world-size", str(WORLD), "--timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(ckpt / ".shardwise" / "int" / "COMMITTING")
    t0 = time.monotonic()
    merger.send_signal(signal.SIGINT)
    code = merger.wait(30)
    assert code == 130 and time.monotonic() - t0 < 3.0, (code, merger.stderr.read())
    assert "interrupted" in merger.stderr.read()
    assert not (ckpt / ".metadata").exists()


def test_ctrl_c_stops_a_waiting_merging_rank_and_the_others_learn_it(ctx, tmp_path):
    """Case 11 (Python): SIGINT to the merging rank while it waits for a rank that never comes raises
    KeyboardInterrupt within a poll; it publishes the failure, so the other rank stops too; nothing
    is committed; a rerun commits."""
    ckpt, sid, out = tmp_path / "c", "int", tmp_path / "out"
    procs = start_ranks(ctx, ckpt, sid, out, ranks=[0, 1], timeout_s=60.0)
    wait_for(ckpt / ".shardwise" / sid / "COMMITTING")
    t0 = time.monotonic()
    os.kill(procs[0].pid, signal.SIGINT)
    results = finish(procs, out, sid, bound_s=30.0)
    assert results[0]["type"] == "KeyboardInterrupt" and time.monotonic() - t0 < 10, results[0]
    assert results[1]["type"] == "NotCommittedError" and "interrupted" in results[1]["error"], results[1]
    assert not (ckpt / ".metadata").exists()
    rerun = finish(start_ranks(ctx, ckpt, "int2", out, timeout_s=60.0), out, "int2")
    assert all(r["ok"] for r in rerun.values()), rerun
    assert_holds(ckpt, [0.0] * WORLD)


def test_ctrl_c_stops_an_async_saves_wait_and_a_later_wait_gets_the_outcome(tmp_path):
    """SaveHandle.wait answers Ctrl-C within a poll, as every other wait does: rank 0 of 2 saves
    asynchronously and waits for rank 1, which never comes; SIGINT raises KeyboardInterrupt at once,
    the save goes on in its thread, and a second wait() gets its own outcome (the missing rank)."""
    script = tmp_path / "wait.py"
    script.write_text(
        "import sys, time, torch\n"
        "from megatron.core.dist_checkpointing.mapping import ShardedTensor\n"
        "import shardwise.megatron as swm\n"
        "sd = {'w': ShardedTensor.from_rank_offsets('w', torch.ones(4, 4), (0, 0, 2))}\n"
        f"h = swm.save(sd, {str(tmp_path / 'c')!r}, rank=0, world_size=2, async_save=True, timeout_s=4.0)\n"
        "print('waiting', flush=True)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    h.wait()\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted after', time.monotonic() - t0, flush=True)\n"
        "try:\n"
        "    h.wait()\n"
        "except Exception as e:\n"
        "    print('outcome', type(e).__name__, e, flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "waiting", p.stderr.read()
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("interrupted after") and float(lines[0].split()[-1]) < 2.0, out
    assert lines[1].startswith("outcome MissingRanksError") and "[1]" in lines[1], out
    assert not (tmp_path / "c" / ".metadata").exists()


def test_an_unwaited_failed_async_save_fails_the_exit_even_after_later_saves(tmp_path):
    """A save that failed while nobody waited for it is not forgotten when later saves start and
    commit: the exit status is 1 and stderr names it. (A save whose error a wait() gave the caller
    is not reported again: the Ctrl-C test above exits 0.)"""
    script = tmp_path / "later.py"
    script.write_text(
        "import time, torch\n"
        "from megatron.core.dist_checkpointing.mapping import ShardedTensor\n"
        "import shardwise.megatron as swm\n"
        "sd = {'w': ShardedTensor.from_rank_offsets('w', torch.ones(4, 4), (0, 0, 2))}\n"
        f"lost = swm.save(sd, {str(tmp_path / 'lost')!r}, rank=0, world_size=2, async_save=True, timeout_s=1.0)\n"
        "while not lost.done():\n"
        "    time.sleep(0.05)\n"
        "one = {'w': ShardedTensor.from_rank_offsets('w', torch.ones(4, 4))}\n"
        f"swm.save(one, {str(tmp_path / 'kept')!r}, rank=0, world_size=1, async_save=True).wait()\n"
        "print('later save committed', flush=True)\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "later save committed" in r.stdout, r.stderr
    assert r.returncode == 1 and "FAILED at exit" in r.stderr and "lost" in r.stderr and "ranks [1]" in r.stderr, r.stderr
    assert (tmp_path / "kept" / ".metadata").exists() and not (tmp_path / "lost" / ".metadata").exists()
