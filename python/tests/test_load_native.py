"""The native load engine, ``Checkpoint.load_into`` (src/load.rs), into host memory: bitwise equal to
plain torch DCP's load on the golden torch / Megatron fixtures and on a shardwise checkpoint whose
tensors have several chunks, for every dtype and for regions spanning several chunks; every bad
request refused before a byte is read; damaged checkpoints reported with key, file and offset."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

import shardwise
from dcp_util import bits, golden
from load_util import dcp_tensors, request, save_grid
from shardwise import _native

GOLDEN = golden()


def regions(t: torch.Tensor, g: torch.Generator, n: int = 3):
    """``n`` random non-empty regions of ``t`` (tuples of slices)."""
    out = []
    for _ in range(n):
        idx = []
        for size in t.shape:
            if size == 0:
                idx.append(slice(0, 0))
                continue
            lo = int(torch.randint(0, size, (1,), generator=g))
            hi = int(torch.randint(lo + 1, size + 1, (1,), generator=g))
            idx.append(slice(lo, hi))
        out.append(tuple(idx))
    return out


def load(ck, wanted, full, **kw):
    """Loads ``wanted`` ([(key, index)]) in one call; returns (destinations, stats)."""
    reqs, outs = [], []
    for key, index in wanted:
        r, o = request(key, index, full[key])
        reqs.append(r)
        outs.append(o)
    stats = ck.load_into(reqs, **kw)
    return outs, stats


def assert_equal(outs, wanted, full):
    for o, (key, index) in zip(outs, wanted):
        want = full[key][index] if index else full[key]
        assert o.dtype == want.dtype and o.shape == want.shape, key
        assert torch.equal(bits(o), bits(want)), (key, index)


@pytest.mark.parametrize("ckpt", GOLDEN, ids=[f"{p.parent.name}/{p.name}" for p in GOLDEN])
def test_golden_fixtures_bitwise(ckpt):
    full = dcp_tensors(ckpt)
    ck = _native.open_checkpoint(str(ckpt))
    whole = [(k, ()) for k in full]
    outs, stats = load(ck, whole, full)
    assert_equal(outs, whole, full)
    assert stats["requests"] == len(whole) and stats["bytes_read"] > 0
    g = torch.Generator().manual_seed(1)
    parts = [(k, idx) for k, t in full.items() if t.dim() for idx in regions(t, g)]
    outs, _ = load(ck, parts, full)
    assert_equal(outs, parts, full)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A shardwise checkpoint: every dtype as a 3x2 grid of chunks from 6 ranks, and ``big``
    (6 row chunks of 4 MiB); with its CRC-32 sidecar. Returns (dir, tensors as torch DCP loads them)."""
    d = tmp_path_factory.mktemp("grid") / "ckpt"
    save_grid(d)
    return d, dcp_tensors(d)


def test_grid_whole_regions_and_small_staging(grid):
    d, full = grid
    ck = _native.open_checkpoint(str(d))
    whole = [(k, ()) for k in full]
    outs, stats = load(ck, whole, full)
    assert_equal(outs, whole, full)
    # Every item was needed whole, so every one was checked against its save-time CRC-32.
    assert stats["items_checked"] == 13 * 6 and stats["items_unchecked"] == 0
    spanning = [
        (k, idx)
        for k in full
        for idx in [
            (slice(3, 15), slice(4, 17)),  # 3 row chunks x 2 column chunks
            (slice(None), slice(7, 13)),  # a column band across both column chunks: strided
            (slice(11, 12), slice(9, 11)),  # one row, two elements, two chunks
            (slice(17, 18), slice(19, 20)),  # the last element
        ]
        if k != "big"
    ] + [("big", (slice(1000, 3100),)), ("big", (slice(5, 6), slice(3, 1000)))]
    outs, stats = load(ck, spanning, full)
    assert_equal(outs, spanning, full)
    # Partly needed items are read in part, and the blocks of their tensor data that the reads
    # touch are checked against the save's block CRC-32s: every item read is checked.
    # (every item of the 12 small keys, and big's chunks 0-3)
    assert stats["items_unchecked"] == 0 and stats["items_checked"] == 12 * 6 + 4
    # A staging budget of 1 MiB: 512 KiB buffers, so copies are cut and reads many; same bytes.
    outs, small = load(ck, whole + spanning, full, staging_budget_bytes=1 << 20)
    assert_equal(outs, whole + spanning, full)
    assert small["read_ops"] > stats["read_ops"]
    # Items also needed in part by other requests of the call are still read whole and checked.
    assert small["items_checked"] == 13 * 6


def _copy(grid, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(grid[0], d)
    return d


def _item(ck, key, n):
    return ck.metadata(key)["chunks"][n]


def test_crc_mismatch_names_key_file_and_offset(grid, tmp_path):
    d = _copy(grid, tmp_path)
    full = grid[1]
    ck = _native.open_checkpoint(str(d))
    it = _item(ck, "big", 2)
    path = d / it["relative_path"]
    with open(path, "r+b") as f:  # one bit of the tensor data, halfway into the item
        f.seek(it["offset"] + it["length"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    ck = _native.open_checkpoint(str(d))
    with pytest.raises(shardwise.CorruptFileError) as e:
        load(ck, [("float32", ()), ("big", ())], full)
    msg = str(e.value)
    assert "big chunk [2048, 0]" in msg and it["relative_path"] in msg and f"offset {it['offset']}" in msg, msg
    assert "CRC-32" in msg
    # Other keys still load; so does the damaged item with checking off (the flipped bit shows).
    outs, _ = load(ck, [("float32", ())], full)
    assert_equal(outs, [("float32", ())], full)
    outs, stats = load(ck, [("big", ())], full, check_crc=False)
    assert stats["items_checked"] == 0 and not torch.equal(bits(outs[0]), bits(full["big"]))
    # A region needing only part of the damaged item reads that part (and the 1 MiB block of
    # tensor data around it), checked by its block CRC-32: the damage lies in another block.
    outs, stats = load(ck, [("big", (slice(2048, 2050),))], full)
    assert stats["items_checked"] == 1 and stats["items_unchecked"] == 0
    assert torch.equal(outs[0], full["big"][2048:2050])


MIB = 1 << 20


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def test_resharded_reads_are_checked_by_block(grid, tmp_path):
    """A resharded load reads part of a saved chunk: ``big``'s chunk 2 (rows 2048..3071, 4 MiB of
    float32, 1 MiB = 256 rows per CRC block). One flipped byte in block 2 (row 640 of the chunk):
    every read touching block 2 (rows, a column band, a direct read of many rows, a region that
    ends inside it) raises CorruptFileError naming key, file and the block's file offset; reads of
    blocks 0, 1 and 3 (outside the widened range) load the right values."""
    d = _copy(grid, tmp_path)
    full = grid[1]
    ck = _native.open_checkpoint(str(d))
    it = _item(ck, "big", 2)
    path = d / it["relative_path"]
    with open(path, "rb") as f:
        f.seek(it["offset"])
        item = f.read(it["length"])
    payload = it["offset"] + item.index(full["big"][2048:2049].numpy().tobytes())
    _flip(path, payload + 2 * MIB + MIB // 2 + 7)  # row 2048 + 640
    ck = _native.open_checkpoint(str(d))
    damaged = [
        (slice(2048 + 640, 2048 + 642),),  # two rows inside block 2, the damaged one first
        (slice(2048 + 760, 2048 + 770),),  # ends in block 3, starts in block 2
        (slice(2048 + 300, 2048 + 600),),  # 1.2 MiB: read straight into the destination
        (slice(2048, 3072), slice(0, 512)),  # half the columns (TP2 -> TP4): strided over all blocks
    ]
    for index in damaged:
        with pytest.raises(shardwise.CorruptFileError) as e:
            load(ck, [("big", index)], full)
        msg = str(e.value)
        assert "big chunk [2048, 0]" in msg and it["relative_path"] in msg, msg
        assert f"block 2 of its tensor data, bytes {payload + 2 * MIB}..{payload + 3 * MIB} of the file" in msg, msg
        assert f"(offset {payload + 2 * MIB})" in msg and "CRC-32" in msg, msg
    # Blocks 0, 1 and 3 are intact: reads touching only them load, and are checked.
    intact = [(slice(2048, 2050),), (slice(2048 + 256, 2048 + 512),), (slice(2048 + 768, 3072),), (slice(2048 + 511, 2048 + 512), slice(3, 9))]
    wanted = [("big", i) for i in intact]
    outs, stats = load(ck, wanted, full)
    assert_equal(outs, wanted, full)
    assert stats["items_checked"] == 1 and stats["items_unchecked"] == 0
    # Bytes read stay bounded: two rows widen to their block (1 MiB), plus the item's probes.
    _, stats = load(ck, wanted[:1], full)
    assert MIB <= stats["bytes_read"] < MIB + 64 * 1024, stats
    # check_crc=False: no block is checked and the damaged bytes load as they are.
    outs, stats = load(ck, [("big", damaged[0])], full, check_crc=False)
    assert stats["items_checked"] == 0 and not torch.equal(bits(outs[0]), bits(full["big"][damaged[0]]))


def test_truncated_and_missing_data_files(grid, tmp_path):
    d = _copy(grid, tmp_path)
    full = grid[1]
    ck = _native.open_checkpoint(str(d))
    it = _item(ck, "big", 5)
    path = d / it["relative_path"]
    with open(path, "r+b") as f:
        f.truncate(it["offset"] + it["length"] - 100)
    good, good_out = request("float32", (), full["float32"])
    bad, _ = request("big", (), full["big"])
    with pytest.raises(shardwise.CorruptFileError) as e:
        ck.load_into([good, bad])
    msg = str(e.value)
    assert "big chunk [5120, 0]" in msg and it["relative_path"] in msg and f"offset {it['offset']}" in msg, msg
    assert "truncated" in msg
    # Found before any read: the other destination was not touched.
    assert bool((good_out.view(torch.uint8) == 0xA5).all())
    path.unlink()
    with pytest.raises(shardwise.CorruptFileError, match=r"big chunk \[5120, 0\].*cannot open"):
        ck.load_into([bad])


def test_bad_requests_are_refused_before_any_read(grid):
    d, full = grid
    ck = _native.open_checkpoint(str(d))
    good, good_out = request("float32", (), full["float32"])
    with pytest.raises(shardwise.MissingKeyError, match='no key "no.such.key"'):
        ck.load_into([good, _native.Region(key="no.such.key", offsets=[0], sizes=[1], data_ptr=good.data_ptr, nbytes=4)])
    assert bool((good_out.view(torch.uint8) == 0xA5).all())
    assert issubclass(shardwise.MissingKeyError, shardwise.ShardwiseError)
    ptr, n = good.data_ptr, good.nbytes
    cases = [
        (("o/shard_0_1", [], [], 0), "o/shard_0_1 is a byte object"),
        (("float32", [0, 0], [19, 20], 19 * 20 * 4), "outside the global shape"),
        (("float32", [0], [18], 18 * 4), "outside the global shape"),
        (("float32", [0, 0], [18, 20], n - 4), "needs 1440 bytes, the destination has 1436"),
    ]
    for (key, offsets, sizes, nbytes), msg in cases:
        req = _native.Region(key=key, offsets=offsets, sizes=sizes, data_ptr=ptr, nbytes=nbytes)
        with pytest.raises(shardwise.InvalidArgumentError, match=msg):
            ck.load_into([good, req])
        assert bool((good_out.view(torch.uint8) == 0xA5).all())


def test_uncovered_region_is_named(grid, tmp_path):
    """A checkpoint whose ``.metadata`` lost one chunk of ``float32`` (re-pickled with torch's own
    classes): DCP would load the hole silently; load_into names it."""
    d = _copy(grid, tmp_path)
    full = grid[1]
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own test checkpoint: trusted
    chunks = md.state_dict_metadata["float32"].chunks
    md.state_dict_metadata["float32"].chunks = [c for c in chunks if list(c.offsets) != [6, 10]]
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)
    shutil.rmtree(d / ".shardwise")  # as another writer left it: shardwise refuses a .metadata its commit did not write
    ck = _native.open_checkpoint(str(d))
    with pytest.raises(shardwise.ValidationError) as e:
        load(ck, [("float32", (slice(2, 18), slice(5, 20)))], full)
    assert "float32: region [2, 5]+[16, 15]" in str(e.value) and "6:12, 10:20" in str(e.value), str(e.value)
    outs, _ = load(ck, [("float32", (slice(0, 6),))], full)
    assert_equal(outs, [("float32", (slice(0, 6),))], full)


@pytest.mark.skipif(shardwise.cuda_available(), reason="checks the error raised without CUDA")
def test_cuda_destination_without_cuda_is_a_clear_error(grid):
    d, full = grid
    ck = _native.open_checkpoint(str(d))
    r, _ = request("float32", (), full["float32"])
    on_gpu = _native.Region(key=r.key, offsets=r.offsets, sizes=r.sizes, data_ptr=r.data_ptr, nbytes=r.nbytes, device=0)
    with pytest.raises(shardwise.GpuError, match="CUDA device 0"):
        ck.load_into([on_gpu])


def test_object_store_ranged_gets(grid):
    """The same checkpoint in an object store (memory://: the object_store crate's in-process store,
    the code of s3:// up to the HTTP client): ranged GETs of the coalesced ranges, bounded by
    timeout_s, same bytes and same CRC-32 checks."""
    import uuid

    full = grid[1]
    url = f"memory://load/{uuid.uuid4().hex}"
    save_grid(url)
    ck = _native.open_checkpoint(url)
    wanted = [(k, ()) for k in full] + [("float32", (slice(3, 15), slice(4, 17))), ("big", (slice(1000, 3100),))]
    outs, stats = load(ck, wanted, full, timeout_s=60)
    assert_equal(outs, wanted, full)
    assert stats["items_checked"] == 13 * 6
    with pytest.raises(shardwise.InvalidArgumentError, match="timeout_s"):
        load(ck, wanted[:1], full, timeout_s=-1)


def test_zstd_items_are_decoded(grid, tmp_path):
    """Items compressed by torch DCP's ZStandard extension cannot be read in place: the reader
    decodes each whole and the pieces are copied out of it, into the same destinations."""
    from test_zstd_items import compress_items, raw_frame

    d = _copy(grid, tmp_path)
    full = grid[1]
    compress_items(d, raw_frame)
    ck = _native.open_checkpoint(str(d))
    wanted = [(k, ()) for k in full] + [("int8", (slice(3, 15), slice(4, 17))), ("big", (slice(1000, 3100),))]
    outs, _ = load(ck, wanted, full)
    assert_equal(outs, wanted, full)
