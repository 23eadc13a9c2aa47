"""The `shardwise` command as a Unix tool: closed pipes, sizes, JSON, wording, paths, hints and
progress. Every case runs the installed `shardwise` console script in a real subprocess."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

import shardwise
import shardwise.megatron as swm
from dcp_util import row_shard, save_ranks

SHARDWISE = str(Path(sys.executable).parent / "shardwise")
# The CLI reference: every subcommand, the "JSON output" fields and the exception classes.
CLI_DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
COMMANDS = ["inspect", "verify", "status", "merge", "to-hf", "diff"]


def sw(*args, **kw):
    """Runs `shardwise ARGS` (str, bytes or paths); stdout and stderr captured as text."""
    return subprocess.run([SHARDWISE, *(a if isinstance(a, bytes) else str(a) for a in args)], capture_output=True,
                          text=True, errors="replace", timeout=120, **kw)


def assert_clean_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("shardwise: error: ") and "Traceback" not in r.stderr and "panicked" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A committed 2-rank checkpoint of 1,500 keys (two row chunks each, one per rank) and a byte
    object: its JSON and text outputs are far larger than a pipe's 64 KiB buffer."""
    d = tmp_path_factory.mktemp("many") / "ckpt"
    states = [{f"layer{i:04d}.weight": row_shard(f"layer{i:04d}.weight", r, 2) for i in range(1500)} for r in range(2)]
    states[0]["opt"] = ShardedObject("opt", {"lr": 0.5}, (1,), (0,), replica_id=0)
    save_ranks(str(d), states)
    return d


@pytest.fixture()
def small(tmp_path):
    """A committed 2-rank checkpoint: w float32 (8, 8) in two row chunks; rank 1 also holds a
    replica of b that rank 0 writes."""
    d = tmp_path / "ckpt"
    states = [{"w": row_shard("w", r, 2), "b": row_shard("b", 0, 1, rows=8, cols=1, replica_id=r)} for r in range(2)]
    save_ranks(str(d), states)
    return d


# --- a closed pipe ends the command quietly -----------------------------------------------------


def test_head_closing_the_pipe_ends_inspect_json_quietly(many):
    """`shardwise inspect --json DIR | head -3`, with the real head."""
    p1 = subprocess.Popen([SHARDWISE, "inspect", "--json", str(many)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p2 = subprocess.Popen(["head", "-3"], stdin=p1.stdout, stdout=subprocess.PIPE)
    p1.stdout.close()
    out, _ = p2.communicate(timeout=120)
    err = p1.stderr.read()
    assert p1.wait(120) == 141 and err == b"", (p1.returncode, err)
    assert out.decode().splitlines()[0] == "{"


def _closed_stdout(*args) -> subprocess.CompletedProcess:
    """Runs `shardwise ARGS` with stdout a pipe whose reader is already gone: its first write fails
    with EPIPE (deterministically, whatever the output size)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([SHARDWISE, *map(str, args)], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["verify"], ["verify", "--json"], ["status"],
                                  ["status", "--keys", "--json"]])
def test_every_read_command_ends_quietly_on_a_closed_stdout(many, args):
    r = _closed_stdout(*args, many)
    assert (r.returncode, r.stderr) == (141, ""), (args, r.returncode, r.stderr)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_merge_ends_quietly_on_a_closed_stdout_after_committing(tmp_path, json_flag):
    d = tmp_path / "c"
    sid = uuid.uuid4().hex
    for r in (0, 1):
        swm.save({"w": row_shard("w", r, 2)}, str(d), rank=r, world_size=2, save_id=sid, merge_rank=None)
    r = _closed_stdout("merge", *json_flag, d)
    assert (r.returncode, r.stderr) == (141, ""), (r.returncode, r.stderr)
    assert (d / ".metadata").exists(), "the commit happened before the result was printed"


def test_help_to_a_closed_stdout_is_quiet():
    r = _closed_stdout("inspect", "--help")
    assert r.stderr == "" and r.returncode in (0, 141)


# --- sizes, JSON, field names, wording ----------------------------------------------------------


def test_tables_show_human_sizes_and_json_plain_bytes(small):
    text = sw("inspect", small)
    assert text.returncode == 0, text.stderr
    assert re.search(r"\b\d+\.\d\d KiB\b", text.stdout), text.stdout
    info = json.loads(sw("inspect", "--json", small).stdout)
    md = shardwise.open(small)
    expect = sum(c["length"] for k in md.keys() for c in md.metadata(k).get("chunks", [md.metadata(k)]))
    assert info["bytes"] == expect and all(isinstance(k["bytes"], int) for k in info["keys"])
    status = sw("status", small).stdout
    assert "KiB in __0_0.distcp" in status, status


def test_every_json_flag_is_in_help_and_every_field_in_the_readme(small, tmp_path):
    """Each command's `--json` help, and every field of its output in docs/cli.md ("JSON output")."""
    for cmd in COMMANDS:
        help_text = sw(cmd, "--help").stdout
        assert "--json" in help_text and "plain bytes" in help_text, (cmd, help_text)
        assert f"shardwise {cmd}" in CLI_DOC and "--json" in CLI_DOC
    section = CLI_DOC[CLI_DOC.index("### JSON output"):]
    section = section[: section.index("\n## ")]
    outputs = {
        "inspect": json.loads(sw("inspect", "--json", small).stdout),
        "verify": json.loads(sw("verify", "--json", small).stdout),
        "status": json.loads(sw("status", "--keys", "--json", small).stdout),
        "merge": json.loads(sw("merge", "--json", small).stdout),
        "diff": json.loads(sw("diff", "--json", small, small).stdout),
    }
    fields = {f"inspect.{k}" for k in outputs["inspect"]} | {f"inspect.keys[].{k}" for k in outputs["inspect"]["keys"][0]}
    fields |= {f"verify.{k}" for k in outputs["verify"]} | {f"merge.{k}" for k in outputs["merge"]}
    fields |= {f"status.{k}" for k in outputs["status"]} | {f"status.saves[].{k}" for k in outputs["status"]["saves"][0]}
    fields |= {f"status.saves[].ranks[].{k}" for k in outputs["status"]["saves"][0]["ranks"][0]}
    fields |= {f"status.saves[].keys[].{k}" for k in outputs["status"]["saves"][0]["keys"][0]}
    fields |= {f"diff.{k}" for k in outputs["diff"]} | {f"diff.keys[].{k}" for k in outputs["diff"]["keys"][0]}
    undocumented = sorted(f for f in fields if f"`{f.rsplit('.', 1)[1]}`" not in section)
    assert not undocumented, f"docs/cli.md's JSON section misses {undocumented}"



def test_every_subcommand_is_in_the_cli_reference():
    """docs/cli.md has each subcommand `shardwise --help` lists, in its synopsis and with its own entry."""
    help_text = sw("--help").stdout
    listed = help_text[help_text.index("Commands:"):help_text.index("Options:")]
    commands = [m for m in re.findall(r"^  ([a-z][a-z-]*) ", listed, re.M) if m != "help"]
    assert set(COMMANDS) <= set(commands) and {"from-hf", "rewrite-metadata"} <= set(commands), commands
    synopsis = CLI_DOC[CLI_DOC.index("## Synopsis"):CLI_DOC.index("## The subcommands")]
    entries = CLI_DOC[CLI_DOC.index("## The subcommands"):]
    missing = [c for c in commands if f"shardwise {c} " not in synopsis or f"**`shardwise {c} " not in entries]
    assert not missing, f"docs/cli.md misses {missing}"

def test_status_keys_are_objects_named_as_in_inspect(small):
    st = json.loads(sw("status", "--keys", "--json", small).stdout)
    keys = {k["key"]: k for k in st["saves"][0]["keys"]}
    assert keys["w"] == {"key": "w", "dtype": "float32", "global_shape": [8, 8], "chunks": 2, "ranks": [0, 1]}
    assert keys["b"]["ranks"] == [0] and keys["b"]["chunks"] == 1
    inspect_row = next(k for k in json.loads(sw("inspect", "--json", small).stdout)["keys"] if k["key"] == "w")
    assert {f: inspect_row[f] for f in ("key", "dtype", "global_shape", "chunks")} == \
        {f: keys["w"][f] for f in ("key", "dtype", "global_shape", "chunks")}


def test_text_has_no_class_names_no_none_and_correct_plurals(small):
    texts = {c: sw(*c.split(), small) for c in ("inspect", "verify", "status --keys", "merge")}
    for c, r in texts.items():
        assert r.returncode == 0, (c, r.stderr)
        for bad in ("None", "torch.distributed", "Metadata)", "MCoreMetadata", "[]", "1 keys", "1 chunks", "1 items",
                    "1 tensors", "1 objects", "1 tensor chunks", "1 byte objects", "1 tensor keys", "1 ranks"):
            assert bad not in r.stdout, (c, bad, r.stdout)
    assert "2 tensors, 0 objects," in texts["inspect"].stdout and "(PyTorch DCP metadata)" in texts["inspect"].stdout
    assert ": 2 keys, 3 items, 3 checked" in texts["verify"].stdout
    status = texts["status --keys"].stdout
    assert "rank 1: 1 tensor chunk, 0 byte objects," in status and "2 tensor keys" in status
    assert "b  float32 [8, 1]: 1 chunk from rank [0]" in status and "w  float32 [8, 8]: 2 chunks from ranks [0-1]" in status


def test_a_rank_without_data_says_so(tmp_path):
    """A DP replica writes no data file: `status` says so rather than printing an empty list."""
    d = tmp_path / "c"
    save_ranks(str(d), [{"b": row_shard("b", 0, 1, rows=8, cols=1, replica_id=r)} for r in range(2)])
    out = sw("status", d).stdout
    assert "rank 1: 0 tensor chunks, 0 byte objects, no data file" in out, out


def test_to_hf_errors_do_not_speak_of_commits(tmp_path):
    ck = tmp_path / "ck"
    save_ranks(str(ck), [{"m": row_shard("decoder.layers.0.mystery.weight", 0, 1)}])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                               "num_key_value_heads": 2, "vocab_size": 4}))
    r = sw("to-hf", ck, tmp_path / "o", "--hf-config", cfg)
    assert_clean_error(r, "no rule maps these checkpoint keys")
    assert "commit" not in r.stderr, r.stderr


def test_readme_lists_every_exception_class():
    errors = [n for n in shardwise.__all__ if n.endswith("Error")]
    assert "CorruptFileError" in errors
    error_list = CLI_DOC[CLI_DOC.index("Errors are subclasses of"):]
    error_list = error_list[: error_list.index("\n\n")]
    missing = [e for e in errors if f"`{e}`" not in error_list and e != "ShardwiseError"]
    assert not missing, f"docs/cli.md's error list misses {missing}"


# --- verify groups problems per file ------------------------------------------------------------


def test_a_missing_data_file_is_one_line(many, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(many, d)
    (d / "__1_0.distcp").unlink()
    r = sw("verify", d)
    assert r.returncode == 1, r.stderr
    problems = [line for line in r.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1, r.stdout[:2000]
    assert problems[0].startswith("PROBLEM __1_0.distcp: ") and "1500 items of 1500 keys" in problems[0], problems
    assert r.stdout.splitlines()[-1].endswith(": 1500 PROBLEMS")
    # JSON keeps one record per item, for programs.
    assert len(json.loads(sw("verify", "--json", d).stdout)["problems"]) == 1500


def test_distinct_problems_in_one_file_stay_apart(small):
    data = small / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])  # the last item of rank 0's file passes its end
    out = sw("verify", small).stdout
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problems and all(re.match(r"PROBLEM \S+ \[__0_0\.distcp @ \d+\]: ", p) for p in problems), out


# --- hints: no .metadata, a save root, an unknown save id ---------------------------------------


def test_inspect_on_an_uncommitted_save_suggests_status(tmp_path):
    d = tmp_path / "c"
    swm.save({"w": row_shard("w", 0, 2)}, str(d), rank=0, world_size=2, save_id="s1", merge_rank=None)
    for cmd in ("inspect", "verify"):
        assert_clean_error(sw(cmd, d), ".metadata", f"`shardwise status {d}`")
    with pytest.raises(shardwise.StorageError, match="shardwise status"):
        shardwise.open(d)


def test_a_save_root_names_its_iterations_and_the_tracked_one(tmp_path):
    root = tmp_path / "run"
    for it in (100, 200):
        swm.save_checkpoint(str(root), it, {"w": row_shard("w", 0, 1)}, {"iteration": it}, rank=0, world_size=1)
    (root / "iter_0000300").mkdir()  # a save in progress, not tracked
    for cmd in ("inspect", "verify", "to-hf"):
        extra = [tmp_path / "hf"] if cmd == "to-hf" else []
        assert_clean_error(sw(cmd, root, *extra), "save root", "iter_0000100 to iter_0000300",
                           "latest_checkpointed_iteration.txt says 200", f"point at {root / 'iter_0000200'}")
    st = sw("status", root)  # a save root holds no committed checkpoint: exit 1, with the hint
    assert st.returncode == 1 and f"point at {root / 'iter_0000200'}" in st.stdout, st.stdout


def test_merge_of_an_unknown_save_id_names_the_saves_and_world_size(small):
    sid = json.loads(sw("status", "--json", small).stdout)["saves"][0]["save_id"]
    r = sw("merge", small, "--save-id", "nonexistent")
    assert_clean_error(r, "no save nonexistent", sid, "--world-size")


def test_a_missing_directory_reads_as_missing_for_every_command(tmp_path):
    for cmd in ("inspect", "verify", "status", "merge"):
        assert_clean_error(sw(cmd, tmp_path / "nope"), str(tmp_path / "nope"), "No such file or directory")
    (tmp_path / "file").write_text("x")
    for cmd in ("status", "merge", "inspect"):
        r = sw(cmd, tmp_path / "file")
        assert r.returncode == 1 and "not a directory" in r.stderr.lower() and "Traceback" not in r.stderr, (cmd, r.stderr)


def test_a_file_given_for_the_directory_says_a_checkpoint_is_a_directory(small):
    """`shardwise status FILE` says what it expected and what it was given, as merge and inspect do
    (it said "list FILE/.shardwise: Not a directory")."""
    for cmd in (["status"], ["status", "--json"], ["status", "--repair"], ["merge"], ["merge", "--repair"], ["inspect"]):
        assert_clean_error(sw(*cmd, small / "common.pt"), f"open checkpoint directory {small / 'common.pt'}",
                           "a checkpoint is a directory (pass the directory that holds .metadata, not a file in it)")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "status", "merge", "rewrite-metadata"])
def test_a_missing_directory_argument_is_named(cmd):
    r = sw(cmd)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    missing = "--torch-compat <2.X>, <DIR>" if cmd == "rewrite-metadata" else "<DIR>"
    assert r.stderr == f"shardwise: error: the following required arguments were not provided: {missing} (see --help)\n", \
        r.stderr


def test_status_exits_0_only_for_a_committed_whole_checkpoint(small, tmp_path):
    """Scripts gate on the exit code (`shardwise status ckpt && resume`): damaged and not committed
    exit 1, as verify does on problems, and the report is still printed (text and JSON); the
    Python report is the same."""
    assert sw("status", small).returncode == 0 and sw("status", "--json", small).returncode == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(small, damaged)
    (damaged / ".metadata").write_bytes((small / ".metadata").read_bytes()[:10])
    uncommitted = tmp_path / "uncommitted"
    swm.save({"w": row_shard("w", 0, 2)}, str(uncommitted), rank=0, world_size=2, save_id="s", merge_rank=None)
    empty = tmp_path / "empty"
    empty.mkdir()
    def ageless(report):
        return {**report, "saves": [{**s, "ranks": [{**r, "age_s": 0} for r in s["ranks"]]} for s in report["saves"]]}

    for d, state, first in ((damaged, "damaged", ": DAMAGED: .metadata"), (uncommitted, "not_committed", ": not committed"),
                            (empty, "not_committed", ": not committed (.metadata is absent)")):
        r = sw("status", d)
        assert r.returncode == 1 and r.stdout.startswith(f"{d}{first}") and r.stderr == "", (r.stdout, r.stderr)
        j = sw("status", "--json", d)
        assert j.returncode == 1 and j.stderr == "", j.stderr
        report = json.loads(j.stdout)
        assert report["checkpoint"] == state and ageless(shardwise.status(str(d))) == ageless(report)
    assert sw("status", "--repair", damaged).returncode == 0, "repaired: committed and whole again"


def test_merge_repair_of_a_cp_r_copy_says_copied_not_changed(small, tmp_path):
    """A `cp -r` copy keeps every byte but gives the files new modification times: repair still
    refuses it (the parts vouch only for the files they recorded), and says so rather than that the
    data changed; a `cp -a` copy repairs."""
    for how in ("cp -r", "cp -a"):
        c = tmp_path / how.replace(" ", "")
        subprocess.run([*how.split(), str(small), str(c)], check=True)
        (c / ".metadata").unlink()
        st = sw("status", c)
        r = sw("merge", "--repair", c)
        if how == "cp -a":
            assert st.returncode == 1 and "`shardwise merge --repair" in st.stdout, st.stdout
            assert r.returncode == 0 and sw("verify", c).returncode == 0, r.stderr
            continue
        assert_clean_error(r, "its data file __0_0.distcp has the size the part recorded but a new modification time",
                           "copied (`cp -r` gives new modification times; `cp -a` and `rsync -a` keep them) or rewritten",
                           "`merge --repair` trusts only what a save's parts vouch for",
                           "its files unchanged (size and modification time, or ETag)")
        assert "replaced or changed" not in r.stderr, r.stderr
        assert "copied (`cp -r`" in st.stdout and st.returncode == 1, st.stdout
        assert not (c / ".metadata").exists(), "refused: nothing written"


# --- paths that are not UTF-8 -------------------------------------------------------------------


def test_non_utf8_paths_work_everywhere(tmp_path):
    bad = os.fsencode(tmp_path) + b"/bad\xffname"
    r = sw("verify", bad)  # does not exist yet
    assert_clean_error(r, "bad\ufffdname")
    # save() with the default save_id, into a directory whose name is not UTF-8 (bytes and str forms)
    swm.save({"w": row_shard("w", 0, 1)}, bad, rank=0, world_size=1)
    assert os.path.exists(bad + b"/.metadata")
    for cmd in (["inspect"], ["verify"], ["status", "--keys"], ["inspect", "--json"]):
        r = sw(*cmd, bad)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stdout, r.stderr)
    with shardwise.open(bad) as r1, shardwise.open(os.fsdecode(bad)) as r2:
        assert r1.read("w").equal(r2.read("w"))


# --- permissions ---------------------------------------------------------------------------------


def test_an_unlistable_state_directory_is_an_error_not_no_saves(small):
    """Only a missing `.shardwise` means "no shardwise saves"; one that cannot be listed (here: a
    file, as root cannot be denied a permission) is an error naming the cause."""
    shutil.rmtree(small / ".shardwise")
    (small / ".shardwise").write_text("not a directory")
    r = sw("status", small)
    assert_clean_error(r, "list ", ".shardwise", "Not a directory")
    assert "no shardwise saves" not in r.stdout


def _as_nobody() -> list[str] | None:
    """A command line prefix that runs `shardwise` without root's privileges: the console script,
    or the Rust binary `cargo test --release` built (which needs no libpython, when this Python
    lives where an unprivileged user cannot read it); None when neither can run so."""
    if os.geteuid() != 0:
        return [SHARDWISE]
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return None
    drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    binary = Path(__file__).resolve().parents[2] / "target" / "release" / "shardwise"
    for exe in (SHARDWISE, str(binary)):
        if subprocess.run([*drop, exe, "--version"], capture_output=True, timeout=60).returncode == 0:
            return [*drop, exe]
    return None


def test_permission_denied_reads_as_permission_denied():
    """A directory this user may not read: the error says so (run unprivileged; as root, through
    setpriv), and never reads as "no .shardwise directory" or an absent `.metadata`."""
    cmd_prefix = _as_nobody()
    if cmd_prefix is None:
        pytest.skip("root, and no shardwise that runs unprivileged (setpriv, or the cargo-built binary)")
    top = Path(tempfile.mkdtemp(prefix="sw_perm_", dir="/tmp"))
    try:
        top.chmod(0o755)
        d = top / "ckpt"
        save_ranks(str(d), [{"w": row_shard("w", r, 2)} for r in range(2)])
        d.chmod(0o000)
        for cmd in ("status", "inspect", "verify"):
            r = subprocess.run([*cmd_prefix, cmd, str(d)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 1 and "Permission denied" in r.stderr, (cmd, r.returncode, r.stdout, r.stderr)
            assert "no shardwise saves" not in r.stdout and "absent" not in r.stdout, (cmd, r.stdout)
    finally:
        (top / "ckpt").chmod(0o755)
        shutil.rmtree(top)


# --- progress: on a terminal only ---------------------------------------------------------------


def _stderr_on_a_terminal(*args) -> tuple[int, str]:
    master, slave = pty.openpty()
    p = subprocess.Popen([SHARDWISE, *map(str, args)], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(120), b"".join(chunks).decode(errors="replace")


def test_verify_shows_progress_on_a_terminal_and_none_otherwise(many):
    code, tty = _stderr_on_a_terminal("verify", many)
    assert code == 0 and re.search(r"verify .*\d+/3001 items", tty), tty[-500:]
    piped = sw("verify", many)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    code, tty = _stderr_on_a_terminal("verify", "--json", many)
    assert code == 0 and "items" not in tty, tty[-500:]


def test_merge_shows_progress_on_a_terminal(tmp_path):
    d = tmp_path / "c"
    swm.save({"w": row_shard("w", 0, 2)}, str(d), rank=0, world_size=2, save_id="s", merge_rank=None)
    code, tty = _stderr_on_a_terminal("merge", d, "--timeout", "1")  # rank 1 never comes: a 1 s wait
    assert code == 1 and "merge" in tty and "waiting for" in tty and "rank" in tty, tty[-800:]


# --- the Python Reader --------------------------------------------------------------------------


def test_reader_repr_len_contains_iter_and_context_manager(small):
    with shardwise.open(small) as r:
        assert len(r) == 2 and "w" in r and "nope" not in r and 3 not in r and list(r) == ["b", "w"]
        assert repr(r) == f"<shardwise.Reader {str(small)!r}: 2 keys, PyTorch DCP>"
        assert r.read("w").shape == (8, 8)
    assert "closed" in repr(r)
    with pytest.raises(shardwise.InvalidArgumentError, match="closed"):
        r.keys()
    r.close()  # idempotent


def test_bare_shardwise_prints_the_usage_not_an_error():
    r = sw()
    assert r.returncode == 2, r
    assert "Usage: shardwise <COMMAND>" in r.stderr and "error" not in r.stderr, r.stderr


def test_a_negative_count_names_its_flag_not_an_unexpected_argument(tmp_path):
    # `--workers -3` used to read as an unknown flag `-3` ("unexpected argument '-3' found").
    for args, needle in [(["to-hf", tmp_path, tmp_path / "o", "--workers", "-3"], "'-3' for '--workers <N>'"),
                         (["from-hf", tmp_path, tmp_path / "o", "--iteration", "-5"], "'-5' for '--iteration"),
                         (["merge", tmp_path, "--world-size", "-1"], "'-1' for '--world-size"),
                         (["diff", tmp_path, tmp_path, "--threads", "-2"], "'-2' for '--threads")]:
        r = sw(*args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
    r = sw("to-hf", tmp_path, tmp_path / "o", "--part", "-1/2")
    assert r.returncode == 1 and '--part "-1/2": use i/n' in r.stderr, r.stderr
