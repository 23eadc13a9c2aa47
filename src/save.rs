//! One rank's collective-free save: write the data file, publish the metadata part, then merge
//! (on the merging rank) or wait for the commit (on the others). No rank ever talks to another.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::commit::liveness::{self, now_ns, process_start_ns};
use crate::commit::manifest;
use crate::commit::part::{
    self, marker_rel, part_rel, publish_failed, read_part, FileRecord, ObjectRecord, ObjectShard,
    RankPart, TensorRecord,
};
use crate::commit::state::{checkpoint_state, files_in_use, CheckpointState};
use crate::commit::wait::{wait_for_commit, Freshness};
use crate::commit::{self, CommitSummary};
use crate::error::{Error, Result};
use crate::format::{COMMON_FILE, METADATA_JSON_FILE};
use crate::staging::SaveTicket;
use crate::storage::Location;
use crate::writer::{
    check_chunk, write_rank_file, write_rank_object, ByteObject, Staging, TensorChunk,
};

/// How one rank saves.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// Checkpoint directory (created if absent) or object-store prefix.
    pub location: Location,
    pub rank: u32,
    pub world_size: u32,
    /// Identifies this save attempt; identical on every rank, different for every attempt.
    pub save_id: String,
    /// Write Megatron's `metadata.json` on commit.
    pub megatron: bool,
    /// The rank that merges the parts and commits (`None`: nobody; commit later with `shardwise merge`).
    pub merge_rank: Option<u32>,
    /// Bound on every wait: for all parts (merger) or for the commit (other ranks).
    pub timeout: Duration,
    /// Non-merging ranks wait for the commit before returning.
    pub wait_for_commit: bool,
    /// Replace a committed checkpoint already in `dir` (local directories only). The old
    /// checkpoint stays loadable until the new `.metadata` replaces it.
    pub overwrite: bool,
    /// Which parts and markers in the directory belong to this attempt:
    /// [`Freshness::this_launch`] for a save id that every launch derives alike,
    /// [`Freshness::any_part`] for an explicit one.
    pub freshness: Freshness,
    /// Record the SHA-256 of every file this rank writes, so that the commit writes megatron-core
    /// 0.19's `integrity.json` ([`crate::commit::manifest`]); every rank of a save must agree.
    pub integrity: bool,
}

/// A byte object with its optional ShardedObject position.
pub struct ObjectItem<'a> {
    pub object: ByteObject<'a>,
    pub shard: Option<ObjectShard>,
}

/// What one rank's save did; sizes in bytes, times in seconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SaveReport {
    pub rank: u32,
    pub save_id: String,
    pub data_file: Option<String>,
    pub data_bytes: u64,
    pub write_s: f64,
    pub rendezvous_s: f64,
    pub committed: bool,
    pub commit: Option<CommitSummary>,
}

/// Saves this rank's chunks and objects (and `common.pt` when `common` is given) and takes part in
/// the file-based rendezvous ([`commit`]).
///
/// Errors: [`Error::InvalidArgument`], [`Error::CheckpointExists`], [`Error::Io`] (unwritable
/// directory, full disk), and the errors of [`commit::merge`] / [`wait_for_commit`]. A failed
/// save never writes `.metadata`; when the merging rank fails it publishes `FAILED`, so the other
/// ranks fail within a poll instead of at their timeout.
pub fn save_rank(
    opts: &SaveOptions,
    tensors: &[TensorChunk],
    objects: &[ObjectItem],
    common: Option<&[u8]>,
    staging: Option<Staging>,
) -> Result<SaveReport> {
    check_options(opts)?;
    for t in tensors {
        check_chunk(t)?; // before any side effect, so bad input changes nothing on disk
    }
    // One save at a time per process stages and writes; a second one waits here until the first
    // has published its part. The rendezvous wait that follows needs no ticket, so ranks played by
    // one process (tests, tools) cannot block each other.
    let ticket = SaveTicket::acquire();
    let loc = &opts.location;
    let merger = opts.merge_rank == Some(opts.rank);
    let t0 = Instant::now();
    let published = write_and_publish(opts, tensors, objects, common, staging);
    drop(ticket);
    let mut report = match published {
        Ok(r) => r,
        Err(e) => {
            // The other ranks would wait for this rank's merge until their timeout: tell them.
            if merger && !matches!(e, Error::CheckpointExists(_) | Error::InvalidArgument(_)) {
                publish_failed(
                    loc,
                    &opts.save_id,
                    &format!("the merging rank {} failed: {e}", opts.rank),
                );
            }
            return Err(e);
        }
    };
    report.write_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    if opts.merge_rank == Some(opts.rank) {
        report.commit = Some(commit::merge(
            loc,
            &opts.save_id,
            opts.world_size,
            opts.timeout,
            &opts.freshness,
        )?);
        report.committed = true;
    } else if let (true, Some(m)) = (opts.wait_for_commit, opts.merge_rank) {
        wait_for_commit(
            loc,
            &opts.save_id,
            opts.world_size,
            opts.timeout,
            &opts.freshness,
        )
        .map_err(|e| match e {
            Error::NotCommitted {
                dir,
                save_id,
                reason,
            } => Error::NotCommitted {
                dir,
                save_id,
                reason: format!("{reason} (merging rank {m})"),
            },
            other => other,
        })?;
        report.committed = true;
    }
    report.rendezvous_s = t1.elapsed().as_secs_f64();
    Ok(report)
}

/// Names the rank in an I/O error of its own writes, so a full disk on one node is found at once.
fn rank_error(rank: u32, e: Error) -> Error {
    match e {
        Error::Io { .. } | Error::Remote { .. } => Error::RankStorage {
            rank,
            source: Box::new(e),
        },
        other => other,
    }
}

/// Checks the options that need no storage: rank, world_size, merge_rank, save id.
///
/// Errors: [`Error::InvalidArgument`].
pub fn check_options(opts: &SaveOptions) -> Result<()> {
    if opts.world_size == 0 || opts.rank >= opts.world_size {
        return Err(Error::InvalidArgument(format!(
            "rank {} is not in 0..world_size ({})",
            opts.rank, opts.world_size
        )));
    }
    if let Some(m) = opts.merge_rank.filter(|&m| m >= opts.world_size) {
        return Err(Error::InvalidArgument(format!(
            "merge_rank {m} is not in 0..{}",
            opts.world_size
        )));
    }
    part::check_save_id(&opts.save_id)
}

/// Prepares the directory, writes this rank's data file (and `common.pt` when given) and publishes
/// its part. Returns the report so far.
fn write_and_publish(
    opts: &SaveOptions,
    tensors: &[TensorChunk],
    objects: &[ObjectItem],
    common: Option<&[u8]>,
    staging: Option<Staging>,
) -> Result<SaveReport> {
    let loc = &opts.location;
    let name = prepare(opts).map_err(|e| rank_error(opts.rank, e))?;
    let mut report = SaveReport {
        rank: opts.rank,
        save_id: opts.save_id.clone(),
        ..Default::default()
    };
    let mut part = RankPart {
        format: part::PART_FORMAT,
        save_id: opts.save_id.clone(),
        rank: opts.rank,
        world_size: opts.world_size,
        megatron: opts.megatron,
        published_at_ns: 0,
        publisher: liveness::publisher(),
        files: Vec::new(),
        tensors: Vec::new(),
        objects: Vec::new(),
        common: None,
    };
    // Files this rank wrote for this save, removed again if it fails before publishing its part.
    let mut written_files: Vec<String> = Vec::new();
    let mut staging = staging;
    if tensors.is_empty() && objects.is_empty() {
        if let Some(f) = staging.take().and_then(|s| s.on_staged) {
            f(); // nothing to stage
        }
    }
    if !tensors.is_empty() || !objects.is_empty() {
        let raw_objects: Vec<ByteObject> = objects
            .iter()
            .map(|o| ByteObject {
                fqn: o.object.fqn.clone(),
                bytes: o.object.bytes,
            })
            .collect();
        let seed = opts.rank as u64;
        let written = match loc {
            Location::Local(dir) => write_rank_file(
                &dir.join(&name),
                seed,
                tensors,
                &raw_objects,
                staging,
                opts.integrity,
            ),
            Location::Remote(r) => r.upload(&name).and_then(|up| {
                write_rank_object(
                    up,
                    r.part_bytes,
                    seed,
                    tensors,
                    &raw_objects,
                    staging,
                    opts.integrity,
                )
            }),
        };
        let written = match written {
            Ok(w) => w,
            Err(e) => {
                // A partial data file is never referenced by a part, but would fill the disk
                // that just failed; remove it (best effort). A failed upload left no object.
                if loc.as_local().is_some() {
                    let _ = loc.remove(&name);
                }
                return Err(rank_error(opts.rank, e));
            }
        };
        written_files.push(name.clone());
        for (t, placed) in tensors.iter().zip(&written.tensors) {
            part.tensors.push(TensorRecord {
                fqn: t.fqn.clone(),
                dtype: t.dtype.torch_name().to_string(),
                global_shape: t.global_shape.clone(),
                offsets: t.offsets.clone(),
                sizes: t.sizes.clone(),
                file: 0,
                offset: placed.offset,
                length: placed.length,
                crc32: placed.crc32,
                blocks: placed.blocks.clone(),
            });
        }
        for (o, placed) in objects.iter().zip(&written.objects) {
            part.objects.push(ObjectRecord {
                fqn: o.object.fqn.clone(),
                shard: o.shard.clone(),
                file: 0,
                offset: placed.offset,
                length: placed.length,
                crc32: placed.crc32,
            });
        }
        part.files.push(FileRecord {
            name: name.clone(),
            size: written.file_size,
            stamp: String::new(),
            sha256: written.sha256.as_ref().map(manifest::hex),
        });
        report.data_file = Some(name);
        report.data_bytes = written.file_size;
    }
    let published = (|| {
        if let Some(bytes) = common {
            // Locally staged under the save and renamed into place at commit, so the common
            // state of a committed checkpoint being overwritten stays until the new commit.
            let rel = match loc {
                Location::Local(_) => marker_rel(&opts.save_id, COMMON_FILE),
                Location::Remote(_) => COMMON_FILE.to_string(),
            };
            loc.write(&rel, bytes.to_vec())?;
            written_files.push(rel.clone());
            part.common = Some(FileRecord {
                name: rel,
                size: bytes.len() as u64,
                stamp: String::new(),
                sha256: opts.integrity.then(|| manifest::sha256_hex(bytes)),
            });
        }
        for f in part.files.iter_mut().chain(part.common.iter_mut()) {
            f.stamp = loc.stamp(&f.name)?.unwrap_or_default();
        }
        part.published_at_ns = now_ns();
        part::write_part(loc, &part)
    })();
    if let Err(e) = published {
        // Without a part nothing will ever reference these files; leave no partial save behind.
        for f in &written_files {
            let _ = loc.remove(f);
        }
        return Err(rank_error(opts.rank, e));
    }
    Ok(report)
}

/// Checks what the directory holds before any write and clears what an earlier attempt of this
/// rank left; returns the name of this rank's data file.
///
/// The name is `__{rank}_{n}.distcp` (torch's `FileSystemWriter` names) with the smallest `n` that
/// the committed checkpoint does not read, so an `overwrite` never touches the old checkpoint's
/// files before the new commit (a save into a directory without a checkpoint uses `n` = 0).
fn prepare(opts: &SaveOptions) -> Result<String> {
    let loc = &opts.location;
    loc.create_dir()?;
    let state = checkpoint_state(loc)?;
    match &state {
        CheckpointState::Committed { record } => {
            if !opts.overwrite {
                return Err(Error::CheckpointExists(loc.display_path()));
            }
            if loc.as_local().is_none() {
                return Err(Error::InvalidArgument(format!(
                    "overwrite=True is refused on object stores ({loc}): they cannot switch a checkpoint atomically; save into a new prefix, or delete the old one first"
                )));
            }
            if record.as_ref().is_some_and(|r| r.save_id == opts.save_id) {
                return Err(Error::InvalidArgument(format!(
                    "{loc} is committed by save {}: overwriting it needs a different save id",
                    opts.save_id
                )));
            }
        }
        CheckpointState::Damaged { reason, .. } if !opts.overwrite => {
            return Err(Error::InvalidArgument(format!(
                "{loc} holds a damaged checkpoint ({reason}); `shardwise merge --repair {loc}` rebuilds it, overwrite=True replaces it"
            )));
        }
        CheckpointState::Damaged { .. } => {}
        CheckpointState::NotCommitted { .. } => {
            // A `.metadata` without a commit record was left by a merger that died mid-commit: it
            // is no checkpoint, and this attempt replaces it like any other leftover.
            loc.remove(METADATA_JSON_FILE)?;
            loc.remove(".metadata")?;
        }
    }
    // This rank's part of an earlier attempt with the same save id (by this process, or by one that
    // is gone) describes data about to be replaced. One whose process is alive (on this host), or
    // that another host published while this process runs, means two live processes save as this
    // rank.
    let own = part_rel(&opts.save_id, opts.rank);
    if let Ok(p) = read_part(loc, &own) {
        let other = p.publisher != liveness::publisher();
        if other
            && (liveness::publisher_alive(&p.publisher) || p.published_at_ns >= process_start_ns())
        {
            return Err(Error::Validation(format!(
                "rank {} already published a part for save {} in {loc} (process {}), which is still \
                 running: two processes save as the same rank",
                opts.rank, opts.save_id, p.publisher
            )));
        }
    }
    loc.remove(&own)?;
    let in_use = files_in_use(loc, &state)?;
    let name = (0..)
        .map(|n| format!("__{}_{n}.distcp", opts.rank))
        .find(|n| !in_use.contains(n))
        .expect("an unused name exists");
    Ok(name)
}
