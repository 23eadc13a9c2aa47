//! File-based rendezvous: each rank publishes a metadata part next to its data, and a merging rank
//! (any rank, or the `shardwise merge` CLI) validates all `world_size` parts and commits the global
//! `.metadata`. No collective is involved, so ranks whose process groups disagree cannot deadlock it;
//! every wait is bounded and names the ranks it is missing.
//!
//! Layout inside the checkpoint directory:
//! `.shardwise/<save_id>/<rank>.part` (one per rank), then on commit `.metadata` (tmp + rename),
//! `metadata.json` (Megatron saves, written last), and `.shardwise/<save_id>/COMMITTED`; on a failed
//! merge, `.shardwise/<save_id>/FAILED` with the reason, so waiting ranks fail fast.
//!
//! Part file: `SWPART01` magic, CRC-32 (u32 LE) of the body, body = MessagePack of [`RankPart`]
//! (structs as arrays, so field names are not repeated; a rank's part is O(its chunks)).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{fmt_ranks, Error, Result};
use crate::format::dtype::DType;
use crate::format::metadata::{check_layout, emit_metadata, volume, Chunk, Entry, StorageInfo};
use crate::storage::{atomic_write, create_dir_all, fsync_dir, sweep_temp_files};

const MAGIC: &[u8; 8] = b"SWPART01";
pub const PART_FORMAT: u32 = 1;
pub const STATE_DIR: &str = ".shardwise";
pub const COMMON_FILE: &str = "common.pt";

/// Megatron's `metadata.json` in the 4-field form that megatron-core ≤0.18 requires and 0.19 accepts
/// (megatron-torch-dist.md §1.3, `CheckpointingConfig` in `dist_checkpointing/core.py`).
pub const MEGATRON_METADATA_JSON: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

/// A data file a rank wrote, with its size in bytes at publish time.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileRecord {
    pub name: String,
    pub size: u64,
}

/// One tensor chunk in a part: key, dtype name, global shape, chunk offsets/sizes (elements) and
/// where its archive is (index into `RankPart::files`, byte offset, length).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TensorRecord {
    pub fqn: String,
    pub dtype: String,
    pub global_shape: Vec<u64>,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub file: u32,
    pub offset: u64,
    pub length: u64,
    /// CRC-32 of the item's bytes.
    pub crc32: u32,
}

/// A Megatron ShardedObject's position: base `key`, `global_shape` and `global_offset`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectShard {
    pub key: String,
    pub global_shape: Vec<u64>,
    pub global_offset: Vec<u64>,
}

/// One byte object in a part.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectRecord {
    pub fqn: String,
    pub shard: Option<ObjectShard>,
    pub file: u32,
    pub offset: u64,
    pub length: u64,
    /// CRC-32 of the item's bytes.
    pub crc32: u32,
}

/// Everything one rank contributes to a save.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RankPart {
    pub format: u32,
    pub save_id: String,
    pub rank: u32,
    pub world_size: u32,
    /// Write Megatron's `metadata.json` on commit (every rank of a save must agree).
    pub megatron: bool,
    pub files: Vec<FileRecord>,
    pub tensors: Vec<TensorRecord>,
    pub objects: Vec<ObjectRecord>,
    /// `common.pt`, when this rank wrote it.
    pub common: Option<FileRecord>,
}

/// The per-save state directory `<dir>/.shardwise/<save_id>`.
pub fn save_dir(dir: &Path, save_id: &str) -> PathBuf {
    dir.join(STATE_DIR).join(save_id)
}

fn part_path(dir: &Path, save_id: &str, rank: u32) -> PathBuf {
    save_dir(dir, save_id).join(format!("{rank}.part"))
}

/// Checks that a save id is a plain name (it becomes a directory name).
pub fn check_save_id(save_id: &str) -> Result<()> {
    let ok = !save_id.is_empty()
        && save_id.len() <= 128
        && save_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !save_id.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "save_id {save_id:?} must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

/// Publishes a rank's part atomically (tmp, fsync, rename, directory fsync).
pub fn write_part(dir: &Path, part: &RankPart) -> Result<PathBuf> {
    check_save_id(&part.save_id)?;
    let sdir = save_dir(dir, &part.save_id);
    create_dir_all(&sdir)?;
    let body = rmp_serde::to_vec(part)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode part: {e}")))?;
    let mut bytes = Vec::with_capacity(body.len() + 12);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    bytes.extend_from_slice(&body);
    let path = part_path(dir, &part.save_id, part.rank);
    atomic_write(&path, &bytes)?;
    Ok(path)
}

/// Reads and checks one part file.
///
/// Errors: [`Error::Corrupt`] on a bad magic, CRC or encoding; [`Error::Io`] if unreadable.
pub fn read_part(path: &Path) -> Result<RankPart> {
    let bytes = std::fs::read(path).map_err(Error::io("read", path))?;
    let corrupt = |reason: String| Error::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(corrupt("not a shardwise part (bad magic)".into()));
    }
    let crc = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    if crc32fast::hash(&bytes[12..]) != crc {
        return Err(corrupt("CRC mismatch".into()));
    }
    let part: RankPart =
        rmp_serde::from_slice(&bytes[12..]).map_err(|e| corrupt(format!("undecodable: {e}")))?;
    if part.format != PART_FORMAT {
        return Err(corrupt(format!(
            "part format {} is not {PART_FORMAT}",
            part.format
        )));
    }
    Ok(part)
}

/// Polling schedule: exponential backoff from 2 ms to 500 ms.
struct Backoff(Duration);
impl Backoff {
    fn new() -> Self {
        Backoff(Duration::from_millis(2))
    }
    fn sleep(&mut self, deadline: Instant) {
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(self.0.min(left));
        self.0 = (self.0 * 2).min(Duration::from_millis(500));
    }
}

/// Ranks in `0..world_size` with no part yet.
pub fn missing_ranks(dir: &Path, save_id: &str, world_size: u32) -> Vec<u32> {
    let present = present_ranks(dir, save_id, world_size);
    (0..world_size).filter(|&r| !present[r as usize]).collect()
}

/// `present[r]` is true when rank `r` has published its part (one directory listing).
fn present_ranks(dir: &Path, save_id: &str, world_size: u32) -> Vec<bool> {
    let mut present = vec![false; world_size as usize];
    if let Ok(rd) = std::fs::read_dir(save_dir(dir, save_id)) {
        for e in rd.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if let Some(r) = name
                .strip_suffix(".part")
                .and_then(|r| r.parse::<u32>().ok())
            {
                if r < world_size {
                    present[r as usize] = true;
                }
            }
        }
    }
    present
}

/// Waits up to `timeout` for the parts of all `world_size` ranks and reads them. Parts are read as
/// they arrive, so a `world_size` or save-id disagreement fails at once instead of at the timeout.
///
/// Errors: [`Error::MissingRanks`] at the timeout; [`Error::Validation`] when a part disagrees on
/// `world_size`; [`Error::Corrupt`]/[`Error::Io`] for unreadable parts.
pub fn collect_parts(
    dir: &Path,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<Vec<RankPart>> {
    check_save_id(save_id)?;
    let deadline = Instant::now() + timeout;
    let mut parts: Vec<Option<RankPart>> = vec![None; world_size as usize];
    let mut backoff = Backoff::new();
    loop {
        let present = present_ranks(dir, save_id, world_size);
        let arrived: Vec<u32> = (0..world_size)
            .filter(|&r| present[r as usize] && parts[r as usize].is_none())
            .collect();
        let fresh: Vec<RankPart> = arrived
            .par_iter()
            .map(|&r| read_part(&part_path(dir, save_id, r)))
            .collect::<Result<_>>()?;
        for p in fresh {
            if p.world_size != world_size {
                return Err(Error::Validation(format!(
                    "world_size disagrees across ranks: rank {} saved with world_size {}, the merger expects {}",
                    p.rank, p.world_size, world_size
                )));
            }
            if p.save_id != save_id {
                return Err(Error::Validation(format!(
                    "part of rank {} carries save id {} but lies under save {save_id}",
                    p.rank, p.save_id
                )));
            }
            let r = p.rank as usize;
            parts[r] = Some(p);
        }
        let missing: Vec<u32> = (0..world_size)
            .filter(|&r| parts[r as usize].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(parts.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            return Err(Error::MissingRanks {
                dir: dir.to_path_buf(),
                save_id: save_id.to_string(),
                world_size,
                missing,
                timeout_s: timeout.as_secs_f64(),
            });
        }
        backoff.sleep(deadline);
    }
}

/// File name of the per-item checksum sidecar, `<dir>/.shardwise/checksums`: MessagePack of
/// [`Checksums`]. torch and Megatron never open it; `shardwise verify` does.
pub const CHECKSUMS_FILE: &str = "checksums";

/// CRC-32 of one item's bytes as written; `offsets` is `None` for byte objects.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ItemChecksum {
    pub fqn: String,
    pub offsets: Option<Vec<u64>>,
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
    pub crc32: u32,
}

/// The sidecar written at commit.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Checksums {
    pub save_id: String,
    pub items: Vec<ItemChecksum>,
}

fn checksums(save_id: &str, parts: &[RankPart]) -> Checksums {
    let mut items = Vec::new();
    for p in parts {
        let name = |i: u32| {
            p.files
                .get(i as usize)
                .map(|f| f.name.clone())
                .unwrap_or_default()
        };
        for t in &p.tensors {
            items.push(ItemChecksum {
                fqn: t.fqn.clone(),
                offsets: Some(t.offsets.clone()),
                relative_path: name(t.file),
                offset: t.offset,
                length: t.length,
                crc32: t.crc32,
            });
        }
        for o in &p.objects {
            items.push(ItemChecksum {
                fqn: o.fqn.clone(),
                offsets: None,
                relative_path: name(o.file),
                offset: o.offset,
                length: o.length,
                crc32: o.crc32,
            });
        }
    }
    Checksums {
        save_id: save_id.to_string(),
        items,
    }
}

/// Reads the checksum sidecar of a checkpoint, if it has one.
pub fn read_checksums(dir: &Path) -> Result<Option<Checksums>> {
    let path = dir.join(STATE_DIR).join(CHECKSUMS_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => rmp_serde::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Corrupt {
                path,
                reason: format!("undecodable checksum sidecar: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Io {
            op: "read",
            path,
            source: e,
        }),
    }
}

/// Whether `dir` holds a committed checkpoint: `.metadata` is there and, when shardwise saved into
/// `dir`, one of its saves has its `COMMITTED` marker. A `.metadata` without a marker is the trace of
/// a merger that died mid-commit (the save may be finished by `shardwise merge` or saved again).
/// A directory without `.shardwise` (a torch or Megatron save) is committed by `.metadata` alone.
pub fn is_committed(dir: &Path) -> bool {
    if !dir.join(".metadata").is_file() {
        return false;
    }
    match std::fs::read_dir(dir.join(STATE_DIR)) {
        Err(_) => true,
        Ok(rd) => {
            let saves: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect();
            saves.is_empty() || saves.iter().any(|s| s.join("COMMITTED").exists())
        }
    }
}

/// Summary of a committed save.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CommitSummary {
    /// The save had already been committed (by this or a racing merger); counts are then zero.
    pub already_committed: bool,
    pub keys: usize,
    pub tensor_chunks: usize,
    pub byte_objects: usize,
    pub data_bytes: u64,
    pub metadata_bytes: u64,
    /// The `COMMITTING` lock of a merger that had died was taken over.
    pub took_over_dead_merger: bool,
}

/// Validates the parts and builds the global entries; the checks of DCP's
/// `_validate_global_plan` and Megatron's `validate_sharding_integrity`, done without a collective.
///
/// Errors: [`Error::Validation`] naming keys and ranks.
pub fn build_global(dir: &Path, parts: &[RankPart]) -> Result<BTreeMap<String, Entry>> {
    struct Agg {
        dtype: String,
        shape: Vec<u64>,
        first_rank: u32,
        chunks: Vec<(u32, Chunk)>,
    }
    let megatron = parts.first().map(|p| p.megatron).unwrap_or(false);
    if let Some(p) = parts.iter().find(|p| p.megatron != megatron) {
        return Err(Error::Validation(format!(
            "rank {} disagrees with rank 0 on the Megatron layout flag",
            p.rank
        )));
    }
    // Every data file must still be there with the size its rank published.
    parts.par_iter().try_for_each(|p| {
        for f in p.files.iter().chain(p.common.iter()) {
            let path = dir.join(&f.name);
            let size = std::fs::metadata(&path).map(|m| m.len()).ok();
            if size != Some(f.size) {
                return Err(Error::Validation(format!(
                    "rank {}: data file {} has size {:?}, its part says {} bytes (file replaced or truncated)",
                    p.rank, f.name, size, f.size
                )));
            }
        }
        Ok(())
    })?;
    if megatron && !parts.iter().any(|p| p.common.is_some()) {
        return Err(Error::Validation(
            "no rank wrote common.pt (Megatron loaders require it)".into(),
        ));
    }

    let mut tensors: HashMap<&str, Agg> = HashMap::new();
    let mut objects: HashMap<&str, (u32, &ObjectRecord, StorageInfo)> = HashMap::new();
    for p in parts {
        let file_name = |i: u32| -> Result<&str> {
            p.files
                .get(i as usize)
                .map(|f| f.name.as_str())
                .ok_or_else(|| {
                    Error::Validation(format!(
                        "rank {}: item refers to file #{i}, which the part does not list",
                        p.rank
                    ))
                })
        };
        for t in &p.tensors {
            DType::from_torch_name(&t.dtype)?;
            let storage = StorageInfo {
                relative_path: file_name(t.file)?.to_string(),
                offset: t.offset,
                length: t.length,
            };
            let agg = tensors.entry(t.fqn.as_str()).or_insert_with(|| Agg {
                dtype: t.dtype.clone(),
                shape: t.global_shape.clone(),
                first_rank: p.rank,
                chunks: Vec::new(),
            });
            if agg.dtype != t.dtype || agg.shape != t.global_shape {
                return Err(Error::Validation(format!(
                    "key {}: rank {} saves it as {} {:?}, rank {} as {} {:?}",
                    t.fqn, agg.first_rank, agg.dtype, agg.shape, p.rank, t.dtype, t.global_shape
                )));
            }
            agg.chunks.push((
                p.rank,
                Chunk {
                    offsets: t.offsets.clone(),
                    sizes: t.sizes.clone(),
                    storage,
                },
            ));
        }
        for o in &p.objects {
            let storage = StorageInfo {
                relative_path: file_name(o.file)?.to_string(),
                offset: o.offset,
                length: o.length,
            };
            if let Some((other, _, _)) = objects.get(o.fqn.as_str()) {
                return Err(Error::Validation(format!(
                    "byte object {} is written by ranks {other} and {}; exactly one main replica may save it",
                    o.fqn, p.rank
                )));
            }
            if tensors.contains_key(o.fqn.as_str()) {
                return Err(Error::Validation(format!(
                    "key {} is both a tensor and a byte object",
                    o.fqn
                )));
            }
            objects.insert(o.fqn.as_str(), (p.rank, o, storage));
        }
    }
    if let Some(k) = objects.keys().find(|k| tensors.contains_key(*k)) {
        return Err(Error::Validation(format!(
            "key {k} is both a tensor and a byte object"
        )));
    }

    // Tensors: bounds, overlaps and coverage, per key in parallel.
    let mut checked: Vec<(String, Entry)> = tensors
        .into_par_iter()
        .map(|(fqn, agg)| {
            let refs: Vec<&Chunk> = agg.chunks.iter().map(|(_, c)| c).collect();
            check_layout(fqn, &agg.shape, &refs, &|i| {
                format!("rank {}", agg.chunks[i].0)
            })
            .map_err(Error::Validation)?;
            let dtype = DType::from_torch_name(&agg.dtype)?;
            let chunks = agg.chunks.into_iter().map(|(_, c)| c).collect();
            Ok((
                fqn.to_string(),
                Entry::Tensor {
                    dtype,
                    global_shape: agg.shape,
                    chunks,
                },
            ))
        })
        .collect::<Result<_>>()?;

    check_sharded_objects(objects.values().map(|(r, o, _)| (*r, *o)))?;
    checked.extend(
        objects
            .into_iter()
            .map(|(k, (_, _, storage))| (k.to_string(), Entry::Bytes { storage })),
    );
    Ok(checked.into_iter().collect())
}

/// Every ShardedObject key must be saved at every offset of its global shape, exactly once.
fn check_sharded_objects<'a>(objects: impl Iterator<Item = (u32, &'a ObjectRecord)>) -> Result<()> {
    let mut by_key: HashMap<&str, (Vec<u64>, Vec<Vec<u64>>)> = HashMap::new();
    for (rank, o) in objects {
        let Some(s) = &o.shard else { continue };
        let e = by_key
            .entry(s.key.as_str())
            .or_insert_with(|| (s.global_shape.clone(), Vec::new()));
        if e.0 != s.global_shape {
            return Err(Error::Validation(format!(
                "ShardedObject {}: rank {rank} uses global shape {:?}, another rank {:?}",
                s.key, s.global_shape, e.0
            )));
        }
        e.1.push(s.global_offset.clone());
    }
    for (key, (shape, offsets)) in by_key {
        let total = volume(&shape);
        if offsets.len() as u128 != total {
            let have: std::collections::HashSet<&Vec<u64>> = offsets.iter().collect();
            let mut missing = Vec::new();
            let mut idx = vec![0u64; shape.len()];
            'outer: for _ in 0..total.min(1 << 20) {
                if !have.contains(&idx) && missing.len() < 8 {
                    missing.push(idx.clone());
                }
                for d in (0..shape.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < shape[d] {
                        continue 'outer;
                    }
                    idx[d] = 0;
                }
            }
            return Err(Error::Validation(format!(
                "ShardedObject {key}: {} of {total} shards saved for global shape {shape:?}; missing offsets {missing:?}",
                offsets.len()
            )));
        }
    }
    Ok(())
}

/// The `COMMITTING` lock of one save, held through an advisory `flock` for as long as its holder
/// lives: the kernel drops the `flock` when the holder dies (even by SIGKILL), so a later merger can
/// tell a dead holder from a slow one without any clock or heartbeat.
struct CommitLock {
    path: PathBuf,
    file: std::fs::File,
}

/// What a merger finds at the lock.
enum Lock {
    /// We hold it; `took_over` when a dead merger's lock was taken over.
    Held(CommitLock, bool),
    /// A live merger holds it (or liveness cannot be told on this filesystem).
    Busy,
}

/// `flock(LOCK_EX | LOCK_NB)`: `Some(true)` acquired, `Some(false)` held by a live process,
/// `None` when the filesystem has no `flock` (Lustre without `-o flock`): liveness is then unknown.
fn try_flock(file: &std::fs::File) -> Option<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: plain syscall on an open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Some(true);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EWOULDBLOCK) => Some(false),
        _ => None,
    }
}

fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

impl CommitLock {
    fn record_holder(&mut self) {
        use std::io::{Seek, Write};
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let _ = self.file.set_len(0);
        let _ = self.file.seek(std::io::SeekFrom::Start(0));
        let _ = write!(self.file, "pid {} host {}", std::process::id(), host.trim());
        let _ = self.file.sync_all();
    }

    /// Takes the lock at `path`, or takes over the lock of a dead merger.
    fn acquire(path: &Path) -> Result<Lock> {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => {
                // Blocking: a contender may hold the flock of this still-empty file for a moment
                // (it then backs off). The holder records itself only once it holds the flock.
                use std::os::unix::io::AsRawFd;
                // SAFETY: plain syscall on an open descriptor. Without flock support the lock is
                // still exclusive by its creation; only dead-holder detection is lost.
                unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
                let mut lock = CommitLock {
                    path: path.to_path_buf(),
                    file,
                };
                lock.record_holder();
                Ok(Lock::Held(lock, false))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let Ok(file) = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                else {
                    return Ok(Lock::Busy); // released meanwhile; the caller looks again
                };
                if try_flock(&file) != Some(true) {
                    return Ok(Lock::Busy);
                }
                // We hold the flock of the file we opened; it is a dead holder's lock only if it
                // is still the lock file (not one its holder removed after finishing) and the
                // holder had recorded itself (an empty file may be a holder about to lock it).
                let current = std::fs::metadata(path).ok();
                let ours = file.metadata().ok();
                let still_lock = matches!((&current, &ours), (Some(a), Some(b)) if same_file(a, b));
                let age = ours
                    .as_ref()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.elapsed().ok())
                    .unwrap_or_default();
                let recorded = ours.is_some_and(|m| m.len() > 0);
                if !still_lock || (!recorded && age < Duration::from_secs(10)) {
                    return Ok(Lock::Busy);
                }
                let mut lock = CommitLock {
                    path: path.to_path_buf(),
                    file,
                };
                lock.record_holder();
                Ok(Lock::Held(lock, true))
            }
            Err(e) => Err(Error::Io {
                op: "create",
                path: path.to_path_buf(),
                source: e,
            }),
        }
    }
}

impl Drop for CommitLock {
    fn drop(&mut self) {
        // Remove the name before the flock goes with the descriptor, so no contender can take
        // over a lock whose holder has finished.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether the `COMMITTING` lock of `save_id` is held by a merger that died (its `flock` is free and
/// it had recorded itself). `None` when there is no lock or liveness cannot be told.
pub fn dead_merger(dir: &Path, save_id: &str) -> Option<String> {
    let path = save_dir(dir, save_id).join("COMMITTING");
    let file = std::fs::File::open(&path).ok()?;
    if try_flock(&file)? {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        (!holder.is_empty()).then_some(holder)
    } else {
        None
    }
}

/// Merges the parts of `save_id` in `dir` and commits: the checksum sidecar, `.metadata`
/// (tmp + rename), `metadata.json` for Megatron saves, then the `COMMITTED` marker; then removes
/// temporary files that killed writers left in `dir`.
///
/// Idempotent and safe to race: a merger first takes the `COMMITTING` lock (exclusive create, then
/// an advisory `flock` held while it works); a second merger waits up to `timeout` (at least 10 s)
/// for the first one's outcome and returns it, so exactly one commits and all report success. When
/// the lock holder died (its `flock` is free), a waiting merger takes the lock over and commits
/// itself. On failure a `FAILED` marker with the reason is published (waiting ranks fail fast) and
/// the lock is released, so a later merge can retry.
///
/// Errors: as [`collect_parts`] and [`build_global`], plus [`Error::Io`], and
/// [`Error::NotCommitted`] when the lock holder fails, or is alive but does not finish in time.
pub fn merge(
    dir: &Path,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<CommitSummary> {
    check_save_id(save_id)?;
    let sdir = save_dir(dir, save_id);
    let already = || CommitSummary {
        already_committed: true,
        ..Default::default()
    };
    if sdir.join("COMMITTED").exists() {
        return Ok(already());
    }
    create_dir_all(&sdir)?;
    let lock_path = sdir.join("COMMITTING");
    let wait = timeout.max(Duration::from_secs(10));
    let deadline = Instant::now() + wait;
    let mut backoff = Backoff::new();
    let (lock, took_over) = loop {
        if sdir.join("COMMITTED").exists() {
            return Ok(already());
        }
        match CommitLock::acquire(&lock_path)? {
            Lock::Held(lock, took_over) => break (lock, took_over),
            Lock::Busy => {}
        }
        // Someone else merges: its outcome is ours.
        if let Ok(reason) = std::fs::read_to_string(sdir.join("FAILED")) {
            return Err(Error::NotCommitted {
                dir: dir.to_path_buf(),
                save_id: save_id.into(),
                reason,
            });
        }
        if Instant::now() >= deadline {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(Error::NotCommitted {
                dir: dir.to_path_buf(),
                save_id: save_id.into(),
                reason: format!(
                    "no commit within {:.1}s; another merger ({holder}) holds {} and is alive or \
                     cannot be checked on this filesystem (remove the file if that merger is dead)",
                    wait.as_secs_f64(),
                    lock_path.display()
                ),
            });
        }
        backoff.sleep(deadline);
    };
    let _ = std::fs::remove_file(sdir.join("FAILED"));
    // A merger that died after writing COMMITTED but before removing its lock left nothing to do.
    if sdir.join("COMMITTED").exists() {
        return Ok(already());
    }
    let result = commit_locked(dir, save_id, world_size, timeout).map(|mut s| {
        s.took_over_dead_merger = took_over;
        s
    });
    if let Err(e) = &result {
        let _ = atomic_write(&sdir.join("FAILED"), e.to_string().as_bytes());
    }
    drop(lock);
    result
}

fn commit_locked(
    dir: &Path,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<CommitSummary> {
    let parts = collect_parts(dir, save_id, world_size, timeout)?;
    let global = build_global(dir, &parts)?;
    let megatron = parts.first().is_some_and(|p| p.megatron);
    let meta = emit_metadata(&global);
    let sums = rmp_serde::to_vec(&checksums(save_id, &parts))
        .map_err(|e| Error::InvalidArgument(format!("cannot encode checksums: {e}")))?;
    atomic_write(&dir.join(STATE_DIR).join(CHECKSUMS_FILE), &sums)?;
    atomic_write(&dir.join(".metadata"), &meta)?;
    if megatron {
        atomic_write(
            &dir.join("metadata.json"),
            MEGATRON_METADATA_JSON.as_bytes(),
        )?;
    }
    let mut summary = CommitSummary {
        keys: global.len(),
        metadata_bytes: meta.len() as u64,
        ..Default::default()
    };
    for e in global.values() {
        match e {
            Entry::Tensor { chunks, .. } => summary.tensor_chunks += chunks.len(),
            Entry::Bytes { .. } => summary.byte_objects += 1,
        }
    }
    summary.data_bytes = parts
        .iter()
        .flat_map(|p| p.files.iter())
        .map(|f| f.size)
        .sum();
    atomic_write(&save_dir(dir, save_id).join("COMMITTED"), b"")?;
    fsync_dir(dir)?;
    // Every rank of this save has published its part, so no writer of it is still writing here;
    // what is left are temporary files of processes killed mid-write (this or earlier attempts).
    sweep_temp_files(dir);
    Ok(summary)
}

/// Waits up to `timeout` for the merger to commit `save_id`.
///
/// Errors: [`Error::NotCommitted`] with the merger's reason when it published `FAILED`, or with the
/// ranks whose parts are still missing at the timeout.
pub fn wait_for_commit(
    dir: &Path,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<()> {
    check_save_id(save_id)?;
    let sdir = save_dir(dir, save_id);
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    loop {
        if sdir.join("COMMITTED").exists() {
            return Ok(());
        }
        if let Ok(reason) = std::fs::read_to_string(sdir.join("FAILED")) {
            return Err(Error::NotCommitted {
                dir: dir.to_path_buf(),
                save_id: save_id.into(),
                reason,
            });
        }
        if Instant::now() >= deadline {
            let missing = missing_ranks(dir, save_id, world_size);
            let reason = if let Some(holder) = dead_merger(dir, save_id) {
                format!(
                    "no commit within {:.1}s: the merger ({holder}) died while holding the COMMITTING \
                     lock; `shardwise merge` takes it over",
                    timeout.as_secs_f64()
                )
            } else if missing.is_empty() {
                format!("no commit within {:.1}s although all parts are present (is the merging rank alive?)", timeout.as_secs_f64())
            } else {
                format!(
                    "no commit within {:.1}s; parts still missing from ranks [{}]",
                    timeout.as_secs_f64(),
                    fmt_ranks(&missing)
                )
            };
            return Err(Error::NotCommitted {
                dir: dir.to_path_buf(),
                save_id: save_id.into(),
                reason,
            });
        }
        backoff.sleep(deadline);
    }
}
