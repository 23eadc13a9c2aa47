//! One rank's collective-free save: write the data file, publish the metadata part, then merge
//! (on the merging rank) or wait for the commit (on the others). No rank ever talks to another.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::rendezvous::{
    self, CommitSummary, FileRecord, ObjectRecord, ObjectShard, RankPart, TensorRecord,
};
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
    /// Replace a committed checkpoint already in `dir`.
    pub overwrite: bool,
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

/// The data file of `rank`: `__{rank}_0.distcp`, the name torch and Megatron use.
pub fn data_file_name(rank: u32) -> String {
    format!("__{rank}_0.distcp")
}

/// Saves this rank's chunks and objects (and `common.pt` when `common` is given) and takes part in
/// the file-based rendezvous.
///
/// Errors: [`Error::InvalidArgument`], [`Error::CheckpointExists`], [`Error::Io`] (unwritable
/// directory, full disk), and the rendezvous errors of [`rendezvous::merge`] /
/// [`rendezvous::wait_for_commit`]. A failed save never writes `.metadata`.
pub fn save_rank(
    opts: &SaveOptions,
    tensors: &[TensorChunk],
    objects: &[ObjectItem],
    common: Option<&[u8]>,
    staging: Option<Staging>,
) -> Result<SaveReport> {
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
    rendezvous::check_save_id(&opts.save_id)?;
    for t in tensors {
        check_chunk(t)?; // before any side effect, so bad input changes nothing on disk
    }
    // One save at a time per process stages and writes; a second one waits here until the first
    // has published its part. The rendezvous wait that follows needs no ticket, so ranks played by
    // one process (tests, tools) cannot block each other.
    let ticket = SaveTicket::acquire();
    let loc = &opts.location;
    let prepared = (|| {
        loc.create_dir()?;
        if loc.exists(".metadata") {
            // A `.metadata` without a COMMITTED marker was left by a merger that died mid-commit:
            // it is no checkpoint, and a rerun replaces it like any other leftover.
            if !opts.overwrite && rendezvous::is_committed(loc) {
                return Err(Error::CheckpointExists(loc.display_path()));
            }
            // Un-commit before touching any data, so the old .metadata never points at new bytes.
            loc.remove("metadata.json")?;
            loc.remove(".metadata")?;
        }
        // State of an earlier attempt with the same save id (a rerun, or an overwrite from a new
        // process whose derived id repeats) is stale: its COMMITTED marker would make the merger
        // skip this commit, and this rank's old part would describe data about to be replaced. No
        // rank of this attempt can have committed yet: the commit needs every rank's part.
        loc.remove(&rendezvous::marker_rel(&opts.save_id, "COMMITTED"))?;
        loc.remove(&rendezvous::part_rel(&opts.save_id, opts.rank))
    })();
    prepared.map_err(|e| rank_error(opts.rank, e))?;

    let t0 = Instant::now();
    let mut report = SaveReport {
        rank: opts.rank,
        save_id: opts.save_id.clone(),
        ..Default::default()
    };
    let mut part = RankPart {
        format: rendezvous::PART_FORMAT,
        save_id: opts.save_id.clone(),
        rank: opts.rank,
        world_size: opts.world_size,
        megatron: opts.megatron,
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
        let name = data_file_name(opts.rank);
        let raw_objects: Vec<ByteObject> = objects
            .iter()
            .map(|o| ByteObject {
                fqn: o.object.fqn.clone(),
                bytes: o.object.bytes,
            })
            .collect();
        let seed = opts.rank as u64;
        let written = match loc {
            Location::Local(dir) => {
                write_rank_file(&dir.join(&name), seed, tensors, &raw_objects, staging)
            }
            Location::Remote(r) => r.upload(&name).and_then(|up| {
                write_rank_object(up, r.part_bytes, seed, tensors, &raw_objects, staging)
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
        });
        report.data_file = Some(name);
        report.data_bytes = written.file_size;
    }
    let published = (|| {
        if let Some(bytes) = common {
            loc.write(rendezvous::COMMON_FILE, bytes.to_vec())?;
            written_files.push(rendezvous::COMMON_FILE.into());
            part.common = Some(FileRecord {
                name: rendezvous::COMMON_FILE.into(),
                size: bytes.len() as u64,
            });
        }
        rendezvous::write_part(loc, &part)
    })();
    if let Err(e) = published {
        // Without a part nothing will ever reference these files; leave no partial save behind.
        for f in &written_files {
            let _ = loc.remove(f);
        }
        return Err(rank_error(opts.rank, e));
    }
    drop(ticket);
    report.write_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    if opts.merge_rank == Some(opts.rank) {
        report.commit = Some(rendezvous::merge(
            loc,
            &opts.save_id,
            opts.world_size,
            opts.timeout,
        )?);
        report.committed = true;
        remove_stale_attempts(loc, &opts.save_id);
    } else if let (true, Some(m)) = (opts.wait_for_commit, opts.merge_rank) {
        rendezvous::wait_for_commit(loc, &opts.save_id, opts.world_size, opts.timeout).map_err(
            |e| match e {
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
            },
        )?;
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

/// After a commit, parts of earlier attempts in the same directory are dead weight: remove them
/// (best effort; they were never merged, because their save id differs).
fn remove_stale_attempts(loc: &Location, keep: &str) {
    if let Ok((_, saves)) = loc.list(rendezvous::STATE_DIR) {
        for id in saves.iter().filter(|id| *id != keep) {
            let _ = loc.remove_dir(&rendezvous::save_rel(id));
        }
    }
}
