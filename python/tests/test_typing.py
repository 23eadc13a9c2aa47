"""The typed Python surface (issue 39): ``python/shardwise`` type-checks with mypy against the shipped
stub ``_native.pyi``; the stub's signatures match the extension module (``mypy.stubtest``); the
reports real calls return have exactly the fields and value types of the stub's ``TypedDict``s; and
those bite: a report field that does not exist, or used as the wrong type, fails the check. The
mypy settings are ``[tool.mypy]`` in pyproject.toml."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def _mypy(*args: str) -> subprocess.CompletedProcess:
    """``python -m mypy ARGS`` from the repository root with its pyproject.toml settings (the cache
    in ROOT/.mypy_cache: the first run analyses torch and megatron-core, about 20 s; later ones
    take a second)."""
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(PYPROJECT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_package_type_checks_against_the_stub():
    r = _mypy()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout, r.stdout


def test_the_stub_matches_the_extension_module():
    """Every name, signature (positional, keyword-only, defaults) and class of the built
    ``shardwise._native`` against the stub; only the stub-only report types are allow-listed."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "shardwise._native", "--mypy-config-file", str(PYPROJECT),
         "--allowlist", str(Path(__file__).with_name("stubtest_allowlist.txt"))],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


# Each line marked `# E: text` must fail the check with `text` in the message; no other line may.
_MISUSE = '''
import shardwise
import shardwise.dcp
import shardwise.megatron as swm

st = shardwise.status("ckpt")
st["no_such_field"]  # E: TypedDict "StatusReport" has no key "no_such_field"
n: int = st["checkpoint"]  # E: Incompatible types in assignment
st["saves"][0]["ranks"][0]["age"]  # E: TypedDict "RankStatus" has no key "age"
shardwise.diff("a", "b")["keys"][0]["max_abs"] + 1.0  # E: Unsupported operand types for + ("None" and "float")
shardwise.merge("ckpt", "id", 2, 10.0)["keys"].upper()  # E: "int" has no attribute "upper"
shardwise.to_hf("ckpt", "out")["tensor"]  # E: TypedDict "ToHfSummary" has no key "tensor"
shardwise.from_hf("hf", "ckpt")["tracker"].upper()  # E: Item "None" of "str | None" has no attribute "upper"
swm.save({}, "ckpt")["commit"]["keys"]  # E: Value of type "CommitSummary | None" is not indexable
swm.save({}, "ckpt", async_save=True)["committed"]  # E: Value of type "SaveHandle" is not indexable
swm.save_checkpoint("root", 1, {})["no_such_field"]  # E: TypedDict "CheckpointReport" has no key "no_such_field"
shardwise.dcp.finish("ckpt")["already_committed"]  # E: TypedDict "RankLocalMergeSummary" has no key
shardwise.status("ckpt", keys="yes")  # E: Argument "keys" to "status" has incompatible type "str"
shardwise.to_hf("ckpt", "out", "config.json")  # E: Too many positional arguments for "to_hf"
'''

# The same reports used as they are: no error.
_USE = '''
import shardwise
import shardwise.dcp
import shardwise.megatron as swm
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise._native import KeyDiff, StatusReport

st: StatusReport = shardwise.status("ckpt", keys=True)
committed: bool = st["checkpoint"] == "committed" and all(s["state"] == "committed" for s in st["saves"])
ages: list[float] = [r["age_s"] for s in st["saves"] for r in s["ranks"]]
d = shardwise.diff("a", "b", atol=1e-3)
worst: list[KeyDiff] = [k for k in d["keys"] if k["status"] != "equal"]
exit_code: int = d["exit_code"]
rep = swm.save({}, "ckpt", rank=0, world_size=1)
commit = rep["commit"]
keys: int = commit["keys"] if commit is not None else 0
handle = swm.save({}, "ckpt", async_save=True)
later: float = handle.wait(60)["write_s"]
ck = swm.save_checkpoint("root", 1, {})
deleted: list[str] = ck.get("deleted", [])
md = shardwise.open("ckpt").metadata("w")
if md["kind"] == "tensor":
    shape: list[int] = md["global_shape"]
merged: int = shardwise.dcp.finish("ckpt")["ranks"]
gb: float = shardwise.to_hf("ckpt", "out", workers=2)["gb_per_s"] + shardwise.from_hf("hf", "ckpt")["gb_per_s"]
'''


def _check(tmp_path, name: str, source: str) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    expected = {i: m.group(1) for i, line in enumerate(source.splitlines(), start=1)
                if (m := re.search(r"# E: (.*)$", line))}
    return _mypy(str(path)), expected


def test_misused_reports_fail_the_check(tmp_path):
    r, expected = _check(tmp_path, "misuse.py", _MISUSE)
    assert r.returncode == 1, r.stdout + r.stderr
    errors: dict[int, list[str]] = {}
    for m in re.finditer(r"misuse\.py:(\d+): error: (.*)$", r.stdout, re.M):
        errors.setdefault(int(m.group(1)), []).append(m.group(2))
    for line, text in expected.items():
        assert any(text in e for e in errors.get(line, [])), (line, text, r.stdout)
    assert set(errors) == set(expected), r.stdout


def test_reports_used_as_documented_pass_the_check(tmp_path):
    r, _ = _check(tmp_path, "use.py", _USE)
    assert r.returncode == 0, r.stdout + r.stderr


# --- the TypedDicts against real reports ----------------------------------------------------------
# stubtest checks signatures only: a TypedDict is not there at run time. Here each report a real call
# returns is checked against its TypedDict as the stub writes it (every field, no other, each value
# of its declared type, nested reports included), so a field added to a Rust report struct fails
# until the stub has it.

STUB = ROOT / "python" / "shardwise" / "_native.pyi"


def _stub_types() -> tuple[dict[str, tuple[dict, set]], dict[str, ast.expr]]:
    """(TypedDict name -> (field -> annotation, required fields)) with inherited fields, and the
    stub's type aliases (name -> annotation)."""
    tree = ast.parse(STUB.read_text())
    typed: dict[str, tuple[dict, set]] = {}
    aliases: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if "TypedDict" not in bases and not any(b in typed for b in bases):
                continue
            fields, required = {}, set()
            for b in bases:
                if b in typed:
                    fields.update(typed[b][0])
                    required |= typed[b][1]
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign):
                    name, ann = stmt.target.id, stmt.annotation
                    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "NotRequired":
                        fields[name] = ann.slice
                    else:
                        fields[name] = ann
                        required.add(name)
            typed[node.name] = (fields, required)
        elif isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "TypeAlias":
            aliases[node.target.id] = node.value
    return typed, aliases


_TYPED, _ALIASES = _stub_types()
_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def _matches(value, ann: ast.expr, where: str) -> list[str]:
    """Why ``value`` is not of the stub's type ``ann`` (empty when it is)."""
    text = ast.unparse(ann)
    if isinstance(ann, ast.BinOp):  # X | Y
        left, right = _matches(value, ann.left, where), _matches(value, ann.right, where)
        return [] if not left or not right else [f"{where}: {value!r} is not {text}"]
    if isinstance(ann, ast.Constant) and ann.value is None:
        return [] if value is None else [f"{where}: {value!r} is not None"]
    if isinstance(ann, ast.Name):
        if ann.id in _ALIASES:
            return _matches(value, _ALIASES[ann.id], where)
        if ann.id in _TYPED:
            return _report_problems(value, ann.id, where)
        t = _SCALARS[ann.id]
        ok = isinstance(value, t) and (t is bool or not isinstance(value, bool))
        return [] if ok else [f"{where}: {value!r} is not {text}"]
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "list":
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not {text}"]
        return [p for i, v in enumerate(value) for p in _matches(v, ann.slice, f"{where}[{i}]")]
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "dict":
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not {text}"]
        key, val = ann.slice.elts
        return [p for k, v in value.items()
                for p in _matches(k, key, f"{where} key {k!r}") + _matches(v, val, f"{where}[{k!r}]")]
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Literal":
        allowed = [e.value for e in (ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice])]
        return [] if value in allowed else [f"{where}: {value!r} is not {text}"]
    raise AssertionError(f"{where}: the test does not know the stub type {text}")


def _report_problems(report, typed_dict: str, where: str = "report") -> list[str]:
    fields, required = _TYPED[typed_dict]
    if not isinstance(report, dict):
        return [f"{where}: {type(report).__name__}, not a dict ({typed_dict})"]
    problems = [f"{where}: {k!r} is not a field of {typed_dict}" for k in report if k not in fields]
    problems += [f"{where}: {typed_dict} field {k!r} is missing" for k in required if k not in report]
    for k, v in report.items():
        if k in fields:
            problems += _matches(v, fields[k], f"{where}[{k!r}]")
    return problems


def _assert_report(report, typed_dict: str) -> None:
    problems = _report_problems(report, typed_dict, typed_dict)
    assert not problems, "\n".join(problems)


def _tiny_llama(base: Path) -> tuple[Path, Path]:
    """A committed one-rank llama checkpoint of 2 layers (hidden 16) with a byte object and
    common state, and an HF config.json for it."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import shardwise.megatron as swm

    g = torch.Generator().manual_seed(0)

    def t(key, *shape):
        return ShardedTensor.from_rank_offsets(key, torch.randn(*shape, generator=g), replica_id=0)

    layers, hidden, ffn, vocab = 2, 16, 32, 64
    sd = {"emb": t("embedding.word_embeddings.weight", vocab, hidden), "out": t("output_layer.weight", vocab, hidden),
          "norm": t("decoder.final_layernorm.weight", hidden),
          "opt": ShardedObject("opt", {"lr": 0.5}, (1,), (0,), replica_id=0)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        sd.update({p + "qkv": t(p + "self_attention.linear_qkv.weight", 3 * hidden, hidden),
                   p + "proj": t(p + "self_attention.linear_proj.weight", hidden, hidden),
                   p + "ln1": t(p + "input_layernorm.weight", hidden), p + "ln2": t(p + "pre_mlp_layernorm.weight", hidden),
                   p + "fc1": t(p + "mlp.linear_fc1.weight", 2 * ffn, hidden),
                   p + "fc2": t(p + "mlp.linear_fc2.weight", hidden, ffn)})
    ckpt = base / "ckpt"
    _assert_report(swm.save(sd, str(ckpt), rank=0, world_size=1, timeout_s=30), "SaveReport")
    config = base / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
                                  "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": ffn,
                                  "vocab_size": vocab, "tie_word_embeddings": False}))
    return ckpt, config


def _ones(key: str):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.ones(4, 4), replica_id=0)


def test_every_report_has_exactly_the_fields_of_its_typed_dict(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    import shardwise
    import shardwise.dcp
    import shardwise.megatron as swm
    from shardwise import _native

    ckpt, config = _tiny_llama(tmp_path)
    _assert_report(shardwise.status(str(ckpt)), "StatusReport")
    with_keys = shardwise.status(str(ckpt), keys=True)
    assert with_keys["saves"][0]["keys"] and with_keys["saves"][0]["ranks"]
    _assert_report(with_keys, "StatusReport")
    _assert_report(shardwise.diff(str(ckpt), str(ckpt)), "DiffReport")

    hf = tmp_path / "hf"
    _assert_report(shardwise.to_hf(str(ckpt), str(hf), hf_config=str(config), allow_unmapped=True), "ToHfSummary")
    hf_diff = shardwise.diff(str(ckpt), str(hf), allow_unmapped=True)
    assert hf_diff["mode"] == "hf"
    _assert_report(hf_diff, "DiffReport")
    back = shardwise.from_hf(str(hf), str(tmp_path / "iter_0000007"), iteration=7, tracker=True)
    assert back["tracker"] is not None
    _assert_report(back, "FromHfSummary")

    # An async save that nobody merges, then the merge.
    sd = {"w": _ones("w")}
    handle = swm.save(sd, str(tmp_path / "c2"), rank=0, world_size=1, timeout_s=30, async_save=True, merge_rank=None,
                      wait_for_commit=False)
    report = handle.wait(60)
    assert report["commit"] is None
    _assert_report(report, "SaveReport")
    _assert_report(shardwise.merge(str(tmp_path / "c2"), report["save_id"], 1, 30.0), "CommitSummary")

    _assert_report(swm.reserve_staging(1 << 20), "StagingReservation")
    _assert_report(swm.save_checkpoint(str(tmp_path / "root"), 5, {"w": _ones("w")}, rank=0, world_size=1,
                                       timeout_s=30, keep_last=1), "CheckpointReport")

    opened = _native.open_checkpoint(str(ckpt))
    out = torch.empty(16)
    region = _native.Region(key="decoder.final_layernorm.weight", offsets=[0], sizes=[16], data_ptr=out.data_ptr(),
                            nbytes=64)
    _assert_report(opened.load_into([region]), "LoadStats")
    with shardwise.open(str(ckpt)) as r:
        _assert_report(r.metadata("output_layer.weight"), "TensorMetadata")
        _assert_report(r.metadata("opt/shard_0_1"), "ObjectMetadata")

    local = tmp_path / "dcp_local"
    dcp.save({"x": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(local)), no_dist=True,
             use_collectives=False)
    _assert_report(shardwise.dcp.finish(str(local), world_size=1, timeout_s=30), "RankLocalMergeSummary")


def test_the_field_check_itself_catches_a_stray_a_missing_and_a_mistyped_field():
    good = {"already_committed": False, "keys": 1, "tensor_chunks": 1, "byte_objects": 0, "data_bytes": 64,
            "metadata_bytes": 100, "took_over_dead_merger": False}
    assert _report_problems(good, "CommitSummary") == []
    assert _report_problems({**good, "extra": 1}, "CommitSummary")
    assert _report_problems({k: v for k, v in good.items() if k != "keys"}, "CommitSummary")
    assert _report_problems({**good, "keys": True}, "CommitSummary")
    assert _report_problems({**good, "keys": "1"}, "CommitSummary")
