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
//! The commit is a sequence of named steps, called in order by [`commit_unguarded`]; the numbers
//! are those of the steps table in docs/guarantees.md, which says what a crash at each one leaves:
//!
//! 5. (Locally, [`merge`] has taken the `COMMITTING` lock.) [`collect_and_validate`]: a current
//!    part of every rank, each folded into the global index as it is read, the whole validated,
//!    every data file still the one its part names, a Megatron save's `common.pt` there and the
//!    ranks agreed on the integrity manifest ([`gather`]).
//! 6. [`encode`]: the checksum sidecar and `.metadata`, encoded at once and streamed to storage as
//!    they are made ([`Location::create_streamed`]): the sidecar is published, `.metadata` only
//!    staged (written and fsynced under a temporary name); then [`place_common`]: rank 0's staged
//!    `common.pt` renamed into place; then [`publish_metadata`]: `.metadata` under its name (rename
//!    and directory fsync; object store: created only if absent).
//! 7. [`write_megatron_files`]: `metadata.json` (Megatron saves), then `integrity.json` (saves with
//!    `integrity`; otherwise one left by a checkpoint this commit replaces is removed).
//! 8. [`write_record`]: the `COMMITTED` record, then a directory fsync; a directory is committed
//!    only once that record matches its `.metadata` ([`state`]). Then [`tidy`]: temporary files of
//!    killed writers, the state of other saves and data files the commit does not name go.
//!
//! A step that fails ends the commit: [`commit`] publishes `FAILED` with the reason, and a
//! `.metadata` still staged is removed (nothing committed). A save with `overwrite` writes its
//! data under file names the committed checkpoint does not use, so the old checkpoint stays
//! loadable until the new `.metadata` replaces it; its files are removed after the commit.
//!
//! On an object store the same names are objects. Parts, `.metadata` and `COMMITTED` are created
//! only-if-absent: a duplicate rank is refused instead of silently replacing a part, and of racing
//! mergers (which compute byte-identical `.metadata` from the same parts) exactly one creates
//! `COMMITTED`. There is no lock to take over; a merger that died mid-commit is finished by the
//! next merge, which finds the identical `.metadata` already there. Locally, parts are created
//! only-if-absent too (hard link of a temporary file).

pub mod attempt;
mod gather;
pub mod liveness;
pub mod lock;
pub mod manifest;
pub mod part;
pub mod record;
pub mod state;
pub mod validate;
pub mod wait;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::format::metadata::{write_metadata, MetadataSource};
use crate::format::sidecar::{self, Checksums, CHECKSUMS_FILE};
use crate::format::METADATA_FILE;
use crate::format::{COMMON_FILE, MEGATRON_METADATA_JSON, METADATA_JSON_FILE};
use crate::storage::{Location, Mode, Staged};
use gather::{collect_and_validate, Validated};
use liveness::now_ns;
use lock::{CommitLock, Lock};
use manifest::Manifest;
use part::{
    check_save_id, marker_rel, publish_failed, read_failed, save_rel, FileRecord, Marker, RankPart,
    STATE_DIR,
};
pub use record::CommitSummary;
use record::{not_committed, read_commit_record, CommitRecord, Digest, Digester};
use state::{CheckpointState, MetadataWriter};
use wait::{Backoff, Freshness};

/// Reads the checksum sidecar of the save that committed the checkpoint's current `.metadata`,
/// `writer` ([`state::metadata_writer`]), if it has one; `.shardwise/checksums` of shardwise < 0.2
/// when there is no record at all. None when another writer (torch, Megatron) replaced the
/// `.metadata` a record describes: its sidecar would describe other bytes.
///
/// Errors: [`Error::Corrupt`] for an undecodable sidecar; storage errors.
pub fn read_checksums(loc: &Location, writer: &MetadataWriter) -> Result<Option<Checksums>> {
    let rel = match writer {
        MetadataWriter::Commit(r) => marker_rel(&r.save_id, CHECKSUMS_FILE),
        MetadataWriter::Unrecorded => format!("{STATE_DIR}/{CHECKSUMS_FILE}"),
        MetadataWriter::Replaced(_) => return Ok(None),
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
    let sums = |loc: &Location| -> Result<Option<Checksums>> {
        let Some(meta) = loc.read_held(METADATA_FILE)? else {
            return Ok(None);
        };
        read_checksums(loc, &state::metadata_writer(loc, &meta)?)
    };
    let (Some(a), Some(b)) = (sums(a)?, sums(b)?) else {
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

/// The most ranks a save may declare. Per-rank tables (the parts waited for, their states) are
/// sized by `world_size` before any part is read, so an absurd one (10^9 from a typo, a hostile
/// argument) must be an error, not an allocation of 224 GB; no job has a million ranks.
pub const MAX_WORLD_SIZE: u32 = 1 << 20;

/// `world_size` is at least 1 and at most [`MAX_WORLD_SIZE`].
///
/// Errors: [`Error::InvalidArgument`] naming it.
pub fn check_world_size(world_size: u32) -> Result<()> {
    if world_size == 0 || world_size > MAX_WORLD_SIZE {
        return Err(Error::InvalidArgument(format!(
            "world_size {world_size} is not in 1..={MAX_WORLD_SIZE}"
        )));
    }
    Ok(())
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
    merge_or_rebuild(loc, save_id, world_size, timeout, fresh, false)
}

/// [`merge`], or with `rebuild` the commit made again although `save_id`'s record is there
/// ([`repair`]: the record stays until the new one replaces it).
fn merge_or_rebuild(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
    rebuild: bool,
) -> Result<CommitSummary> {
    check_save_id(save_id)?;
    check_world_size(world_size)?;
    let current_commit = |loc: &Location, save_id: &str, fresh: &Freshness| {
        current_commit(loc, save_id, fresh).filter(|_| !rebuild)
    };
    if let Some(done) = current_commit(loc, save_id, fresh) {
        return Ok(done);
    }
    let Some(lock_path) = lock::lock_path(loc, save_id) else {
        return commit(loc, save_id, world_size, timeout, fresh, Publish::Racing);
    };
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
    let result = commit(loc, save_id, world_size, timeout, fresh, Publish::Locked).map(|mut s| {
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
/// Errors: [`Error::InvalidArgument`], with nothing changed, when `loc` is not damaged or no save's
/// parts can rebuild it (`state::unmergeable`: a data file that is not the one its part recorded
/// is named); [`Error::Io`] when `loc` is missing or not a directory; the errors of [`merge`].
pub fn repair(loc: &Location, timeout: Duration) -> Result<(String, CommitSummary)> {
    // A file given for the directory is refused as not a checkpoint directory, rather than
    // failing the listing of a path under it.
    loc.canonical()?;
    let save_id = match state::checkpoint_state(loc)? {
        CheckpointState::Damaged {
            repairable: Some(id),
            ..
        } => id,
        CheckpointState::Damaged { reason, .. } => {
            return Err(Error::InvalidArgument(format!(
                "{loc} is damaged ({reason}); `merge --repair` trusts only what a save's parts \
                 vouch for: every rank's part readable and its files unchanged (size and \
                 modification time, or ETag) since it was published: nothing changed"
            )))
        }
        CheckpointState::Committed { .. } => {
            // What the state checked, no more: the data's bytes were not read, and `--repair`
            // rebuilds only the commit's own files from the parts, never data.
            return Err(Error::InvalidArgument(format!(
                "{loc} is committed: its .metadata and common.pt are the ones its commit \
                 recorded (same size and CRC-32, or the storage stamp the commit saw: size and \
                 modification time, or ETag) and every data file has at least its recorded size, \
                 so there is nothing `merge --repair` rebuilds (it rewrites .metadata and the \
                 commit record from the parts, never data); the data's CRC-32s were not read: \
                 `shardwise verify {loc}` checks them"
            )));
        }
        CheckpointState::NotCommitted { reason } => {
            return Err(Error::InvalidArgument(format!(
                "{loc} holds no committed checkpoint to repair ({reason})"
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
    // Locally the record stays until the rebuilt commit replaces it, so a crash mid-repair leaves
    // the checkpoint damaged and repairable, or repaired (tests/crashpoints.rs). Object stores
    // create the record only if absent: it goes first there.
    if !loc.can_replace_atomically() {
        loc.remove(&Marker::Committed.rel(&save_id))?;
    }
    let fresh = Freshness::any_part();
    let summary = merge_or_rebuild(loc, &save_id, world_size, timeout, &fresh, true)?;
    Ok((save_id, summary))
}

/// How a merger publishes the commit's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Publish {
    /// It holds the local `COMMITTING` lock: files an earlier attempt left are replaced.
    Locked,
    /// No lock exists (object stores): `.metadata` and `COMMITTED` are created only if absent, so
    /// of racing mergers exactly one commits, and a `.metadata` already there must be identical.
    Racing,
}

impl Publish {
    /// How `.metadata` is published: replacing an earlier attempt's (locked), or only if absent.
    fn mode(self) -> Mode {
        match self {
            Publish::Locked => Mode::Replace,
            Publish::Racing => Mode::CreateNew,
        }
    }
}

/// The commit itself, by the lock holder (local) or by every merger (object store). On failure it
/// publishes `FAILED` with the reason, so waiting ranks fail fast.
fn commit(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
    publish: Publish,
) -> Result<CommitSummary> {
    let result = commit_unguarded(loc, save_id, world_size, timeout, fresh, publish);
    let result = result.map_err(|e| match e {
        Error::Validation(m) => Error::Validation(format!("{m}; nothing committed")),
        other => other,
    });
    if let Err(e) = &result {
        publish_failed(loc, save_id, &e.to_string());
    }
    result
}

/// The commit in the order of the module docs, each step a function; [`commit`] publishes `FAILED`
/// when one fails.
fn commit_unguarded(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
    publish: Publish,
) -> Result<CommitSummary> {
    let Validated {
        parts,
        counts,
        global,
        megatron,
        common,
        mut integrity,
    } = collect_and_validate(loc, save_id, world_size, timeout, fresh)?;
    let common = common.as_ref();
    let common_digest = common_digest(loc, common)?;
    let meta = encode(loc, save_id, &global, publish, integrity.is_some())?;
    let record = commit_record(
        save_id,
        &parts,
        &counts,
        &global,
        meta.digest,
        common_digest,
        megatron,
    );
    drop(global);
    complete_manifest(&mut integrity, meta.sha256, megatron);
    place_common(loc, common)?;
    publish_metadata(loc, meta.staged, meta.digest)?;
    write_megatron_files(loc, megatron, integrity)?;
    let record = match write_record(loc, save_id, record, publish)? {
        Recorded::Ours(record) => record,
        Recorded::Theirs(summary) => return Ok(summary),
    };
    tidy(loc, save_id, &record);
    Ok(record.summary)
}

/// The digest of `common`'s bytes, read where it is staged, or in place (an earlier attempt of
/// this commit renamed it already, or an object store writes it there).
///
/// Errors: storage errors.
fn common_digest(loc: &Location, common: Option<&FileRecord>) -> Result<Option<Digest>> {
    let Some(c) = common else {
        return Ok(None);
    };
    let bytes = match loc.read(&c.name)? {
        Some(b) => b,
        None => loc.read(COMMON_FILE)?.unwrap_or_default(),
    };
    Ok(Some(Digest::of(&bytes)))
}

/// What [`encode`] gives: `.metadata`, made and durable but not yet under its name, with its digest
/// (and SHA-256 when the commit writes a manifest).
struct Encoded<'a> {
    staged: Staged<'a>,
    digest: Digest,
    sha256: Option<String>,
}

/// Step 6: the checksum sidecar and `.metadata` are encoded at once, on two threads, each
/// written to storage as it is made (at scale each is about 1 GB). The sidecar is published;
/// `.metadata` is staged, and published in its turn ([`publish_metadata`]).
///
/// Errors: storage errors (the sidecar's first).
fn encode<'a>(
    loc: &'a Location,
    save_id: &str,
    global: &validate::Global,
    publish: Publish,
    sha256: bool,
) -> Result<Encoded<'a>> {
    let (sums, meta) = std::thread::scope(|s| {
        let sums = s.spawn(|| -> Result<()> {
            let rel = marker_rel(save_id, CHECKSUMS_FILE);
            let mut sink = loc.create_streamed(&rel, Mode::Replace)?;
            global.write_checksums(save_id, &mut |b| sink.write(b))?;
            sink.finish()?.publish().map(|_| ())
        });
        let meta = (|| -> Result<_> {
            let mut sink = loc.create_streamed(METADATA_FILE, publish.mode())?;
            let mut digest = Digester::new(sha256);
            write_metadata(global, &mut |b| {
                digest.update(b);
                sink.write(b)
            })?;
            Ok((sink.finish()?, digest.finish()))
        })();
        let sums = sums
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (sums, meta)
    });
    sums?;
    let (staged, (digest, sha256)) = meta?;
    Ok(Encoded {
        staged,
        digest,
        sha256,
    })
}

/// Adds the commit's own top-level files to the manifest, when the save asked for one: `.metadata`
/// (`meta_sha256`) and, for Megatron saves, `metadata.json`. Pure.
fn complete_manifest(
    integrity: &mut Option<Manifest>,
    meta_sha256: Option<String>,
    megatron: bool,
) {
    if let (Some(m), Some(sha)) = (integrity, meta_sha256) {
        m.add(METADATA_FILE, sha);
        if megatron {
            m.add(
                METADATA_JSON_FILE,
                manifest::sha256_hex(MEGATRON_METADATA_JSON.as_bytes()),
            );
        }
    }
}

/// Step 6: rank 0's `common.pt` renamed into place from where it was staged (see
/// `attempt`), so an overwritten checkpoint keeps its common state until this commit. Nothing to
/// do when it was written in place (object stores) or an earlier attempt renamed it.
///
/// Errors: storage errors.
fn place_common(loc: &Location, common: Option<&FileRecord>) -> Result<()> {
    if let Some(c) = common.filter(|c| c.name != COMMON_FILE && loc.exists(&c.name)) {
        loc.rename(&c.name, COMMON_FILE)?;
    }
    Ok(())
}

/// Step 6: `.metadata` published under its name (locally a rename and a directory fsync).
///
/// Errors: storage errors; [`Error::Validation`] when racing (object store) and a different
/// `.metadata` is already there.
fn publish_metadata(loc: &Location, staged: Staged, digest: Digest) -> Result<()> {
    if !staged.publish()? {
        // Racing (object store): a merger of the same parts made the same bytes; anything else
        // is another save's (compared by size and CRC-32, as a record is with its `.metadata`).
        let there = loc.read(METADATA_FILE)?.map(|b| Digest::of(&b));
        if there != Some(digest) {
            return Err(Error::Validation(format!(
                "{loc} already holds a different .metadata (another save's); nothing committed"
            )));
        }
    }
    Ok(())
}

/// Step 7: `metadata.json` (Megatron saves), then the manifest.
///
/// Errors: storage errors.
fn write_megatron_files(loc: &Location, megatron: bool, integrity: Option<Manifest>) -> Result<()> {
    if megatron {
        loc.write(
            METADATA_JSON_FILE,
            MEGATRON_METADATA_JSON.as_bytes().to_vec(),
        )?;
    }
    write_integrity(loc, integrity.map(|m| m.encode()).transpose()?)
}

/// Who created the `COMMITTED` record ([`write_record`]).
enum Recorded {
    /// This merger: the record it wrote.
    Ours(CommitRecord),
    /// A racing merger (object store), first: the summary of its commit.
    Theirs(CommitSummary),
}

/// Step 8: the `COMMITTED` record, stamped with the files as they now are, then a directory fsync.
///
/// Errors: storage errors.
fn write_record(
    loc: &Location,
    save_id: &str,
    mut record: CommitRecord,
    publish: Publish,
) -> Result<Recorded> {
    let committed_rel = Marker::Committed.rel(save_id);
    record.stamp_files(loc)?;
    let record_bytes = record.to_json()?;
    match publish {
        // A COMMITTED here is an earlier attempt's, replaced.
        Publish::Locked => loc.write(&committed_rel, record_bytes)?,
        Publish::Racing => {
            if !loc.write_new(&committed_rel, record_bytes)? {
                // A racing merger created the marker first: the commit is its.
                return Ok(Recorded::Theirs(theirs(read_commit_record(loc, save_id))));
            }
        }
    }
    loc.sync_dir()?;
    Ok(Recorded::Ours(record))
}

/// The summary a merger that lost the race reports: the winner's record's, if it can be read.
/// Pure.
fn theirs(record: Option<CommitRecord>) -> CommitSummary {
    record
        .map(|r| CommitSummary {
            already_committed: true,
            ..r.summary
        })
        .unwrap_or(CommitSummary {
            already_committed: true,
            ..Default::default()
        })
}

/// Step 8: what the commit made dead weight goes. Best effort.
fn tidy(loc: &Location, save_id: &str, record: &CommitRecord) {
    // Every rank of this save has published its part, so no writer of it is still writing here;
    // what is left are temporary files of processes killed mid-write.
    loc.sweep_temp_files();
    remove_superseded(loc, save_id, record);
}

/// Writes the manifest, or removes one left by a checkpoint this commit replaces (its digests
/// would not match the new files; only where checkpoints can be replaced: object-store prefixes
/// are never overwritten).
fn write_integrity(loc: &Location, bytes: Option<Vec<u8>>) -> Result<()> {
    match bytes {
        Some(m) => loc.write(manifest::INTEGRITY_FILE, m),
        None => loc.remove_replaced(manifest::INTEGRITY_FILE),
    }
}

/// The record of this commit; `counts` is each rank's (tensor chunks, byte objects).
fn commit_record(
    save_id: &str,
    parts: &[RankPart],
    counts: &BTreeMap<u32, (usize, usize)>,
    global: &validate::Global,
    meta: Digest,
    common: Option<Digest>,
    megatron: bool,
) -> CommitRecord {
    let (tensor_chunks, byte_objects) = global.counts();
    let mut summary = CommitSummary {
        keys: global.keys(),
        tensor_chunks,
        byte_objects,
        metadata_bytes: meta.size,
        ..Default::default()
    };
    let files: Vec<(String, u64)> = parts
        .iter()
        .flat_map(|p| p.files.iter())
        .map(|f| (f.name.clone(), f.size))
        .collect();
    summary.data_bytes = files.iter().map(|(_, s)| s).sum();
    let ranks = parts
        .iter()
        .map(|p| {
            let (tensor_chunks, byte_objects) = counts.get(&p.rank).copied().unwrap_or_default();
            record::RankLayout {
                rank: p.rank,
                tensor_chunks,
                byte_objects,
                bytes: p.files.iter().map(|f| f.size).sum(),
                files: p.files.iter().map(|f| f.name.clone()).collect(),
                common: p.common.is_some(),
            }
        })
        .collect();
    CommitRecord {
        save_id: save_id.to_string(),
        committed_at_ns: now_ns(),
        metadata: meta,
        common,
        megatron,
        files,
        summary,
        // Set once the files are written (`stamp_files`).
        metadata_stamp: None,
        common_stamp: None,
        layout: Some(record::SaveLayout {
            tensor_keys: global.tensor_keys(),
            ranks,
        }),
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

/// Saves made of parts alone, for the unit tests of the commit protocol: each rank's data file is
/// plain bytes (a merge never reads data files, only their storage stamps).
#[cfg(test)]
pub(crate) mod testing {
    use super::part::{write_part, FileRecord, RankPart, TensorRecord, PART_FORMAT};
    use super::*;

    /// Bytes of each rank's data file; its one item is bytes 8..72.
    pub const DATA_BYTES: usize = 80;

    /// Publishes rank `rank`'s part of save `save_id` (`world_size` ranks, each saving rows
    /// `rank*2..rank*2+2` of an 8-bit tensor `w` of shape `[2 * world_size]`), after writing its
    /// data file (and, for rank 0 of a Megatron save, the staged `common.pt`).
    pub fn publish(loc: &Location, save_id: &str, rank: u32, world_size: u32, megatron: bool) {
        let name = format!("__{rank}_0.distcp");
        loc.create_dir().unwrap();
        loc.write(&name, vec![rank as u8; DATA_BYTES]).unwrap();
        let common = (megatron && rank == 0).then(|| {
            let rel = loc.stage_rel(marker_rel(save_id, COMMON_FILE), COMMON_FILE);
            loc.write(&rel, b"PK common".to_vec()).unwrap();
            FileRecord {
                stamp: loc.stamp(&rel).unwrap().unwrap(),
                name: rel,
                size: 9,
                sha256: None,
            }
        });
        let part = RankPart {
            format: PART_FORMAT,
            save_id: save_id.into(),
            rank,
            world_size,
            megatron,
            published_at_ns: now_ns(),
            publisher: liveness::publisher(),
            files: vec![FileRecord {
                stamp: loc.stamp(&name).unwrap().unwrap(),
                name,
                size: DATA_BYTES as u64,
                sha256: None,
            }],
            tensors: vec![TensorRecord {
                fqn: "w".into(),
                dtype: "torch.uint8".into(),
                global_shape: vec![2 * world_size as u64],
                offsets: vec![2 * rank as u64],
                sizes: vec![2],
                file: 0,
                offset: 8,
                length: 64,
                crc32: rank,
                blocks: vec![],
            }],
            objects: vec![],
            common,
        };
        write_part(loc, &part).unwrap();
    }

    /// A save of `world_size` ranks, published and merged.
    pub fn committed(
        loc: &Location,
        save_id: &str,
        world_size: u32,
        megatron: bool,
    ) -> CommitSummary {
        for r in 0..world_size {
            publish(loc, save_id, r, world_size, megatron);
        }
        merge(
            loc,
            save_id,
            world_size,
            Duration::from_secs(10),
            &Freshness::any_part(),
        )
        .unwrap()
    }

    /// A fresh `memory://` location.
    pub fn memory(name: &str) -> Location {
        Location::parse(&format!("memory://commit-tests/{name}-{}", now_ns())).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::gather::{common_state, CommonState};
    use super::testing::{committed, memory, publish};
    use super::*;

    #[test]
    fn a_merge_commits_once_and_a_second_reports_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        let first = committed(&loc, "s", 2, true);
        assert_eq!(
            (first.already_committed, first.keys, first.tensor_chunks),
            (false, 1, 2)
        );
        assert_eq!(first.data_bytes, 2 * testing::DATA_BYTES as u64);
        // The staged common state was renamed into place, and the record names every file.
        assert!(loc.exists(COMMON_FILE) && !loc.exists(&marker_rel("s", COMMON_FILE)));
        let record = read_commit_record(&loc, "s").unwrap();
        assert_eq!(record.files.len(), 2);
        assert!(record.megatron && record.common.is_some());
        // The layout `status` reads instead of the parts: per rank, as the parts held it.
        let layout = record.layout.unwrap();
        assert_eq!(layout.tensor_keys, 1);
        let rank = |r: u32| record::RankLayout {
            rank: r,
            tensor_chunks: 1,
            byte_objects: 0,
            bytes: testing::DATA_BYTES as u64,
            files: vec![format!("__{r}_0.distcp")],
            common: r == 0,
        };
        assert_eq!(layout.ranks, vec![rank(0), rank(1)]);
        let again = merge(&loc, "s", 2, Duration::from_secs(1), &Freshness::any_part()).unwrap();
        assert!(again.already_committed);
        assert_eq!((again.keys, again.tensor_chunks), (1, 2));
    }

    /// A merge that misses a rank fails at its timeout naming the rank, and publishes FAILED so
    /// that a waiting rank fails at once with the merger's reason.
    #[test]
    fn a_missing_rank_fails_the_merge_and_the_waiters_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 0, 2, false);
        let fresh = Freshness::any_part();
        let e = merge(&loc, "s", 2, Duration::from_millis(50), &fresh).unwrap_err();
        assert!(
            matches!(&e, Error::MissingRanks { missing, world_size: 2, .. } if missing == &[1]),
            "{e}"
        );
        assert!(part::read_failed(&loc, "s").is_some());
        let t0 = Instant::now();
        let waited = wait::wait_for_commit(&loc, "s", 2, Duration::from_secs(30), &fresh);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a FAILED marker ends the wait"
        );
        assert!(
            matches!(&waited, Err(Error::NotCommitted { reason, .. }) if reason.contains("ranks [1]")),
            "{waited:?}"
        );
        assert!(!loc.exists(METADATA_FILE), "nothing committed");
    }

    /// A waiting rank returns once the commit is there, and at its timeout names the missing
    /// ranks; a commit older than the attempt does not count.
    #[test]
    fn wait_for_commit_sees_only_this_attempts_commit() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 1, 3, false);
        let short = Duration::from_millis(30);
        let e = wait::wait_for_commit(&loc, "s", 3, short, &Freshness::any_part()).unwrap_err();
        assert!(
            matches!(&e, Error::NotCommitted { reason, .. } if reason.contains("parts still missing from ranks [0, 2]")),
            "{e}"
        );
        publish(&loc, "s", 0, 3, false);
        publish(&loc, "s", 2, 3, false);
        merge(&loc, "s", 3, short, &Freshness::any_part()).unwrap();
        wait::wait_for_commit(&loc, "s", 3, short, &Freshness::any_part()).unwrap();
        let later = Freshness {
            since_ns: Some(liveness::now_ns() + 1_000_000_000),
            failed_since_ns: 0,
        };
        assert!(wait::wait_for_commit(&loc, "s", 3, short, &later).is_err());
    }

    /// `n` mergers of save `s` (2 ranks) started at once; their summaries.
    fn race(loc: &Location, n: usize) -> Vec<CommitSummary> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|_| {
                    s.spawn(|| {
                        merge(loc, "s", 2, Duration::from_secs(10), &Freshness::any_part()).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// On an object store there is no lock: racing mergers each publish with create-if-absent,
    /// and exactly one of them commits; the others report its commit.
    #[test]
    fn racing_mergers_on_an_object_store_commit_once() {
        let loc = memory("race");
        for r in 0..2 {
            publish(&loc, "s", r, 2, true);
        }
        let summaries = race(&loc, 4);
        assert_eq!(summaries.iter().filter(|s| !s.already_committed).count(), 1);
        assert!(state::is_committed(&loc));
        assert!(loc.exists(COMMON_FILE), "written in place, no rename");
    }

    /// Local mergers racing for the lock: one commits, the others wait for its outcome.
    #[test]
    fn racing_local_mergers_commit_once() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        for r in 0..2 {
            publish(&loc, "s", r, 2, false);
        }
        let summaries = race(&loc, 4);
        assert_eq!(summaries.iter().filter(|s| !s.already_committed).count(), 1);
        assert!(
            !loc.exists(&Marker::Committing.rel("s")),
            "the lock is gone"
        );
    }

    /// A part of rank `rank` without items: data file `__{rank}_0.distcp` (with a digest when
    /// `sha`), and `common` as the name of its `common.pt`.
    fn bare_part(rank: u32, megatron: bool, common: Option<&str>, sha: bool) -> RankPart {
        let file = |name: &str| FileRecord {
            name: name.into(),
            size: 1,
            stamp: String::new(),
            sha256: sha.then(|| "ab".repeat(32)),
        };
        RankPart {
            format: part::PART_FORMAT,
            save_id: "s".into(),
            rank,
            world_size: 2,
            megatron,
            published_at_ns: 0,
            publisher: String::new(),
            files: vec![file(&format!("__{rank}_0.distcp"))],
            tensors: vec![],
            objects: vec![],
            common: common.map(file),
        }
    }

    /// A Megatron save needs a `common.pt` (any rank's, the first found); another save may have
    /// one or not.
    #[test]
    fn common_state_requires_common_pt_of_megatron_saves_only() {
        let parts = [
            bare_part(0, true, None, false),
            bare_part(1, true, Some("c1"), false),
        ];
        let state = common_state(&parts).unwrap();
        assert!(state.megatron);
        assert_eq!(state.common.map(|c| c.name.as_str()), Some("c1"));
        let none = [bare_part(0, true, None, false)];
        let e = common_state(&none).unwrap_err();
        assert!(
            matches!(&e, Error::Validation(m) if m == "no rank wrote common.pt (Megatron loaders require it)"),
            "{e}"
        );
        let plain = [bare_part(0, false, None, false)];
        assert_eq!(
            common_state(&plain).unwrap(),
            CommonState {
                megatron: false,
                common: None
            }
        );
        assert!(!common_state(&[]).unwrap().megatron);
    }

    /// The manifest's file names, as encoded.
    fn manifest_names(m: &Manifest) -> Vec<String> {
        let json: serde_json::Value = serde_json::from_slice(&m.encode().unwrap()).unwrap();
        json["files"].as_object().unwrap().keys().cloned().collect()
    }

    /// The commit adds `.metadata` (and `metadata.json` for Megatron saves) to a manifest, and
    /// nothing when the save asked for none.
    #[test]
    fn complete_manifest_adds_the_commits_own_files() {
        let parts = [bare_part(0, true, Some(COMMON_FILE), true)];
        let sha = Some("cd".repeat(32));
        let mut megatron = Manifest::of_parts(&parts).unwrap();
        complete_manifest(&mut megatron, sha.clone(), true);
        assert_eq!(
            manifest_names(megatron.as_ref().unwrap()),
            [
                METADATA_FILE,
                "__0_0.distcp",
                COMMON_FILE,
                METADATA_JSON_FILE
            ]
        );
        let mut plain = Manifest::of_parts(&parts).unwrap();
        complete_manifest(&mut plain, sha.clone(), false);
        assert_eq!(
            manifest_names(plain.as_ref().unwrap()),
            [METADATA_FILE, "__0_0.distcp", COMMON_FILE]
        );
        let mut none = None;
        complete_manifest(&mut none, sha, true);
        assert!(none.is_none());
    }

    /// A merger that lost the race reports the winner's counts, or only that it is committed when
    /// the winner's record cannot be read.
    #[test]
    fn a_merger_that_lost_the_race_reports_the_winners_commit() {
        let summary = CommitSummary {
            keys: 3,
            tensor_chunks: 7,
            ..Default::default()
        };
        let record = CommitRecord {
            save_id: "s".into(),
            committed_at_ns: 1,
            metadata: Digest::of(b"m"),
            common: None,
            megatron: false,
            files: vec![],
            summary: summary.clone(),
            metadata_stamp: None,
            common_stamp: None,
            layout: None,
        };
        assert_eq!(
            theirs(Some(record)),
            CommitSummary {
                already_committed: true,
                ..summary
            }
        );
        assert_eq!(
            theirs(None),
            CommitSummary {
                already_committed: true,
                ..Default::default()
            }
        );
        assert_eq!(
            (Publish::Locked.mode(), Publish::Racing.mode()),
            (Mode::Replace, Mode::CreateNew)
        );
    }

    /// Racing on an object store, a merger finds `.metadata` there: the same bytes finish the
    /// commit, other bytes (another save's) refuse it and are left as they are.
    #[test]
    fn publish_metadata_accepts_only_identical_bytes_already_there() {
        let loc = memory("publish");
        let staged = |bytes: &[u8]| {
            let mut sink = loc.create_streamed(METADATA_FILE, Mode::CreateNew).unwrap();
            sink.write(bytes).unwrap();
            sink.finish().unwrap()
        };
        publish_metadata(&loc, staged(b"meta"), Digest::of(b"meta")).unwrap();
        publish_metadata(&loc, staged(b"meta"), Digest::of(b"meta")).unwrap();
        let e = publish_metadata(&loc, staged(b"other"), Digest::of(b"other")).unwrap_err();
        assert!(
            matches!(&e, Error::Validation(m) if m.ends_with("already holds a different .metadata (another save's); nothing committed")),
            "{e}"
        );
        assert_eq!(loc.read(METADATA_FILE).unwrap(), Some(b"meta".to_vec()));
    }

    /// The staged `common.pt` is renamed into place; one already in place (an object store's, or
    /// renamed by an earlier attempt) is left.
    #[test]
    fn place_common_renames_the_staged_common_pt_once() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        let staged = marker_rel("s", COMMON_FILE);
        loc.write(&staged, b"PK new".to_vec()).unwrap();
        let part = bare_part(0, true, Some(&staged), false);
        place_common(&loc, part.common.as_ref()).unwrap();
        assert_eq!(loc.read(COMMON_FILE).unwrap(), Some(b"PK new".to_vec()));
        assert!(!loc.exists(&staged));
        place_common(&loc, part.common.as_ref()).unwrap();
        let in_place = bare_part(0, true, Some(COMMON_FILE), false);
        place_common(&loc, in_place.common.as_ref()).unwrap();
        place_common(&loc, None).unwrap();
        assert_eq!(loc.read(COMMON_FILE).unwrap(), Some(b"PK new".to_vec()));
    }

    /// A data file rewritten after its part was published is not merged: the merge waits past the
    /// stale part and fails naming it.
    #[test]
    fn a_data_file_changed_after_its_part_is_not_merged() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 0, 1, false);
        std::thread::sleep(Duration::from_millis(20));
        loc.write("__0_0.distcp", vec![9; 81]).unwrap();
        let e = merge(
            &loc,
            "s",
            1,
            Duration::from_millis(50),
            &Freshness::any_part(),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::MissingRanks { stale, .. } if stale.len() == 1
                && stale[0].1.contains("__0_0.distcp was replaced or changed")),
            "{e}"
        );
    }
}
