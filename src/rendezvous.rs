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
//! On an object store the same names are objects. Parts, `.metadata` and `COMMITTED` are created
//! only-if-absent (`PutMode::Create`): a duplicate rank is refused instead of silently replacing a
//! part, and of racing mergers (which compute byte-identical `.metadata` from the same parts)
//! exactly one creates `COMMITTED`. There is no lock to take over; a merger that died mid-commit
//! is finished by the next merge, which finds the identical `.metadata` already there.
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
use crate::storage::{fsync_dir, sweep_temp_files, Listed, Location};

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

/// `.shardwise/<save_id>`, relative to the checkpoint.
pub fn save_rel(save_id: &str) -> String {
    format!("{STATE_DIR}/{save_id}")
}

/// `.shardwise/<save_id>/<marker>`, relative to the checkpoint.
pub fn marker_rel(save_id: &str, marker: &str) -> String {
    format!("{STATE_DIR}/{save_id}/{marker}")
}

/// `.shardwise/<save_id>/<rank>.part`, relative to the checkpoint.
pub fn part_rel(save_id: &str, rank: u32) -> String {
    format!("{STATE_DIR}/{save_id}/{rank}.part")
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

/// Publishes a rank's part atomically (local: tmp, fsync, rename, directory fsync; object store:
/// create-if-absent). Returns its path inside the checkpoint.
///
/// Errors: [`Error::Validation`] on an object store when the rank's part already exists (two
/// processes saved as the same rank of one save); storage errors.
pub fn write_part(loc: &Location, part: &RankPart) -> Result<String> {
    check_save_id(&part.save_id)?;
    let body = rmp_serde::to_vec(part)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode part: {e}")))?;
    let mut bytes = Vec::with_capacity(body.len() + 12);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    bytes.extend_from_slice(&body);
    let rel = part_rel(&part.save_id, part.rank);
    match loc {
        Location::Local(_) => loc.write(&rel, bytes)?,
        Location::Remote(r) => {
            if !r.put_new(&rel, bytes)? {
                return Err(Error::Validation(format!(
                    "rank {} already published a part for save {} in {loc}: two processes saved as \
                     the same rank (or reuse a save_id: pass a fresh one)",
                    part.rank, part.save_id
                )));
            }
        }
    }
    Ok(rel)
}

/// Reads and checks one part file (`rel` inside the checkpoint).
///
/// Errors: [`Error::Corrupt`] on a bad magic, CRC or encoding; [`Error::Io`]/[`Error::Remote`] if
/// unreadable or gone.
pub fn read_part(loc: &Location, rel: &str) -> Result<RankPart> {
    let bytes = loc.read(rel)?.ok_or_else(|| Error::Io {
        op: "read",
        path: loc.path_of(rel),
        source: std::io::ErrorKind::NotFound.into(),
    })?;
    let corrupt = |reason: String| Error::Corrupt {
        path: loc.path_of(rel),
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
///
/// Errors: storage errors when the save's directory cannot be listed (object store unreachable).
pub fn missing_ranks(loc: &Location, save_id: &str, world_size: u32) -> Result<Vec<u32>> {
    let present = present_ranks(loc, save_id, world_size)?;
    Ok((0..world_size).filter(|&r| !present[r as usize]).collect())
}

/// `present[r]` is true when rank `r` has published its part (one directory listing).
fn present_ranks(loc: &Location, save_id: &str, world_size: u32) -> Result<Vec<bool>> {
    let mut present = vec![false; world_size as usize];
    for (r, _) in listed_parts(loc, save_id)? {
        if r < world_size {
            present[r as usize] = true;
        }
    }
    Ok(present)
}

/// The part files published for `save_id` (one listing), as `(rank, file)`, any rank number.
///
/// Errors: storage errors when the save's directory cannot be listed.
pub fn listed_parts(loc: &Location, save_id: &str) -> Result<Vec<(u32, Listed)>> {
    let (files, _) = loc.list(&save_rel(save_id))?;
    Ok(files
        .into_iter()
        .filter_map(|f| {
            let rank = f.name.strip_suffix(".part")?.parse::<u32>().ok()?;
            Some((rank, f))
        })
        .collect())
}

/// Waits up to `timeout` for the parts of all `world_size` ranks and reads them. Parts are read as
/// they arrive, so a `world_size` or save-id disagreement fails at once instead of at the timeout.
///
/// Errors: [`Error::MissingRanks`] at the timeout; [`Error::Validation`] when a part disagrees on
/// `world_size`; [`Error::Corrupt`]/[`Error::Io`] for unreadable parts.
pub fn collect_parts(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<Vec<RankPart>> {
    check_save_id(save_id)?;
    let deadline = Instant::now() + timeout;
    let mut parts: Vec<Option<RankPart>> = vec![None; world_size as usize];
    let mut backoff = Backoff::new();
    loop {
        // An unreachable store is retried by the client; what still fails is reported at once.
        let present = present_ranks(loc, save_id, world_size)?;
        let arrived: Vec<u32> = (0..world_size)
            .filter(|&r| present[r as usize] && parts[r as usize].is_none())
            .collect();
        let fresh: Vec<RankPart> = arrived
            .par_iter()
            .map(|&r| read_part(loc, &part_rel(save_id, r)))
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
                dir: loc.display_path(),
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
pub fn read_checksums(loc: &Location) -> Result<Option<Checksums>> {
    let rel = format!("{STATE_DIR}/{CHECKSUMS_FILE}");
    match loc.read(&rel)? {
        Some(bytes) => rmp_serde::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Corrupt {
                path: loc.path_of(&rel),
                reason: format!("undecodable checksum sidecar: {e}"),
            }),
        None => Ok(None),
    }
}

/// Whether `dir` holds a committed checkpoint: `.metadata` is there and, when shardwise saved into
/// `dir`, one of its saves has its `COMMITTED` marker. A `.metadata` without a marker is the trace of
/// a merger that died mid-commit (the save may be finished by `shardwise merge` or saved again).
/// A directory without `.shardwise` (a torch or Megatron save) is committed by `.metadata` alone.
pub fn is_committed(loc: &Location) -> bool {
    if !loc.exists(".metadata") {
        return false;
    }
    match loc.list(STATE_DIR) {
        Err(_) => true,
        Ok((_, saves)) => {
            saves.is_empty()
                || saves
                    .iter()
                    .any(|s| loc.exists(&marker_rel(s, "COMMITTED")))
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
pub fn build_global(loc: &Location, parts: &[RankPart]) -> Result<BTreeMap<String, Entry>> {
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
            let size = loc.size(&f.name).ok().flatten();
            if size != Some(f.size) {
                let found = size.map_or("is missing".to_string(), |s| format!("has {s} bytes"));
                return Err(Error::Validation(format!(
                    "rank {}: data file {} {found}, its part says {} bytes (file replaced or truncated)",
                    p.rank, f.name, f.size
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
/// it had recorded itself). `None` when there is no lock, liveness cannot be told, or `loc` is an
/// object store (which has no lock).
pub fn dead_merger(loc: &Location, save_id: &str) -> Option<String> {
    let path = save_dir(loc.as_local()?, save_id).join("COMMITTING");
    let file = std::fs::File::open(&path).ok()?;
    if try_flock(&file)? {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        (!holder.is_empty()).then_some(holder)
    } else {
        None
    }
}

fn failed_reason(loc: &Location, save_id: &str) -> Option<String> {
    let bytes = loc.read(&marker_rel(save_id, "FAILED")).ok()??;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

fn not_committed(loc: &Location, save_id: &str, reason: String) -> Error {
    Error::NotCommitted {
        dir: loc.display_path(),
        save_id: save_id.into(),
        reason,
    }
}

/// Merges the parts of `save_id` in `loc` and commits: the checksum sidecar, `.metadata`,
/// `metadata.json` for Megatron saves, then the `COMMITTED` marker; locally it then removes
/// temporary files that killed writers left in the directory.
///
/// Idempotent and safe to race, so exactly one merger commits and all report success:
/// - local: a merger first takes the `COMMITTING` lock (exclusive create, then an advisory `flock`
///   held while it works); a second merger waits up to `timeout` (at least 10 s) for the first
///   one's outcome and returns it. When the lock holder died (its `flock` is free), a waiting merger
///   takes the lock over and commits itself.
/// - object store: `.metadata` and `COMMITTED` are created only-if-absent; a merger that finds
///   `.metadata` already there checks it is byte-identical to its own, then finishes the commit.
///
/// On failure a `FAILED` marker with the reason is published (waiting ranks fail fast), so a
/// later merge can retry.
///
/// Errors: as [`collect_parts`] and [`build_global`], plus storage errors, and
/// [`Error::NotCommitted`] when the lock holder fails, or is alive but does not finish in time.
pub fn merge(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<CommitSummary> {
    check_save_id(save_id)?;
    if world_size == 0 {
        return Err(Error::InvalidArgument(
            "world_size must be at least 1".into(),
        ));
    }
    let already = || CommitSummary {
        already_committed: true,
        ..Default::default()
    };
    let committed_rel = marker_rel(save_id, "COMMITTED");
    if loc.exists(&committed_rel) {
        return Ok(already());
    }
    let Some(dir) = loc.as_local() else {
        loc.remove(&marker_rel(save_id, "FAILED"))?;
        return commit(loc, save_id, world_size, timeout);
    };
    let sdir = save_dir(dir, save_id);
    crate::storage::create_dir_all(&sdir)?;
    let lock_path = sdir.join("COMMITTING");
    let wait = timeout.max(Duration::from_secs(10));
    let deadline = Instant::now() + wait;
    let mut backoff = Backoff::new();
    let (lock, took_over) = loop {
        if loc.exists(&committed_rel) {
            return Ok(already());
        }
        match CommitLock::acquire(&lock_path)? {
            Lock::Held(lock, took_over) => break (lock, took_over),
            Lock::Busy => {}
        }
        // Someone else merges: its outcome is ours.
        if let Some(reason) = failed_reason(loc, save_id) {
            return Err(not_committed(loc, save_id, reason));
        }
        if Instant::now() >= deadline {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(not_committed(
                loc,
                save_id,
                format!(
                    "no commit within {:.1}s; another merger ({holder}) holds {} and is alive or \
                     cannot be checked on this filesystem (remove the file if that merger is dead)",
                    wait.as_secs_f64(),
                    lock_path.display()
                ),
            ));
        }
        backoff.sleep(deadline);
    };
    let _ = std::fs::remove_file(sdir.join("FAILED"));
    // A merger that died after writing COMMITTED but before removing its lock left nothing to do.
    if loc.exists(&committed_rel) {
        return Ok(already());
    }
    let result = commit(loc, save_id, world_size, timeout).map(|mut s| {
        s.took_over_dead_merger = took_over;
        s
    });
    drop(lock);
    result
}

/// The commit itself, by the lock holder (local) or by every merger (object store). On failure it
/// publishes `FAILED` with the reason, so waiting ranks fail fast.
fn commit(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<CommitSummary> {
    let result = commit_unguarded(loc, save_id, world_size, timeout);
    if let Err(e) = &result {
        let _ = loc.write(&marker_rel(save_id, "FAILED"), e.to_string().into_bytes());
    }
    result
}

fn commit_unguarded(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<CommitSummary> {
    let parts = collect_parts(loc, save_id, world_size, timeout)?;
    let global = build_global(loc, &parts)?;
    let megatron = parts.first().is_some_and(|p| p.megatron);
    let meta = emit_metadata(&global);
    let sums = rmp_serde::to_vec(&checksums(save_id, &parts))
        .map_err(|e| Error::InvalidArgument(format!("cannot encode checksums: {e}")))?;
    loc.write(&format!("{STATE_DIR}/{CHECKSUMS_FILE}"), sums)?;
    let mut summary = CommitSummary {
        keys: global.len(),
        metadata_bytes: meta.len() as u64,
        ..Default::default()
    };
    match loc {
        Location::Local(_) => loc.write(".metadata", meta)?,
        Location::Remote(r) => {
            if !r.put_new(".metadata", meta.clone())? && loc.read(".metadata")? != Some(meta) {
                return Err(Error::Validation(format!(
                    "{loc} already holds a different .metadata (another save's); nothing committed"
                )));
            }
        }
    }
    if megatron {
        loc.write("metadata.json", MEGATRON_METADATA_JSON.as_bytes().to_vec())?;
    }
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
    let committed_rel = marker_rel(save_id, "COMMITTED");
    match loc {
        Location::Local(dir) => {
            loc.write(&committed_rel, Vec::new())?;
            fsync_dir(dir)?;
            // Every rank of this save has published its part, so no writer of it is still writing
            // here; what is left are temporary files of processes killed mid-write.
            sweep_temp_files(dir);
        }
        Location::Remote(r) => {
            if !r.put_new(&committed_rel, Vec::new())? {
                // A racing merger created the marker first: the commit is its.
                return Ok(CommitSummary {
                    already_committed: true,
                    ..Default::default()
                });
            }
        }
    }
    Ok(summary)
}

/// Waits up to `timeout` for the merger to commit `save_id`.
///
/// Errors: [`Error::NotCommitted`] with the merger's reason when it published `FAILED`, or with the
/// ranks whose parts are still missing at the timeout.
pub fn wait_for_commit(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
) -> Result<()> {
    check_save_id(save_id)?;
    let committed_rel = marker_rel(save_id, "COMMITTED");
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    loop {
        if loc.exists(&committed_rel) {
            return Ok(());
        }
        if let Some(reason) = failed_reason(loc, save_id) {
            return Err(not_committed(loc, save_id, reason));
        }
        if Instant::now() >= deadline {
            let t = timeout.as_secs_f64();
            let missing = match missing_ranks(loc, save_id, world_size) {
                Ok(m) => m,
                Err(e) => {
                    let reason =
                        format!("no commit within {t:.1}s, and the parts cannot be listed: {e}");
                    return Err(not_committed(loc, save_id, reason));
                }
            };
            let reason = if let Some(holder) = dead_merger(loc, save_id) {
                format!(
                    "no commit within {t:.1}s: the merger ({holder}) died while holding the \
                     COMMITTING lock; `shardwise merge` takes it over"
                )
            } else if missing.is_empty() {
                format!("no commit within {t:.1}s although all parts are present (is the merging rank alive?)")
            } else {
                format!(
                    "no commit within {t:.1}s; parts still missing from ranks [{}]",
                    fmt_ranks(&missing)
                )
            };
            return Err(not_committed(loc, save_id, reason));
        }
        backoff.sleep(deadline);
    }
}
