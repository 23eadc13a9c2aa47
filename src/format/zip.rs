//! The `torch.save` zip container, written exactly as torch's `PyTorchStreamWriter` (miniz) lays it
//! out, so that every offset is known before a byte of payload is written.
//!
//! Layout facts (torch 2.3.1 `caffe2/serialize/inline_container.cc`, checked byte for byte against
//! `../shared/fixtures/dcp/torch-2.3.1`): all entries STORED under one folder `archive/`; each local
//! header has version 0, flags 0x0808 (data descriptor + UTF-8) and zero CRC/sizes; an extra field
//! `"FB"` of `'Z'` bytes pads every record's data to a 64-byte boundary from the archive start; a data
//! descriptor follows each record; the central directory is followed by a zip64 end record, a zip64
//! locator and the classic end record, always. Records of 4 GiB or more, or at offsets of 4 GiB or
//! more, get zip64 extra fields (APPNOTE 4.5.3), counted in the padding as `getPadding` does.

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
        let (prefix, suffix_template, crc_at) = encode_archive(&records, zip64_threshold);
        ArchiveLayout {
            prefix,
            payload_len,
            suffix_template,
            crc_at,
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
    let (mut bytes, suffix, _) = encode_archive(&records, U32_LIMIT);
    bytes.extend_from_slice(&suffix);
    bytes
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

struct Central {
    name: String,
    crc: u32,
    size: u64,
    offset: u64,
    external: bool,
}

/// Encodes the archive with a payload CRC of 0; returns the bytes before the external payload, the
/// bytes after it, and the two positions in the latter where the payload's CRC-32 belongs (its data
/// descriptor, absent for an empty payload, and its central directory entry).
fn encode_archive(records: &[Record], threshold: u64) -> (Vec<u8>, Vec<u8>, [Option<usize>; 2]) {
    let payload_crc = 0u32;
    let mut descriptor_crc_at = None;
    let mut prefix = Vec::new();
    let mut suffix = Vec::new();
    let mut cursor = 0u64;
    let mut central = Vec::with_capacity(records.len());
    let mut seen_external = false;
    for rec in records {
        let name = format!("{PREFIX}{}", rec.name);
        let header_offset = cursor;
        let (size, crc) = match rec.data {
            Data::Inline(b) => (b.len() as u64, crc32fast::hash(b)),
            Data::External(n) => (n, payload_crc),
        };
        let big_size = size >= threshold;
        let zip64 = zip64_extra(size, cursor, threshold);
        let out = if seen_external {
            &mut suffix
        } else {
            &mut prefix
        };
        let header_start = out.len();
        put32(out, 0x0403_4b50);
        put16(out, if zip64.is_empty() { 0 } else { 45 });
        put16(out, flags(size));
        put16(out, 0); // STORED
        put16(out, 0); // time
        put16(out, 0); // date
        put32(out, 0); // crc: in the data descriptor
        let local_size = if big_size { 0xFFFF_FFFF } else { 0 };
        put32(out, local_size);
        put32(out, local_size);
        // Extra fields: zip64 (sizes, then offset) first, then the "FB" padding (getPadding).
        let zip64_len = if zip64.is_empty() {
            0
        } else {
            4 + zip64.len() as u64
        };
        let start = cursor + 30 + name.len() as u64 + 4 + zip64_len;
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
        debug_assert_eq!((cursor + header_len) % ALIGN, 0);
        cursor += header_len;
        match rec.data {
            Data::Inline(b) => out.extend_from_slice(b),
            Data::External(_) => seen_external = true,
        }
        cursor += size;
        // miniz writes no data descriptor after an empty record (fixture `empty_0x4`).
        if size > 0 {
            let out = if seen_external {
                &mut suffix
            } else {
                &mut prefix
            };
            let before = out.len();
            put32(out, 0x0807_4b50);
            if matches!(rec.data, Data::External(_)) {
                descriptor_crc_at = Some(out.len());
            }
            put32(out, crc);
            if big_size {
                put64(out, size);
                put64(out, size);
            } else {
                put32(out, size as u32);
                put32(out, size as u32);
            }
            cursor += (out.len() - before) as u64;
        }
        central.push(Central {
            name,
            crc,
            size,
            offset: header_offset,
            external: matches!(rec.data, Data::External(_)),
        });
    }
    let cd_offset = cursor;
    let out = &mut suffix;
    let cd_start = out.len();
    let mut central_crc_at = None;
    for c in &central {
        let zip64 = zip64_extra(c.size, c.offset, threshold);
        put32(out, 0x0201_4b50);
        put16(out, 0); // made by
        put16(out, if zip64.is_empty() { 0 } else { 45 });
        put16(out, flags(c.size));
        put16(out, 0);
        put16(out, 0);
        put16(out, 0);
        if c.external {
            central_crc_at = Some(out.len());
        }
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
    }
    let cd_size = (out.len() - cd_start) as u64;
    let eocd64_offset = cd_offset + cd_size;
    let n = central.len() as u64;
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
    (prefix, suffix, [descriptor_crc_at, central_crc_at])
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
}
