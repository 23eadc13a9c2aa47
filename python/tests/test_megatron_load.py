"""shardwise.megatron.load (issue 17): the collective-free resharding load.

One 4-rank gloo run (``load_workers.load_matrix``, session-scoped) saves a GPT (SwiGLU, GQA) at
TP2 x DP2 with Megatron's own save and with shardwise, an EP=2 MoE and a DistributedOptimizer in both
formats, and loads each with shardwise and with Megatron at TP2 x DP2, TP1, PP2 x TP2 and TP4; the
results must be bitwise equal. The rest runs in this process, which has no process group at all.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from argparse import Namespace

import pytest
import torch

import load_workers
from conftest import _run

import shardwise
import shardwise.megatron as swm
from shardwise import load as swl


@pytest.fixture(scope="session")
def matrix(tmp_path_factory):
    return _run(tmp_path_factory, "load_matrix", load_workers.load_matrix, 4)


GPT_CASES = [f"gpt_{src}_{layout}" for layout, _, _ in load_workers.LAYOUTS for src in ("megatron", "shardwise")]
CASES = GPT_CASES + ["moe_ep2_megatron", "moe_ep2_shardwise", "distopt"]


@pytest.mark.parametrize("case", CASES)
def test_equal_to_megatron_load_and_collective_free(matrix, case):
    _, results = matrix
    for r in results:
        # distopt: both DistributedOptimizer formats of the installed release (load_workers._distopt_formats)
        cases = [k for k in r if k.startswith("distopt_")] if case == "distopt" else [case]
        assert len(cases) == (2 if case == "distopt" else 1), sorted(r)
        for name in cases:
            got = r[name]
            assert got["diff"] == [], (r["rank"], name, got["diff"])
            assert got["tensors"] >= 8, got
            assert got["dist_calls"] == [], f"rank {r['rank']} {name} called torch.distributed: {got['dist_calls']}"
            # The destination started from other values and the load changed it.
            assert got["changed"] >= 8 and got["observed"] >= 8, (r["rank"], name, got)


class Opaque:
    """A class outside every allow-list (module-level so that torch.save can pickle it)."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.v == self.v


def _request(dtype=torch.float32, device="cpu"):
    """A request exercising Megatron's structure rules: prepended axis, 2 chunks of one key on one
    rank, a factory (SwiGLU-like merge), int keys, lists, a non-persistent value, a plain value."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    def build(key, t, replica_id, flattened_range):
        half = t.shape[0] // 2
        return {
            "w": ShardedTensor.from_rank_offsets(f"{key}.w", t[:half], replica_id=replica_id),
            "v": ShardedTensor.from_rank_offsets(f"{key}.v", t[half:], replica_id=replica_id),
        }

    def merge(sub):
        return torch.cat([sub["w"], sub["v"]])

    return {
        "layers": [
            {
                "weight": ShardedTensor.from_rank_offsets(
                    "layers.weight", torch.zeros(4, 6, dtype=dtype, device=device), (0, 0, 1), replica_id=0, prepend_axis_num=1
                )
            },
            {
                7: ShardedTensor.from_rank_offsets("rows", torch.zeros(2, 5, dtype=dtype, device=device), (0, 0, 2)),
                8: ShardedTensor.from_rank_offsets("rows", torch.zeros(2, 5, dtype=dtype, device=device), (0, 1, 2)),
            },
        ],
        "fc1": ShardedTensorFactory("fc1", torch.zeros(6, 3, dtype=dtype, device=device), build, merge, 0),
        "obj": ShardedObject("extra", {"step": 3, "ns": Namespace(lr=0.1)}, (1,), (0,)),
        "nonpersistent": LocalNonpersistentObject({"local": 1}),
        "plain": "dropped",
    }


def _values(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {
        "layers.weight": torch.randn(1, 4, 6, generator=g).to(dtype),
        "rows": torch.randn(4, 5, generator=g).to(dtype),
        "fc1.w": torch.randn(3, 3, generator=g).to(dtype),
        "fc1.v": torch.randn(3, 3, generator=g).to(dtype),
    }


def _save_plain(path, dtype=torch.float32, obj=None, common_extra=None):
    """Saves ``_values()`` as one rank (shardwise, rank 0 of 1; no process group)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    vals = _values(dtype)
    sd = {
        "a": ShardedTensor.from_rank_offsets("layers.weight", vals["layers.weight"][0], (0, 0, 1), prepend_axis_num=1),
        "b": ShardedTensor.from_rank_offsets("rows", vals["rows"]),
        "c": ShardedTensor.from_rank_offsets("fc1.w", vals["fc1.w"]),
        "d": ShardedTensor.from_rank_offsets("fc1.v", vals["fc1.v"]),
        "o": ShardedObject("extra", obj if obj is not None else {"step": 3, "ns": Namespace(lr=0.1)}, (1,), (0,)),
        "iteration": 11,
        "plain": "from checkpoint",
        **(common_extra or {}),
    }
    swm.save(sd, str(path), rank=0, world_size=1, timeout_s=30)
    return vals


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    return path, _save_plain(path)


class NoDistributed:
    """Every public torch.distributed function raises while active: a load must call none."""

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.saved = []
        for mod in (dist, c10d):
            for name in dir(mod):
                obj = getattr(mod, name)
                if not name.startswith("_") and callable(obj) and not isinstance(obj, type) and getattr(obj, "__module__", "").startswith("torch.distributed"):
                    self.saved.append((mod, name, obj))

                    def refuse(*a, __name=name, **k):
                        raise AssertionError(f"torch.distributed.{__name} called during the load")

                    setattr(mod, name, refuse)
        return self

    def __exit__(self, *exc):
        for mod, name, obj in self.saved:
            setattr(mod, name, obj)


def _check_plain(res, vals, dtype=torch.float32):
    assert list(res) == ["iteration", "plain", "nonpersistent", "layers", "fc1", "obj"] or set(res) == {
        "iteration", "plain", "nonpersistent", "layers", "fc1", "obj"}
    assert res["plain"] == "from checkpoint" and res["iteration"] == 11
    assert res["nonpersistent"] == {"local": 1}
    assert isinstance(res["layers"], list) and list(res["layers"][1]) == [7, 8]
    w = res["layers"][0]["weight"]
    assert w.shape == (4, 6) and w.dtype == dtype and torch.equal(w, vals["layers.weight"][0].to(dtype))
    assert torch.equal(res["layers"][1][7], vals["rows"][:2].to(dtype))
    assert torch.equal(res["layers"][1][8], vals["rows"][2:].to(dtype))
    assert torch.equal(res["fc1"], torch.cat([vals["fc1.w"], vals["fc1.v"]]).to(dtype))
    assert res["obj"]["step"] == 3 and res["obj"]["ns"] == Namespace(lr=0.1)


def test_no_process_group_in_place_and_structure(plain_ckpt):
    import torch.distributed as dist

    path, vals = plain_ckpt
    assert not dist.is_initialized()
    req = _request()
    dest = req["layers"][0]["weight"].data
    with NoDistributed():
        res = swm.load(req, str(path))
    _check_plain(res, vals)
    assert res["layers"][0]["weight"].data_ptr() == dest.data_ptr(), "loaded in place"


def test_from_a_thread_and_cast_to_request_dtype(plain_ckpt):
    path, vals = plain_ckpt
    out = {}

    def run():
        try:
            with NoDistributed():
                out["res"] = swm.load(_request(torch.float64), path)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the main thread
            out["err"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert "err" not in out, out.get("err")
    _check_plain(out["res"], vals, torch.float64)


def test_repeated_loads_parse_metadata_once(plain_ckpt, monkeypatch):
    path, _ = plain_ckpt
    swl.clear_cache()
    opened = []
    real = swl._native.open_checkpoint
    monkeypatch.setattr(swl._native, "open_checkpoint", lambda p: opened.append(p) or real(p))
    for _ in range(3):
        swm.load(_request(), path)
    assert len(opened) == 1


def test_strict_modes(plain_ckpt, monkeypatch):
    import logging

    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    path, vals = plain_ckpt

    def req():
        r = _request()
        r["missing"] = ShardedTensor.from_rank_offsets("not.saved", torch.zeros(3))
        return r

    with pytest.raises(shardwise.MissingKeyError, match="not.saved"):
        swm.load(req(), path)
    with pytest.raises(shardwise.MissingKeyError, match="not.saved"):
        swm.load(req(), path, strict=StrictHandling.RAISE_UNEXPECTED)
    res, missing, unexpected = swm.load(req(), path, strict="return_unexpected")
    assert missing == set() and unexpected == {"not.saved"} and "missing" not in res
    _check_plain(res, vals)
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    # The report is Megatron's own (validation.maybe_report_missing_and_unexpected_keys).
    logging.getLogger("megatron.core.dist_checkpointing.validation").addHandler(handler)
    try:
        res = swm.load(req(), path, strict="log_unexpected")
    finally:
        logging.getLogger("megatron.core.dist_checkpointing.validation").removeHandler(handler)
    assert any("Unexpected keys (for this rank): {'not.saved'}" in m for m in logged) and "missing" not in res
    assert "missing" not in swm.load(req(), path, strict="ignore_all")
    # *_all as the only rank: the checkpoint keys it did not ask for are missing (several ranks
    # against Megatron's own result: test_megatron_compat.py).
    few = {"rows": ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 5)), "missing": req()["missing"]}
    res, missing, unexpected = swm.load(few, path, strict="return_all", rank=0, world_size=1)
    assert missing == {"layers.weight", "fc1.w", "fc1.v", "extra"} and unexpected == {"not.saved"}
    assert torch.equal(res["rows"], vals["rows"])
    with pytest.raises(swm.KeyMismatchError, match=r"Missing keys \(for all ranks\)"):
        swm.load(few, path, strict="raise_all", rank=0, world_size=1)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(shardwise.InvalidArgumentError, match="RANK/WORLD_SIZE"):
        swm.load(few, path, strict="log_all")


def test_missing_key_raised_before_any_read(plain_ckpt, monkeypatch):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path, _ = plain_ckpt
    reads = []
    ckpt = swl.open_cached(str(path))
    monkeypatch.setattr(swl, "open_cached", lambda p, *timeout: _Counting(ckpt, reads))
    r = _request()
    r["z"] = ShardedTensor.from_rank_offsets("zz.missing", torch.zeros(3))
    with pytest.raises(shardwise.MissingKeyError, match="zz.missing"):
        swm.load(r, path)
    assert reads == []
    assert issubclass(shardwise.MissingKeyError, shardwise.ShardwiseError)


class _Counting:
    def __init__(self, ckpt, reads):
        self.ckpt, self.reads = ckpt, reads

    def __getattr__(self, name):
        attr = getattr(self.ckpt, name)
        if name in ("read_into", "read_bytes", "load_into"):
            return lambda *a, **k: self.reads.append(name) or attr(*a, **k)
        return attr

    def __contains__(self, key):
        return key in self.ckpt


def test_shape_and_dtype_kind_mismatch(plain_ckpt):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path, _ = plain_ckpt
    with pytest.raises(shardwise.ValidationError, match=r"rows: global shape \[4, 6\]"):
        swm.load({"x": ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 6))}, path)
    with pytest.raises(shardwise.ValidationError, match="rows: the checkpoint holds float32, the request is int64"):
        swm.load({"x": ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 5, dtype=torch.int64))}, path)
    with pytest.raises(shardwise.ValidationError, match="byte object"):
        swm.load({"x": ShardedTensor.from_rank_offsets("extra/shard_0_1", torch.zeros(1))}, path)


def test_uncovered_region(plain_ckpt, tmp_path):
    """A checkpoint whose chunks cover only the first 4 of 8 rows of ``rows`` (its .metadata
    rewritten, as a writer that lost a rank's part would leave it): asking for rows 4-7 names the
    key and the region; rows 0-3 still load."""
    import pickle

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path, vals = plain_ckpt
    gap = tmp_path / "gap"
    # Without the save's state: shardwise refuses a .metadata that its commit did not write.
    shutil.copytree(path, gap, ignore=shutil.ignore_patterns(".shardwise"))
    with open(gap / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file
    md.state_dict_metadata["rows"].size = torch.Size([8, 5])
    with open(gap / ".metadata", "wb") as f:
        pickle.dump(md, f)
    top = ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 5), (0, 0, 2))
    assert torch.equal(swm.load({"t": top}, gap)["t"], vals["rows"])
    bottom = ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 5), (0, 1, 2))
    with pytest.raises(shardwise.ValidationError, match="rows"):
        swm.load({"t": bottom}, gap)


def test_truncated_and_missing_data_file(plain_ckpt, tmp_path):
    path, _ = plain_ckpt
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = bad / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(shardwise.CorruptFileError, match="__0_0.distcp"):
        swm.load(_request(), bad)
    swl.clear_cache()
    os.unlink(data)
    with pytest.raises(shardwise.CorruptFileError, match="__0_0.distcp.*cannot open the data file: it is missing"):
        swm.load(_request(), bad)


def test_crc_mismatch_names_key_file_offset(plain_ckpt, tmp_path):
    """One flipped bit inside the bytes of ``rows`` (a shardwise save records CRC-32s): the load
    raises CorruptFileError naming the key, file and offset; check_crc=False reads the bad bytes."""
    path, vals = plain_ckpt
    bad = tmp_path / "flipped"
    shutil.copytree(path, bad)
    chunk = shardwise.open(bad).metadata("rows")["chunks"][0]
    with open(bad / chunk["relative_path"], "r+b") as f:
        f.seek(chunk["offset"])
        item = f.read(chunk["length"])
        at = chunk["offset"] + item.index(vals["rows"].numpy().tobytes()) + 9  # in the tensor's bytes
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def whole():  # the engine checks the CRC of items it reads whole
        return {"rows": ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 5))}

    def resharded():  # rows 0..1 of the saved chunk, as rank 0 of 2 (the flipped bit is in row 0)
        return {"rows": ShardedTensor.from_rank_offsets("rows", torch.zeros(2, 5), (0, 0, 2))}

    with pytest.raises(shardwise.CorruptFileError, match=rf"__0_0\.distcp: rows chunk .*offset {chunk['offset']}.*CRC-32"):
        swm.load(whole(), bad)
    swl.clear_cache()
    # A partial read is checked by the block CRC-32s of the tensor data (one block here: 80 bytes).
    payload = at - 9
    with pytest.raises(shardwise.CorruptFileError, match=rf"__0_0\.distcp: rows chunk .*block 0 of its tensor data, bytes {payload}\.\.{payload + 80} of the file"):
        swm.load(resharded(), bad)
    swl.clear_cache()
    rows = swm.load(whole(), bad, check_crc=False)["rows"]
    assert not torch.equal(rows, vals["rows"]) and rows.shape == vals["rows"].shape


def test_without_sidecar_whole_items_are_checked_by_their_zip_crc(plain_ckpt, tmp_path):
    """A copy without hidden directories has no checksum sidecar (``.shardwise``): an item read
    whole is then checked against the CRC-32 its own torch.save archive records for its tensor
    data (as ``shardwise verify`` checks it), with the error a sidecar mismatch gives; an intact
    copy still loads, and a resharded read of part of an item stays unchecked."""
    path, vals = plain_ckpt
    bad = tmp_path / "nosidecar"
    shutil.copytree(path, bad)
    shutil.rmtree(bad / ".shardwise")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def whole():
        return {"rows": ShardedTensor.from_rank_offsets("rows", torch.zeros(4, 5))}

    def resharded():  # rows 0..1 of the saved chunk, as rank 0 of 2
        return {"rows": ShardedTensor.from_rank_offsets("rows", torch.zeros(2, 5), (0, 0, 2))}

    assert torch.equal(swm.load(whole(), bad)["rows"], vals["rows"])
    assert torch.equal(shardwise.open(bad).read("rows"), vals["rows"])
    swl.clear_cache()
    chunk = shardwise.open(bad).metadata("rows")["chunks"][0]
    with open(bad / chunk["relative_path"], "r+b") as f:
        f.seek(chunk["offset"])
        item = f.read(chunk["length"])
        at = chunk["offset"] + item.index(vals["rows"].numpy().tobytes()) + 9  # in row 0
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    msg = rf"__0_0\.distcp: rows chunk \[0, 0\] \(item at offset {chunk['offset']}, .*record .*/data/0 fails its zip CRC-32"
    with pytest.raises(shardwise.CorruptFileError, match=msg):
        swm.load(whole(), bad)
    swl.clear_cache()
    with pytest.raises(shardwise.CorruptFileError, match=msg):
        shardwise.open(bad).read("rows")
    # Part of the item, without block CRC-32s: not checked (the flipped bit shows).
    rows = swm.load(resharded(), bad)["rows"]
    assert not torch.equal(rows, vals["rows"][:2])
    swl.clear_cache()
    rows = swm.load(whole(), bad, check_crc=False)["rows"]
    assert not torch.equal(rows, vals["rows"])
    swl.clear_cache()


def test_other_backend_refused(plain_ckpt, tmp_path):
    path, _ = plain_ckpt
    other = tmp_path / "zarr"
    shutil.copytree(path, other)
    (other / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(shardwise.InvalidArgumentError, match="sharded_backend 'zarr'.*torch_dist"):
        swm.load(_request(), other)


def test_disallowed_class_in_object_needs_opt_in(tmp_path):
    path = tmp_path / "ckpt"
    vals = _save_plain(path, obj=Opaque(5))
    with pytest.raises(swm.UnsafeObjectError, match="Opaque"):
        swm.load(_request(), path)
    res = swm.load(_request(), path, safe_globals=[Opaque])
    assert res["obj"] == Opaque(5)
    assert torch.equal(res["layers"][1][7], vals["rows"][:2])


def test_flattened_range_and_shape_mismatch(plain_ckpt):
    """Requests megatron-core 0.19 no longer builds itself, checked against the full tensors:
    a ``flattened_range`` slice of a local chunk (the distributed optimizer of <= 0.15), and an
    ``allow_shape_mismatch`` tensor larger than the saved one (zero padded)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path, vals = plain_ckpt
    flat = ShardedTensor.from_rank_offsets("rows", torch.zeros(2, 5), (0, 1, 2))
    # Set after construction: 0.19's __post_init__ refuses flattened_range, 0.13's built it so.
    flat.data, flat.flattened_range = torch.zeros(4), slice(3, 7)
    res = swm.load({"f": flat}, path)
    assert torch.equal(res["f"], vals["rows"][2:].reshape(-1)[3:7])
    bigger = ShardedTensor.from_rank_offsets("rows", torch.full((6, 5), 9.0), allow_shape_mismatch=True)
    bigger.global_shape = (6, 5)
    res = swm.load({"b": bigger}, path)
    assert torch.equal(res["b"][:4], vals["rows"]) and torch.equal(res["b"][4:], torch.zeros(2, 5))


def test_common_state_of_megatron_019_and_install_routes(plain_ckpt):
    """install() routes load and load_common_state_dict; load_content_metadata goes through them."""
    from megatron.core import dist_checkpointing

    path, vals = plain_ckpt
    with swm.installed():
        assert dist_checkpointing.load is swm.dist_checkpointing_load
        with NoDistributed():
            res = dist_checkpointing.load(_request(), str(path), None, strict="assume_ok_unexpected")
            common = dist_checkpointing.load_common_state_dict(str(path))
        with pytest.raises(shardwise.InvalidArgumentError, match="backend"):
            dist_checkpointing.load(_request(), str(path), ("zarr", 1))
    _check_plain(res, vals)
    assert common["iteration"] == 11
    assert dist_checkpointing.load is not swm.dist_checkpointing_load
    original_load = dist_checkpointing.load
    with swm.installed(load=False):
        assert dist_checkpointing.load is original_load
        assert dist_checkpointing.save.func is swm.dist_checkpointing_save
        swm.install()  # a later call may route the load, and load=False un-routes it again
        assert dist_checkpointing.load is swm.dist_checkpointing_load
        swm.install(load=False)
        assert dist_checkpointing.load is original_load
    assert dist_checkpointing.load is original_load


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_destinations_in_place_and_cast(plain_ckpt):
    """CUDA tensors are filled in place through the pinned staging pool (float32) or a device
    temporary cast on the device (bfloat16); usable on the current stream at return."""
    path, vals = plain_ckpt
    for dtype in (torch.float32, torch.bfloat16):
        req = _request(dtype, device="cuda")
        dest = req["layers"][0]["weight"].data
        res = swm.load(req, path)
        w = res["layers"][0]["weight"]
        assert w.is_cuda and w.data_ptr() == dest.data_ptr() and w.dtype == dtype
        _check_plain(
            {**res, "layers": [{"weight": w.cpu()}, {k: v.cpu() for k, v in res["layers"][1].items()}], "fc1": res["fc1"].cpu()},
            vals,
            dtype,
        )
