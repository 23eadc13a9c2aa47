"""Every crash point of the tracker's update and of retention, the durable state Python writes
(``update_tracker``, ``retain``): each as a process death (a forked child ends with ``os._exit``
right before the operation) and as every power loss ``crash_model`` derives there. The Rust half
(save, merge, repair, overwrite, from-hf, to-hf) is ``tests/crashpoints.rs`` and
``crates/shardwise-hf/tests/crashpoints.rs``; docs/guarantees.md ("Every crash point") has the
counts and times.

For each state: the tracker holds the old or the new iteration, never anything else, and names a
committed iteration; every visible ``iter_*`` folder is committed and whole (``status`` and
``verify`` agree), so a crash mid-retention never leaves a partial checkpoint in sight; the newest
iteration is there; a rerun (``update_tracker`` then ``retain``) ends with only it.
"""

from __future__ import annotations

import os
import shutil
import time

import shardwise
import shardwise.megatron as swm
from crash_model import Model, hooked, materialize
from dcp_util import row_shard, save_ranks

ITERS = (1, 2, 3)


def _operation(root: str) -> None:
    swm.update_tracker(root, 3)
    swm.retain(root, keep=1)


def _run_child(root: str, out: str, target) -> int:
    """Forks a child that runs the operation on ``root`` with the hook; at point ``target`` (an
    index, None: record only, "end": after it returned) it writes the power-loss states into
    ``out`` and ends at once. Returns the number of points seen (recording)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            model, seen = Model(root), []

            def crash():
                descs, trees = [], [model.tree(("all",), ("written",))]
                for names, data in model.states():
                    tree = model.tree(names, data)
                    if tree in trees:
                        continue
                    trees.append(tree)
                    materialize(tree, os.path.join(out, f"power-{len(descs)}"))
                    descs.append(model.describe(names, data))
                with open(os.path.join(out, "states"), "w") as f:
                    f.write("\n".join(descs))
                os._exit(0)

            def hook(op, path, src=None):
                if len(seen) == target:
                    crash()
                seen.append(f"{op} {os.path.relpath(path, root)}")
                model.record(op, path, src)

            with hooked(hook):
                _operation(root)
            if target == "end":
                crash()
            with open(os.path.join(out, "points"), "w") as f:
                f.write("\n".join(seen))
        except BaseException as e:  # noqa: BLE001: the child reports everything and never returns
            with open(os.path.join(out, "error"), "w") as f:
                f.write(repr(e))
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, open(os.path.join(out, "error")).read()
    return 0


def _whole(ckpt: str) -> bool:
    return shardwise._native.cli_main(["shardwise", "verify", ckpt]) == 0


def _check(root: str, done: bool) -> list[str]:
    v = []
    tracker = swm.read_tracker(root)
    if tracker not in ((3,) if done else (2, 3)):
        v.append(f"the tracker holds {tracker}")
    visible = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    for name in visible:
        ckpt = os.path.join(root, name)
        state = shardwise.status(ckpt)["checkpoint"]
        if state != "committed" or not _whole(ckpt):
            v.append(f"{name} is in sight but {state} (verify whole: {_whole(ckpt)})")
    if tracker is not None and swm.checkpoint_name(root, tracker) not in [os.path.join(root, n) for n in visible]:
        v.append(f"the tracker names iteration {tracker}, which is gone")
    if "iter_0000003" not in visible:
        v.append("the newest iteration is gone")
    try:
        _operation(root)
    except shardwise.ShardwiseError as e:
        return v + [f"the rerun fails: {e}"]
    left = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    if left != ["iter_0000003"] or swm.read_tracker(root) != 3:
        v.append(f"after the rerun: {left}, tracker {swm.read_tracker(root)}")
    return v


def test_every_crash_point_of_the_tracker_and_retention(tmp_path):
    t0 = time.monotonic()
    template = tmp_path / "template"
    for it in ITERS:
        save_ranks(swm.checkpoint_name(str(template), it), [{"w": row_shard("w", r, 2)} for r in range(2)])
    swm.update_tracker(str(template), 2)
    record = tmp_path / "record"
    shutil.copytree(template, record / "root")
    _run_child(str(record / "root"), str(record), None)
    points = (record / "points").read_text().splitlines()
    violations, states, power = [], 0, 0
    for k in [*range(len(points)), "end"]:
        at = tmp_path / "point"
        shutil.rmtree(at, ignore_errors=True)
        shutil.copytree(template, at / "root")
        _run_child(str(at / "root"), str(at), k)
        descs = [d for d in (at / "states").read_text().splitlines() if d]
        name = points[k] if k != "end" else "end"
        for desc, state in [("process death", at / "root"), *((d, at / f"power-{i}") for i, d in enumerate(descs))]:
            states += 1
            power += state.name.startswith("power-")
            violations += [f"#{k} {name} [{desc}]: {x}" for x in _check(str(state), k == "end")]
    took = time.monotonic() - t0
    print(f"crashpoints tracker and retention: {len(points) + 1} points, {states} states ({power} power loss), "
          f"{len(violations)} violations, {took:.1f} s")
    assert not violations, "\n".join(violations[:40])
    assert len(points) > 10 and power > 0
