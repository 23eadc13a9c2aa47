//! Reads one DCP item: a torch.save zip archive (`torch/serialization.py` `_save`, torch 2.3.1–2.15.0;
//! layout in [`crate::format::zip`]) held in memory or mapped.
//! Sizes come from the central directory (torch's local headers hold zeros), zip64 records are
//! honoured, every offset is bounds-checked against the blob, and nothing is copied.

use crate::format::dtype::DType;
use crate::format::unpickle::{unpickle, Value};

/// Why an item could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveError(pub String);

type R<T> = Result<T, ArchiveError>;

fn bad<T>(msg: impl Into<String>) -> R<T> {
    Err(ArchiveError(msg.into()))
}

/// One STORED record of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The record's name inside the archive (`<archive>/data.pkl`, `<archive>/data/0`, ...).
    pub name: String,
    /// Byte range of the record's data inside the blob.
    pub start: usize,
    /// Its data's length in bytes.
    pub len: usize,
    /// CRC-32 recorded in the central directory (0 when the writer left it out).
    pub crc: u32,
}

impl Record {
    /// Whether this is the archive's pickle, `<archive name>/data.pkl`, which `torch.load`
    /// unpickles (torch/serialization.py `_load`, 2.3–2.15).
    pub fn is_data_pkl(&self) -> bool {
        self.name.ends_with("/data.pkl") || self.name == "data.pkl"
    }

    /// Whether the central directory records a CRC-32 for this record's data (a writer may leave
    /// it 0; torch writes real ones).
    pub fn has_crc(&self) -> bool {
        self.crc != 0
    }

    /// The problem when `got`, the CRC-32 of this record's data, is not the one the central
    /// directory records; None when it is (or when none is recorded).
    pub fn crc_mismatch(&self, got: u32) -> Option<String> {
        (self.has_crc() && got != self.crc).then(|| {
            format!(
                "record {} fails its zip CRC-32 (stored {:08x}, computed {got:08x})",
                self.name, self.crc
            )
        })
    }
}

/// An item's bytes, whole or in part: the loader decodes an item from its first and last bytes
/// alone (the zip structures torch writes sit there) to find where its tensor data lies before
/// reading it. Offsets are those of the whole item; a range that is not held reads as `None`,
/// which decoding reports as a truncated structure.
pub trait Blob {
    /// Length of the whole item in bytes.
    fn size(&self) -> usize;
    /// Bytes `r` of the item, when held.
    fn range(&self, r: std::ops::Range<usize>) -> Option<&[u8]>;
}

impl Blob for [u8] {
    fn size(&self) -> usize {
        self.len()
    }
    fn range(&self, r: std::ops::Range<usize>) -> Option<&[u8]> {
        self.get(r)
    }
}

/// The first and the last bytes of an item of `size` bytes.
pub struct HeadTail<'a> {
    /// The item's size in bytes.
    pub size: usize,
    pub(crate) head: &'a [u8],
    pub(crate) tail: &'a [u8],
}

impl Blob for HeadTail<'_> {
    fn size(&self) -> usize {
        self.size
    }
    fn range(&self, r: std::ops::Range<usize>) -> Option<&[u8]> {
        let tail_start = self.size.checked_sub(self.tail.len())?;
        if r.end <= self.head.len() {
            self.head.get(r)
        } else if r.start >= tail_start {
            self.tail
                .get(r.start - tail_start..r.end.checked_sub(tail_start)?)
        } else {
            None
        }
    }
}

fn field<const N: usize>(b: &(impl Blob + ?Sized), at: usize) -> R<[u8; N]> {
    b.range(at..at + N)
        .map(|s| s.try_into().unwrap())
        .ok_or_else(|| ArchiveError("truncated zip structure".into()))
}
fn le16(b: &(impl Blob + ?Sized), at: usize) -> R<u16> {
    field(b, at).map(u16::from_le_bytes)
}
fn le32(b: &(impl Blob + ?Sized), at: usize) -> R<u32> {
    field(b, at).map(u32::from_le_bytes)
}
fn le64(b: &(impl Blob + ?Sized), at: usize) -> R<u64> {
    field(b, at).map(u64::from_le_bytes)
}

/// Lists the records of a zip archive. Only STORED (method 0) records are accepted, as torch writes.
///
/// Errors: [`ArchiveError`] when the blob is not a complete zip (truncated, wrong `length` in the
/// metadata, compressed records, offsets outside the blob).
pub fn records(blob: &[u8]) -> R<Vec<Record>> {
    records_in(blob)
}

/// [`records`] of an item held in part ([`Blob`]).
pub fn records_in(blob: &(impl Blob + ?Sized)) -> R<Vec<Record>> {
    // End of central directory: the last "PK\5\6" within the final 64 KiB + 22 bytes.
    let lo = blob.size().saturating_sub(22 + 65535);
    let eocd = (lo..=blob.size().saturating_sub(22))
        .rev()
        .find(|&i| blob.range(i..i + 4) == Some(b"PK\x05\x06"))
        .ok_or_else(|| {
            ArchiveError(
                "no zip end-of-central-directory record (item truncated or length wrong)".into(),
            )
        })?;
    let mut entries = le16(blob, eocd + 10)? as u64;
    let mut cd_size = le32(blob, eocd + 12)? as u64;
    let mut cd_offset = le32(blob, eocd + 16)? as u64;
    if eocd >= 20 && blob.range(eocd - 20..eocd - 16) == Some(b"PK\x06\x07") {
        let z64 = le64(blob, eocd - 20 + 8)?;
        let z64 = usize::try_from(z64)
            .map_err(|_| ArchiveError("zip64 record offset out of range".into()))?;
        if blob.range(z64..z64.saturating_add(4)) != Some(b"PK\x06\x06") {
            return bad("zip64 locator points at no zip64 end record");
        }
        entries = le64(blob, z64 + 32)?;
        cd_size = le64(blob, z64 + 40)?;
        cd_offset = le64(blob, z64 + 48)?;
    }
    let cd_end = cd_offset
        .checked_add(cd_size)
        .filter(|&e| e <= blob.size() as u64);
    if cd_end.is_none() {
        return bad("central directory lies outside the item");
    }
    if entries > cd_size / 46 {
        return bad("central directory entry count exceeds its size");
    }
    let mut out = Vec::with_capacity(entries as usize);
    let mut at = cd_offset as usize;
    for _ in 0..entries {
        if le32(blob, at)? != 0x0201_4b50 {
            return bad("bad central directory entry signature");
        }
        let method = le16(blob, at + 10)?;
        let crc = le32(blob, at + 16)?;
        let mut csize = le32(blob, at + 20)? as u64;
        let mut usize_ = le32(blob, at + 24)? as u64;
        let name_len = le16(blob, at + 28)? as usize;
        let extra_len = le16(blob, at + 30)? as usize;
        let comment_len = le16(blob, at + 32)? as usize;
        let mut local = le32(blob, at + 42)? as u64;
        let name = blob
            .range(at + 46..at + 46 + name_len)
            .ok_or_else(|| ArchiveError("truncated file name".into()))?;
        let name = String::from_utf8_lossy(name).into_owned();
        let extra = blob
            .range(at + 46 + name_len..at + 46 + name_len + extra_len)
            .ok_or_else(|| ArchiveError("truncated extra field".into()))?;
        // zip64 extended information: values present only for fields saturated at 0xFFFFFFFF.
        let mut e = 0;
        while e + 4 <= extra.len() {
            let id = le16(extra, e)?;
            let len = le16(extra, e + 2)? as usize;
            if id == 1 {
                let mut p = e + 4;
                for field in [&mut usize_, &mut csize, &mut local] {
                    if *field == 0xFFFF_FFFF {
                        *field = le64(extra, p)?;
                        p += 8;
                    }
                }
            }
            e += 4 + len;
        }
        if method != 0 || csize != usize_ {
            return bad(format!(
                "record {name} is compressed (method {method}); torch archives are STORED"
            ));
        }
        let local = usize::try_from(local)
            .map_err(|_| ArchiveError("local header offset out of range".into()))?;
        if le32(blob, local)? != 0x0403_4b50 {
            return bad(format!("record {name}: bad local header signature"));
        }
        let start =
            local + 30 + le16(blob, local + 26)? as usize + le16(blob, local + 28)? as usize;
        let end = (start as u64)
            .checked_add(usize_)
            .filter(|&e| e <= blob.size() as u64);
        if end.is_none() {
            return bad(format!("record {name} extends past the end of the item"));
        }
        out.push(Record {
            name,
            start,
            len: usize_ as usize,
            crc,
        });
        at += 46 + name_len + extra_len + comment_len;
    }
    Ok(out)
}

/// Records whose data fails the CRC-32 the central directory records for them, as messages
/// (records with CRC 0, which a writer may leave out, are skipped). torch writes real CRCs
/// (caffe2/serialize/inline_container.cc) but its reader never checks them.
pub fn bad_record_crcs(blob: &[u8], recs: &[Record]) -> Vec<String> {
    recs.iter()
        .filter(|r| r.has_crc())
        .filter_map(|r| r.crc_mismatch(crc32fast::hash(&blob[r.start..r.start + r.len])))
        .collect()
}

/// A decoded tensor item: what `torch.load` would rebuild, as a view on the archive's storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// The tensor's dtype.
    pub dtype: DType,
    pub(crate) shape: Vec<u64>,
    /// Strides in elements.
    pub strides: Vec<u64>,
    /// Offset of element 0 in the storage, in elements.
    pub storage_offset: u64,
    /// The storage record's data range in the blob.
    pub storage: Record,
}

fn int(v: &Value, what: &str) -> R<u64> {
    v.as_int()
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| ArchiveError(format!("{what} is {} , not a non-negative int", v.kind())))
}

fn ints(v: &Value, what: &str) -> R<Vec<u64>> {
    v.items()
        .ok_or_else(|| ArchiveError(format!("{what} is {}, not a tuple", v.kind())))?
        .iter()
        .map(|x| int(x, what))
        .collect()
}

/// Decodes a tensor item: `data.pkl` must be `_rebuild_tensor_v2` (6 or 7 arguments) or
/// `_rebuild_tensor_v3` over one storage record, as torch.save writes (torch/_utils.py, 2.3–2.15).
///
/// Errors: [`ArchiveError`] for anything else, or a storage too small for shape/strides/offset.
pub fn stored_tensor(blob: &[u8]) -> R<StoredTensor> {
    stored_tensor_in(blob)
}

/// [`stored_tensor`] of an item held in part ([`Blob`]): its first bytes (local headers and
/// `data.pkl`) and its last ones (central directory) suffice.
pub fn stored_tensor_in(blob: &(impl Blob + ?Sized)) -> R<StoredTensor> {
    let recs = records_in(blob)?;
    let pkl = recs
        .iter()
        .find(|r| r.is_data_pkl())
        .ok_or_else(|| ArchiveError("no data.pkl record".into()))?;
    let prefix = &pkl.name[..pkl.name.len() - "data.pkl".len()];
    let pkl_bytes = blob
        .range(pkl.start..pkl.start + pkl.len)
        .ok_or_else(|| ArchiveError("truncated zip structure".into()))?;
    let value = unpickle(pkl_bytes).map_err(|e| ArchiveError(format!("data.pkl: {e}")))?;
    let Value::Call(call) = &*value else {
        return bad(format!("data.pkl holds {}, not a tensor", value.kind()));
    };
    let func = call
        .0
        .global()
        .map(|(m, n)| format!("{m}.{n}"))
        .unwrap_or_default();
    let args = call
        .1
        .items()
        .ok_or_else(|| ArchiveError("rebuild arguments are not a tuple".into()))?;
    let v3 = match (func.as_str(), args.len()) {
        ("torch._utils._rebuild_tensor_v2", 6 | 7) => false,
        ("torch._utils._rebuild_tensor_v3", 7 | 8) => true,
        _ => {
            return bad(format!(
                "data.pkl calls {func} with {} arguments; not a plain tensor",
                args.len()
            ))
        }
    };
    let Value::PersId(pid) = &args[0] else {
        return bad("tensor storage is not a persistent id");
    };
    let pid = pid
        .items()
        .filter(|p| p.len() == 5)
        .ok_or_else(|| ArchiveError("storage persistent id is not a 5-tuple".into()))?;
    let class = pid[1]
        .global()
        .map(|(_, n)| n.to_string())
        .unwrap_or_default();
    let key = pid[2]
        .as_str()
        .ok_or_else(|| ArchiveError("storage key is not a string".into()))?
        .to_string();
    let dtype = if v3 {
        let (m, n) = args
            .last()
            .unwrap()
            .global()
            .ok_or_else(|| ArchiveError("_rebuild_tensor_v3 without a dtype".into()))?;
        if m != "torch" {
            return bad(format!("dtype global {m}.{n}"));
        }
        DType::from_torch_name(n).map_err(|e| ArchiveError(e.to_string()))?
    } else {
        DType::from_legacy_storage(&class)
            .ok_or_else(|| ArchiveError(format!("unknown storage class {class}")))?
    };
    let storage_offset = int(&args[1], "storage_offset")?;
    let shape = ints(&args[2], "size")?;
    let strides = ints(&args[3], "stride")?;
    if shape.len() != strides.len() {
        return bad("size and stride differ in length");
    }
    let name = format!("{prefix}data/{key}");
    let storage = recs
        .iter()
        .find(|r| r.name == name)
        .cloned()
        .ok_or_else(|| ArchiveError(format!("storage record {name} missing")))?;
    // Highest element index any view position touches, checked against the storage size.
    if shape.iter().all(|&s| s > 0) {
        let mut last = storage_offset as u128;
        for (&s, &st) in shape.iter().zip(&strides) {
            last += (s as u128 - 1) * st as u128;
        }
        if (last + 1) * dtype.itemsize() as u128 > storage.len as u128 {
            return bad(format!(
                "storage of {} bytes is too small for shape {shape:?} stride {strides:?}",
                storage.len
            ));
        }
    }
    Ok(StoredTensor {
        dtype,
        shape,
        strides,
        storage_offset,
        storage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::zip::ArchiveLayout;

    fn archive(threshold: u64) -> Vec<u8> {
        let payload: Vec<u8> = (0..48u8).collect();
        let l = ArchiveLayout::with_threshold(DType::F32, &[3, 4], "1", threshold);
        let mut b = l.prefix.clone();
        b.extend_from_slice(&payload);
        b.extend_from_slice(&l.suffix(crc32fast::hash(&payload)));
        b
    }

    #[test]
    fn reads_our_archives_including_zip64() {
        for threshold in [u64::from(u32::MAX), 8] {
            let b = archive(threshold);
            let t = stored_tensor(&b).unwrap();
            assert_eq!(
                (t.dtype, t.shape.clone(), t.strides.clone()),
                (DType::F32, vec![3, 4], vec![4, 1])
            );
            assert_eq!(
                &b[t.storage.start..t.storage.start + 48],
                &(0..48u8).collect::<Vec<_>>()[..]
            );
            assert_eq!(
                t.storage.crc,
                crc32fast::hash(&b[t.storage.start..t.storage.start + 48])
            );
        }
    }

    #[test]
    fn head_and_tail_decode_like_the_whole_item() {
        for threshold in [u64::from(u32::MAX), 8] {
            let b = archive(threshold);
            let whole = stored_tensor(&b).unwrap();
            let start = whole.storage.start;
            // The payload bytes are not needed: head up to the data, tail after it.
            let ht = HeadTail {
                size: b.len(),
                head: &b[..start],
                tail: &b[start + 48..],
            };
            assert_eq!(stored_tensor_in(&ht).unwrap(), whole);
            // Too short a head is reported as truncation, not misread.
            let short = HeadTail {
                size: b.len(),
                head: &b[..20],
                tail: &b[start + 48..],
            };
            assert!(stored_tensor_in(&short).is_err());
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = archive(u64::from(u32::MAX));
        for n in 0..b.len() {
            assert!(stored_tensor(&b[..n]).is_err(), "{n}");
        }
    }
}
