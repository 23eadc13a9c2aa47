//! The commit protocol: each rank publishes a part next to its data; a merging rank (any rank, or
//! the `shardwise merge` CLI) waits for a current part of every rank, validates them and commits
//! the global `.metadata`. No collective is involved, so ranks whose process groups disagree cannot
//! deadlock it; every wait is bounded and names the ranks it is missing.
//!
//! - [`part`]: what a rank publishes and the markers of a save, with their paths;
//! - [`validate`]: pure validation of the parts (no storage);
//! - [`wait`]: bounded, interruptible waits and which parts belong to this attempt ([`Freshness`]);
//! - [`lock`]: the local `COMMITTING` lock;
//! - [`state`]: the one definition of "committed", and the state of each save;
//! - [`record`]: the `COMMITTED` record a commit writes;
//! - [`liveness`]: publication times and whether a publishing process still runs;
//! - [`manifest`]: megatron-core 0.19's `integrity.json`, built from the parts.
//!
//! Commit order (local): checksum sidecar, rank 0's staged `common.pt` renamed into place,
//! `.metadata` (tmp + rename), `metadata.json` (Megatron saves), then the `COMMITTED` record; a
//! directory is committed only once that record matches its `.metadata` ([`state`]). A save with
//! `overwrite` writes its data under file names the committed checkpoint does not use, so the old
//! checkpoint stays loadable until the new `.metadata` replaces it; its files are removed after
//! the commit.
//!
//! On an object store the same names are objects. Parts, `.metadata` and `COMMITTED` are created
//! only-if-absent: a duplicate rank is refused instead of silently replacing a part, and of racing
//! mergers (which compute byte-identical `.metadata` from the same parts) exactly one creates
//! `COMMITTED`. There is no lock to take over; a merger that died mid-commit is finished by the
//! next merge, which finds the identical `.metadata` already there. Locally, parts are created
//! only-if-absent too (hard link of a temporary file).

pub mod liveness;
pub mod lock;
pub mod manifest;
pub mod part;
pub mod record;
pub mod state;
pub mod validate;
pub mod wait;

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::format::metadata::{emit_metadata_from, MetadataSource};
use crate::format::sidecar::{self, Checksums, CHECKSUMS_FILE};
use crate::format::{COMMON_FILE, MEGATRON_METADATA_JSON, METADATA_JSON_FILE};
use crate::storage::{fsync_dir, sweep_temp_files, Location};
use liveness::now_ns;
use lock::{CommitLock, Lock};
use part::{
    check_save_id, marker_rel, publish_failed, read_failed, save_rel, Marker, RankPart, STATE_DIR,
};
pub use record::CommitSummary;
use record::{not_committed, read_commit_record, CommitRecord, Digest};
use state::CheckpointState;
use wait::{collect_parts, stale_reason, Backoff, Freshness};

/// Reads the checksum sidecar of the save that committed the checkpoint's current `.metadata` (the
/// `COMMITTED` record whose `.metadata` size and CRC-32 match), if it has one; `.shardwise/checksums`
/// of shardwise < 0.2 when there is no record at all. None when another writer (torch, Megatron)
/// replaced the `.metadata` a record describes: its sidecar would describe other bytes.
///
/// Errors: [`Error::Corrupt`] for an undecodable sidecar; storage errors.
pub fn read_checksums(loc: &Location) -> Result<Option<Checksums>> {
    let records: Vec<CommitRecord> = state::save_ids(loc)?
        .into_iter()
        .filter_map(|id| read_commit_record(loc, &id))
        .collect();
    let rel = if records.is_empty() {
        format!("{STATE_DIR}/{CHECKSUMS_FILE}")
    } else {
        let Some(meta) = loc.read(".metadata")? else {
            return Ok(None);
        };
        let digest = Digest::of(&meta);
        match records.iter().find(|r| r.metadata == digest) {
            Some(r) => marker_rel(&r.save_id, CHECKSUMS_FILE),
            None => return Ok(None),
        }
    };
    match loc.read(&rel)? {
        Some(bytes) => sidecar::decode(&bytes, loc.path_of(&rel)).map(Some),
        None => Ok(None),
    }
}

/// Whether checkpoints `a` and `b` hold the same tensors bit for bit by their save-time CRC-32s:
/// the same set of tensor chunks (key and global offsets) with equal CRCs, read from the two
/// checksum sidecars alone (no data is read). Byte objects are not compared (RNG states and the
/// like change every save). `None` when either has no sidecar (not saved by shardwise).
///
/// Used to catch saves that did not change (NeMo-RL #3312: every save after the first rewrote the
/// first one's tensors). A CRC-32 match is evidence, not proof, of equal bytes.
///
/// Errors: as [`read_checksums`].
pub fn same_tensor_crcs(a: &Location, b: &Location) -> Result<Option<bool>> {
    let (Some(a), Some(b)) = (read_checksums(a)?, read_checksums(b)?) else {
        return Ok(None);
    };
    let tensors = |c: Checksums| -> std::collections::HashMap<(String, Vec<u64>), u32> {
        c.items
            .into_iter()
            .filter_map(|i| i.offsets.map(|o| ((i.fqn, o), i.crc32)))
            .collect()
    };
    let (a, b) = (tensors(a), tensors(b));
    Ok(Some(!a.is_empty() && a == b))
}

/// The summary of `save_id`'s commit when it is committed by this attempt (see [`Freshness`]).
fn current_commit(loc: &Location, save_id: &str, fresh: &Freshness) -> Option<CommitSummary> {
    read_commit_record(loc, save_id)
        .filter(|r| fresh.commit_is_current(r.committed_at_ns))
        .map(|r| CommitSummary {
            already_committed: true,
            ..r.summary
        })
}

/// Merges the parts of `save_id` in `loc` and commits (see the module docs for the order).
///
/// Idempotent and safe to race, so exactly one merger commits and all report success:
/// - local: a merger first takes the `COMMITTING` lock (exclusive create, then an advisory `flock`
///   held while it works); a second merger waits up to `timeout` (at least 10 s) for the first
///   one's outcome and returns it. When the lock holder died (its `flock` is free), a waiting merger
///   takes the lock over and commits itself.
/// - object store: `.metadata` and `COMMITTED` are created only-if-absent; a merger that finds
///   `.metadata` already there checks it is byte-identical to its own, then finishes the commit.
///
/// Parts and markers of earlier attempts are ignored as `fresh` says. On failure a `FAILED` marker
/// with the reason is published (waiting ranks fail fast), so a later merge can retry.
///
/// Errors: as [`collect_parts`] and [`validate::build_global`], plus storage errors,
/// [`Error::NotCommitted`] when the lock holder fails, or is alive but does not finish in time, and
/// [`Error::Interrupted`].
pub fn merge(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
) -> Result<CommitSummary> {
    check_save_id(save_id)?;
    if world_size == 0 {
        return Err(Error::InvalidArgument(
            "world_size must be at least 1".into(),
        ));
    }
    if let Some(done) = current_commit(loc, save_id, fresh) {
        return Ok(done);
    }
    let Some(dir) = loc.as_local() else {
        return commit(loc, save_id, world_size, timeout, fresh);
    };
    crate::storage::create_dir_all(&dir.join(save_rel(save_id)))?;
    let lock_path = dir.join(Marker::Committing.rel(save_id));
    let wait = timeout.max(Duration::from_secs(10));
    let deadline = Instant::now() + wait;
    let mut backoff = Backoff::new();
    let (lock, took_over) = loop {
        if let Some(done) = current_commit(loc, save_id, fresh) {
            return Ok(done);
        }
        match CommitLock::acquire(&lock_path)? {
            Lock::Held(lock, took_over) => break (lock, took_over),
            Lock::Busy => {}
        }
        // Someone else merges: its outcome is ours (a FAILED of an earlier merge is not).
        if let Some(f) = read_failed(loc, save_id).filter(|f| f.at_ns >= fresh.failed_since_ns) {
            return Err(not_committed(loc, save_id, f.reason));
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
        backoff.sleep(deadline)?;
    };
    loc.remove(&Marker::Failed.rel(save_id))?;
    // A merger that died after writing COMMITTED but before removing its lock left nothing to do.
    if let Some(done) = current_commit(loc, save_id, fresh) {
        return Ok(done);
    }
    let result = commit(loc, save_id, world_size, timeout, fresh).map(|mut s| {
        s.took_over_dead_merger = took_over;
        s
    });
    drop(lock);
    result
}

/// Rebuilds the commit of a damaged checkpoint ([`CheckpointState::Damaged`]) from the parts of
/// the save that committed it, which are kept after a commit: its `.metadata`, `common.pt` name
/// and `COMMITTED` record are written again once every part checks out against its data files.
///
/// Errors: [`Error::InvalidArgument`] when `loc` is not damaged or no save can rebuild it; the
/// errors of [`merge`] (a data file that changed since its part was published is named).
pub fn repair(loc: &Location, timeout: Duration) -> Result<(String, CommitSummary)> {
    let save_id = match state::checkpoint_state(loc)? {
        CheckpointState::Damaged {
            repairable: Some(id),
            ..
        } => id,
        CheckpointState::Damaged { reason, .. } => {
            return Err(Error::InvalidArgument(format!(
                "{loc} is damaged ({reason}) and holds no shardwise save to rebuild it from"
            )))
        }
        CheckpointState::Committed { .. } => {
            return Err(Error::InvalidArgument(format!(
                "{loc} is committed and whole: nothing to repair"
            )))
        }
        CheckpointState::NotCommitted { reason } => {
            return Err(Error::InvalidArgument(format!(
                "{loc} holds no committed checkpoint to repair ({reason}); use `shardwise merge`"
            )))
        }
    };
    let world_size = part::listed_parts(loc, &save_id)?
        .into_iter()
        .find_map(|(r, _)| part::read_part(loc, &part::part_rel(&save_id, r)).ok())
        .map(|p| p.world_size)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "save {save_id} in {loc} has no readable part left to rebuild from"
            ))
        })?;
    loc.remove(&Marker::Committed.rel(&save_id))?;
    let summary = merge(loc, &save_id, world_size, timeout, &Freshness::any_part())?;
    Ok((save_id, summary))
}

/// The commit itself, by the lock holder (local) or by every merger (object store). On failure it
/// publishes `FAILED` with the reason, so waiting ranks fail fast.
fn commit(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
) -> Result<CommitSummary> {
    let result = commit_unguarded(loc, save_id, world_size, timeout, fresh).map_err(|e| match e {
        Error::Validation(m) => Error::Validation(format!("{m}; nothing committed")),
        other => other,
    });
    if let Err(e) = &result {
        publish_failed(loc, save_id, &e.to_string());
    }
    result
}

fn commit_unguarded(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
) -> Result<CommitSummary> {
    use rayon::prelude::*;

    // Each part is folded into the index as it is read, then dropped.
    let fold = validate::Fold::default();
    let parts = collect_parts(loc, save_id, world_size, timeout, fresh, &|p, items| {
        fold.add_part(p, items)
    })?;
    let global = fold.finish(&parts)?;
    // A data file may have been rewritten while the merger waited for the last part.
    let any = Freshness {
        since_ns: None,
        failed_since_ns: 0,
    };
    parts
        .par_iter()
        .try_for_each(|p| match stale_reason(loc, p, &any)? {
            None => Ok(()),
            Some(why) => Err(Error::Validation(format!("rank {}: {why}", p.rank))),
        })?;
    let megatron = parts.first().is_some_and(|p| p.megatron);
    let common = parts.iter().find_map(|p| p.common.as_ref());
    if megatron && common.is_none() {
        return Err(Error::Validation(
            "no rank wrote common.pt (Megatron loaders require it)".into(),
        ));
    }
    let common_digest = match common {
        Some(c) => {
            let bytes = match loc.read(&c.name)? {
                Some(b) => b,
                None => loc.read(COMMON_FILE)?.unwrap_or_default(),
            };
            Some(Digest::of(&bytes))
        }
        None => None,
    };
    // The sidecar is written, and dropped, before `.metadata` is pickled: at scale each is ~1 GB.
    loc.write(
        &marker_rel(save_id, CHECKSUMS_FILE),
        global.checksums(save_id)?,
    )?;
    let meta = emit_metadata_from(&global);
    let record = commit_record(save_id, &parts, &global, &meta, common_digest, megatron);
    drop(global);
    let integrity = integrity_manifest(&parts, &meta, megatron)?;
    let record_bytes = serde_json::to_vec(&record)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode the commit record: {e}")))?;
    let committed_rel = Marker::Committed.rel(save_id);
    match loc {
        Location::Local(dir) => {
            if let Some(c) = common.filter(|c| c.name != COMMON_FILE && loc.exists(&c.name)) {
                loc.rename(&c.name, COMMON_FILE)?;
            }
            loc.write(".metadata", meta)?;
            if megatron {
                loc.write(
                    METADATA_JSON_FILE,
                    MEGATRON_METADATA_JSON.as_bytes().to_vec(),
                )?;
            }
            write_integrity(loc, integrity)?;
            // We hold the lock: a COMMITTED here is an earlier attempt's, replaced.
            loc.write(&committed_rel, record_bytes)?;
            fsync_dir(dir)?;
            // Every rank of this save has published its part, so no writer of it is still writing
            // here; what is left are temporary files of processes killed mid-write.
            sweep_temp_files(dir);
        }
        Location::Remote(r) => {
            if !r.put_new(".metadata", meta.clone())? && loc.read(".metadata")? != Some(meta) {
                return Err(Error::Validation(format!(
                    "{loc} already holds a different .metadata (another save's); nothing committed"
                )));
            }
            if megatron {
                loc.write(
                    METADATA_JSON_FILE,
                    MEGATRON_METADATA_JSON.as_bytes().to_vec(),
                )?;
            }
            write_integrity(loc, integrity)?;
            if !r.put_new(&committed_rel, record_bytes)? {
                // A racing merger created the marker first: the commit is its.
                return Ok(read_commit_record(loc, save_id)
                    .map(|r| CommitSummary {
                        already_committed: true,
                        ..r.summary
                    })
                    .unwrap_or(CommitSummary {
                        already_committed: true,
                        ..Default::default()
                    }));
            }
        }
    }
    remove_superseded(loc, save_id, &record);
    Ok(record.summary)
}

/// megatron-core 0.19's `integrity.json` for this commit, when the ranks recorded digests
/// ([`manifest::manifest`]): their files, `.metadata` and `metadata.json`.
fn integrity_manifest(parts: &[RankPart], meta: &[u8], megatron: bool) -> Result<Option<Vec<u8>>> {
    let mut top: Vec<(&str, &[u8])> = vec![(".metadata", meta)];
    if megatron {
        top.push((METADATA_JSON_FILE, MEGATRON_METADATA_JSON.as_bytes()));
    }
    manifest::manifest(parts, &top)
}

/// Writes the manifest, or removes one left by a local checkpoint this commit replaces (its
/// digests would not match the new files; object-store prefixes are never overwritten).
fn write_integrity(loc: &Location, bytes: Option<Vec<u8>>) -> Result<()> {
    match (bytes, loc) {
        (Some(m), _) => loc.write(manifest::INTEGRITY_FILE, m),
        (None, Location::Local(_)) => loc.remove(manifest::INTEGRITY_FILE),
        (None, Location::Remote(_)) => Ok(()),
    }
}

fn commit_record(
    save_id: &str,
    parts: &[RankPart],
    global: &validate::Global,
    meta: &[u8],
    common: Option<Digest>,
    megatron: bool,
) -> CommitRecord {
    let (tensor_chunks, byte_objects) = global.counts();
    let mut summary = CommitSummary {
        keys: global.keys(),
        tensor_chunks,
        byte_objects,
        metadata_bytes: meta.len() as u64,
        ..Default::default()
    };
    let files: Vec<(String, u64)> = parts
        .iter()
        .flat_map(|p| p.files.iter())
        .map(|f| (f.name.clone(), f.size))
        .collect();
    summary.data_bytes = files.iter().map(|(_, s)| s).sum();
    CommitRecord {
        save_id: save_id.to_string(),
        committed_at_ns: now_ns(),
        metadata: Digest::of(meta),
        common,
        megatron,
        files,
        summary,
    }
}

/// After a commit: the state of every other save in the directory (failed attempts, the save an
/// `overwrite` replaced) and data files the new commit does not name are dead weight. Best effort.
fn remove_superseded(loc: &Location, keep: &str, record: &CommitRecord) {
    if let Ok(ids) = state::save_ids(loc) {
        for id in ids.iter().filter(|id| *id != keep) {
            let _ = loc.remove_dir(&save_rel(id));
        }
    }
    if let Ok((files, _)) = loc.list("") {
        for f in files {
            if state::is_data_file_name(&f.name) && !record.files.iter().any(|(n, _)| *n == f.name)
            {
                let _ = loc.remove(&f.name);
            }
        }
    }
}
