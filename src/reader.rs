//! Reads any DCP / torch_dist checkpoint as data: `.metadata` through the symbolic unpickler,
//! items through memory-mapped `.distcp` files (or one ranged GET per item on an object store).
//! Paths are confined to the checkpoint directory,
//! every offset and size is checked against the real file, and memory use is bounded by what the
//! caller asks for, not by what the file claims.
//!
//! Integrity: when the checkpoint has shardwise's checksum sidecar, every item read is checked
//! against the CRC-32 recorded when it was written, on the bytes as they are read (the page-cache
//! pages of the mapping or the body of the ranged GET; the file is not read twice). An item of a
//! mapped file is hashed once per open [`Checkpoint`]. Checkpoints without a sidecar (written by
//! torch or Megatron) are read unchecked: DCP records no checksum. A `.metadata` that none of the
//! directory's saves committed (`shardwise status`: damaged) is refused: read unchecked, another
//! file order would swap tensors of one shape without a trace.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use rayon::prelude::*;

use crate::commit::read_checksums;
use crate::commit::record::CommitRecord;
use crate::commit::state::{metadata_writer, Damage, MetadataWriter};
use crate::error::{Error, Result};
use crate::format::archive::{
    bad_record_crcs, stored_tensor, stored_tensor_in, Archive, HeadTail, StoredTensor,
};
use crate::format::dtype::DType;
use crate::format::metadata::{volume, Chunk, Entry, StorageInfo};
use crate::format::read_metadata::{read_metadata, CheckpointMetadata};
use crate::format::unpickle::unpickle;
use crate::format::COMMON_FILE;
use crate::format::METADATA_FILE;
use crate::storage::{DataSource, Location};

/// Where and with which CRC-32 the writer placed one item: a record of the checksum sidecar.
pub use crate::format::sidecar::ItemChecksum as Recorded;

/// Key prefix of the common state inside DCP (megatron-core 0.19: `common_state/shard_0_1`,
/// `dist_checkpointing/serialization.py` `save`).
pub const COMMON_STATE_PREFIX: &str = "common_state";

/// An open checkpoint directory.
pub struct Checkpoint {
    loc: Location,
    dir: PathBuf,
    /// The parsed `.metadata`.
    pub metadata: CheckpointMetadata,
    files: Mutex<HashMap<String, Arc<Mapped>>>,
    /// Save-time CRC-32s: key -> records sorted by chunk offsets (None, a byte object, first).
    /// Never changed after `open`, so a record's address identifies its item.
    recorded: Option<HashMap<String, Vec<Recorded>>>,
    /// Payload bytes per block CRC-32 of the sidecar ([`crate::blockcrc`]); 0 without block CRCs.
    block_bytes: u64,
    /// Items of mapped files already checked against their CRC (addresses of their records).
    verified: Mutex<HashSet<usize>>,
    /// The record of the commit that wrote `.metadata`, when shardwise did.
    commit: Option<CommitRecord>,
}

/// The common (non-sharded) state a Megatron loader reads, as raw torch.save bytes.
pub struct CommonState {
    /// `common.pt` or the key of the `common_state` object.
    pub source: String,
    /// The torch.save bytes (not unpickled here).
    pub bytes: Vec<u8>,
}

/// A data file as the reader holds it: open for positioned reads ([`DataSource`]), and memory
/// mapped where that is possible (a non-empty local file); an object is read by ranged GETs.
pub struct Mapped {
    source: DataSource,
    map: Option<Mmap>,
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }

    fn len(&self) -> u64 {
        self.source.len()
    }
}

/// An item's bytes: a window on a mapped file, the body of a ranged GET, or decoded bytes when a
/// stream transform applied.
pub enum ItemBytes {
    /// A range of a memory-mapped local file.
    Mapped(Arc<Mapped>, std::ops::Range<usize>),
    /// The body of a ranged GET.
    Fetched(bytes::Bytes),
    /// Bytes decoded by a stream transform (`stream.zstd/1`).
    Owned(Vec<u8>),
}

impl std::ops::Deref for ItemBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ItemBytes::Mapped(m, r) => &m.bytes()[r.clone()],
            ItemBytes::Fetched(b) => b,
            ItemBytes::Owned(v) => v,
        }
    }
}

// Pages of a read item leave this process's resident set once the item is dropped: reading a
// checkpoint of any size then holds only what is being copied (the page cache keeps them for the
// kernel to manage), which is what "memory bounded by what was asked for" means to someone
// watching RSS. Safe for a read-only shared file mapping: a later access just faults them back in.
impl Drop for ItemBytes {
    fn drop(&mut self) {
        if let ItemBytes::Mapped(m, r) = self {
            if let Some(map) = &m.map {
                // SAFETY: MADV_DONTNEED on a read-only shared file mapping discards no data.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, r.start, r.len())
                };
            }
        }
    }
}

/// A chunk's stored tensor together with the item bytes it lives in.
pub struct ChunkData {
    pub(crate) tensor: StoredTensor,
    pub(crate) blob: ItemBytes,
}

impl ChunkData {
    /// The storage record's bytes.
    pub fn storage(&self) -> &[u8] {
        &self.blob[self.tensor.storage.start..self.tensor.storage.start + self.tensor.storage.len]
    }
}

fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Error {
    Error::Corrupt {
        path: path.into(),
        reason: reason.into(),
    }
}

impl Checkpoint {
    /// Opens the checkpoint at `loc` (a directory or an object-store prefix) and decodes its
    /// `.metadata` (never executing it).
    ///
    /// Errors: [`Error::Io`]/[`Error::Remote`] if `.metadata` cannot be read, [`Error::Corrupt`] if
    /// it is not DCP metadata, or if the directory's saves committed another `.metadata` (the
    /// damage `shardwise status` reports): its items would be read where that other `.metadata`
    /// placed them, unchecked (another file order swaps tensors of one shape without a trace).
    pub fn open(loc: &Location) -> Result<Checkpoint> {
        match Checkpoint::open_as_found(loc)? {
            (ckpt, None) => Ok(ckpt),
            (ckpt, Some(damage)) => Err(corrupt(
                ckpt.dir.join(METADATA_FILE),
                format!(
                    "{} holds a damaged checkpoint, not loaded: {}; `shardwise status {}` tells its \
                     state",
                    ckpt.loc,
                    damage.with_fix(&ckpt.loc),
                    ckpt.loc
                ),
            )),
        }
    }

    /// Opens the checkpoint at `loc` as [`Checkpoint::open`] does, also when the directory's saves
    /// committed another `.metadata`: then with that damage, and no save-time CRC-32s (that save's
    /// describe other bytes). For `verify`, which reports the damage and checks the rest.
    ///
    /// Errors: as [`Checkpoint::open`], except for the damage.
    pub fn open_as_found(loc: &Location) -> Result<(Checkpoint, Option<Damage>)> {
        let loc = loc.canonical()?;
        let path = loc.path_of(METADATA_FILE);
        // Memory-mapped locally (hundreds of MB at millions of chunks: no copy into the heap, and
        // pages the decoder has passed can be dropped by the kernel), read whole from a store.
        let bytes = loc
            .read_held(METADATA_FILE)?
            .ok_or_else(|| crate::hints::no_metadata(&loc))?;
        let metadata = read_metadata(&bytes).map_err(|e| corrupt(&path, e.0))?;
        let writer = metadata_writer(&loc, &bytes)?;
        drop(bytes);
        let sums = read_checksums(&loc, &writer)?;
        let block_bytes = sums.as_ref().map_or(0, |s| s.block_bytes);
        let recorded = sums.map(|sums| {
            let mut by_key: HashMap<String, Vec<Recorded>> = HashMap::new();
            for i in sums.items {
                by_key.entry(i.fqn.clone()).or_default().push(i);
            }
            for v in by_key.values_mut() {
                v.sort_by(|a, b| a.offsets.cmp(&b.offsets));
            }
            by_key
        });
        let (commit, damage) = match writer {
            MetadataWriter::Commit(r) => (Some(r), None),
            MetadataWriter::Unrecorded => (None, None),
            MetadataWriter::Replaced(d) => (None, Some(d)),
        };
        let ckpt = Checkpoint {
            dir: loc.display_path(),
            loc,
            metadata,
            files: Mutex::new(HashMap::new()),
            recorded,
            block_bytes,
            verified: Mutex::new(HashSet::new()),
            commit,
        };
        Ok((ckpt, damage))
    }

    /// The `COMMITTED` record of the shardwise save whose commit wrote this `.metadata`, if any:
    /// what the commit wrote beside it (`common.pt`'s size and CRC-32, the data files' sizes).
    pub fn commit_record(&self) -> Option<&CommitRecord> {
        self.commit.as_ref()
    }

    /// Whether the checkpoint has shardwise's checksum sidecar (its reads are CRC-checked).
    pub fn has_checksums(&self) -> bool {
        self.recorded.is_some()
    }

    /// The save-time placement and CRC-32 of the item of `key` (`offsets`: the chunk's global
    /// offsets, None for a byte object), when the sidecar records one.
    pub fn recorded(&self, key: &str, offsets: Option<&[u64]>) -> Option<&Recorded> {
        // Binary search on borrowed offsets: no allocation on the read path.
        let v = self.recorded.as_ref()?.get(key)?;
        let at = v
            .binary_search_by(|r| r.offsets.as_deref().cmp(&offsets))
            .ok()?;
        Some(&v[at])
    }

    /// Size in bytes of the data file `rel` (a `relative_path` of `.metadata`).
    ///
    /// Errors: [`Error::Corrupt`] for a path leaving the directory; [`Error::Io`] / [`Error::Remote`]
    /// when it cannot be opened.
    pub fn file_size(&self, rel: &str) -> Result<u64> {
        Ok(self.file(rel)?.len())
    }

    /// The common state: `common.pt` when present (megatron-core ≤ 0.18 layout), else the
    /// `common_state` byte object (0.19, [`COMMON_STATE_PREFIX`]); None when there is neither.
    /// Raw torch.save bytes, never unpickled here; every zip record is checked against its CRC-32
    /// and `data.pkl` must decode as a pickle (symbolically, nothing is executed).
    ///
    /// Errors: [`Error::Corrupt`] naming the file (and the key for `common_state`) for a damaged
    /// archive; item errors as [`Checkpoint::read_bytes`].
    pub fn read_common(&self) -> Result<Option<CommonState>> {
        let (source, bytes, path) = match self.loc.read(COMMON_FILE)? {
            Some(b) => (COMMON_FILE.to_string(), b, self.dir.join(COMMON_FILE)),
            None => {
                let key = self.metadata.entries.iter().find_map(|(k, e)| {
                    (k.starts_with(COMMON_STATE_PREFIX) && matches!(e, Entry::Bytes { .. }))
                        .then_some(k)
                });
                let Some(key) = key else { return Ok(None) };
                let Entry::Bytes { storage } = &self.metadata.entries[key] else {
                    unreachable!("filtered on Entry::Bytes")
                };
                let path = self.dir.join(&storage.relative_path);
                (key.clone(), self.read_bytes(key, 1 << 34)?, path)
            }
        };
        check_common(&bytes).map_err(|r| corrupt(path, format!("{source}: {r}")))?;
        Ok(Some(CommonState { source, bytes }))
    }

    /// The checkpoint directory (canonical), or the URL of an object-store checkpoint.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the checkpoint is.
    pub fn location(&self) -> &Location {
        &self.loc
    }

    /// The entry of `key`.
    ///
    /// Errors: [`Error::MissingKey`] when the checkpoint has no such key.
    pub fn entry(&self, key: &str) -> Result<&Entry> {
        self.metadata
            .entries
            .get(key)
            .ok_or_else(|| Error::MissingKey {
                key: key.to_owned(),
                dir: self.dir.clone(),
            })
    }

    /// Opens data file `rel` (a `relative_path` of `.metadata`, confined to the directory when
    /// decoded) for positioned reads ([`Location::open_data`]).
    ///
    /// Errors: [`Error::Corrupt`] for a file that resolves outside the directory (through a
    /// symlink) or is not a regular file; [`Error::Io`] / [`Error::Remote`] when it cannot be
    /// opened (missing file).
    pub fn open_data(&self, rel: &str) -> Result<DataSource> {
        self.loc.open_data(rel)
    }

    fn file(&self, rel: &str) -> Result<Arc<Mapped>> {
        if let Some(f) = self.files.lock().unwrap().get(rel) {
            return Ok(f.clone());
        }
        let source = self.open_data(rel)?;
        let map = source.map()?;
        let mapped = Arc::new(Mapped { source, map });
        self.files
            .lock()
            .unwrap()
            .insert(rel.to_string(), mapped.clone());
        Ok(mapped)
    }

    /// The bytes of one item (after its stream transforms), at most `limit` bytes once decoded,
    /// checked against the save-time CRC-32 when the checkpoint records one.
    ///
    /// Errors: [`Error::Corrupt`] when the item lies outside its file, fails its CRC-32, uses an
    /// unknown transform or decodes to more than `limit` bytes.
    pub fn item(
        &self,
        key: &str,
        offsets: Option<&[u64]>,
        storage: &StorageInfo,
        limit: u64,
    ) -> Result<ItemBytes> {
        let (bytes, pending) = self.item_deferred(key, offsets, storage, limit)?;
        if let Some(p) = pending {
            self.finish_check(p, &bytes)?;
        }
        Ok(bytes)
    }

    /// [`Checkpoint::item`] without the CRC-32 check (`verify --quick` reads structures only).
    pub(crate) fn item_unchecked(
        &self,
        key: &str,
        storage: &StorageInfo,
        limit: u64,
    ) -> Result<ItemBytes> {
        self.item_deferred(key, None, storage, limit)
            .map(|(b, _)| b)
    }

    /// [`Checkpoint::item`] with the CRC-32 check of an untransformed item left to the caller
    /// (so that it can run alongside the copy out of the item).
    fn item_deferred(
        &self,
        key: &str,
        offsets: Option<&[u64]>,
        storage: &StorageInfo,
        limit: u64,
    ) -> Result<(ItemBytes, Option<PendingCrc<'_>>)> {
        if storage.relative_path.is_empty() {
            return Err(corrupt(
                self.dir.join(METADATA_FILE),
                format!("{key}: chunk has no storage_data entry"),
            ));
        }
        let file = self.file(&storage.relative_path)?;
        let end = storage
            .offset
            .checked_add(storage.length)
            .filter(|&e| e <= file.len())
            .ok_or_else(|| {
                corrupt(
                    self.dir.join(&storage.relative_path),
                    format!(
                        "{key}: item at offset {} length {} passes the end of the file ({} bytes)",
                        storage.offset,
                        storage.length,
                        file.len()
                    ),
                )
            })?;
        let range = storage.offset as usize..end as usize;
        let transforms = self
            .metadata
            .transforms
            .get(&(key.to_string(), offsets.map(|o| o.to_vec())));
        let raw = match &file.map {
            Some(_) => ItemBytes::Mapped(file.clone(), range),
            // An object (or an empty item of an empty file): one ranged GET.
            None => ItemBytes::Fetched(file.source.read_range(storage.offset..end)?),
        };
        let pending = self.pending_check(key, offsets, storage, &raw)?;
        let Some(transforms) = transforms else {
            return Ok((raw, pending));
        };
        // The CRC covers the stored bytes, which decoding does not keep: check them first.
        if let Some(p) = pending {
            self.finish_check(p, &raw)?;
        }
        let mut data = raw.to_vec();
        // Descriptors are stored in reverse order of application, so decode in list order.
        for t in transforms {
            if !t.starts_with("stream.zstd/1") {
                return Err(corrupt(
                    self.dir.join(&storage.relative_path),
                    format!("{key}: unknown stream transform {t:?}"),
                ));
            }
            let zerr = |e: String| {
                corrupt(
                    self.dir.join(&storage.relative_path),
                    format!("{key}: zstd: {e}"),
                )
            };
            let mut out = Vec::new();
            // One frame after another (a stream may hold several), each checked against its
            // content checksum when it carries one.
            let mut src: &[u8] = &data;
            while !src.is_empty() && out.len() as u64 <= limit {
                let mut frame = ruzstd::decoding::StreamingDecoder::new(&mut src)
                    .map_err(|e| zerr(e.to_string()))?;
                (&mut frame)
                    .take(limit + 1 - out.len() as u64)
                    .read_to_end(&mut out)
                    .map_err(|e| zerr(e.to_string()))?;
                if let (Some(stored), Some(computed)) = (
                    frame.decoder.get_checksum_from_data(),
                    frame.decoder.get_calculated_checksum(),
                ) {
                    if stored != computed {
                        return Err(zerr(format!(
                            "content checksum {stored:08x} does not match the decoded bytes ({computed:08x})"
                        )));
                    }
                }
            }
            if out.len() as u64 > limit {
                return Err(corrupt(
                    self.dir.join(&storage.relative_path),
                    format!("{key}: item decompresses past {limit} bytes"),
                ));
            }
            data = out;
        }
        Ok((ItemBytes::Owned(data), None))
    }

    /// The CRC-32 check an item's stored bytes still need (our writer applies no stream
    /// transform, so the stored bytes are the bytes it hashed): None without a sidecar record, or
    /// for an item of a mapped file already checked.
    ///
    /// Errors: [`Error::Corrupt`] when the sidecar places the item elsewhere than `.metadata`.
    fn pending_check(
        &self,
        key: &str,
        offsets: Option<&[u64]>,
        storage: &StorageInfo,
        raw: &ItemBytes,
    ) -> Result<Option<PendingCrc<'_>>> {
        let Some(rec) = self.placed_record(key, offsets, storage)? else {
            return Ok(None);
        };
        let remember = matches!(raw, ItemBytes::Mapped(..));
        if remember && self.verified.lock().unwrap().contains(&rec.id()) {
            return Ok(None);
        }
        Ok(Some(PendingCrc { rec, remember }))
    }

    /// Runs a pending check on the item's stored bytes.
    ///
    /// Errors: [`Error::Corrupt`] naming key, file and offset when the CRC-32 differs.
    fn finish_check(&self, p: PendingCrc, raw: &[u8]) -> Result<()> {
        let rec = p.rec;
        self.check_crc(rec, crc32(raw))?;
        if p.remember {
            self.verified.lock().unwrap().insert(rec.id());
        }
        Ok(())
    }

    /// Compares an item's computed CRC-32 `got` with the one recorded at save time.
    ///
    /// Errors: [`Error::Corrupt`] naming the key (and chunk), the file and the item's offset.
    pub(crate) fn check_crc(&self, rec: &Recorded, got: u32) -> Result<()> {
        if got == rec.crc32 {
            return Ok(());
        }
        Err(corrupt(
            self.dir.join(&rec.relative_path),
            format!(
                "{} (item at offset {}, {} bytes) fails the CRC-32 recorded at save time \
                 (recorded {:08x}, computed {got:08x})",
                rec.what(),
                rec.offset,
                rec.length,
                rec.crc32
            ),
        ))
    }

    /// Payload bytes per block CRC-32 when the save recorded block CRCs ([`crate::blockcrc`]).
    pub(crate) fn block_bytes(&self) -> Option<u64> {
        (self.block_bytes > 0).then_some(self.block_bytes)
    }

    /// Compares the CRC-32 `got` of block `block` of an item's payload, which lies at bytes `at`
    /// of the item's file, with the one recorded at save time.
    ///
    /// Errors: [`Error::Corrupt`] naming the key (and chunk), the file and the block's byte offset
    /// in the file when the CRC-32 differs.
    pub(crate) fn check_block_crc(
        &self,
        rec: &Recorded,
        block: u64,
        at: std::ops::Range<u64>,
        got: u32,
    ) -> Result<()> {
        let want = rec.blocks[block as usize];
        if got == want {
            return Ok(());
        }
        Err(corrupt(
            self.dir.join(&rec.relative_path),
            format!(
                "{} (item at offset {}, {} bytes): block {block} of its tensor data, bytes \
                 {}..{} of the file (offset {}), fails the CRC-32 recorded at save time \
                 (recorded {want:08x}, computed {got:08x})",
                rec.what(),
                rec.offset,
                rec.length,
                at.start,
                at.end,
                at.start
            ),
        ))
    }

    /// The sidecar record of an item when it places the item where `.metadata` does.
    ///
    /// Errors: [`Error::Corrupt`] when the sidecar places the item elsewhere (another save's).
    pub(crate) fn placed_record(
        &self,
        key: &str,
        offsets: Option<&[u64]>,
        storage: &StorageInfo,
    ) -> Result<Option<&Recorded>> {
        let Some(rec) = self.recorded(key, offsets) else {
            return Ok(None);
        };
        if (rec.relative_path.as_str(), rec.offset, rec.length)
            != (
                storage.relative_path.as_str(),
                storage.offset,
                storage.length,
            )
        {
            return Err(corrupt(
                self.dir.join(&storage.relative_path),
                format!(
                    "{}: the checksum sidecar places this item at {}@{}+{}, .metadata at {}@{}+{} \
                     (the sidecar belongs to another save)",
                    rec.what(),
                    rec.relative_path,
                    rec.offset,
                    rec.length,
                    storage.relative_path,
                    storage.offset,
                    storage.length
                ),
            ));
        }
        Ok(Some(rec))
    }

    /// Decodes chunk `index` of tensor `key`, checking it against the metadata.
    ///
    /// Errors: [`Error::Corrupt`] naming key, file and offset when the item is not a tensor of the
    /// chunk's shape and the key's dtype.
    pub fn chunk(&self, key: &str, index: usize) -> Result<(ChunkData, &Chunk)> {
        let (data, c, pending) = self.chunk_deferred(key, index)?;
        if let Some(p) = pending {
            self.finish_check(p, &data.blob)?;
        }
        Ok((data, c))
    }

    /// [`Checkpoint::chunk`] with the item's CRC-32 check left to the caller (a decoding error is
    /// reported as the CRC failure when the item fails its CRC).
    fn chunk_deferred(
        &self,
        key: &str,
        index: usize,
    ) -> Result<(ChunkData, &Chunk, Option<PendingCrc<'_>>)> {
        let (dtype, c) = self.tensor_chunk(key, index)?;
        let expect = volume(&c.sizes)
            .and_then(|v| v.checked_mul(dtype.itemsize()))
            .ok_or_else(|| {
                corrupt(
                    self.dir.join(METADATA_FILE),
                    format!("{key}: absurd chunk sizes {:?}", c.sizes),
                )
            })?;
        let (blob, pending) = self.item_deferred(
            key,
            Some(&c.offsets),
            &c.storage,
            expect.saturating_add(1 << 20),
        )?;
        let at = |reason: String| {
            corrupt(
                self.dir.join(&c.storage.relative_path),
                format!(
                    "{key} chunk {:?} (item at offset {}): {reason}",
                    c.offsets, c.storage.offset
                ),
            )
        };
        let decoded = stored_tensor(&blob)
            .map_err(|e| e.0)
            .and_then(|tensor| matches_chunk(tensor, dtype, c));
        match decoded {
            Ok(tensor) => Ok((ChunkData { tensor, blob }, c, pending)),
            Err(reason) => {
                // Damage explains a decoding failure best as the CRC mismatch it is.
                if let Some(p) = pending {
                    self.finish_check(p, &blob)?;
                }
                Err(at(reason))
            }
        }
    }

    /// The dtype of tensor `key` and its chunk `index`.
    ///
    /// Errors: [`Error::InvalidArgument`] when `key` is a byte object or has no such chunk.
    fn tensor_chunk(&self, key: &str, index: usize) -> Result<(DType, &Chunk)> {
        let Entry::Tensor { dtype, chunks, .. } = self.entry(key)? else {
            return Err(Error::InvalidArgument(format!(
                "{key} is a byte object, not a tensor"
            )));
        };
        let c = chunks
            .get(index)
            .ok_or_else(|| Error::InvalidArgument(format!("{key} has no chunk {index}")))?;
        Ok((*dtype, c))
    }

    /// Decodes chunk `index` of tensor `key` as [`Checkpoint::chunk`] does, from only the bytes
    /// torch reads before the tensor data (the archive's headers, `data.pkl` and central
    /// directory): the payload is neither read nor checked (`verify --quick`). A mapped file
    /// loads only the pages read; an object's item is read by its first and last bytes, as the
    /// loader probes it.
    ///
    /// Errors: as [`Checkpoint::chunk`], without the CRC-32 check.
    pub fn chunk_structure(&self, key: &str, index: usize) -> Result<()> {
        let (dtype, c) = self.tensor_chunk(key, index)?;
        let file = self.file(&c.storage.relative_path)?;
        let transformed = self
            .metadata
            .transforms
            .contains_key(&(key.to_string(), Some(c.offsets.to_vec())));
        if file.map.is_some() || transformed {
            return self.chunk_deferred(key, index).map(|_| ());
        }
        let (offset, len) = (c.storage.offset, c.storage.length);
        let at = |reason: String| {
            corrupt(
                self.dir.join(&c.storage.relative_path),
                format!(
                    "{key} chunk {:?} (item at offset {offset}): {reason}",
                    c.offsets
                ),
            )
        };
        let mut last = String::new();
        for window in [4u64 << 10, 1 << 20] {
            let (head_len, tail_len) = if len <= 2 * window {
                (len, 0)
            } else {
                (window, window)
            };
            let end = offset.checked_add(len).filter(|&e| e <= file.len());
            let end = end
                .ok_or_else(|| at(format!("passes the end of the file ({} bytes)", file.len())))?;
            let head = file.source.read_range(offset..offset + head_len)?;
            let tail = file.source.read_range(end - tail_len..end)?;
            let blob = HeadTail {
                size: len as usize,
                head: &head,
                tail: &tail,
            };
            match stored_tensor_in(&blob) {
                Ok(t) => return matches_chunk(t, dtype, c).map(|_| ()).map_err(at),
                Err(e) if tail_len == 0 => return Err(at(e.0)),
                Err(e) => last = e.0,
            }
        }
        Err(at(last))
    }

    /// The raw bytes of byte object `key` (a torch.save archive).
    pub fn read_bytes(&self, key: &str, limit: u64) -> Result<Vec<u8>> {
        let Entry::Bytes { storage } = self.entry(key)? else {
            return Err(Error::InvalidArgument(format!(
                "{key} is a tensor, not a byte object"
            )));
        };
        Ok(self.item(key, None, storage, limit)?.to_vec())
    }

    /// Decodes chunk `index` of tensor `key`, as [`Checkpoint::chunk`], and runs `f` on it while
    /// its CRC-32 check runs (on another core for a large item, when there is one): for callers
    /// that copy out of the item. Whatever `f` wrote holds damaged bytes only when the CRC error
    /// is returned.
    ///
    /// Errors: as [`Checkpoint::chunk`].
    pub fn with_chunk<T: Send>(
        &self,
        key: &str,
        index: usize,
        f: impl FnOnce(&ChunkData, &Chunk) -> T + Send,
    ) -> Result<T> {
        let (data, c, pending) = self.chunk_deferred(key, index)?;
        Ok(match pending {
            Some(p) if data.blob.len() >= PARALLEL_CHECK_BYTES => {
                let (checked, out) =
                    rayon::join(|| self.finish_check(p, &data.blob), || f(&data, c));
                checked?;
                out
            }
            Some(p) => {
                self.finish_check(p, &data.blob)?;
                f(&data, c)
            }
            None => f(&data, c),
        })
    }
}

/// `tensor` when it is what chunk `c` of a tensor of `dtype` must hold; else why not.
fn matches_chunk(
    tensor: StoredTensor,
    dtype: DType,
    c: &Chunk,
) -> std::result::Result<StoredTensor, String> {
    if tensor.dtype != dtype {
        return Err(format!(
            "item holds {} but .metadata says {}",
            tensor.dtype.torch_name(),
            dtype.torch_name()
        ));
    }
    if tensor.shape != c.sizes {
        return Err(format!(
            "item has shape {:?} but the chunk is {:?}",
            tensor.shape, c.sizes
        ));
    }
    Ok(tensor)
}

/// Items at least this large are hashed alongside the copy out of them.
const PARALLEL_CHECK_BYTES: usize = 1 << 20;

/// A CRC-32 check an item still needs.
struct PendingCrc<'a> {
    rec: &'a Recorded,
    /// Remember the item as checked (a mapped file, whose bytes cannot change under us).
    remember: bool,
}

impl Recorded {
    /// The key, with the chunk's offsets for a tensor chunk.
    fn what(&self) -> String {
        match &self.offsets {
            Some(o) => format!("{} chunk {o:?}", self.fqn),
            None => self.fqn.clone(),
        }
    }

    /// Identity of the item for the checked set: the record's address (records never move).
    fn id(&self) -> usize {
        self as *const Recorded as usize
    }
}

/// CRC-32 of `bytes`; large items are hashed in 8 MiB blocks on rayon's pool and the block CRCs
/// combined (page faults of a mapped item are then taken in parallel too).
pub fn crc32(bytes: &[u8]) -> u32 {
    const BLOCK: usize = 8 << 20;
    if bytes.len() <= 2 * BLOCK {
        return crc32fast::hash(bytes);
    }
    bytes
        .par_chunks(BLOCK)
        .map(|b| {
            let mut h = crc32fast::Hasher::new();
            h.update(b);
            h
        })
        // rayon's reduce keeps the order of an indexed iterator: blocks combine left to right.
        .reduce_with(|mut a, b| {
            a.combine(&b);
            a
        })
        .map_or(0, |h| h.finalize())
}

/// Checks a common-state archive: every zip record against its CRC-32, and `data.pkl` decodes.
fn check_common(bytes: &[u8]) -> std::result::Result<(), String> {
    let archive = Archive::read(bytes).map_err(|e| format!("not a torch.save archive: {}", e.0))?;
    if let Some(bad) = bad_record_crcs(bytes, &archive.records).into_iter().next() {
        return Err(bad);
    }
    let pkl = archive.data_pkl().map_err(|e| e.0)?;
    unpickle(&bytes[pkl.start..pkl.start + pkl.len])
        .map(|_| ())
        .map_err(|e| format!("data.pkl does not decode: {}", e.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::state::{checkpoint_state, CheckpointState};
    use crate::commit::testing::committed;

    /// A `.metadata` that none of the directory's saves committed (here another save's, which
    /// parses) is refused with the damage `status` reports; `open_as_found` opens it with that
    /// damage and no save-time CRC-32s; without `.shardwise/` it is a torch checkpoint and opens.
    #[test]
    fn a_metadata_no_commit_wrote_is_not_opened() {
        let (dir, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let loc = Location::local(dir.path());
        committed(&loc, "s", 2, false);
        assert!(Checkpoint::open(&loc).unwrap().has_checksums());
        committed(&Location::local(other.path()), "t", 1, false);
        std::fs::copy(
            other.path().join(METADATA_FILE),
            dir.path().join(METADATA_FILE),
        )
        .unwrap();
        let CheckpointState::Damaged { reason, repairable } = checkpoint_state(&loc).unwrap()
        else {
            panic!("not damaged")
        };
        let Err(Error::Corrupt {
            reason: refused, ..
        }) = Checkpoint::open(&loc)
        else {
            panic!("opened")
        };
        assert!(refused.contains(&reason), "{refused}");
        assert!(refused.contains("`shardwise merge --repair"), "{refused}");
        assert!(refused.contains("`shardwise status"), "{refused}");
        let (ckpt, damage) = Checkpoint::open_as_found(&loc).unwrap();
        assert_eq!(damage, Some(Damage { reason, repairable }));
        assert!(!ckpt.has_checksums() && ckpt.commit_record().is_none());
        std::fs::remove_dir_all(dir.path().join(".shardwise")).unwrap();
        assert!(!Checkpoint::open(&loc).unwrap().has_checksums());
    }

    #[test]
    fn blockwise_crc_equals_the_sequential_one() {
        for n in [0usize, 5, 16 << 20, (16 << 20) + 1, (40 << 20) + 12_345] {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
            assert_eq!(crc32(&bytes), crc32fast::hash(&bytes), "{n} bytes");
        }
    }
}
