//! The `torch.save` zip container, written exactly as torch's `PyTorchStreamWriter` (miniz) lays it
//! out, so that every offset is known before a byte of payload is written.
//!
//! Layout facts (torch 2.3.1 `caffe2/serialize/inline_container.cc`, checked byte for byte against
//! the golden `tests/fixtures/dcp/torch-2.3.1`, `tests/golden.rs`): all entries STORED under one
//! folder `archive/`; each local header has version 0, flags 0x0808 (data descriptor + UTF-8) and
//! zero CRC/sizes; an extra field `"FB"` of `'Z'` bytes pads every record's data to a 64-byte
//! boundary from the archive start; a data descriptor follows each record; the central directory is
//! followed by a zip64 end record, a zip64 locator and the classic end record, always. Records of
//! 4 GiB or more, or at offsets of 4 GiB or more, get zip64 extra fields (APPNOTE 4.5.3), counted in
//! the padding as `getPadding` does.

use crate::format::dtype::DType;
use crate::format::pickle::Pickler;

const ALIGN: u64 = 64;
const U32_LIMIT: u64 = 0xFFFF_FFFF;
const PREFIX: &str = "archive/";

/// One record of the archive: its name under `archive/` and either inline bytes or the length of an
/// external payload that the caller streams in (the tensor's storage).
enum Data<'a> {
    Inline(&'a [u8]),
    External(u64),
}

struct Record<'a> {
    name: &'a str,
    data: Data<'a>,
}

/// The bytes of one torch.save archive around an external payload: `prefix`, then the payload,
/// then `suffix(crc32 of payload)`. `len()` is the archive's exact size in bytes.
#[derive(Clone, Debug)]
pub struct ArchiveLayout {
    /// The archive's bytes before the payload: the records before it and the payload's local
    /// header.
    pub prefix: Vec<u8>,
    pub(crate) payload_len: u64,
    /// The suffix encoded with a payload CRC of 0, and where in it the payload CRC goes (the data
    /// descriptor of `data/0` and its central directory entry): `suffix()` patches those 8 bytes
    /// instead of encoding the archive again.
    suffix_template: Vec<u8>,
    crc_at: [Option<usize>; 2],
}

impl ArchiveLayout {
    /// Layout of `torch.save(tensor)` for a contiguous CPU tensor of `shape` (elements) and `dtype`,
    /// storage offset 0. `serialization_id` is 40 decimal digits (torch writes random ones; the
    /// reader ignores them).
    pub fn for_tensor(dtype: DType, shape: &[u64], serialization_id: &str) -> ArchiveLayout {
        Self::with_threshold(dtype, shape, serialization_id, U32_LIMIT)
    }

    /// As [`ArchiveLayout::for_tensor`], with zip64 used for values `>= zip64_threshold`. Tests use a
    /// small threshold to exercise the zip64 form with small tensors.
    pub fn with_threshold(
        dtype: DType,
        shape: &[u64],
        serialization_id: &str,
        zip64_threshold: u64,
    ) -> ArchiveLayout {
        let numel: u64 = shape.iter().product();
        let payload_len = numel * dtype.itemsize();
        let pickle = tensor_pickle(dtype, shape);
        let records = [
            Record {
                name: "data.pkl",
                data: Data::Inline(&pickle),
            },
            Record {
                name: "byteorder",
                data: Data::Inline(b"little"),
            },
            Record {
                name: "data/0",
                data: Data::External(payload_len),
            },
            Record {
                name: "version",
                data: Data::Inline(b"3\n"),
            },
            Record {
                name: ".data/serialization_id",
                data: Data::Inline(serialization_id.as_bytes()),
            },
        ];
        let enc = encode_archive(&records, zip64_threshold);
        ArchiveLayout {
            prefix: enc.prefix,
            payload_len,
            suffix_template: enc.suffix,
            crc_at: enc.crc_at,
        }
    }

    /// Total archive size in bytes.
    pub fn len(&self) -> u64 {
        self.prefix.len() as u64 + self.payload_len + self.suffix_template.len() as u64
    }

    /// Always false: an archive has headers even around an empty payload.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes after the payload, given the payload's CRC-32.
    pub fn suffix(&self, payload_crc: u32) -> Vec<u8> {
        let mut out = self.suffix_template.clone();
        for at in self.crc_at.into_iter().flatten() {
            out[at..at + 4].copy_from_slice(&payload_crc.to_le_bytes());
        }
        out
    }
}

/// The whole `torch.save` archive of an object without tensors (a dict of plain values, e.g.
/// Megatron's `common.pt`): `data.pkl` is `pickle`, then the records torch writes beside it
/// (`byteorder`, `version`, `.data/serialization_id`), as [`ArchiveLayout::for_tensor`] lays
/// them out without a storage record.
pub fn object_archive(pickle: &[u8], serialization_id: &str) -> Vec<u8> {
    let records = [
        Record {
            name: "data.pkl",
            data: Data::Inline(pickle),
        },
        Record {
            name: "byteorder",
            data: Data::Inline(b"little"),
        },
        Record {
            name: "version",
            data: Data::Inline(b"3\n"),
        },
        Record {
            name: ".data/serialization_id",
            data: Data::Inline(serialization_id.as_bytes()),
        },
    ];
    let mut enc = encode_archive(&records, U32_LIMIT);
    enc.prefix.extend_from_slice(&enc.suffix);
    enc.prefix
}

/// `data.pkl` of `torch.save(tensor)`: `_rebuild_tensor_v2` for legacy dtypes, `_rebuild_tensor_v3`
/// (UntypedStorage, numel in bytes, trailing dtype) for float8. Memo opcodes as CPython emits them.
pub fn tensor_pickle(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let numel: u64 = shape.iter().product();
    let mut p = Pickler::new(false);
    let legacy = dtype.legacy_storage();
    p.global(
        "torch._utils",
        if legacy.is_some() {
            "_rebuild_tensor_v2"
        } else {
            "_rebuild_tensor_v3"
        },
    );
    p.mark();
    p.mark();
    p.str("storage");
    match legacy {
        Some(cls) => p.global("torch", cls),
        None => p.global("torch.storage", "UntypedStorage"),
    }
    p.str("0");
    p.str("cpu");
    p.int(if legacy.is_some() {
        numel
    } else {
        numel * dtype.itemsize()
    } as i128);
    p.tuple(5);
    p.binpersid();
    p.int(0);
    p.int_tuple(shape);
    p.int_tuple(&contiguous_strides(shape));
    p.bool(false);
    p.global("collections", "OrderedDict");
    p.empty_tuple();
    p.reduce();
    p.put();
    if legacy.is_none() {
        p.global("torch", dtype.torch_name());
    }
    p.tuple(7); // 6 or 7 items: always > 3, so MARK ... TUPLE
    p.reduce();
    p.put();
    p.finish()
}

/// C-order strides in elements, as torch computes them for a contiguous tensor
/// (`stride[i] = stride[i+1] * max(size[i+1], 1)`).
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i].max(1);
    }
    strides
}

fn put16(b: &mut Vec<u8>, v: u16) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}
/// Payload of a zip64 extra field (id 0x0001): uncompressed and compressed size when the size
/// overflows 32 bits, then the local header offset when it does (APPNOTE 4.5.3); empty if neither.
fn zip64_extra(size: u64, offset: u64, threshold: u64) -> Vec<u8> {
    let mut out = Vec::new();
    if size >= threshold {
        put64(&mut out, size);
        put64(&mut out, size);
    }
    if offset >= threshold {
        put64(&mut out, offset);
    }
    out
}

/// General-purpose flags: UTF-8 names, plus "data descriptor follows" for non-empty records.
fn flags(size: u64) -> u16 {
    if size > 0 {
        0x0808
    } else {
        0x0800
    }
}

fn clamp32(v: u64, threshold: u64) -> u32 {
    if v >= threshold {
        0xFFFF_FFFF
    } else {
        v as u32
    }
}

/// A record's central directory entry, remembered while the records are written.
struct Central {
    name: String,
    crc: u32,
    size: u64,
    offset: u64,
    external: bool,
}

/// An encoded archive with a payload CRC of 0: the bytes before the external payload, the bytes
/// after it, and the two positions in the latter where the payload's CRC-32 belongs (its data
/// descriptor, absent for an empty payload, and its central directory entry).
struct Encoded {
    prefix: Vec<u8>,
    suffix: Vec<u8>,
    crc_at: [Option<usize>; 2],
}

/// Encodes the archive with a payload CRC of 0, as named steps: each record ([`Records::push`]: local header, inline data,
/// data descriptor), then the central directory ([`central_entry`]) and the end records
/// ([`end_records`]), which all follow the payload.
fn encode_archive(records: &[Record], threshold: u64) -> Encoded {
    let mut enc = Records::default();
    let central: Vec<Central> = records.iter().map(|r| enc.push(r, threshold)).collect();
    let cd_offset = enc.cursor;
    let out = &mut enc.suffix;
    let cd_start = out.len();
    let mut central_crc_at = None;
    for c in &central {
        let at = central_entry(out, c, threshold);
        if c.external {
            central_crc_at = Some(at);
        }
    }
    let cd_size = (out.len() - cd_start) as u64;
    end_records(out, central.len() as u64, cd_size, cd_offset, threshold);
    Encoded {
        prefix: enc.prefix,
        suffix: enc.suffix,
        crc_at: [enc.descriptor_crc_at, central_crc_at],
    }
}

/// The records written so far: bytes before the external payload go to `prefix`, those after it
/// to `suffix`; `cursor` is the archive offset of the next byte (the payload counted).
#[derive(Default)]
struct Records {
    prefix: Vec<u8>,
    suffix: Vec<u8>,
    cursor: u64,
    seen_external: bool,
    /// Where in `suffix` the external record's data descriptor holds its CRC.
    descriptor_crc_at: Option<usize>,
}

impl Records {
    /// Where the next bytes go: after the external payload once it has been passed.
    fn out(&mut self) -> &mut Vec<u8> {
        if self.seen_external {
            &mut self.suffix
        } else {
            &mut self.prefix
        }
    }

    /// Writes one record (local header, inline data, data descriptor) and returns its central
    /// directory entry. An external record's data is the payload, written by the caller between
    /// `prefix` and `suffix`; its CRC is 0 here.
    fn push(&mut self, rec: &Record, threshold: u64) -> Central {
        let name = format!("{PREFIX}{}", rec.name);
        let header_offset = self.cursor;
        let (size, crc) = match rec.data {
            Data::Inline(b) => (b.len() as u64, crc32fast::hash(b)),
            Data::External(n) => (n, 0),
        };
        let cursor = self.cursor;
        self.cursor += local_header(self.out(), &name, size, cursor, threshold);
        match rec.data {
            Data::Inline(b) => self.out().extend_from_slice(b),
            Data::External(_) => self.seen_external = true,
        }
        self.cursor += size;
        // miniz writes no data descriptor after an empty record (fixture `empty_0x4`).
        if size > 0 {
            let out = self.out();
            let before = out.len();
            let at = data_descriptor(out, crc, size, threshold);
            if matches!(rec.data, Data::External(_)) {
                self.descriptor_crc_at = Some(at);
            }
            self.cursor += (self.out().len() - before) as u64;
        }
        Central {
            name,
            crc,
            size,
            offset: header_offset,
            external: matches!(rec.data, Data::External(_)),
        }
    }
}

/// Appends the local header of record `name` (`size` bytes, header at archive offset `offset`),
/// padded so that the record's data starts on a 64-byte boundary; returns the header's length.
fn local_header(out: &mut Vec<u8>, name: &str, size: u64, offset: u64, threshold: u64) -> u64 {
    let zip64 = zip64_extra(size, offset, threshold);
    let header_start = out.len();
    put32(out, 0x0403_4b50);
    put16(out, if zip64.is_empty() { 0 } else { 45 });
    put16(out, flags(size));
    put16(out, 0); // STORED
    put16(out, 0); // time
    put16(out, 0); // date
    put32(out, 0); // crc: in the data descriptor
    let local_size = if size >= threshold { 0xFFFF_FFFF } else { 0 };
    put32(out, local_size);
    put32(out, local_size);
    // Extra fields: zip64 (sizes, then offset) first, then the "FB" padding (getPadding).
    let zip64_len = if zip64.is_empty() {
        0
    } else {
        4 + zip64.len() as u64
    };
    let start = offset + 30 + name.len() as u64 + 4 + zip64_len;
    let pad = (ALIGN - start % ALIGN) % ALIGN;
    put16(out, name.len() as u16);
    put16(out, (zip64_len + 4 + pad) as u16);
    out.extend_from_slice(name.as_bytes());
    if !zip64.is_empty() {
        put16(out, 0x0001);
        put16(out, zip64.len() as u16);
        out.extend_from_slice(&zip64);
    }
    out.extend_from_slice(b"FB");
    put16(out, pad as u16);
    out.resize(out.len() + pad as usize, b'Z');
    let header_len = (out.len() - header_start) as u64;
    debug_assert_eq!((offset + header_len) % ALIGN, 0);
    header_len
}

/// Appends the data descriptor of a record of `size` bytes (sizes in 64 bits from `threshold`
/// on); returns where in `out` its CRC is.
fn data_descriptor(out: &mut Vec<u8>, crc: u32, size: u64, threshold: u64) -> usize {
    put32(out, 0x0807_4b50);
    let crc_at = out.len();
    put32(out, crc);
    if size >= threshold {
        put64(out, size);
        put64(out, size);
    } else {
        put32(out, size as u32);
        put32(out, size as u32);
    }
    crc_at
}

/// Appends the central directory entry of one record; returns where in `out` its CRC is.
fn central_entry(out: &mut Vec<u8>, c: &Central, threshold: u64) -> usize {
    let zip64 = zip64_extra(c.size, c.offset, threshold);
    put32(out, 0x0201_4b50);
    put16(out, 0); // made by
    put16(out, if zip64.is_empty() { 0 } else { 45 });
    put16(out, flags(c.size));
    put16(out, 0);
    put16(out, 0);
    put16(out, 0);
    let crc_at = out.len();
    put32(out, c.crc);
    put32(out, clamp32(c.size, threshold));
    put32(out, clamp32(c.size, threshold));
    put16(out, c.name.len() as u16);
    put16(
        out,
        if zip64.is_empty() {
            0
        } else {
            4 + zip64.len() as u16
        },
    );
    put16(out, 0); // comment
    put16(out, 0); // disk
    put16(out, 0); // internal attributes
    put32(out, 0); // external attributes
    put32(out, clamp32(c.offset, threshold));
    out.extend_from_slice(c.name.as_bytes());
    if !zip64.is_empty() {
        put16(out, 0x0001);
        put16(out, zip64.len() as u16);
        out.extend_from_slice(&zip64);
    }
    crc_at
}

/// Appends the zip64 end record, its locator and the classic end record (torch writes all three,
/// always) for `n` entries and a central directory of `cd_size` bytes at `cd_offset`.
fn end_records(out: &mut Vec<u8>, n: u64, cd_size: u64, cd_offset: u64, threshold: u64) {
    let eocd64_offset = cd_offset + cd_size;
    put32(out, 0x0606_4b50);
    put64(out, 44);
    put16(out, 0x031e);
    put16(out, 45);
    put32(out, 0);
    put32(out, 0);
    put64(out, n);
    put64(out, n);
    put64(out, cd_size);
    put64(out, cd_offset);
    put32(out, 0x0706_4b50);
    put32(out, 0);
    put64(out, eocd64_offset);
    put32(out, 1);
    put32(out, 0x0605_4b50);
    put16(out, 0);
    put16(out, 0);
    put16(out, n as u16);
    put16(out, n as u16);
    put32(out, clamp32(cd_size, threshold));
    put32(out, clamp32(cd_offset, threshold));
    put16(out, 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_match_torch() {
        assert_eq!(contiguous_strides(&[4, 8]), vec![8, 1]);
        assert_eq!(contiguous_strides(&[2, 0, 3]), vec![3, 3, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<u64>::new());
    }

    #[test]
    fn layout_is_consistent_and_readable_by_zip_crate() {
        for threshold in [U32_LIMIT, 8] {
            let payload: Vec<u8> = (0..96u8).collect();
            let l = ArchiveLayout::with_threshold(DType::F32, &[4, 6], "7", threshold);
            let mut bytes = l.prefix.clone();
            bytes.extend_from_slice(&payload);
            bytes.extend_from_slice(&l.suffix(crc32fast::hash(&payload)));
            assert_eq!(bytes.len() as u64, l.len());
            let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
            assert_eq!(z.len(), 5);
            let mut f = z.by_name("archive/data/0").unwrap();
            assert_eq!(f.data_start().unwrap() % 64, 0);
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut got).unwrap();
            assert_eq!(got, payload);
        }
    }

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// A local header pads with "FB" and 'Z's so the data starts on a 64-byte boundary of the
    /// archive, whatever the header's offset; zip64 sizes come before the padding.
    #[test]
    fn local_header_aligns_the_data() {
        let mut out = vec![0u8; 3]; // bytes already there do not count: `offset` does
        let len = local_header(&mut out, "archive/data.pkl", 10, 0, U32_LIMIT);
        assert_eq!((len, out.len()), (64, 67));
        let h = &out[3..];
        assert_eq!(u32_at(h, 0), 0x0403_4b50);
        assert_eq!((u16_at(h, 4), u16_at(h, 6)), (0, 0x0808));
        assert_eq!((u32_at(h, 18), u32_at(h, 22)), (0, 0));
        assert_eq!((u16_at(h, 26), u16_at(h, 28)), (16, 4 + 14));
        assert_eq!(&h[30..46], b"archive/data.pkl");
        assert_eq!((&h[46..48], u16_at(h, 48)), (&b"FB"[..], 14));
        assert!(h[50..].iter().all(|&b| b == b'Z'));

        let mut out = Vec::new();
        let len = local_header(&mut out, "archive/data/0", 0, 100, U32_LIMIT);
        assert_eq!((100 + len) % ALIGN, 0);
        assert_eq!(u16_at(&out, 6), 0x0800, "an empty record has no descriptor");

        // zip64: sizes of 8 bytes or more with a threshold of 8; the offset 0 stays 32-bit.
        let mut out = Vec::new();
        let len = local_header(&mut out, "archive/data.pkl", 10, 0, 8);
        assert_eq!(len, 128);
        assert_eq!(u16_at(&out, 4), 45);
        assert_eq!(
            (u32_at(&out, 18), u32_at(&out, 22)),
            (0xFFFF_FFFF, 0xFFFF_FFFF)
        );
        assert_eq!((u16_at(&out, 46), u16_at(&out, 48)), (0x0001, 16));
        assert_eq!(&out[66..68], b"FB");
    }

    #[test]
    fn data_descriptor_holds_the_crc_and_both_sizes() {
        let mut out = vec![9u8; 2];
        assert_eq!(data_descriptor(&mut out, 0xdead_beef, 10, U32_LIMIT), 6);
        assert_eq!(out.len(), 2 + 16);
        assert_eq!(u32_at(&out, 2), 0x0807_4b50);
        assert_eq!(u32_at(&out, 6), 0xdead_beef);
        assert_eq!((u32_at(&out, 10), u32_at(&out, 14)), (10, 10));
        let mut out = Vec::new();
        assert_eq!(data_descriptor(&mut out, 1, 10, 8), 4);
        assert_eq!(out.len(), 24);
        assert_eq!(
            &out[8..24],
            &[10, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn central_entry_points_at_its_header() {
        let c = Central {
            name: "archive/version".into(),
            crc: 7,
            size: 2,
            offset: 320,
            external: false,
        };
        let mut out = vec![0u8; 5];
        assert_eq!(central_entry(&mut out, &c, U32_LIMIT), 5 + 16);
        let e = &out[5..];
        assert_eq!(e.len(), 46 + 15);
        assert_eq!(u32_at(e, 0), 0x0201_4b50);
        assert_eq!((u32_at(e, 16), u32_at(e, 20), u32_at(e, 24)), (7, 2, 2));
        assert_eq!((u16_at(e, 28), u16_at(e, 30)), (15, 0));
        assert_eq!(u32_at(e, 42), 320);
        assert_eq!(&e[46..], b"archive/version");
        // zip64: the offset past the threshold moves into the extra field.
        let mut out = Vec::new();
        central_entry(&mut out, &c, 300);
        assert_eq!((u16_at(&out, 6), u16_at(&out, 30)), (45, 4 + 8));
        assert_eq!(u32_at(&out, 42), 0xFFFF_FFFF);
        assert_eq!(out.len(), 46 + 15 + 12);
    }

    #[test]
    fn end_records_are_zip64_then_classic() {
        let mut out = Vec::new();
        end_records(&mut out, 5, 300, 1000, U32_LIMIT);
        assert_eq!(out.len(), 56 + 20 + 22);
        assert_eq!(u32_at(&out, 0), 0x0606_4b50);
        assert_eq!(u32_at(&out, 56), 0x0706_4b50);
        assert_eq!(
            u32_at(&out, 64),
            1300,
            "the locator points at the zip64 end record"
        );
        let classic = &out[76..];
        assert_eq!(u32_at(classic, 0), 0x0605_4b50);
        assert_eq!((u16_at(classic, 8), u16_at(classic, 10)), (5, 5));
        assert_eq!((u32_at(classic, 12), u32_at(classic, 16)), (300, 1000));
        let mut out = Vec::new();
        end_records(&mut out, 5, 300, 1000, 500);
        assert_eq!(
            (u32_at(&out, 76 + 12), u32_at(&out, 76 + 16)),
            (300, 0xFFFF_FFFF)
        );
    }

    /// The external record's header goes before the payload, its descriptor after it; the cursor
    /// counts the payload.
    #[test]
    fn records_split_around_the_external_payload() {
        let mut enc = Records::default();
        let small = enc.push(
            &Record {
                name: "byteorder",
                data: Data::Inline(b"little"),
            },
            U32_LIMIT,
        );
        assert_eq!((small.offset, small.size, small.external), (0, 6, false));
        assert_eq!(small.crc, crc32fast::hash(b"little"));
        assert_eq!(enc.prefix.len(), 64 + 6 + 16);
        let payload = enc.push(
            &Record {
                name: "data/0",
                data: Data::External(100),
            },
            U32_LIMIT,
        );
        assert_eq!(
            (payload.offset, payload.crc, payload.external),
            (86, 0, true)
        );
        assert_eq!(enc.prefix.len() % 64, 0, "the payload starts aligned");
        assert_eq!(enc.suffix.len(), 16);
        assert_eq!(enc.descriptor_crc_at, Some(4));
        assert_eq!(enc.cursor, enc.prefix.len() as u64 + 100 + 16);
    }
}
