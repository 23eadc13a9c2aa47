//! Reads any DCP / torch_dist checkpoint as data: `.metadata` through the symbolic unpickler,
//! items through memory-mapped `.distcp` files (or one ranged GET per item on an object store).
//! Paths are confined to the checkpoint directory,
//! every offset and size is checked against the real file, and memory use is bounded by what the
//! caller asks for, not by what the file claims.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::format::archive::{stored_tensor, StoredTensor};
use crate::format::metadata::{Chunk, Entry, StorageInfo};
use crate::format::read_metadata::{read_metadata, CheckpointMetadata};
use crate::storage::Location;

/// An open checkpoint directory.
pub struct Checkpoint {
    loc: Location,
    dir: PathBuf,
    pub metadata: CheckpointMetadata,
    files: Mutex<HashMap<String, Arc<Mapped>>>,
}

/// A data file as the reader holds it.
pub enum Mapped {
    Map(Mmap),
    Empty,
    /// An object of `size` bytes, read by ranged GETs.
    Remote {
        size: u64,
    },
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        match self {
            Mapped::Map(m) => m,
            Mapped::Empty | Mapped::Remote { .. } => &[],
        }
    }

    fn len(&self) -> u64 {
        match self {
            Mapped::Remote { size } => *size,
            other => other.bytes().len() as u64,
        }
    }
}

/// An item's bytes: a window on a mapped file, the body of a ranged GET, or decoded bytes when a
/// stream transform applied.
pub enum ItemBytes {
    Mapped(Arc<Mapped>, std::ops::Range<usize>),
    Fetched(bytes::Bytes),
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
            if let Mapped::Map(map) = m.as_ref() {
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
    pub tensor: StoredTensor,
    pub blob: ItemBytes,
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

/// Checks that a `relative_path` from `.metadata` names a file inside the checkpoint directory:
/// relative, no `..`, no root or prefix components.
pub fn check_relative_path(rel: &str) -> std::result::Result<(), String> {
    let p = Path::new(rel);
    if rel.is_empty()
        || p.components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(format!(
            "relative_path {rel:?} leaves the checkpoint directory"
        ));
    }
    Ok(())
}

fn volume(sizes: &[u64]) -> Option<u64> {
    sizes.iter().try_fold(1u64, |a, &s| a.checked_mul(s))
}

impl Checkpoint {
    /// Opens the checkpoint at `loc` (a directory or an object-store prefix) and decodes its
    /// `.metadata` (never executing it).
    ///
    /// Errors: [`Error::Io`]/[`Error::Remote`] if `.metadata` cannot be read, [`Error::Corrupt`] if
    /// it is not DCP metadata.
    pub fn open(loc: &Location) -> Result<Checkpoint> {
        let loc = match loc {
            Location::Local(dir) => Location::Local(
                dir.canonicalize()
                    .map_err(Error::io("open checkpoint directory", dir))?,
            ),
            remote => remote.clone(),
        };
        let path = loc.path_of(".metadata");
        let bytes = loc.read(".metadata")?.ok_or_else(|| Error::Io {
            op: "read",
            path: path.clone(),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        let metadata = read_metadata(&bytes).map_err(|e| corrupt(&path, e.0))?;
        Ok(Checkpoint {
            dir: loc.display_path(),
            loc,
            metadata,
            files: Mutex::new(HashMap::new()),
        })
    }

    /// The checkpoint directory (canonical), or the URL of an object-store checkpoint.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn location(&self) -> &Location {
        &self.loc
    }

    /// The entry of `key`.
    ///
    /// Errors: [`Error::InvalidArgument`] when the checkpoint has no such key.
    pub fn entry(&self, key: &str) -> Result<&Entry> {
        self.metadata.entries.get(key).ok_or_else(|| {
            Error::InvalidArgument(format!("no key {key:?} in {}", self.dir.display()))
        })
    }

    fn file(&self, rel: &str) -> Result<Arc<Mapped>> {
        if let Some(f) = self.files.lock().unwrap().get(rel) {
            return Ok(f.clone());
        }
        check_relative_path(rel).map_err(|r| corrupt(self.dir.join(".metadata"), r))?;
        let path = self.dir.join(rel);
        if let Location::Remote(r) = &self.loc {
            let size = r.size(rel)?.ok_or_else(|| Error::Io {
                op: "open",
                path: path.clone(),
                source: std::io::ErrorKind::NotFound.into(),
            })?;
            let mapped = Arc::new(Mapped::Remote { size });
            self.files
                .lock()
                .unwrap()
                .insert(rel.to_string(), mapped.clone());
            return Ok(mapped);
        }
        // A symlink inside the directory must not lead out of it either.
        let real = path.canonicalize().map_err(Error::io("open", &path))?;
        if !real.starts_with(&self.dir) {
            return Err(corrupt(
                &path,
                format!("{rel:?} resolves outside the checkpoint directory"),
            ));
        }
        let file = File::open(&real).map_err(Error::io("open", &path))?;
        let len = file.metadata().map_err(Error::io("stat", &path))?.len();
        let mapped = if len == 0 {
            Mapped::Empty
        } else {
            // SAFETY: checkpoint files are immutable once written; a concurrent writer would be a
            // misuse that can only produce wrong bytes, which the CRC checks of `verify` report.
            Mapped::Map(unsafe { Mmap::map(&file) }.map_err(Error::io("map", &path))?)
        };
        let mapped = Arc::new(mapped);
        self.files
            .lock()
            .unwrap()
            .insert(rel.to_string(), mapped.clone());
        Ok(mapped)
    }

    /// The bytes of one item (after its stream transforms), at most `limit` bytes once decoded.
    ///
    /// Errors: [`Error::Corrupt`] when the item lies outside its file, uses an unknown transform or
    /// decodes to more than `limit` bytes.
    pub fn item(
        &self,
        key: &str,
        offsets: Option<&[u64]>,
        storage: &StorageInfo,
        limit: u64,
    ) -> Result<ItemBytes> {
        if storage.relative_path.is_empty() {
            return Err(corrupt(
                self.dir.join(".metadata"),
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
        let raw = match &self.loc {
            Location::Remote(r) => {
                ItemBytes::Fetched(r.get_range(&storage.relative_path, storage.offset..end)?)
            }
            Location::Local(_) => ItemBytes::Mapped(file.clone(), range),
        };
        let Some(transforms) = transforms else {
            return Ok(raw);
        };
        let mut data = raw.to_vec();
        // Descriptors are stored in reverse order of application, so decode in list order.
        for t in transforms {
            if !t.starts_with("stream.zstd/1") {
                return Err(corrupt(
                    self.dir.join(&storage.relative_path),
                    format!("{key}: unknown stream transform {t:?}"),
                ));
            }
            let zerr = |e: std::io::Error| {
                corrupt(
                    self.dir.join(&storage.relative_path),
                    format!("{key}: zstd: {e}"),
                )
            };
            let mut out = Vec::new();
            zstd::stream::read::Decoder::new(&data[..])
                .map_err(zerr)?
                .take(limit + 1)
                .read_to_end(&mut out)
                .map_err(zerr)?;
            if out.len() as u64 > limit {
                return Err(corrupt(
                    self.dir.join(&storage.relative_path),
                    format!("{key}: item decompresses past {limit} bytes"),
                ));
            }
            data = out;
        }
        Ok(ItemBytes::Owned(data))
    }

    /// Decodes chunk `index` of tensor `key`, checking it against the metadata.
    ///
    /// Errors: [`Error::Corrupt`] naming key, file and offset when the item is not a tensor of the
    /// chunk's shape and the key's dtype.
    pub fn chunk(&self, key: &str, index: usize) -> Result<(ChunkData, &Chunk)> {
        let Entry::Tensor { dtype, chunks, .. } = self.entry(key)? else {
            return Err(Error::InvalidArgument(format!(
                "{key} is a byte object, not a tensor"
            )));
        };
        let c = chunks
            .get(index)
            .ok_or_else(|| Error::InvalidArgument(format!("{key} has no chunk {index}")))?;
        let expect = volume(&c.sizes)
            .and_then(|v| v.checked_mul(dtype.itemsize()))
            .ok_or_else(|| {
                corrupt(
                    self.dir.join(".metadata"),
                    format!("{key}: absurd chunk sizes {:?}", c.sizes),
                )
            })?;
        let blob = self.item(
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
        let tensor = stored_tensor(&blob).map_err(|e| at(e.0))?;
        if tensor.dtype != *dtype {
            return Err(at(format!(
                "item holds {} but .metadata says {}",
                tensor.dtype.torch_name(),
                dtype.torch_name()
            )));
        }
        if tensor.shape != c.sizes {
            return Err(at(format!(
                "item has shape {:?} but the chunk is {:?}",
                tensor.shape, c.sizes
            )));
        }
        Ok((ChunkData { tensor, blob }, c))
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

    /// Reads the region `offsets`/`sizes` (elements) of tensor `key` into `out` (C order,
    /// `prod(sizes) * itemsize` bytes), assembled from every chunk that overlaps it.
    ///
    /// Errors: [`Error::InvalidArgument`] for a region outside the global shape or a wrong `out`
    /// length; [`Error::Validation`] when the saved chunks do not cover the region; item errors as
    /// [`Checkpoint::chunk`].
    pub fn read_region(
        &self,
        key: &str,
        offsets: &[u64],
        sizes: &[u64],
        out: &mut [u8],
    ) -> Result<()> {
        let Entry::Tensor {
            dtype,
            global_shape,
            chunks,
        } = self.entry(key)?
        else {
            return Err(Error::InvalidArgument(format!(
                "{key} is a byte object, not a tensor"
            )));
        };
        let n = global_shape.len();
        let inside = offsets.len() == n
            && sizes.len() == n
            && offsets
                .iter()
                .zip(sizes)
                .zip(global_shape)
                .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|e| e <= g));
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "{key}: region {offsets:?}+{sizes:?} is outside the global shape {global_shape:?}"
            )));
        }
        let item = dtype.itemsize();
        let want = volume(sizes).and_then(|v| v.checked_mul(item));
        if want != Some(out.len() as u64) {
            return Err(Error::InvalidArgument(format!(
                "{key}: region needs {want:?} bytes, buffer has {}",
                out.len()
            )));
        }
        let total = volume(sizes).unwrap_or(0);
        let mut covered = 0u64;
        for (i, c) in chunks.iter().enumerate() {
            let lo: Vec<u64> = (0..n).map(|d| c.offsets[d].max(offsets[d])).collect();
            let hi: Vec<u64> = (0..n)
                .map(|d| (c.offsets[d] + c.sizes[d]).min(offsets[d] + sizes[d]))
                .collect();
            if c.offsets.len() != n || c.sizes.len() != n || (0..n).any(|d| lo[d] >= hi[d]) {
                continue;
            }
            let (data, _) = self.chunk(key, i)?;
            copy_box(&data, &c.offsets, offsets, sizes, &lo, &hi, item, out);
            covered += (0..n).map(|d| hi[d] - lo[d]).product::<u64>();
        }
        if covered != total {
            return Err(Error::Validation(format!(
                "{key}: saved chunks cover {covered} of the {total} elements asked for"
            )));
        }
        Ok(())
    }
}

/// Copies the box `[lo, hi)` (global coordinates) from a stored chunk at `chunk_off` into `out`,
/// a contiguous buffer for the region at `region_off` of `region_sizes`.
#[allow(clippy::too_many_arguments)]
fn copy_box(
    data: &ChunkData,
    chunk_off: &[u64],
    region_off: &[u64],
    region_sizes: &[u64],
    lo: &[u64],
    hi: &[u64],
    item: u64,
    out: &mut [u8],
) {
    let t = &data.tensor;
    let src = data.storage();
    let n = lo.len();
    let item = item as usize;
    if n == 0 {
        let s = t.storage_offset as usize * item;
        out[..item].copy_from_slice(&src[s..s + item]);
        return;
    }
    let mut out_strides = vec![1u64; n];
    for d in (0..n - 1).rev() {
        out_strides[d] = out_strides[d + 1] * region_sizes[d + 1];
    }
    let run = (hi[n - 1] - lo[n - 1]) as usize;
    let mut idx = lo.to_vec();
    loop {
        let mut s = t.storage_offset;
        let mut o = 0u64;
        for d in 0..n {
            s += (idx[d] - chunk_off[d]) * t.strides[d];
            o += (idx[d] - region_off[d]) * out_strides[d];
        }
        let (s, o) = (s as usize * item, o as usize * item);
        if t.strides[n - 1] == 1 {
            out[o..o + run * item].copy_from_slice(&src[s..s + run * item]);
        } else {
            let st = t.strides[n - 1] as usize * item;
            for k in 0..run {
                out[o + k * item..o + (k + 1) * item]
                    .copy_from_slice(&src[s + k * st..s + k * st + item]);
            }
        }
        // Odometer over all dimensions but the last.
        let mut d = n - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}
