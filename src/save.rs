//! One rank's collective-free save, as named steps (the shape of DCP's `_save_state_dict`):
//! [`check`] the input → [`commit::attempt::begin`] (may this attempt start, under which names) →
//! write the data file and `common.pt` ([`write_files`]: [`write_data`], [`write_common`]; Ctrl-C
//! stops it, nothing published) → [`build_part`] (pure)
//! → publish the part, with a [`Cleanup`] guard removing this rank's files if it fails before →
//! merge (on the merging rank) or wait for the commit (on the others). No rank ever talks to
//! another.

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::commit::attempt::{self, Attempt};
use crate::commit::liveness::{now_ns, publisher};
use crate::commit::manifest;
use crate::commit::part::{
    self, publish_failed, FileRecord, ObjectRecord, ObjectShard, RankPart, TensorRecord,
};
use crate::commit::wait::{wait_for_commit, Freshness};
use crate::commit::{self, CommitSummary};
use crate::error::{Error, Result, Stopped};
use crate::staging::SaveTicket;
use crate::storage::Location;
use crate::writer::{
    check_chunk, write_rank, ByteObject, Staging, TensorChunk, WriteOptions, Written,
};

/// How one rank saves.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// Checkpoint directory (created if absent) or object-store prefix.
    pub location: Location,
    /// This rank, `< world_size`.
    pub rank: u32,
    /// Number of ranks that save.
    pub world_size: u32,
    /// Identifies this save attempt; identical on every rank, different for every attempt (or the
    /// base of such ids, see `derived_save_id`).
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
    /// `save_id` is a base that every rank of a launch derives alike (`default_save_id`), not an
    /// attempt's id: the rank joins an attempt of it ([`attempt::join`]), and parts and markers
    /// written before this process started belong to an earlier launch
    /// ([`Freshness::this_launch`]). False: `save_id` is the attempt's, and any part of it counts
    /// ([`Freshness::any_part`]).
    pub derived_save_id: bool,
    /// Record the SHA-256 of every file this rank writes, so that the commit writes megatron-core
    /// 0.19's `integrity.json` ([`crate::commit::manifest`]); every rank of a save must agree.
    pub integrity: bool,
}

/// A byte object with its optional ShardedObject position.
pub struct ObjectItem<'a> {
    /// The object's bytes and key.
    pub object: ByteObject<'a>,
    /// Its ShardedObject position, when it is one.
    pub shard: Option<ObjectShard>,
}

/// What one rank's save did; sizes in bytes, times in seconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SaveReport {
    /// The rank.
    pub rank: u32,
    /// The save attempt (the directory's next attempt when the id was derived).
    pub save_id: String,
    /// Its data file's name, when it wrote one.
    pub data_file: Option<String>,
    /// Bytes of this rank's data file.
    pub data_bytes: u64,
    pub(crate) write_s: f64,
    pub(crate) rendezvous_s: f64,
    /// `.metadata` was committed when the call returned.
    pub committed: bool,
    pub(crate) commit: Option<CommitSummary>,
}

/// Saves this rank's chunks and objects (and `common.pt` when `common` is given) and takes part in
/// the file-based rendezvous ([`commit`]).
///
/// Errors: [`Error::InvalidArgument`], [`Error::CheckpointExists`], [`Error::Io`] (unwritable
/// directory, full disk), [`Error::Interrupted`] on Ctrl-C during the write (in the thread that
/// checks for it: Python's main thread), and the errors of [`commit::merge`] /
/// [`wait_for_commit`]. A failed
/// save never writes `.metadata`; when the merging rank fails it publishes `FAILED`, so the other
/// ranks fail within a poll instead of at their timeout.
pub fn save_rank(
    opts: &SaveOptions,
    tensors: &[TensorChunk],
    objects: &[ObjectItem],
    common: Option<&[u8]>,
    staging: Option<Staging>,
) -> Result<SaveReport> {
    check(opts, tensors)?;
    // One save at a time per process stages and writes; a second one waits here until the first
    // has published its part. The rendezvous wait that follows needs no ticket, so ranks played by
    // one process (tests, tools) cannot block each other.
    let ticket = SaveTicket::acquire();
    let t0 = Instant::now();
    let joined = this_attempt(opts).map_err(|e| rank_error(opts.rank, e))?;
    let opts = &joined;
    let published = write_and_publish(opts, tensors, objects, common, staging);
    drop(ticket);
    let mut report = published.inspect_err(|e| {
        // The other ranks would wait for this rank's merge until their timeout: tell them.
        let merger = opts.merge_rank == Some(opts.rank);
        if merger && !matches!(e, Error::CheckpointExists(_) | Error::InvalidArgument(_)) {
            let reason = format!("the merging rank {} failed: {e}", opts.rank);
            publish_failed(&opts.location, &opts.save_id, &reason);
        }
    })?;
    report.write_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    merge_or_wait(opts, &mut report)?;
    report.rendezvous_s = t1.elapsed().as_secs_f64();
    Ok(report)
}

impl SaveOptions {
    /// Which parts and markers in the directory belong to this attempt (see `derived_save_id`).
    pub fn freshness(&self) -> Freshness {
        if self.derived_save_id {
            Freshness::this_launch()
        } else {
            Freshness::any_part()
        }
    }
}

/// The options of the attempt this rank saves in: for a derived save id, the attempt it joins
/// ([`attempt::join`], looked up as late as possible, right before it writes), with the
/// freshness of a derived id; otherwise `opts` as given.
///
/// Errors: storage errors when the directory's saves cannot be listed.
fn this_attempt(opts: &SaveOptions) -> Result<SaveOptions> {
    let mut joined = opts.clone();
    if opts.derived_save_id {
        joined.save_id = attempt::join(&opts.location, &opts.save_id)?;
    }
    Ok(joined)
}

/// Checks the options and chunks, before any side effect, so bad input changes nothing on disk.
///
/// Errors: [`Error::InvalidArgument`].
fn check(opts: &SaveOptions, tensors: &[TensorChunk]) -> Result<()> {
    check_options(opts)?;
    tensors.iter().try_for_each(check_chunk)
}

/// Checks the options that need no storage: rank, world_size, merge_rank, save id.
///
/// Errors: [`Error::InvalidArgument`].
pub fn check_options(opts: &SaveOptions) -> Result<()> {
    crate::commit::check_world_size(opts.world_size)?;
    if opts.rank >= opts.world_size {
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
    if opts.derived_save_id {
        // The longest attempt id must be a valid save id too.
        part::check_save_id(&attempt::attempt_id(&opts.save_id, u32::MAX))
    } else {
        part::check_save_id(&opts.save_id)
    }
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

/// Begins the attempt, writes this rank's files and publishes its part; the files are removed
/// again if anything fails before the part is published (nothing would ever reference them).
fn write_and_publish(
    opts: &SaveOptions,
    tensors: &[TensorChunk],
    objects: &[ObjectItem],
    common: Option<&[u8]>,
    staging: Option<Staging>,
) -> Result<SaveReport> {
    let loc = &opts.location;
    let rank_error = |e| rank_error(opts.rank, e);
    let attempt =
        attempt::begin(loc, &opts.save_id, opts.rank, opts.overwrite).map_err(rank_error)?;
    let mut cleanup = Cleanup {
        loc,
        files: Vec::new(),
    };
    let input = SaveInput {
        tensors,
        objects,
        common,
    };
    let Files { data, common } = write_files(opts, &attempt, &input, staging, &mut cleanup)?;
    let stamps = cleanup
        .files
        .iter()
        .map(|f| Ok(loc.stamp(f)?.unwrap_or_default()))
        .collect::<Result<Vec<String>>>()
        .map_err(rank_error)?;
    let written = data.as_ref().map(|w| (attempt.data_file.as_str(), w));
    let part = build_part(
        opts,
        tensors,
        objects,
        written,
        common,
        &stamps,
        (publisher(), now_ns()),
    );
    attempt.publish(&part).map_err(rank_error)?;
    cleanup.files.clear();
    Ok(SaveReport {
        rank: opts.rank,
        save_id: opts.save_id.clone(),
        data_file: data.as_ref().map(|_| attempt.data_file.clone()),
        data_bytes: data.map_or(0, |w| w.file_size),
        ..Default::default()
    })
}

/// What one rank saves: its chunks and objects, and `common.pt`'s bytes when it has them.
struct SaveInput<'a> {
    tensors: &'a [TensorChunk<'a>],
    objects: &'a [ObjectItem<'a>],
    common: Option<&'a [u8]>,
}

/// This rank's files as written: where the writer placed each item of the data file (none without
/// items) and `common.pt`'s record (without its storage stamp yet).
struct Files {
    data: Option<Written>,
    common: Option<FileRecord>,
}

/// Writes this rank's data file and `common.pt`, naming each written file for `cleanup`, while the
/// calling thread watches for Ctrl-C ([`crate::interrupt::watching`]): the data write then stops
/// at its next piece or window.
///
/// Errors: as [`write_data`] and [`write_common`] (I/O errors naming the rank);
/// [`Error::Interrupted`] when Ctrl-C was seen, even once the writes were done: a save told to
/// stop publishes nothing, so nothing is committed.
fn write_files(
    opts: &SaveOptions,
    attempt: &Attempt,
    input: &SaveInput,
    staging: Option<Staging>,
    cleanup: &mut Cleanup,
) -> Result<Files> {
    let ((data, common), stopped) = crate::interrupt::watching(|stop| {
        // `common.pt` is written (and fsynced) on a second thread while the data file is: on its
        // own after the data, its fsync waited for the disk to finish the other ranks' data (24 ms
        // of a 0.5 s save, BENCHMARKS.md "CPU save at the disk's speed").
        std::thread::scope(|s| {
            let common = s.spawn(|| write_common(opts, attempt, input.common));
            let data = write_data(opts, attempt, input, staging, stop, cleanup);
            let common = common
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (data, common)
        })
    });
    // Named for the cleanup before any error is returned, after the data file (the part's stamps
    // follow this order).
    if let Ok(Some(c)) = &common {
        cleanup.files.push(c.name.clone());
    }
    if stopped {
        return Err(Error::Interrupted(Stopped::Commit));
    }
    Ok(Files {
        data: data.map_err(|e| rank_error(opts.rank, e))?,
        common: common.map_err(|e| rank_error(opts.rank, e))?,
    })
}

/// Files this rank wrote for its save, in the order written; removed (best effort) when dropped
/// before the part that names them is published.
struct Cleanup<'a> {
    loc: &'a Location,
    files: Vec<String>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        // A partial data file would fill the disk that just failed; an object store has no object
        // for a failed upload, and removing an absent one is fine.
        for f in &self.files {
            let _ = self.loc.remove(f);
        }
    }
}

/// Writes this rank's data file ([`Attempt::data_file`]), when it has any item.
///
/// Errors: as [`write_rank`]; [`Error::Interrupted`] once `stop` is set.
fn write_data(
    opts: &SaveOptions,
    attempt: &Attempt,
    input: &SaveInput,
    staging: Option<Staging>,
    stop: &AtomicBool,
    cleanup: &mut Cleanup,
) -> Result<Option<Written>> {
    let SaveInput {
        tensors, objects, ..
    } = *input;
    if tensors.is_empty() && objects.is_empty() {
        if let Some(f) = staging.and_then(|s| s.on_staged) {
            f(); // nothing to stage
        }
        return Ok(None);
    }
    let sink = opts.location.create_data(&attempt.data_file)?;
    cleanup.files.push(attempt.data_file.clone());
    let objects: Vec<&ByteObject> = objects.iter().map(|o| &o.object).collect();
    let how = WriteOptions {
        seed: opts.rank as u64,
        digest: opts.integrity,
        stop,
    };
    write_rank(sink, tensors, &objects, staging, how).map(Some)
}

/// Writes `common.pt` ([`Attempt::common_file`]) when this rank has the common state; returns its
/// record (without a storage stamp yet). The caller names the file for its [`Cleanup`].
///
/// Errors: storage errors.
fn write_common(
    opts: &SaveOptions,
    attempt: &Attempt,
    common: Option<&[u8]>,
) -> Result<Option<FileRecord>> {
    let Some(bytes) = common else {
        return Ok(None);
    };
    opts.location.write(&attempt.common_file, bytes.to_vec())?;
    Ok(Some(FileRecord {
        name: attempt.common_file.clone(),
        size: bytes.len() as u64,
        stamp: String::new(),
        sha256: opts.integrity.then(|| manifest::sha256_hex(bytes)),
    }))
}

/// This rank's part: its data file `written` (name, what the writer placed where) and `common`
/// file, with their storage stamps `stamps` (in that order, as written), published by `by`
/// (publisher, publication time in ns since the epoch). Pure: no storage, no clock.
fn build_part(
    opts: &SaveOptions,
    tensors: &[TensorChunk],
    objects: &[ObjectItem],
    written: Option<(&str, &Written)>,
    common: Option<FileRecord>,
    stamps: &[String],
    by: (String, u64),
) -> RankPart {
    let mut part = RankPart {
        format: part::PART_FORMAT,
        save_id: opts.save_id.clone(),
        rank: opts.rank,
        world_size: opts.world_size,
        megatron: opts.megatron,
        published_at_ns: by.1,
        publisher: by.0,
        files: Vec::new(),
        tensors: Vec::new(),
        objects: Vec::new(),
        common,
    };
    if let Some((name, w)) = written {
        part.tensors = tensors
            .iter()
            .zip(&w.tensors)
            .map(|(t, placed)| TensorRecord {
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
            })
            .collect();
        part.objects = objects
            .iter()
            .zip(&w.objects)
            .map(|(o, placed)| ObjectRecord {
                fqn: o.object.fqn.clone(),
                shard: o.shard.clone(),
                file: 0,
                offset: placed.offset,
                length: placed.length,
                crc32: placed.crc32,
            })
            .collect();
        part.files.push(FileRecord {
            name: name.to_string(),
            size: w.file_size,
            stamp: String::new(),
            sha256: w.sha256.as_ref().map(manifest::hex),
        });
    }
    for (f, stamp) in part
        .files
        .iter_mut()
        .chain(part.common.iter_mut())
        .zip(stamps)
    {
        f.stamp = stamp.clone();
    }
    part
}

/// The rendezvous after the part is published: the merging rank merges and commits; the others
/// wait for the commit when asked to.
///
/// Errors: as [`commit::merge`] and [`wait_for_commit`] (naming the merging rank).
fn merge_or_wait(opts: &SaveOptions, report: &mut SaveReport) -> Result<()> {
    let loc = &opts.location;
    if opts.merge_rank == Some(opts.rank) {
        let summary = commit::merge(
            loc,
            &opts.save_id,
            opts.world_size,
            opts.timeout,
            &opts.freshness(),
        )?;
        report.commit = Some(summary);
        report.committed = true;
    } else if let (true, Some(m)) = (opts.wait_for_commit, opts.merge_rank) {
        wait_for_commit(
            loc,
            &opts.save_id,
            opts.world_size,
            opts.timeout,
            &opts.freshness(),
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::DType;
    use crate::writer::{Payload, Placed};

    fn options(loc: Location, rank: u32, world_size: u32) -> SaveOptions {
        SaveOptions {
            location: loc,
            rank,
            world_size,
            save_id: "s1".into(),
            megatron: true,
            merge_rank: Some(0),
            timeout: Duration::from_secs(20),
            wait_for_commit: true,
            overwrite: false,
            derived_save_id: false,
            integrity: false,
        }
    }

    fn chunk<'a>(fqn: &str, data: &'a [u8], offset: u64, global: u64) -> TensorChunk<'a> {
        TensorChunk {
            fqn: fqn.into(),
            dtype: DType::from_torch_name("torch.uint8").unwrap(),
            global_shape: vec![global],
            offsets: vec![offset],
            sizes: vec![data.len() as u64],
            data: Payload::Host(data),
        }
    }

    fn placed(offset: u64, crc32: u32, blocks: Vec<u32>) -> Placed {
        Placed {
            offset,
            length: 10,
            crc32,
            blocks,
        }
    }

    /// Every record of the part comes from where the writer placed the item and what the caller
    /// described, files in the order written, and the publisher and time as given.
    #[test]
    fn build_part_records_what_was_written_where() {
        let opts = options(Location::local(std::path::Path::new("/x")), 1, 2);
        let data = [7u8; 4];
        let tensors = [chunk("w", &data, 4, 8), chunk("b", &data[..2], 0, 2)];
        let shard = ObjectShard {
            key: "o".into(),
            global_shape: vec![2],
            global_offset: vec![1],
        };
        let objects = [ObjectItem {
            object: ByteObject {
                fqn: "o/shard_1_2".into(),
                bytes: b"PK",
            },
            shard: Some(shard.clone()),
        }];
        let written = Written {
            tensors: vec![placed(100, 1, vec![9, 8]), placed(200, 2, vec![])],
            objects: vec![placed(0, 3, vec![])],
            file_size: 300,
            sha256: Some([0xab; 32]),
        };
        let common = FileRecord {
            name: ".shardwise/s1/common.pt".into(),
            size: 5,
            stamp: String::new(),
            sha256: None,
        };
        let stamps = ["data-stamp".to_string(), "common-stamp".to_string()];
        let p = build_part(
            &opts,
            &tensors,
            &objects,
            Some(("__1_0.distcp", &written)),
            Some(common),
            &stamps,
            ("h#1:2:3".into(), 42),
        );
        assert_eq!(
            (p.rank, p.world_size, p.save_id.as_str(), p.megatron),
            (1, 2, "s1", true)
        );
        assert_eq!(
            (p.publisher.as_str(), p.published_at_ns, p.format),
            ("h#1:2:3", 42, part::PART_FORMAT)
        );
        assert_eq!(
            p.files,
            vec![FileRecord {
                name: "__1_0.distcp".into(),
                size: 300,
                stamp: "data-stamp".into(),
                sha256: Some("ab".repeat(32)),
            }]
        );
        let c = p.common.as_ref().unwrap();
        assert_eq!(
            (c.name.as_str(), c.stamp.as_str()),
            (".shardwise/s1/common.pt", "common-stamp")
        );
        assert_eq!(
            p.tensors[0],
            TensorRecord {
                fqn: "w".into(),
                dtype: "uint8".into(),
                global_shape: vec![8],
                offsets: vec![4],
                sizes: vec![4],
                file: 0,
                offset: 100,
                length: 10,
                crc32: 1,
                blocks: vec![9, 8],
            }
        );
        assert_eq!((p.tensors[1].fqn.as_str(), p.tensors[1].offset), ("b", 200));
        assert_eq!(
            p.objects,
            vec![ObjectRecord {
                fqn: "o/shard_1_2".into(),
                shard: Some(shard),
                file: 0,
                offset: 0,
                length: 10,
                crc32: 3,
            }]
        );
    }

    /// A rank with nothing to save but the common state publishes a part without files whose
    /// common file carries the first stamp.
    #[test]
    fn build_part_of_a_rank_with_only_the_common_state() {
        let opts = options(Location::local(std::path::Path::new("/x")), 0, 1);
        let common = FileRecord {
            name: "common.pt".into(),
            size: 5,
            stamp: String::new(),
            sha256: None,
        };
        let p = build_part(
            &opts,
            &[],
            &[],
            None,
            Some(common),
            &["c".into()],
            ("p".into(), 1),
        );
        assert!(p.files.is_empty() && p.tensors.is_empty() && p.objects.is_empty());
        assert_eq!(p.common.unwrap().stamp, "c");
    }

    #[test]
    fn check_refuses_bad_options_and_chunks_before_any_write() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(&dir.path().join("c"));
        let bad = |mutate: &dyn Fn(&mut SaveOptions), want: &str| {
            let mut o = options(loc.clone(), 0, 2);
            mutate(&mut o);
            let e = check(&o, &[]).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(want)),
                "{want}: {e}"
            );
        };
        bad(&|o| o.rank = 2, "rank 2 is not in 0..world_size (2)");
        bad(&|o| o.world_size = 0, "world_size 0 is not in 1..=");
        bad(
            &|o| o.world_size = 1_000_000_000,
            "world_size 1000000000 is not in 1..=",
        );
        bad(&|o| o.merge_rank = Some(5), "merge_rank 5 is not in 0..2");
        bad(&|o| o.save_id = "../up".into(), "save_id");
        let data = [0u8; 3];
        let mut c = chunk("w", &data, 0, 4);
        c.sizes = vec![4]; // 4 elements described, 3 bytes given
        let e = check(&options(loc.clone(), 0, 2), &[c]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(!dir.path().join("c").exists(), "nothing was created");
    }

    /// A rank whose save fails after its data file was written (here: `common.pt` cannot be
    /// written) leaves no file behind and no part; the error names the rank.
    #[test]
    fn a_failed_save_removes_the_files_it_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        // A directory where the staged common.pt goes.
        std::fs::create_dir_all(dir.path().join(".shardwise/s1/common.pt/x")).unwrap();
        let data = [1u8; 8];
        let mut opts = options(loc.clone(), 0, 1);
        opts.merge_rank = None;
        let e = save_rank(&opts, &[chunk("w", &data, 0, 8)], &[], Some(b"PK"), None).unwrap_err();
        assert!(matches!(e, Error::RankStorage { rank: 0, .. }), "{e}");
        assert!(
            !dir.path().join("__0_0.distcp").exists(),
            "data file removed"
        );
        assert!(!dir.path().join(".shardwise/s1/0.part").exists(), "no part");
    }

    /// Two ranks saved on an object store: rank 1 publishes without waiting, rank 0 merges; the
    /// checkpoint is committed, reads back, and `common.pt` was written in place (no rename there).
    #[test]
    fn two_ranks_on_an_object_store_commit() {
        let loc = Location::parse(&format!(
            "memory://save-tests/two-{}",
            crate::commit::liveness::now_ns()
        ))
        .unwrap();
        let data = [[1u8; 4], [2u8; 4]];
        for rank in [1u32, 0] {
            let mut opts = options(loc.clone(), rank, 2);
            opts.wait_for_commit = false;
            let common = (rank == 0).then_some(&b"PK\x05\x06"[..]);
            let t = [chunk("w", &data[rank as usize], 4 * rank as u64, 8)];
            let r = save_rank(&opts, &t, &[], common, None).unwrap();
            assert_eq!(
                r.data_file.as_deref(),
                Some(format!("__{rank}_0.distcp").as_str())
            );
            assert_eq!(r.committed, rank == 0);
        }
        assert!(crate::commit::state::is_committed(&loc));
        assert_eq!(loc.read("common.pt").unwrap(), Some(b"PK\x05\x06".to_vec()));
        let ck = crate::reader::Checkpoint::open(&loc).unwrap();
        let mut out = [0u8; 8];
        crate::load::read_region(&ck, "w", &[0], &[8], &mut out).unwrap();
        assert_eq!(out, [1, 1, 1, 1, 2, 2, 2, 2]);
    }
}
