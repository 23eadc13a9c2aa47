"""Archives for the differential test of shardwise's torch.save reader against torch's own
(torch_reader_diff.py): a zip writer that controls every field torch's reader (miniz, through
``PyTorchStreamReader``) looks at, and a generator of the variations where two readers could
disagree: record names and order, case, duplicates, the archive's folder, zip64 fields and end
records, extra fields, data descriptors, flags, compression, leading and trailing bytes, the
``version``/``byteorder``/``.storage_alignment`` records, and the pickles (every protocol torch
writes, storage ids that lie, globals that run code).

Needs torch (to write the real pickles the variations start from); never imports shardwise.
"""

from __future__ import annotations

import io
import pickle
import random
import struct
import zipfile
import zlib
from dataclasses import dataclass, field, replace

FOLDER = b"archive/"


@dataclass
class Rec:
    """One record, and how its headers are written."""

    name: bytes
    data: bytes
    method: int = 0  # 0 STORED, 8 DEFLATE (the data is compressed when written)
    flags: int = 0x0808  # data descriptor follows + UTF-8, as torch's writer
    external: int = 0  # external attributes (0x10: DOS directory)
    local_name: bytes | None = None  # a local header name other than the central one
    local_extra: bytes = b""  # extra fields in the local header (before the FB padding)
    cd_extra: bytes = b""  # extra fields in the central directory entry
    zip64: bool = False  # sizes saturated at 0xFFFFFFFF, real ones in an id-1 field
    zip64_second: bytes | None = None  # a second id-1 field, after the first
    zip64_short: bool = False  # the id-1 field holds 4 bytes where 8 are needed
    crc: int | None = None  # None: the real CRC-32
    descriptor: bool = True
    align: bool = True  # FB padding so that the data starts on 64 bytes
    size_lie: int = 0  # added to the central directory's uncompressed size
    disk: int = 0


@dataclass
class Layout:
    """Archive-wide choices."""

    lead: bytes = b""  # bytes before the first local header
    trail: bytes = b""  # bytes after the end record
    comment: bytes = b""  # the end record's comment
    zip64_end: bool = True  # zip64 end record + locator before the end record (torch does)
    locator_elsewhere: bool = False  # a second zip64 end record the locator points at
    eocd_entries_lie: int = 0


def _u16(v):
    return struct.pack("<H", v & 0xFFFF)


def _u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def _u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def build(recs: list[Rec], lay: Layout = Layout()) -> bytes:
    """The archive's bytes: each record (local header, data, descriptor), the central directory,
    then the end records, as miniz lays them out unless a field says otherwise."""
    out = bytearray(lay.lead)
    central = []
    for r in recs:
        payload = r.data
        if r.method == 8:
            c = zlib.compressobj(9, zlib.DEFLATED, -15)
            payload = c.compress(r.data) + c.flush()
        crc = zlib.crc32(r.data) if r.crc is None else r.crc
        offset = len(out)
        lname = r.name if r.local_name is None else r.local_name
        extra = bytes(r.local_extra)
        if r.align:
            start = offset + 30 + len(lname) + len(extra) + 4
            pad = (64 - start % 64) % 64
            extra += b"FB" + _u16(pad) + b"Z" * pad
        out += _u32(0x04034B50) + _u16(0) + _u16(r.flags) + _u16(r.method) + _u16(0) + _u16(0)
        if r.descriptor:
            out += _u32(0) + _u32(0) + _u32(0)
        else:
            out += _u32(crc) + _u32(len(payload)) + _u32(len(r.data))
        out += _u16(len(lname)) + _u16(len(extra)) + lname + extra
        out += payload
        if r.descriptor:
            out += _u32(0x08074B50) + _u32(crc) + _u32(len(payload)) + _u32(len(r.data))
        central.append((r, crc, len(payload), len(r.data) + r.size_lie, offset))
    cd_offset = len(out)
    for r, crc, csize, usize, offset in central:
        extra = bytes(r.cd_extra)
        if r.zip64:
            body = _u64(usize) + _u64(csize) + _u64(offset)
            if r.zip64_short:
                body = body[:4]
            extra = _u16(1) + _u16(len(body)) + body + extra
            if r.zip64_second is not None:
                extra += _u16(1) + _u16(len(r.zip64_second)) + r.zip64_second
            csize = usize = offset = 0xFFFFFFFF
        elif r.zip64_second is not None:
            extra += _u16(1) + _u16(len(r.zip64_second)) + r.zip64_second
        out += _u32(0x02014B50) + _u16(0) + _u16(45 if r.zip64 else 0) + _u16(r.flags) + _u16(r.method)
        out += _u16(0) + _u16(0) + _u32(crc) + _u32(csize) + _u32(usize)
        out += _u16(len(r.name)) + _u16(len(extra)) + _u16(0) + _u16(r.disk) + _u16(0) + _u32(r.external)
        out += _u32(offset) + r.name + extra
    cd_size = len(out) - cd_offset
    n = len(recs) + lay.eocd_entries_lie
    if lay.zip64_end:
        if lay.locator_elsewhere:
            # A zip64 end record that claims no entries, where the locator points; the one right
            # before the locator holds the real directory.
            decoy = len(out)
            out += _u32(0x06064B50) + _u64(44) + _u16(0x031E) + _u16(45) + _u32(0) + _u32(0)
            out += _u64(0) + _u64(0) + _u64(0) + _u64(cd_offset)
        eocd64 = len(out)
        out += _u32(0x06064B50) + _u64(44) + _u16(0x031E) + _u16(45) + _u32(0) + _u32(0)
        out += _u64(n) + _u64(n) + _u64(cd_size) + _u64(cd_offset)
        target = decoy if lay.locator_elsewhere else eocd64
        out += _u32(0x07064B50) + _u32(0) + _u64(target) + _u32(1)
    out += _u32(0x06054B50) + _u16(0) + _u16(0) + _u16(n) + _u16(n) + _u32(cd_size) + _u32(cd_offset)
    out += _u16(len(lay.comment)) + lay.comment + lay.trail
    return bytes(out)


# --- the pickles -----------------------------------------------------------------------------------


def torch_item(tensor, protocol: int = 2) -> dict[str, bytes]:
    """The records of ``torch.save(tensor, pickle_protocol=protocol)``, by name under the folder."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf, pickle_protocol=protocol)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


class _Touch:
    """Pickles as a call of fuzz_marker.touch: what a payload looks like (importing and calling a
    global), without harm."""

    def __reduce__(self):
        import fuzz_marker

        return (fuzz_marker.touch, ("payload",))


def object_pickles() -> list[tuple[str, bytes]]:
    """Pickles of byte objects: allowed ones (what Megatron and DCP store) and payloads, in every
    protocol, plus hand-written opcode sequences a naive reader could misjudge."""
    import argparse
    import collections
    import types

    import torch

    allowed = [
        {"iteration": 7, "lr": 0.5},
        collections.OrderedDict(a=1, b=[1, 2]),
        argparse.Namespace(num_layers=2, hidden_size=64),
        types.SimpleNamespace(x=1),
        torch.Size([2, 3]),
        [None],
    ]
    out = []
    for p in range(0, 6):
        for i, obj in enumerate(allowed):
            out.append((f"allowed{i}-p{p}", pickle.dumps(obj, protocol=p)))
        out.append((f"payload-p{p}", pickle.dumps({"ok": 1, "x": _Touch()}, protocol=p)))
    # STACK_GLOBAL whose strings come from the memo; INST; OBJ; trailing bytes after STOP.
    out.append(("stack-global-memo", b"\x80\x04\x8c\x0bfuzz_marker\x94\x8c\x05touch\x94h\x00h\x01\x93\x8c\x01x\x85R."))
    out.append(("inst", b"(S'x'\nifuzz_marker\ntouch\n."))
    out.append(("obj", b"\x80\x02(cfuzz_marker\ntouch\nX\x01\x00\x00\x00xo."))
    out.append(("after-stop", pickle.dumps({"a": 1}, protocol=2) + b"cfuzz_marker\ntouch\n(tR."))
    out.append(("global-in-dict-key", b"\x80\x02}cfuzz_marker\ntouch\nK\x01s."))
    out.append(("ext1", b"\x80\x02\x82\x01."))
    out.append(("persid-text", b"Pfoo\n."))
    return out


# --- the variations ----------------------------------------------------------------------------------


def _flip_case(name: bytes, rng: random.Random) -> bytes:
    b = bytearray(name)
    letters = [i for i, c in enumerate(b) if 97 <= c <= 122 or 65 <= c <= 90]
    for i in rng.sample(letters, k=min(len(letters), rng.randint(1, 4))):
        b[i] ^= 0x20
    return bytes(b)


@dataclass
class Case:
    """One generated archive and how it was made (the mutations, for the corpus's names)."""

    data: bytes
    kind: str  # "tensor" or "object"
    mutations: list[str] = field(default_factory=list)


def base_records(kind: str, rng: random.Random, protocol: int) -> list[Rec]:
    """The records torch.save writes, in its order, for a small tensor or an object."""
    import torch

    if kind == "tensor":
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.uint8])
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
        if rng.random() < 0.2:
            t = t.t()  # non-contiguous strides, storage kept
        recs = torch_item(t, protocol)
        order = ["data.pkl", "byteorder", "data/0", "version", ".data/serialization_id"]
        return [Rec(FOLDER + n.encode(), recs[n]) for n in order if n in recs] + [
            Rec(FOLDER + n.encode(), recs[n]) for n in recs if n not in order
        ]
    name, pkl = rng.choice(object_pickles())
    return [
        Rec(FOLDER + b"data.pkl", pkl),
        Rec(FOLDER + b"byteorder", b"little"),
        Rec(FOLDER + b"version", b"3\n"),
        Rec(FOLDER + b".data/serialization_id", b"1234567890" * 4),
    ]


def _find(recs: list[Rec], suffix: bytes) -> int | None:
    for i, r in enumerate(recs):
        if r.name.lower().endswith(suffix):
            return i
    return None


def _other_pickle(rng: random.Random) -> bytes:
    return rng.choice(object_pickles())[1]


MUTATIONS = {}


def mutation(fn):
    MUTATIONS[fn.__name__] = fn
    return fn


@mutation
def case_of_name(recs, lay, rng):
    i = rng.randrange(len(recs))
    recs[i] = replace(recs[i], name=recs[i].name[: len(FOLDER)] + _flip_case(recs[i].name[len(FOLDER):], rng))


@mutation
def case_twin(recs, lay, rng):
    """A second record whose name differs only in case, with other bytes, before or after."""
    i = rng.randrange(len(recs))
    r = recs[i]
    twin = replace(r, name=r.name[: len(FOLDER)] + _flip_case(r.name[len(FOLDER):], rng))
    twin = replace(twin, data=_other_pickle(rng) if r.name.endswith(b".pkl") else bytes(reversed(r.data)) + b"!")
    recs.insert(i + rng.choice([0, 1]), twin)


@mutation
def exact_twin(recs, lay, rng):
    i = rng.randrange(len(recs))
    r = recs[i]
    recs.insert(i + rng.choice([0, 1]), replace(r, data=_other_pickle(rng) if r.name.endswith(b".pkl") else r.data[::-1]))


@mutation
def reorder(recs, lay, rng):
    rng.shuffle(recs)


@mutation
def folder(recs, lay, rng):
    choice = rng.randrange(5)
    if choice == 0:  # another folder name for all
        new = rng.choice([b"x/", b"common/", b"a.b/", b"ARCHIVE/", b"\xc3\xa9t\xc3\xa9/"])
        for i, r in enumerate(recs):
            recs[i] = replace(r, name=new + r.name[len(FOLDER):])
    elif choice == 1:  # one record elsewhere
        i = rng.randrange(len(recs))
        recs[i] = replace(recs[i], name=rng.choice([b"other/", b"ARCHIVE/", b""]) + recs[i].name[len(FOLDER):])
    elif choice == 2:  # nested
        i = rng.randrange(len(recs))
        recs[i] = replace(recs[i], name=FOLDER + b"sub/" + recs[i].name[len(FOLDER):])
    elif choice == 3:  # no folder for the first
        recs[0] = replace(recs[0], name=recs[0].name[len(FOLDER):])
    else:  # a long or NUL-holding name
        i = rng.randrange(len(recs))
        recs[i] = replace(recs[i], name=recs[i].name + rng.choice([b"\x00tail", b"x" * 600]))


@mutation
def torchscript(recs, lay, rng):
    recs.insert(rng.randrange(len(recs) + 1), Rec(FOLDER + rng.choice([b"constants.pkl", b"CONSTANTS.pkl", b"constants.pkl\x00"]), b"\x80\x02)."))


@mutation
def byteorder(recs, lay, rng):
    i = _find(recs, b"/byteorder")
    value = rng.choice([b"big", b"BIG", b"little\n", b"", b"middle", None])
    if i is None:
        if value is not None:
            recs.append(Rec(FOLDER + b"byteorder", value))
    elif value is None:
        del recs[i]
    else:
        recs[i] = replace(recs[i], data=value)


@mutation
def version(recs, lay, rng):
    i = _find(recs, b"/version")
    value = rng.choice([b"0\n", b"1", b"10", b"11", b" 3", b"+3", b"-3", b"3x", b"x", b"", b"18446744073709551619", None])
    if rng.random() < 0.4:
        recs.append(Rec(FOLDER + b".data/version", rng.choice([b"3\n", b"12", b"x", b"2"])))
    elif value is None and i is not None:
        del recs[i]
    elif i is not None:
        recs[i] = replace(recs[i], data=value)


@mutation
def extra_records(recs, lay, rng):
    name, value = rng.choice(
        [
            (b".storage_alignment", rng.choice([b"64", b" 64\n", b"x", b"6_4", b"-1"])),
            (b".format_version", rng.choice([b"1", b"0", b"x"])),
            (b".data/serialization_id", b"99"),
            (b"data/1", b"\x00" * 8),
            (b"data.debug_pkl", b"\x80\x02)."),
        ]
    )
    recs.insert(rng.randrange(len(recs) + 1), Rec(FOLDER + name, value))


@mutation
def zip64_fields(recs, lay, rng):
    i = rng.randrange(len(recs))
    kind = rng.randrange(4)
    if kind == 0:
        recs[i] = replace(recs[i], zip64=True)
    elif kind == 1:
        # A second id-1 field whose sizes differ: readers taking the last one see other bytes.
        recs[i] = replace(recs[i], zip64=True, zip64_second=_u64(1) + _u64(1) + _u64(0))
    elif kind == 2:
        recs[i] = replace(recs[i], zip64=True, zip64_short=True)
    else:
        recs[i] = replace(recs[i], zip64_second=_u64(len(recs[i].data)))


@mutation
def end_records(recs, lay, rng):
    kind = rng.randrange(5)
    if kind == 0:
        lay.zip64_end = False
    elif kind == 1:
        lay.locator_elsewhere = True
    elif kind == 2:
        lay.eocd_entries_lie = rng.choice([-1, 1, 1000])
    elif kind == 3:
        lay.comment = rng.choice([b"hello", b"PK\x05\x06" + b"\x00" * 18])
    else:
        lay.trail = rng.choice([b"\x00" * 10, b"x" * 100, b"PK\x05\x06"])


@mutation
def headers(recs, lay, rng):
    i = rng.randrange(len(recs))
    r = recs[i]
    kind = rng.randrange(6)
    if kind == 0:
        recs[i] = replace(r, local_name=_flip_case(r.name, rng))
    elif kind == 1:
        recs[i] = replace(r, local_extra=b"XY" + _u16(3) + b"abc")
    elif kind == 2:
        recs[i] = replace(r, cd_extra=rng.choice([b"XY" + _u16(2) + b"ab", b"XY" + _u16(50) + b"ab", b"\x01"]))
    elif kind == 3:
        recs[i] = replace(r, descriptor=False, flags=0)
    elif kind == 4:
        recs[i] = replace(r, align=False)
    else:
        recs[i] = replace(r, crc=0)


@mutation
def flags_and_method(recs, lay, rng):
    i = rng.randrange(len(recs))
    r = recs[i]
    kind = rng.randrange(5)
    if kind == 0:
        recs[i] = replace(r, method=8)
    elif kind == 1:
        recs[i] = replace(r, flags=r.flags | rng.choice([0x1, 0x20, 0x40, 0x2000]))
    elif kind == 2:
        recs[i] = replace(r, external=0x10)
    elif kind == 3:
        recs[i] = replace(r, size_lie=rng.choice([-1, 1, 7]))
    else:
        recs[i] = replace(r, disk=rng.choice([1, 2, 0xFFFF]))


@mutation
def lead(recs, lay, rng):
    lay.lead = rng.choice([pickle.dumps(_Touch(), protocol=2), b"\x00" * 4, b"PK\x03\x04" + b"\x00" * 26])


@mutation
def storage_id(recs, lay, rng):
    """Lies in the storage's persistent id: numel, key, class (protocol-2 pickles only)."""
    i = _find(recs, b"data.pkl")
    if i is None:
        return
    p = recs[i].data
    kind = rng.randrange(3)
    if kind == 0:  # numel: the last BININT1/BININT2 before TUPLE BINPERSID
        at = p.find(b"tq\x01Q") if b"tq\x01Q" in p else p.find(b"t\x94Q")
        if at > 2 and p[at - 2] == 0x4B:  # BININT1
            p = p[: at - 1] + bytes([(p[at - 1] + rng.choice([1, 7, 255])) % 256]) + p[at:]
    elif kind == 1:  # key "0" -> another record name
        j = _find(recs, b"/data/0")
        new_key = rng.choice([b"A", b"00", b"1"])
        p = p.replace(b"X\x01\x00\x00\x000", b"X" + _u32(len(new_key)) + new_key, 1)
        if j is not None and rng.random() < 0.7:
            recs[j] = replace(recs[j], name=recs[j].name[: -1] + new_key.lower())
    else:
        p = p.replace(b"FloatStorage", b"DoubleStorage").replace(b"BFloat16Storage", b"HalfStorage")
    recs[i] = replace(recs[i], data=p)


@mutation
def pickle_swap(recs, lay, rng):
    i = _find(recs, b"data.pkl")
    if i is not None:
        recs[i] = replace(recs[i], data=_other_pickle(rng))


def generate(rng: random.Random) -> Case:
    kind = rng.choice(["tensor", "tensor", "object"])
    protocol = rng.choice([2, 2, 2, 1, 3, 4, 5])
    recs = base_records(kind, rng, protocol)
    lay = Layout()
    names = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3])):
        name = rng.choice(sorted(MUTATIONS))
        MUTATIONS[name](recs, lay, rng)
        names.append(name)
    data = build(recs, lay)
    if rng.random() < 0.05:  # raw damage on top
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        data = bytes(b)
        names.append("bitflip")
    if rng.random() < 0.03:
        data = data[: rng.randrange(len(data))]
        names.append("truncate")
    return Case(data, kind, [f"p{protocol}"] + names)
