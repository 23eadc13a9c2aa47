//! Reads one torch.save archive (a DCP item, `common.pt`; layout in [`crate::format::zip`]) held in
//! memory or mapped, exactly as torch's reader resolves it, and refuses what torch would read
//! differently or run.
//!
//! torch reads these archives with `PyTorchStreamReader` (`caffe2/serialize/inline_container.cc`)
//! over miniz (`third_party/miniz-3.0.2/miniz.c`; torch 2.3.1 and 2.15.0 behave alike, tested by
//! `python/tests/test_torch_reader_diff.py`). What that reader does, and so what [`Archive::read`]
//! does or refuses:
//! - `torch.load` (`torch/serialization.py`, `_is_zipfile`) treats the bytes as a zip only when they
//!   *start* with a local header `PK\3\4`; anything else is unpickled as a legacy file, running the
//!   pickle at its start. Refused.
//! - miniz finds the end of the central directory as the last `PK\5\6` with 22 bytes after it, and
//!   a zip64 end record right before the zip64 locator (`mz_zip_reader_read_central_dir`); sizes
//!   and offsets come from the central directory, values saturated at `0xFFFFFFFF` from the first
//!   zip64 extended-information field (`mz_zip_file_stat_internal`). An end record the locator does
//!   not point at, or a second zip64 field, could be read two ways: refused.
//! - The archive's folder is the first record's name up to its first `/` (`init`); every record
//!   must be under it, compared case-sensitively (`getAllRecords`, called by `torch.load`'s
//!   `_is_torchscript_zip`), and a record `constants.pkl` makes `torch.load` hand the file to
//!   `torch.jit.load` (refused: that runs TorchScript).
//! - Records are looked up **case-insensitively** (ASCII): `getRecord` calls
//!   `mz_zip_reader_locate_file` with flags 0, a binary search over names sorted by
//!   `mz_zip_reader_filename_less` (`MZ_TOLOWER`). Two names equal but for ASCII case are the same
//!   name to torch, and which of them it finds depends on an unstable heap sort: refused, naming
//!   both. With that refused, [`Archive::get`] finds exactly the record torch finds.
//! - A "directory" (a name ending in `/` or the DOS directory attribute) extracts as nothing, which
//!   leaves torch's buffer uninitialised; encrypted and patch records are not read; compressed
//!   records are inflated by torch but never written by it: all refused.
//! - `init` reads `.data/version`, else `version`, as `std::stoull` parses it, and refuses a value
//!   outside 1..=10 (`kMinSupportedFileFormatVersion`, `kMaxSupportedFileFormatVersion`; measured
//!   on torch 2.3.1 and 2.15.0). `_load` byteswaps every storage when `byteorder` says `big` and
//!   fails on any other value but `little`, parses `.storage_alignment` with `int()`, and ends by
//!   logging `.data/serialization_id` as a UTF-8 string.
//! - A tensor's pickle must use only the opcodes torch's weights-only unpickler reads (DCP loads
//!   tensor items with `weights_only=True` from torch 2.4), and every storage a pickle names must
//!   be a record of exactly the bytes it declares ([`Archive::storage`]).
//!
//! Every offset is bounds-checked against the blob, and nothing is copied.

use crate::format::dtype::DType;
use std::rc::Rc;

use crate::format::globals::{scan, Pickle};
use crate::format::unpickle::{unpickle_weights_only, Value};

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

fn bytes_at<B: Blob + ?Sized>(b: &B, at: usize, len: usize) -> R<&[u8]> {
    at.checked_add(len)
        .and_then(|end| b.range(at..end))
        .ok_or_else(|| ArchiveError("truncated zip structure".into()))
}
fn field<const N: usize>(b: &(impl Blob + ?Sized), at: usize) -> R<[u8; N]> {
    bytes_at(b, at, N).map(|s| s.try_into().unwrap())
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

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const EOCD64_SIG: u32 = 0x0606_4b50;
const LOCATOR_SIG: u32 = 0x0706_4b50;
const EOCD_LEN: usize = 22;
const EOCD64_LEN: usize = 56;
const LOCATOR_LEN: usize = 20;
const CENTRAL_LEN: usize = 46;
const SATURATED: u64 = 0xFFFF_FFFF;
/// miniz's `MZ_ZIP_MAX_ARCHIVE_FILENAME_SIZE`: `getAllRecords` copies names into a buffer of
/// this size, so a longer one is cut short there.
const MAX_NAME: usize = 512;
/// Flags under which miniz reads no data: encrypted (bit 0), compressed patch (bit 5), strong
/// encryption (bit 6), masked local headers (bit 13).
const UNREADABLE_FLAGS: u16 = 0x0001 | 0x0020 | 0x0040 | 0x2000;
/// `kMaxSupportedFileFormatVersion` of torch 2.3.1 and 2.15.0 (a `version` of 11 is refused).
const MAX_FORMAT_VERSION: u64 = 10;

/// Where the central directory lies: `entries` records in `size` bytes from `offset`.
#[derive(Debug, PartialEq, Eq)]
struct Directory {
    entries: u64,
    offset: u64,
    size: u64,
}

/// The central directory as miniz finds it (`mz_zip_reader_locate_header_sig` and
/// `mz_zip_reader_read_central_dir`): the last end record with 22 bytes after it; a zip64 end
/// record right before the zip64 locator, which must point at it.
fn directory(blob: &(impl Blob + ?Sized)) -> R<Directory> {
    let size = blob.size();
    let lo = size.saturating_sub(EOCD_LEN + 65535);
    let eocd = (lo..=size.saturating_sub(EOCD_LEN))
        .rev()
        .find(|&i| blob.range(i..i + 4) == Some(&EOCD_SIG.to_le_bytes()[..]))
        .ok_or_else(|| {
            ArchiveError(
                "no zip end-of-central-directory record (item truncated or length wrong)".into(),
            )
        })?;
    let mut d = Directory {
        entries: le16(blob, eocd + 10)?.into(),
        offset: le32(blob, eocd + 16)?.into(),
        size: le32(blob, eocd + 12)?.into(),
    };
    let mut disks = (le16(blob, eocd + 4)? as u32, le16(blob, eocd + 6)? as u32);
    let mut on_this_disk: u64 = le16(blob, eocd + 8)?.into();
    let locator = eocd.checked_sub(LOCATOR_LEN);
    if let Some(loc) = locator.filter(|&l| le32(blob, l).ok() == Some(LOCATOR_SIG)) {
        let at = loc
            .checked_sub(EOCD64_LEN)
            .filter(|&at| le32(blob, at).ok() == Some(EOCD64_SIG))
            .ok_or_else(|| {
                ArchiveError("zip64 locator without a zip64 end record before it".into())
            })?;
        if le64(blob, loc + 8)? != at as u64 {
            return bad(format!(
                "the zip64 locator points at offset {}, the zip64 end record lies at {at}: readers \
                 differ on which to take",
                le64(blob, loc + 8)?
            ));
        }
        if le64(blob, at + 4)? < 44 || le32(blob, loc + 16)? != 1 {
            return bad("zip64 end record too short, or a multi-disk archive");
        }
        d.entries = le64(blob, at + 32)?;
        on_this_disk = le64(blob, at + 24)?;
        d.size = le64(blob, at + 40)?;
        d.offset = le64(blob, at + 48)?;
        disks = (le32(blob, at + 16)?, le32(blob, at + 20)?);
        if d.entries > u32::MAX as u64 || d.size > u32::MAX as u64 {
            return bad("zip64 central directory larger than miniz reads");
        }
    }
    if d.entries != on_this_disk || !matches!(disks, (0, 0) | (1, 1)) {
        return bad("a multi-disk zip archive");
    }
    if d.entries > d.size / CENTRAL_LEN as u64 {
        return bad("central directory entry count exceeds its size");
    }
    if d.offset.checked_add(d.size).is_none_or(|e| e > size as u64) {
        return bad("central directory lies outside the item");
    }
    Ok(d)
}

/// One central directory entry's fields, sizes already widened from its zip64 field.
struct Entry {
    name: String,
    crc: u32,
    size: u64,
    local: u64,
    /// Bytes the entry takes in the central directory.
    len: usize,
}

/// The values of a zip64 extended-information field (id 1) for the fields saturated at
/// `0xFFFFFFFF`, in APPNOTE 4.5.3's order: uncompressed size, compressed size, local header
/// offset. Every field of `extra` must be well formed, and at most one may have id 1.
fn zip64_values(extra: &[u8], name: &str, saturated: [&mut u64; 3]) -> R<()> {
    let mut fields = Vec::new();
    let mut e = 0;
    while e < extra.len() {
        let (Ok(id), Ok(len)) = (le16(extra, e), le16(extra, e + 2)) else {
            return bad(format!("record {name}: truncated extra field"));
        };
        let body = bytes_at(extra, e + 4, len as usize)
            .map_err(|_| ArchiveError(format!("record {name}: extra field overruns its entry")))?;
        if id == 1 {
            fields.push(body);
        }
        e += 4 + len as usize;
    }
    if fields.len() > 1 {
        return bad(format!(
            "record {name} has {} zip64 fields: readers differ on which to take",
            fields.len()
        ));
    }
    let mut p = 0;
    for v in saturated.into_iter().filter(|v| **v == SATURATED) {
        let Some(body) = fields.first() else {
            return bad(format!(
                "record {name}: a size is 0xFFFFFFFF without a zip64 field"
            ));
        };
        *v = le64(*body, p)
            .map_err(|_| ArchiveError(format!("record {name}: zip64 field too short")))?;
        p += 8;
    }
    Ok(())
}

/// Parses the central directory entry at `at` with miniz's checks, and refuses what torch would
/// not read as stored bytes (compressed, encrypted, directory entries).
fn entry(blob: &(impl Blob + ?Sized), at: usize, archive_size: usize) -> R<Entry> {
    if le32(blob, at)? != CENTRAL_SIG {
        return bad("bad central directory entry signature");
    }
    let flags = le16(blob, at + 8)?;
    let method = le16(blob, at + 10)?;
    let crc = le32(blob, at + 16)?;
    let mut csize: u64 = le32(blob, at + 20)?.into();
    let mut usize_: u64 = le32(blob, at + 24)?.into();
    let (name_len, extra_len, comment_len) = (
        le16(blob, at + 28)? as usize,
        le16(blob, at + 30)? as usize,
        le16(blob, at + 32)? as usize,
    );
    let disk = le16(blob, at + 34)?;
    let external = le32(blob, at + 38)?;
    let mut local: u64 = le32(blob, at + 42)?.into();
    let raw = bytes_at(blob, at + CENTRAL_LEN, name_len)?;
    let name = std::str::from_utf8(raw)
        .map_err(|_| ArchiveError(format!("record name {raw:?} is not UTF-8")))?
        .to_string();
    let extra = bytes_at(blob, at + CENTRAL_LEN + name_len, extra_len)?;
    zip64_values(extra, &name, [&mut usize_, &mut csize, &mut local])?;
    if disk != 0 && disk != 1 {
        return bad(format!("record {name} lies on disk {disk}"));
    }
    if flags & UNREADABLE_FLAGS != 0 {
        return bad(format!(
            "record {name} is encrypted or a patch (flags {flags:#06x}): torch reads no bytes of it"
        ));
    }
    if method != 0 || csize != usize_ {
        return bad(format!(
            "record {name} is compressed (method {method}); torch archives are STORED"
        ));
    }
    if name.ends_with('/') || external & 0x10 != 0 {
        return bad(format!(
            "record {name} is a directory entry: torch reads it as uninitialised bytes"
        ));
    }
    if local
        .checked_add(30 + csize)
        .is_none_or(|e| e > archive_size as u64)
    {
        return bad(format!("record {name} extends past the end of the item"));
    }
    Ok(Entry {
        name,
        crc,
        size: usize_,
        local,
        len: CENTRAL_LEN + name_len + extra_len + comment_len,
    })
}

/// The record of `e`: its data starts after its local header's name and extra field (miniz
/// reads those lengths from the local header, not the central directory).
fn record_of(blob: &(impl Blob + ?Sized), e: Entry) -> R<Record> {
    let local = usize::try_from(e.local)
        .map_err(|_| ArchiveError("local header offset out of range".into()))?;
    if le32(blob, local)? != LOCAL_SIG {
        return bad(format!("record {}: bad local header signature", e.name));
    }
    let start = local + 30 + le16(blob, local + 26)? as usize + le16(blob, local + 28)? as usize;
    if (start as u64)
        .checked_add(e.size)
        .is_none_or(|end| end > blob.size() as u64)
    {
        return bad(format!(
            "record {} extends past the end of the item",
            e.name
        ));
    }
    Ok(Record {
        name: e.name,
        start,
        len: e.size as usize,
        crc: e.crc,
    })
}

/// A torch.save archive as torch's reader resolves it (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Archive {
    /// Every record, in central directory order.
    pub records: Vec<Record>,
    /// The folder all records are under, with its `/` (`archive/` when torch saved to a stream).
    pub folder: String,
}

impl Archive {
    /// Reads the archive's structure and the records torch reads before unpickling (`version`,
    /// `byteorder`, `.storage_alignment`), refusing what torch would read differently or run.
    ///
    /// Errors: [`ArchiveError`] naming the record or structure: not a zip from its first byte,
    /// truncated, wrong `length` in the metadata, ambiguous (two names equal but for case, two
    /// zip64 fields, an unreferenced zip64 end record), a record torch does not read as stored
    /// bytes, a TorchScript archive, or a `version`, `byteorder` or `.storage_alignment` torch
    /// refuses or reads as byteswapped.
    pub fn read(blob: &(impl Blob + ?Sized)) -> R<Archive> {
        if blob.range(0..4) != Some(&LOCAL_SIG.to_le_bytes()[..]) {
            return bad(
                "does not start with a zip local header (PK\\3\\4): torch.load would unpickle it \
                 as a legacy file",
            );
        }
        let d = directory(blob)?;
        let mut records = Vec::with_capacity(d.entries as usize);
        let (mut at, end) = (d.offset as usize, (d.offset + d.size) as usize);
        for _ in 0..d.entries {
            let e = entry(blob, at, blob.size())?;
            at += e.len;
            if at > end {
                return bad("central directory entry overruns the directory");
            }
            records.push(record_of(blob, e)?);
        }
        let archive = Archive {
            folder: folder(&records)?,
            records,
        };
        archive.check_names()?;
        archive.check_torch_records(blob)?;
        Ok(archive)
    }

    /// The record torch's `getRecord(name)` reads: `<folder><name>`, compared ignoring ASCII case
    /// (names equal but for case were refused by [`Archive::read`]).
    pub fn get(&self, name: &str) -> Option<&Record> {
        let full = format!("{}{name}", self.folder);
        self.records
            .iter()
            .find(|r| r.name.eq_ignore_ascii_case(&full))
    }

    /// The pickle `torch.load` unpickles (`_load`, `pickle_file="data.pkl"`).
    ///
    /// Errors: [`ArchiveError`] when there is none.
    pub fn data_pkl(&self) -> R<&Record> {
        self.get("data.pkl")
            .ok_or_else(|| ArchiveError(format!("no {}data.pkl record", self.folder)))
    }

    /// Names torch's `getAllRecords` would reject or mistake (not under the folder, cut short or
    /// at a NUL byte), a TorchScript archive, and names torch's lookup cannot tell apart.
    fn check_names(&self) -> R<()> {
        let mut folded: Vec<(String, &str)> = Vec::with_capacity(self.records.len());
        for r in &self.records {
            if r.name.len() >= MAX_NAME || r.name.contains('\0') {
                return bad(format!(
                    "record name {:?} is longer than torch reads or holds a NUL byte",
                    r.name
                ));
            }
            let Some(inner) = r.name.strip_prefix(&self.folder) else {
                return bad(format!(
                    "record {} is not under the archive's folder {} (torch.load refuses it)",
                    r.name, self.folder
                ));
            };
            if inner == "constants.pkl" {
                return bad(format!(
                    "record {} makes torch.load run the archive as TorchScript (torch.jit.load)",
                    r.name
                ));
            }
            folded.push((r.name.to_ascii_lowercase(), &r.name));
        }
        folded.sort();
        if let Some(w) = folded.windows(2).find(|w| w[0].0 == w[1].0) {
            return bad(if w[0].1 == w[1].1 {
                format!(
                    "record {} appears twice: torch's lookup may read either",
                    w[0].1
                )
            } else {
                format!(
                    "records {} and {} differ only in case: torch looks names up ignoring case \
                     and may read either",
                    w[0].1, w[1].1
                )
            });
        }
        Ok(())
    }

    /// The records torch reads before the pickle, checked as torch checks them.
    fn check_torch_records(&self, blob: &(impl Blob + ?Sized)) -> R<()> {
        let content = |name: &str| -> R<Option<&[u8]>> {
            self.get(name)
                .map(|r| bytes_at(blob, r.start, r.len))
                .transpose()
        };
        let version = match content(".data/version")? {
            Some(v) => v,
            None => content("version")?.ok_or_else(|| {
                ArchiveError(format!(
                    "no {}version record (torch requires one)",
                    self.folder
                ))
            })?,
        };
        match parse_version(version) {
            Some(v) if (1..=MAX_FORMAT_VERSION).contains(&v) => {}
            _ => {
                return bad(format!(
                    "version record {:?} is not a format version torch reads (1 to {MAX_FORMAT_VERSION})",
                    String::from_utf8_lossy(version)
                ))
            }
        }
        match content("byteorder")? {
            None | Some(b"little") => {}
            Some(other) => {
                return bad(format!(
                    "byteorder record is {:?}: torch byteswaps (\"big\") or refuses it; shardwise \
                     reads little-endian archives only",
                    String::from_utf8_lossy(other)
                ))
            }
        }
        // `_load` ends by logging `zip_file.serialization_id()`, a C++ string pybind11 decodes
        // as UTF-8 (torch/serialization.py, 2.3–2.15).
        if let Some(id) = content(".data/serialization_id")? {
            if std::str::from_utf8(id).is_err() {
                return bad(".data/serialization_id record is not UTF-8 (torch.load fails on it)");
            }
        }
        if let Some(a) = content(".storage_alignment")? {
            let ok = std::str::from_utf8(a)
                .ok()
                .map(|s| s.trim_matches(|c: char| c.is_ascii_whitespace()))
                .is_some_and(|s| {
                    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
                    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
                });
            if !ok {
                return bad(format!(
                    ".storage_alignment record {:?} is not an int (torch's int() refuses it)",
                    String::from_utf8_lossy(a)
                ));
            }
        }
        Ok(())
    }
}

/// The archive's folder as torch's `init` takes it: the first record's name up to and including
/// its first `/`.
fn folder(records: &[Record]) -> R<String> {
    let first = records
        .first()
        .ok_or_else(|| ArchiveError("archive does not contain any files".into()))?;
    match first.name.find('/') {
        Some(p) => Ok(first.name[..=p].to_string()),
        None => bad(format!(
            "record {} is not in a folder (torch refuses the archive)",
            first.name
        )),
    }
}

/// The value `std::stoull` reads from the start of `bytes` (leading whitespace, an optional sign,
/// decimal digits, anything after them ignored), as torch's `init` parses the version; None where
/// it throws. A `-` wraps around as in C, to a value no version check accepts (`-0` reads 0).
fn parse_version(bytes: &[u8]) -> Option<u64> {
    // C's isspace: space, \t, \n, \v, \f, \r.
    let s = bytes
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
        .map_or(&[][..], |p| &bytes[p..]);
    let (negative, s) = match s.first() {
        Some(b'+') => (false, &s[1..]),
        Some(b'-') => (true, &s[1..]),
        _ => (false, s),
    };
    let n = s.iter().take_while(|b| b.is_ascii_digit()).count();
    if n == 0 {
        return None;
    }
    let v = std::str::from_utf8(&s[..n]).ok()?.parse::<u64>().ok()?;
    Some(if negative { v.wrapping_neg() } else { v })
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
/// `_rebuild_tensor_v3` over one storage record, as torch.save writes (torch/_utils.py, 2.3–2.15),
/// read from the archive as torch reads it ([`Archive::read`]).
///
/// Errors: [`ArchiveError`] for anything else, a storage record whose length is not the one the
/// pickle declares (torch sizes the storage from the pickle), or a storage too small for
/// shape/strides/offset.
pub fn stored_tensor(blob: &[u8]) -> R<StoredTensor> {
    stored_tensor_in(blob)
}

/// [`stored_tensor`] of an item held in part ([`Blob`]): its first bytes (local headers and
/// `data.pkl`) and its last ones (central directory) suffice.
pub fn stored_tensor_in(blob: &(impl Blob + ?Sized)) -> R<StoredTensor> {
    let archive = Archive::read(blob)?;
    let pkl = archive.data_pkl()?;
    let bytes = bytes_at(blob, pkl.start, pkl.len)?;
    // Every global the pickle names is imported by torch 2.3's load (weights_only=False), and
    // torch 2.4+'s weights-only load refuses any outside its allow-list: a tensor item names only
    // those torch.save writes.
    if let Some(g) = scan(Pickle::TorchSave, bytes)
        .imported
        .into_iter()
        .find(|g| !plain_tensor_global(g))
    {
        return bad(format!(
            "{} names {g}, which no plain tensor's pickle names",
            pkl.name
        ));
    }
    // Tensor items are loaded with weights_only=True from torch 2.4 on (DCP's read_data).
    let value =
        unpickle_weights_only(bytes).map_err(|e| ArchiveError(format!("{}: {e}", pkl.name)))?;
    tensor_of(&archive, &value)
}

/// The tensor a `_rebuild_tensor_v2`/`_v3` call rebuilds from `archive`'s storages, checked as
/// torch's rebuild checks it (torch/_utils.py; `Tensor.set_` bounds the view by the storage).
///
/// Errors: [`ArchiveError`] for anything else, a storage record of another size than declared,
/// a view outside it, or a `requires_grad` torch refuses.
pub fn tensor_of(archive: &Archive, value: &Value) -> R<StoredTensor> {
    let call = rebuild_call(value)?;
    let storage = storage_ref(&call.args[0])?;
    let dtype = match call.dtype {
        Some(d) => d,
        None => storage.class.ok_or_else(|| {
            ArchiveError("_rebuild_tensor_v2 over an untyped storage; not a plain tensor".into())
        })?,
    };
    let storage_offset = int(&call.args[1], "storage_offset")?;
    let shape = ints(&call.args[2], "size")?;
    let strides = ints(&call.args[3], "stride")?;
    if shape.len() != strides.len() {
        return bad("size and stride differ in length");
    }
    match &call.args[4] {
        Value::Bool(false) => {}
        Value::Bool(true) if dtype.is_floating() => {}
        other => {
            return bad(format!(
                "requires_grad is {} (torch sets it only as a bool, true only on floating tensors)",
                other.kind()
            ))
        }
    }
    let hooks = match &call.args[5] {
        Value::Call(c) => c.0.global(),
        _ => None,
    };
    if hooks != Some(("collections", "OrderedDict")) {
        return bad("backward_hooks is not an OrderedDict, as torch.save writes it");
    }
    let record = archive.storage(&storage)?.clone();
    check_view(&shape, &strides, storage_offset, dtype, &record)?;
    Ok(StoredTensor {
        dtype,
        shape,
        strides,
        storage_offset,
        storage: record,
    })
}

/// Checks every tensor the archive's pickle rebuilds (an object's tensors: `common.pt`'s RNG
/// states, an optimizer state) as [`tensor_of`] checks a tensor item's; returns how many.
///
/// Errors: [`ArchiveError`] for the first tensor torch would fail to rebuild, or a pickle that
/// does not decode.
pub fn object_tensors(archive: &Archive, blob: &(impl Blob + ?Sized)) -> R<usize> {
    let pkl = archive.data_pkl()?;
    let value = crate::format::unpickle::unpickle(bytes_at(blob, pkl.start, pkl.len)?)
        .map_err(|e| ArchiveError(format!("{}: {e}", pkl.name)))?;
    let calls = rebuild_calls(&value);
    for c in &calls {
        tensor_of(archive, c)
            .map_err(|e| ArchiveError(format!("a tensor of {}: {}", pkl.name, e.0)))?;
    }
    Ok(calls.len())
}

/// Whether `module.name` is a global torch.save writes in a plain tensor's pickle: the rebuild
/// functions, storage classes, dtypes and `collections.OrderedDict` (torch/_tensor.py
/// `__reduce_ex__`, torch/serialization.py `persistent_id`).
fn plain_tensor_global(global: &str) -> bool {
    let (module, name) = global.rsplit_once('.').unwrap_or(("", global));
    match module {
        "torch._utils" => matches!(name, "_rebuild_tensor_v2" | "_rebuild_tensor_v3"),
        "torch" => {
            DType::from_legacy_storage(name).is_some() || DType::from_torch_name(name).is_ok()
        }
        "torch.storage" => name == "UntypedStorage",
        "collections" => name == "OrderedDict",
        _ => false,
    }
}

/// Every `_rebuild_tensor_v2`/`_v3` call in an unpickled value (shared containers visited once),
/// in no particular order: the tensors a `torch.load` of an object rebuilds.
pub fn rebuild_calls(root: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut work = vec![root.clone()];
    while let Some(v) = work.pop() {
        let shared = match &v {
            Value::Tuple(t) => Rc::as_ptr(t) as *const () as usize,
            Value::List(l) => Rc::as_ptr(l) as *const () as usize,
            Value::Dict(d) => Rc::as_ptr(d) as *const () as usize,
            Value::Call(c) => Rc::as_ptr(c) as *const () as usize,
            Value::Object(o) => Rc::as_ptr(o) as *const () as usize,
            Value::PersId(p) => Rc::as_ptr(p) as *const () as usize,
            _ => continue,
        };
        if !seen.insert(shared) {
            continue;
        }
        match &v {
            Value::Tuple(t) => work.extend(t.iter().cloned()),
            Value::List(l) => work.extend(l.borrow().iter().cloned()),
            Value::Dict(d) => {
                for (k, x) in d.borrow().iter() {
                    work.push(k.clone());
                    work.push(x.clone());
                }
            }
            Value::Call(c) => {
                if matches!(
                    c.0.global(),
                    Some(("torch._utils", "_rebuild_tensor_v2" | "_rebuild_tensor_v3"))
                ) {
                    out.push(v.clone());
                }
                work.push(c.0.clone());
                work.push(c.1.clone());
            }
            Value::Object(o) => {
                work.push(o.class.clone());
                work.push(o.args.clone());
                work.extend(o.state.borrow().iter().cloned());
            }
            Value::PersId(p) => work.push((**p).clone()),
            _ => {}
        }
    }
    out
}

/// `data.pkl`'s top call: its arguments, and the dtype `_rebuild_tensor_v3` names (None for v2,
/// whose dtype is its storage class's).
struct RebuildCall {
    args: Vec<Value>,
    dtype: Option<DType>,
}

fn rebuild_call(value: &Value) -> R<RebuildCall> {
    let Value::Call(call) = value else {
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
    let dtype = if v3 {
        let (m, n) = args[6]
            .global()
            .ok_or_else(|| ArchiveError("_rebuild_tensor_v3 without a dtype".into()))?;
        if m != "torch" {
            return bad(format!("dtype global {m}.{n}"));
        }
        Some(DType::from_torch_name(n).map_err(|e| ArchiveError(e.to_string()))?)
    } else {
        None
    };
    Ok(RebuildCall { args, dtype })
}

/// A storage persistent id, `('storage', <class>, key, location, numel)`
/// (torch/serialization.py `persistent_load`, torch 2.3–2.15).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageRef {
    /// The dtype of a typed (legacy) storage class; None for `UntypedStorage`, counted in bytes.
    pub class: Option<DType>,
    /// The record's name under `data/`.
    pub key: String,
    /// Its length in elements of `class` (bytes for `UntypedStorage`).
    pub numel: u64,
}

/// A persistent id's fields as a decoder holds them (each None when of another kind).
pub struct PidFields<'v> {
    /// How many items the tuple has (0 when the id is not a tuple).
    pub items: usize,
    /// Item 0, a str.
    pub typename: Option<&'v str>,
    /// Item 1's name, a global.
    pub class: Option<&'v str>,
    /// Item 2, a str.
    pub key: Option<&'v str>,
    /// Item 4, an int.
    pub numel: Option<i128>,
}

impl StorageRef {
    /// The storage a persistent id names, as torch's `persistent_load` takes it: a 5-tuple whose
    /// first item is `'storage'`; the class is found by its name alone (torch's `find_class` maps
    /// any name holding "Storage" to a storage type, whatever the module).
    ///
    /// Errors: [`ArchiveError`] for any other persistent id (torch's load fails on it).
    pub fn from_fields(f: PidFields<'_>) -> R<StorageRef> {
        if f.items != 5 || f.typename != Some("storage") {
            return bad(
                "persistent id is not a ('storage', class, key, location, numel) tuple: torch's \
                 persistent_load refuses it",
            );
        }
        let class = match f.class {
            Some("UntypedStorage") => None,
            Some(c) => Some(
                DType::from_legacy_storage(c)
                    .ok_or_else(|| ArchiveError(format!("unknown storage class {c}")))?,
            ),
            None => return bad("storage class is not a global"),
        };
        let key = f
            .key
            .ok_or_else(|| ArchiveError("storage key is not a string".into()))?
            .to_string();
        let numel = f
            .numel
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| ArchiveError("storage numel is not a non-negative int".into()))?;
        Ok(StorageRef { class, key, numel })
    }

    /// The storage's length in bytes as torch computes it (`numel * element_size`).
    pub fn nbytes(&self) -> Option<u64> {
        self.numel
            .checked_mul(self.class.map_or(1, |c| c.itemsize()))
    }
}

impl Archive {
    /// The record storage `s` reads (`data/<key>`, looked up as [`Archive::get`] does), which
    /// must hold exactly the bytes the reference declares: torch sizes the storage from the
    /// pickle, not from the record (`get_storage_from_record(name, nbytes, ...)`), so it reads a
    /// shorter record past its end.
    ///
    /// Errors: [`ArchiveError`] naming the record when it is missing or of another length.
    pub fn storage(&self, s: &StorageRef) -> R<&Record> {
        let name = format!("data/{}", s.key);
        let r = self
            .get(&name)
            .ok_or_else(|| ArchiveError(format!("storage record {}{name} missing", self.folder)))?;
        if s.nbytes() != Some(r.len as u64) {
            return bad(format!(
                "storage record {} holds {} bytes but the pickle declares {} elements of {} bytes",
                r.name,
                r.len,
                s.numel,
                s.class.map_or(1, |c| c.itemsize())
            ));
        }
        Ok(r)
    }
}

fn storage_ref(arg: &Value) -> R<StorageRef> {
    let Value::PersId(pid) = arg else {
        return bad("tensor storage is not a persistent id");
    };
    let items = pid.items().unwrap_or_default();
    StorageRef::from_fields(PidFields {
        items: items.len(),
        typename: items.first().and_then(|v| v.as_str()),
        class: items.get(1).and_then(|v| v.global()).map(|(_, n)| n),
        key: items.get(2).and_then(|v| v.as_str()),
        numel: items.get(4).and_then(|v| v.as_int()),
    })
}

/// The highest byte any view position touches lies inside the storage record.
fn check_view(
    shape: &[u64],
    strides: &[u64],
    storage_offset: u64,
    dtype: DType,
    storage: &Record,
) -> R<()> {
    if shape.contains(&0) {
        return Ok(());
    }
    let mut last = storage_offset as u128;
    for (&s, &st) in shape.iter().zip(strides) {
        last += (s as u128 - 1) * st as u128;
    }
    if (last + 1) * dtype.itemsize() as u128 > storage.len as u128 {
        return bad(format!(
            "storage of {} bytes is too small for shape {shape:?} stride {strides:?}",
            storage.len
        ));
    }
    Ok(())
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

    /// Replaces every occurrence of `from` (local header and central directory) by `to`, of the
    /// same length.
    fn patched(b: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
        assert_eq!(from.len(), to.len());
        let mut out = b.to_vec();
        let mut i = 0;
        while let Some(p) = out[i..].windows(from.len()).position(|w| w == from) {
            out[i + p..i + p + to.len()].copy_from_slice(to);
            i += p + to.len();
        }
        assert!(i > 0, "{from:?} not found");
        out
    }

    /// A STORED zip of `records` (names as given), written by the zip crate.
    fn zip_of(records: &[(&str, &[u8])]) -> Vec<u8> {
        use std::io::Write;
        let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        for (name, data) in records {
            w.start_file(*name, opts).unwrap();
            w.write_all(data).unwrap();
        }
        w.finish().unwrap().into_inner()
    }

    fn err_of<T: std::fmt::Debug>(r: R<T>) -> String {
        r.unwrap_err().0
    }

    /// torch looks records up ignoring ASCII case: an uppercase `DATA.PKL` is the pickle.
    #[test]
    fn names_are_looked_up_ignoring_case_as_torch_does() {
        let b = patched(
            &archive(u64::from(u32::MAX)),
            b"archive/data.pkl",
            b"archive/DATA.PKL",
        );
        let a = Archive::read(&b[..]).unwrap();
        assert_eq!(a.data_pkl().unwrap().name, "archive/DATA.PKL");
        assert_eq!(stored_tensor(&b).unwrap().shape, vec![3, 4]);
        let b = patched(
            &archive(u64::from(u32::MAX)),
            b"archive/data/0",
            b"archive/DATA/0",
        );
        assert_eq!(stored_tensor(&b).unwrap().storage.name, "archive/DATA/0");
    }

    /// Two names torch cannot tell apart are refused by name, whatever their order.
    #[test]
    fn twins_are_refused_naming_both() {
        let v = b"3\n".as_slice();
        for (first, second) in [("data.pkl", "DATA.PKL"), ("DATA.PKL", "data.pkl")] {
            let b = zip_of(&[
                (&format!("archive/{first}"), b"\x80\x02}."),
                (&format!("archive/{second}"), b"\x80\x02]."),
                ("archive/version", v),
            ]);
            let e = err_of(Archive::read(&b[..]));
            assert!(
                e.contains("archive/data.pkl") && e.contains("archive/DATA.PKL"),
                "{e}"
            );
        }
        let ok = zip_of(&[("archive/data.pkl", b"\x80\x02}."), ("archive/version", v)]);
        assert!(Archive::read(&ok[..]).is_ok());
    }

    /// The folder is the first record's; every record must be under it exactly; no TorchScript.
    #[test]
    fn the_folder_and_torchscript_are_torchs() {
        let v = b"3\n".as_slice();
        let pkl = b"\x80\x02}.".as_slice();
        let a = Archive::read(&zip_of(&[("x/data.pkl", pkl), ("x/version", v)])[..]).unwrap();
        assert_eq!(a.folder, "x/");
        for (records, needle) in [
            (vec![("x/data.pkl", pkl), ("X/version", v)], "not under"),
            (vec![("data.pkl", pkl), ("version", v)], "not in a folder"),
            (
                vec![
                    ("a/data.pkl", pkl),
                    ("a/version", v),
                    ("a/constants.pkl", pkl),
                ],
                "TorchScript",
            ),
            (vec![("a/data.pkl", pkl)], "version"),
        ] {
            let e = err_of(Archive::read(&zip_of(&records)[..]));
            assert!(e.contains(needle), "{e}");
        }
    }

    /// `version`, `byteorder`, `.storage_alignment` and `.data/serialization_id` as torch reads them.
    #[test]
    fn the_records_torch_reads_first() {
        let pkl = b"\x80\x02}.".as_slice();
        let with = |extra: &[(&str, &[u8])]| {
            let mut r: Vec<(&str, &[u8])> = vec![("archive/data.pkl", pkl)];
            r.extend_from_slice(extra);
            Archive::read(&zip_of(&r)[..]).map(|_| ())
        };
        for ok in [&b" 3"[..], b"+3", b"10", b"3x", b"\t1\n"] {
            assert!(with(&[("archive/version", ok)]).is_ok(), "{ok:?}");
        }
        for refused in [
            &b"0"[..],
            b"11",
            b"-0",
            b"-3",
            b"x3",
            b"",
            b"99999999999999999999999",
        ] {
            assert!(
                with(&[("archive/version", refused)]).is_err(),
                "{refused:?}"
            );
        }
        let v: (&str, &[u8]) = ("archive/version", b"3");
        assert!(err_of(with(&[v, (".data/version", b"3")])).contains("not under"));
        assert!(
            with(&[v, ("archive/.data/version", b"x")]).is_err(),
            ".data/version wins"
        );
        assert!(with(&[v, ("archive/byteorder", b"little")]).is_ok());
        for bo in [&b"big"[..], b"BIG", b"little\n", b""] {
            assert!(err_of(with(&[v, ("archive/byteorder", bo)])).contains("byteorder"));
        }
        assert!(with(&[v, ("archive/.storage_alignment", b" 64\n")]).is_ok());
        assert!(with(&[v, ("archive/.storage_alignment", b"6_4")]).is_err());
        assert!(with(&[v, ("archive/.data/serialization_id", b"\xb6")]).is_err());
    }

    /// torch.load unpickles a file that does not start with a local header as a legacy pickle.
    #[test]
    fn a_zip_that_does_not_start_the_item_is_refused() {
        let mut b = vec![0x80, 0x02, b'}', b'.'];
        let zip = archive(u64::from(u32::MAX));
        b.extend_from_slice(&zip);
        assert!(err_of(Archive::read(&b[..])).contains("legacy"));
    }

    /// The storage record must hold exactly what the pickle declares.
    #[test]
    fn the_storage_is_sized_by_the_pickle() {
        let b = archive(u64::from(u32::MAX));
        let pkl = tensor_pickle_bytes(&b);
        // numel 12 -> 11 (BININT1 before TUPLE BINPERSID).
        let at = pkl.windows(3).position(|w| w == [b'K', 12, b't']).unwrap();
        let mut bad = b.clone();
        let start = b.windows(pkl.len()).position(|w| w == pkl).unwrap();
        bad[start + at + 1] = 11;
        assert!(err_of(stored_tensor(&bad)).contains("declares 11 elements"));
    }

    fn tensor_pickle_bytes(b: &[u8]) -> Vec<u8> {
        let a = Archive::read(b).unwrap();
        let r = a.data_pkl().unwrap();
        b[r.start..r.start + r.len].to_vec()
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = archive(u64::from(u32::MAX));
        for n in 0..b.len() {
            assert!(stored_tensor(&b[..n]).is_err(), "{n}");
        }
    }
}
