"""Integrity on every read, `shardwise diff` and `verify` of the whole checkpoint: real megatron-core
GPTModels saved by Megatron's own torch_dist (TP=2, the shared ``tp2dp2`` run) and by shardwise
(TP=2, and TP=1 in one extra process), damaged copies of them, and their `to-hf` output."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

import mcore_workers
import shardwise
from conftest import _run

CLI = [sys.executable, "-m", "shardwise.cli"]
NUDGED = "decoder.layers.mlp.linear_fc2.weight"

# build_gpt's dimensions as an HF llama config (the checkpoints carry no Megatron args). Its learned
# position embeddings have no llama name: conversions pass allow_unmapped.
LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
         "tie_word_embeddings": False}


def cli(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def tp1(tmp_path_factory):
    """The tp2dp2 model saved by shardwise at TP=1 (one process), and a copy with one element of
    NUDGED one ulp up."""
    base, _ = _run(tmp_path_factory, "tp1", mcore_workers.tp1_with_ulp, 1, NUDGED)
    return base


@pytest.fixture(scope="session")
def hf_config(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_text(json.dumps(LLAMA))
    return p


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _flip(path, at):
    b = bytearray(path.read_bytes())
    b[at] ^= 0x10
    path.write_bytes(bytes(b))


def _pkl_data_at(raw: bytes) -> int:
    """Offset of the data of the ``data.pkl`` record of a torch.save archive (from its local header)."""
    import io
    import zipfile

    info = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith("data.pkl"))
    h = info.header_offset
    return h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")


def _flip_pkl_of_item(ckpt, key):
    """Flips a byte inside the ``data.pkl`` record of byte object ``key``; returns (file, item offset)."""
    md = shardwise.open(ckpt).metadata(key)
    raw = (ckpt / md["relative_path"]).read_bytes()[md["offset"]:md["offset"] + md["length"]]
    _flip(ckpt / md["relative_path"], md["offset"] + _pkl_data_at(raw) + 3)
    return md["relative_path"], md["offset"]


def _flip_in_item(ckpt, key, chunk=0, back=64):
    """Flips one byte ``back`` bytes before the end of the item's storage record region (inside the
    tensor data or the object's pickle, before the zip directory); returns (file name, item offset)."""
    md = shardwise.open(ckpt).metadata(key)
    item = md["chunks"][chunk] if md["kind"] == "tensor" else md
    raw = (ckpt / item["relative_path"]).read_bytes()[item["offset"]:item["offset"] + item["length"]]
    # The zip central directory starts at the first "PK\x01\x02"; stay before the last local record's end.
    cd = raw.find(b"PK\x01\x02")
    _flip(ckpt / item["relative_path"], item["offset"] + cd - back)
    return item["relative_path"], item["offset"]


# --- diff ------------------------------------------------------------------------------------


def test_diff_megatron_tp2_against_shardwise_tp1_is_equal(tp2dp2, tp1):
    base, _ = tp2dp2
    for a in (base / "megatron", base / "shardwise"):
        rep = shardwise.diff(a, tp1 / "tp1", exclude=["common_state*", "common.pt"])  # args differ: TP2 vs TP1
        tensors = [k for k in rep["keys"] if k["kind"] == "tensor"]
        assert len(tensors) >= 10
        assert all(k["status"] == "equal" and k["elements"] > 0 for k in tensors), [k for k in tensors if k["status"] != "equal"]
        assert rep["exit_code"] == 0, [k for k in rep["keys"] if k["status"] != "equal"]
    # The same through the CLI, with its exit status.
    r = cli("diff", base / "megatron", tp1 / "tp1", "--exclude", "common_state*", "--exclude", "common.pt", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert json.loads(r.stdout)["different"] == 0


def test_diff_names_exactly_the_tensor_changed_by_one_ulp(tp2dp2, tp1):
    base, _ = tp2dp2
    rep = shardwise.diff(base / "megatron", tp1 / "tp1_ulp", exclude=["common_state*", "common.pt"])
    bad = [k for k in rep["keys"] if k["status"] != "equal"]
    assert [k["key"] for k in bad] == [NUDGED]
    (k,) = bad
    assert k["status"] == "different" and k["mismatched"] == 1
    w = shardwise.open(tp1 / "tp1").read(NUDGED).view(-1)[7]
    assert k["max_abs"] == pytest.approx(float(torch.nextafter(w, torch.tensor(float("inf"))) - w), rel=1e-6)
    # One ulp is within rtol=1e-6: "close", and the exit status says no difference.
    close = shardwise.diff(tp1 / "tp1", tp1 / "tp1_ulp", rtol=1e-6)
    assert [k["key"] for k in close["keys"] if k["status"] != "equal"] == [NUDGED]
    assert close["close"] == 1 and close["exit_code"] == 0
    r = cli("diff", tp1 / "tp1", tp1 / "tp1_ulp")
    assert r.returncode == 1 and f"DIFFERENT {NUDGED}: 1 of " in r.stdout, r.stdout + r.stderr
    r = cli("diff", tp1 / "tp1", tp1 / "tp1_ulp", "--keys", "embedding.word*", "--json")
    assert r.returncode == 0 and [k["key"] for k in json.loads(r.stdout)["keys"]] == ["embedding.word_embeddings.weight"]


def test_diff_reports_missing_keys_and_shapes(tp2dp2, tp1, tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from dcp_util import save_ranks

    one = tmp_path / "one"
    save_ranks(str(one), [{"embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
        "embedding.word_embeddings.weight", torch.zeros(8, 64), replica_id=0)}])
    rep = shardwise.diff(tp1 / "tp1", one)
    by = {k["key"]: k for k in rep["keys"]}
    assert by["embedding.word_embeddings.weight"]["status"] == "different"
    assert "global shape [256, 64] in A, [8, 64] in B" in by["embedding.word_embeddings.weight"]["message"]
    assert by[NUDGED]["status"] == "only_in_a" and rep["only_in_b"] == 0 and rep["exit_code"] == 1


def test_diff_checkpoint_against_its_to_hf_output(tp2dp2, hf_config, tmp_path):
    base, _ = tp2dp2
    out = tmp_path / "hf"
    shardwise.to_hf(str(base / "megatron"), str(out), hf_config=str(hf_config), max_shard_size="100KB",
                     allow_unmapped=True)
    rep = shardwise.diff(base / "megatron", out, allow_unmapped=True)  # config: the folder's config.json
    assert rep["mode"] == "hf" and rep["exit_code"] == 0, [k for k in rep["keys"] if k["status"] != "equal"]
    assert rep["equal"] == len(rep["keys"]) >= 20
    # Against the TP=2 shardwise save too, with the folder as A; and a damaged HF file is found.
    assert shardwise.diff(out, base / "shardwise", allow_unmapped=True)["exit_code"] == 0
    st = sorted(out.glob("*.safetensors"))[-1]
    b = bytearray(st.read_bytes())
    b[-3] ^= 0x40  # the last tensor's data
    st.write_bytes(bytes(b))
    r = cli("diff", base / "shardwise", out, "--allow-unmapped")
    assert r.returncode == 1 and r.stdout.count("DIFFERENT ") == 1, r.stdout + r.stderr


def test_diff_reads_an_hf_folder_through_its_index_as_loaders_do(tp2dp2, hf_config, tmp_path):
    """diff reads an HF folder as transformers and from-hf do, through model.safetensors.index.json:
    an index naming a missing file, misplacing a tensor or naming none is never "equal"; a stale
    shard the index does not name is ignored, as loaders ignore it."""
    base, _ = tp2dp2
    out = tmp_path / "hf"
    shardwise.to_hf(str(base / "megatron"), str(out), hf_config=str(hf_config), max_shard_size="100KB",
                     allow_unmapped=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2

    def with_index(name, weight_map, extra=None):
        d = tmp_path / name
        shutil.copytree(out, d)
        (d / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
        if extra:
            shutil.copy(out / files[0], d / extra)
        return d

    first = sorted(index["weight_map"])[0]
    missing = with_index("missing", {**index["weight_map"], first: "model-99999-of-99999.safetensors"})
    with pytest.raises(shardwise.InvalidArgumentError, match="which is not a file"):
        shardwise.diff(base / "megatron", missing, allow_unmapped=True)
    other = next(f for f in files if f != index["weight_map"][first])
    moved = with_index("moved", {**index["weight_map"], first: other})
    with pytest.raises(shardwise.ValidationError, match=f"puts {re.escape(first)} in {re.escape(other)}"):
        shardwise.diff(base / "megatron", moved, allow_unmapped=True)
    empty = with_index("empty", {})
    assert shardwise.diff(base / "megatron", empty, allow_unmapped=True)["exit_code"] != 0
    r = cli("diff", base / "megatron", empty, "--allow-unmapped")
    assert r.returncode != 0 and "equal" in r.stdout and " 0 only in A" not in r.stdout, r.stdout + r.stderr
    stale = with_index("stale", index["weight_map"], extra="model-00099-of-00099.safetensors")
    assert shardwise.diff(base / "megatron", stale, allow_unmapped=True)["exit_code"] == 0


# --- damage found by read, to-hf and verify ------------------------------------------------------


def test_flipped_byte_in_a_tensor_item(tp1, hf_config, tmp_path):
    ck = _copy(tp1 / "tp1", tmp_path / "ck")
    key = "decoder.layers.self_attention.linear_qkv.weight"
    file, offset = _flip_in_item(ck, key)
    r = shardwise.open(ck)
    with pytest.raises(shardwise.CorruptFileError) as e:
        r.read(key)
    msg = str(e.value)
    assert key in msg and file in msg and f"offset {offset}" in msg and "CRC-32" in msg
    with pytest.raises(shardwise.CorruptFileError, match="CRC-32") as e:
        r.read(key, (0, slice(0, 2)))  # a partial read of the damaged chunk checks its whole item
    assert r.read(key, (1,)).shape == (128, 64)  # layer 1 is another chunk, undamaged
    # Other keys still read.
    assert r.read("embedding.word_embeddings.weight").shape == (256, 64)
    with pytest.raises(shardwise.CorruptFileError, match=key.replace(".", r"\.")):
        shardwise.to_hf(str(ck), str(tmp_path / "hf"), hf_config=str(hf_config), allow_unmapped=True)
    v = cli("verify", ck, "--json")
    assert v.returncode == 1
    problems = json.loads(v.stdout)["problems"]
    assert [(p["key"], p["file"], p["offset"]) for p in problems] == [(key, file, offset)]
    # --quick reads no data: the damage is invisible to it, the layout is fine.
    q = cli("verify", ck, "--quick", "--json")
    assert q.returncode == 0 and json.loads(q.stdout)["quick"] is True


def test_flipped_byte_in_a_byte_object(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from dcp_util import row_shard, save_ranks

    ck = tmp_path / "ck"
    save_ranks(str(ck), [{"w": row_shard("w", 0, 1), "o": ShardedObject("rng_state", {"seed": 1234, "pad": list(range(64))}, (1,), (0,), replica_id=0)}])
    key = "rng_state/shard_0_1"
    file, offset = _flip_pkl_of_item(ck, key)
    with pytest.raises(shardwise.CorruptFileError) as e:
        shardwise.open(ck).read_bytes(key)
    assert key in str(e.value) and file in str(e.value) and f"offset {offset}" in str(e.value)
    v = cli("verify", ck)
    assert v.returncode == 1 and f"PROBLEM {key} [{file} @ {offset}]" in v.stdout, v.stdout
    # to-hf never reads optimizer/RNG objects (skipped by design); the tensors still convert.


def test_flipped_byte_in_common_pt(tp1, hf_config, tmp_path):
    ck = _copy(tp1 / "tp1", tmp_path / "ck")
    common = ck / "common.pt"
    _flip(common, _pkl_data_at(common.read_bytes()) + 3)
    with pytest.raises(shardwise.CorruptFileError, match="common.pt.*CRC-32"):
        shardwise.open(ck).read_common()
    with pytest.raises(shardwise.CorruptFileError, match="common.pt"):
        shardwise.to_hf(str(ck), str(tmp_path / "hf"), hf_config=str(hf_config), allow_unmapped=True)
    v = cli("verify", ck, "--json")
    assert v.returncode == 1
    assert [p["key"] for p in json.loads(v.stdout)["problems"]] == ["common.pt"]


def test_verify_finds_a_common_pt_byte_that_no_zip_crc_covers(tp1, tmp_path):
    """A byte of common.pt outside every record's data (here the "version made by" field of its zip
    central directory) passes the zip CRCs; verify, quick or not, still reports common.pt against
    the size and CRC-32 that its COMMITTED record holds (issue 25)."""
    ck = _copy(tp1 / "tp1", tmp_path / "ck")
    common = ck / "common.pt"
    _flip(common, common.read_bytes().find(b"PK\x01\x02") + 4)
    shardwise.open(ck).read_common()  # every zip record still checks out
    for quick in ([], ["--quick"]):
        v = cli("verify", ck, "--json", *quick)
        assert v.returncode == 1, v.stdout + v.stderr
        problems = json.loads(v.stdout)["problems"]
        assert [p["key"] for p in problems] == ["common.pt"], problems
        assert "changed since the commit" in problems[0]["message"], problems


def test_flipped_byte_in_megatron_common_state_object(tp2dp2, hf_config, tmp_path):
    """megatron-core 0.19 keeps the common state inside DCP (``common_state/shard_0_1``); a
    Megatron-written checkpoint has no sidecar, so the zip CRCs are what finds the damage."""
    base, _ = tp2dp2
    ck = _copy(base / "megatron", tmp_path / "ck")
    keys = [k for k in shardwise.open(ck).keys() if k.startswith("common_state")]
    if not keys:
        pytest.skip("this megatron-core writes common.pt (< 0.19)")
    (key,) = keys
    _flip_pkl_of_item(ck, key)
    with pytest.raises(shardwise.CorruptFileError, match="common_state.*CRC-32"):
        shardwise.open(ck).read_common()
    with pytest.raises(shardwise.CorruptFileError, match="common_state"):
        shardwise.to_hf(str(ck), str(tmp_path / "hf"), hf_config=str(hf_config), allow_unmapped=True)
    v = cli("verify", ck, "--json")
    assert v.returncode == 1 and key in {p["key"] for p in json.loads(v.stdout)["problems"]}


def test_verify_covers_metadata_json_and_the_common_state(tp1, tmp_path):
    ck = _copy(tp1 / "tp1", tmp_path / "ck")
    assert cli("verify", ck).returncode == 0 and cli("verify", ck, "--quick").returncode == 0
    (ck / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                  "surprise": 1}))
    q = cli("verify", ck, "--quick", "--json")
    assert q.returncode == 1
    assert [(p["key"], "surprise" in p["message"]) for p in json.loads(q.stdout)["problems"]] == [("metadata.json", True)]
    (ck / "metadata.json").unlink()
    q = cli("verify", ck, "--quick")
    assert q.returncode == 1 and "PROBLEM metadata.json" in q.stdout
    # A truncated data file: --quick sees it from the file size alone.
    ck2 = _copy(tp1 / "tp1", tmp_path / "ck2")
    data = sorted(ck2.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-100])
    q = cli("verify", ck2, "--quick", "--json")
    assert q.returncode == 1 and any("passes the end of the file" in p["message"] for p in json.loads(q.stdout)["problems"])


def test_diff_compares_the_common_state(tmp_path):
    # Two saves of equal weights whose common state (iteration, lr) differs were "all equal", exit 0.
    import shardwise.megatron as swm
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    w = torch.arange(12.0).reshape(3, 4)
    for name, it in (("a", 5), ("b", 6), ("c", 5)):
        swm.save({"w": ShardedTensor.from_rank_offsets("w", w.clone(), replica_id=0), "iteration": it, "lr": 0.1},
                 tmp_path / name, rank=0, world_size=1)
    rep = shardwise.diff(tmp_path / "a", tmp_path / "b")
    by = {k["key"]: k for k in rep["keys"]}
    assert by["w"]["status"] == "equal"
    assert by["common.pt"]["status"] == "different" and rep["exit_code"] == 1, by["common.pt"]
    assert shardwise.diff(tmp_path / "a", tmp_path / "c")["exit_code"] == 0
    assert shardwise.diff(tmp_path / "a", tmp_path / "b", exclude=["common.pt"])["exit_code"] == 0
    r = cli("diff", tmp_path / "a", tmp_path / "b")
    assert r.returncode == 1 and "common.pt" in r.stdout, r.stdout
