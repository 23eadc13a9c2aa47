"""Items compressed by torch DCP's ZStandard extension (`transform_descriptors: ["stream.zstd/1"]`,
torch >= 2.7) are decoded by the reader and `verify`. The frames are made two ways: by hand with raw
blocks (the zstd format's simplest valid frame, always available) and by the reference `zstd`
tool (real compression and a content checksum) when it is installed."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import shardwise
from dcp_util import bits, read_all, row_shard, save_ranks

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
SHARDWISE = str(Path(sys.executable).parent / "shardwise")


def raw_frame(payload: bytes) -> bytes:
    """A zstd frame of raw blocks (RFC 8878 §3.1.1): no content size, a 128 KiB window, no
    checksum; blocks of at most 128 KiB, the last one flagged."""
    out = bytearray(ZSTD_MAGIC + bytes([0x00, 7 << 3]))  # descriptor; window 2^(10+7) bytes
    blocks = [payload[i:i + (128 << 10)] for i in range(0, len(payload), 128 << 10)] or [b""]
    for n, b in enumerate(blocks):
        header = (len(b) << 3) | (0 << 1) | (n == len(blocks) - 1)  # Block_Type 0: Raw
        out += header.to_bytes(3, "little") + b
    return bytes(out)


def cli_frame(payload: bytes) -> bytes:
    """A frame from the reference implementation (`zstd -19`, content checksum on)."""
    return subprocess.run(["zstd", "-q", "-19", "--check", "-c"], input=payload, capture_output=True,
                          check=True).stdout


def compress_items(ckpt: Path, compress) -> None:
    """Rewrites every item of `ckpt` as `compress(item bytes)` in one new data file, with torch's own
    _StorageInfo and the transform descriptor its ZStandard extension records. The checksum sidecar
    (placements of the uncompressed items) is dropped, as a torch-written checkpoint has none."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = FileSystemReader(str(ckpt)).read_metadata()
    blob = bytearray()
    for idx, info in md.storage_data.items():
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        z = compress(item)
        md.storage_data[idx] = _StorageInfo("__z_0.distcp", len(blob), len(z), transform_descriptors=["stream.zstd/1"])
        blob += z
    for p in ckpt.glob("*.distcp"):
        p.unlink()
    (ckpt / "__z_0.distcp").write_bytes(bytes(blob))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    shutil.rmtree(ckpt / ".shardwise")


def two_frames(payload: bytes) -> bytes:
    half = len(payload) // 2
    return raw_frame(payload[:half]) + raw_frame(payload[half:])


COMPRESSORS = {"raw_blocks": raw_frame, "two_frames": two_frames}
if shutil.which("zstd"):
    COMPRESSORS["zstd_cli"] = cli_frame


@pytest.mark.parametrize("how", sorted(COMPRESSORS))
def test_zstd_items_read_and_verify(tmp_path, how):
    d = tmp_path / "ckpt"
    save_ranks(str(d), [{"w": row_shard("w", r, 2), "b": row_shard("b", 0, 1, rows=8, cols=1, replica_id=r)}
                        for r in range(2)])
    expected, _ = read_all(str(d))
    compress_items(d, COMPRESSORS[how])
    with shardwise.open(d) as r:
        for k, v in expected.items():
            assert torch.equal(bits(r.read(k)), bits(v)), k
    out = subprocess.run([SHARDWISE, "verify", str(d)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "3 items" in out.stdout and "OK" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(not shutil.which("zstd"), reason="the zstd tool makes frames with a content checksum")
def test_a_zstd_frame_failing_its_content_checksum_is_corrupt(tmp_path):
    d = tmp_path / "ckpt"
    save_ranks(str(d), [{"w": row_shard("w", r, 2)} for r in range(2)])
    compress_items(d, lambda item: cli_frame(item)[:-4] + bytes(4))  # zeroed checksum
    with pytest.raises(shardwise.CorruptFileError, match="zstd: content checksum"):
        shardwise.open(d).read("w")
    out = subprocess.run([SHARDWISE, "verify", str(d)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "content checksum" in out.stdout, out.stdout + out.stderr
