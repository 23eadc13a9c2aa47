//! Gives torch DCP's collective-free saves their global `.metadata` back.
//!
//! `torch.distributed.checkpoint.save(..., use_collectives=False)` (torch ≥ 2.9, `filesystem.py`
//! `_FileSystemWriter.finish`, `state_dict_saver.py`) plans every rank alone: rank `r` writes its
//! data files `__{r}_{i}.distcp`, then `__{r}.metadata`, a `Metadata` pickle of only its own items
//! (written to `__{r}.metadata.tmp`, then renamed), and no rank writes the global `.metadata`.
//! torch's load reads `.metadata` and, when that fails, the loading rank's own `__{rank}.metadata`
//! (`state_dict_loader.py` `_load_state_dict`), so such a checkpoint loads only at the same world
//! size and sharding (meta-pytorch/tnt #1064: "no longer cross-world re-shardable").
//!
//! [`merge`] reads every rank-local file as data (the hostile-safe `.metadata` parser, nothing
//! executed), validates them together with the merger's own validation of shardwise parts
//! ([`crate::commit::validate::Fold`]: dtype and global-shape agreement, bounds, overlaps,
//! coverage), and creates the global `.metadata` only if absent, in shardwise's max-compat form
//! (loads on torch 2.3 to 2.15, [`crate::format::metadata`]). Plain DCP then loads the checkpoint
//! at any world size. No collective, no process group.
//!
//! Without collectives DCP also skips its cross-rank dedup (`dedup_save_plans`), so an item every
//! rank holds in full (a replicated tensor, a byte object such as a step counter) is written by
//! every rank. An exact replica (same key, offsets, sizes, dtype and global shape; for byte
//! objects the same key) is kept once, from the lowest rank, as DCP's dedup keeps one copy; a
//! partial overlap is refused.
//!
//! Refused, with nothing written: a rank-local file missing among ranks `0..n` (or below
//! `world_size` when given), a rank whose data files exist without its `__{r}.metadata` (it did
//! not finish), a data file newer than its rank's metadata (a later save rewrote it: two saves
//! mixed), items outside their files, stream transforms (zstd, which the max-compat `.metadata`
//! cannot describe), and a `.metadata` already there with other content that is not older than
//! the rank-local files.
//!
//! A later `use_collectives=False` save into a merged directory rewrites the data files and the
//! rank-local files but not `.metadata`, which torch's load prefers: it would read the new bytes at
//! the old save's offsets, with no error. Such a `.metadata` is *stale*: modified before a
//! rank-local file ([`stale_metadata`]). [`merge`] replaces a stale `.metadata` (its save's data is
//! gone, so nothing is lost) and `verify` reports one as a problem.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::commit::part::{
    Dims, FileRecord, ObjectView, PartItems, RankPart, TensorView, PART_FORMAT,
};
use crate::commit::validate::{self, Fold};
use crate::commit::wait::Backoff;
use crate::error::{fmt_ranks, Error, Result};
use crate::format::metadata::{emit_metadata_from, Entry, MetadataSource};
use crate::format::read_metadata::read_metadata;
use crate::format::METADATA_FILE;
use crate::storage::{Listed, Location};

/// What [`merge`] did; sizes in bytes.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    /// Number of ranks whose `__{rank}.metadata` was merged.
    pub ranks: u32,
    /// Keys in the merged `.metadata`.
    pub keys: usize,
    /// Tensor chunks in the merged `.metadata`.
    pub tensor_chunks: usize,
    /// Byte objects in the merged `.metadata`.
    pub byte_objects: usize,
    /// Exact replicas written by more than one rank, kept once.
    pub replicas_dropped: usize,
    /// Size of the merged `.metadata` in bytes.
    pub metadata_bytes: u64,
    /// `.metadata` was already there, byte-identical to the merge (an earlier or racing merge).
    pub already_merged: bool,
    /// A stale `.metadata` (an earlier save's, see [`stale_metadata`]) was replaced.
    pub replaced_stale: bool,
}

/// The rank of a rank-local metadata file name (`__3.metadata` → 3).
fn metadata_rank(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("__")?.strip_suffix(".metadata")?;
    decimal(digits)
}

/// The rank of a DCP data file name (`__3_0.distcp` → 3).
fn data_rank(name: &str) -> Option<u32> {
    let (rank, rest) = name.strip_prefix("__")?.split_once('_')?;
    decimal(rest.strip_suffix(".distcp")?)?;
    decimal(rank)
}

fn decimal(s: &str) -> Option<u32> {
    let canonical =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    canonical.then(|| s.parse().ok()).flatten()
}

/// Whether `loc` holds rank-local DCP metadata (`__0.metadata`).
///
/// Errors: storage errors other than "not found".
pub fn has_rank_local(loc: &Location) -> Result<bool> {
    Ok(loc.size("__0.metadata")?.is_some())
}

/// The rank-local files modified after `.metadata`, as "`__{r}.metadata` (`s` s later)", when
/// `files` (one listing of the directory) holds a `.metadata` and any: that `.metadata` is an
/// earlier save's, and torch's load (which reads `.metadata` first, `state_dict_loader.py`) would
/// read this save's bytes at that save's offsets. Empty when there is no `.metadata` or no
/// rank-local file, or when every rank-local file is older.
pub fn stale_metadata(files: &[Listed]) -> Vec<String> {
    let Some(global) = files.iter().find(|f| f.name == METADATA_FILE) else {
        return Vec::new();
    };
    let mut newer: Vec<(u32, f64)> = files
        .iter()
        .filter_map(|f| Some((metadata_rank(&f.name)?, global.age_s - f.age_s)))
        .filter(|&(_, later_s)| later_s > 1e-3)
        .collect();
    newer.sort_unstable_by_key(|&(r, _)| r);
    newer
        .into_iter()
        .map(|(r, later_s)| format!("__{r}.metadata ({later_s:.3}s later)"))
        .collect()
}

/// Waits up to `timeout` until `__{r}.metadata` exists for every rank below `world_size`.
///
/// Errors: [`Error::MissingRanks`] naming the ranks still missing; [`Error::Interrupted`].
fn wait_for_ranks(loc: &Location, world_size: u32, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    loop {
        let (files, _) = loc.list("")?;
        let have: HashSet<u32> = files
            .iter()
            .filter_map(|f| metadata_rank(&f.name))
            .collect();
        let missing: Vec<u32> = (0..world_size).filter(|r| !have.contains(r)).collect();
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::Validation(format!(
                "after {:.1}s, {loc} has no __{{rank}}.metadata of ranks {} (world_size {world_size}): \
                 those ranks did not finish their save; nothing committed",
                timeout.as_secs_f64(),
                fmt_ranks(&missing)
            )));
        }
        backoff.sleep(deadline)?;
    }
}

/// One tensor chunk of a rank-local file: key, dtype name, global shape, chunk offsets and sizes
/// (elements), and where its item is (file index in the rank's part, byte offset, length).
struct TensorItem {
    fqn: String,
    dtype: String,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    file: u32,
    offset: u64,
    length: u64,
}

/// One byte object: key, file index, byte offset, length.
struct ObjectItem {
    fqn: String,
    file: u32,
    offset: u64,
    length: u64,
}

/// One rank's metadata as a part: its data files, and its items.
struct RankItems {
    part: RankPart,
    tensors: Vec<TensorItem>,
    objects: Vec<ObjectItem>,
}

/// Merges the rank-local metadata of the DCP checkpoint at `loc` into its global `.metadata`
/// (see the module docs). `world_size`: the number of ranks that saved, when known; with it, waits
/// up to `timeout` for the rank-local files of every rank.
///
/// The steps: wait for every rank ([`wait_for_ranks`], with `world_size`) → one listing, and the
/// ranks it must hold ([`ranks_to_merge`], pure) → each rank's file read and checked
/// ([`rank_items`]), its replicas of lower ranks' items dropped ([`Replicas::keep`], pure) and
/// the rest folded ([`fold_ranks`]) → the `.metadata` encoded and published ([`publish`]).
///
/// Errors: [`Error::InvalidArgument`] when `loc` holds no rank-local metadata;
/// [`Error::Validation`] for every refusal of the module docs (naming ranks, keys, files;
/// nothing committed); [`Error::Corrupt`] for a rank-local file that is not DCP metadata; storage
/// errors.
pub fn merge(loc: &Location, world_size: Option<u32>, timeout: Duration) -> Result<Summary> {
    if let Some(w) = world_size {
        crate::commit::check_world_size(w)?;
        wait_for_ranks(loc, w, timeout)?;
    }
    let (files, _) = loc.list("")?;
    let ranks = ranks_to_merge(loc, &files, world_size)?;
    let Folded {
        global,
        replicas_dropped,
    } = fold_ranks(loc, &ranks, &files)?;
    let meta = emit_metadata_from(&global);
    let (tensor_chunks, byte_objects) = global.counts();
    let mut summary = Summary {
        ranks: ranks.len() as u32,
        keys: global.keys(),
        tensor_chunks,
        byte_objects,
        replicas_dropped,
        metadata_bytes: meta.len() as u64,
        already_merged: false,
        replaced_stale: false,
    };
    // Every rank-local file merged here is newer than the .metadata there: that one describes an
    // earlier save whose data files these ranks rewrote; replacing it (atomically) loses nothing.
    let stale = stale_metadata(&files).len() == ranks.len();
    match publish(loc, meta, stale)? {
        Published::Created => {}
        Published::ReplacedStale => summary.replaced_stale = true,
        Published::AlreadyMerged => summary.already_merged = true,
    }
    Ok(summary)
}

/// The ranks whose `__{rank}.metadata` the listing `files` of `loc` holds, sorted, once they are
/// every rank `0..n` (`n`: `world_size` when given, else one past the highest) and no other rank
/// left data files. Pure (`loc` only names the directory in errors).
///
/// Errors: [`Error::InvalidArgument`] when there is no rank-local file; [`Error::Validation`] for
/// ranks beyond `world_size`, ranks missing, or data files of ranks without metadata.
fn ranks_to_merge(loc: &Location, files: &[Listed], world_size: Option<u32>) -> Result<Vec<u32>> {
    let mut ranks: Vec<u32> = files
        .iter()
        .filter_map(|f| metadata_rank(&f.name))
        .collect();
    ranks.sort_unstable();
    if ranks.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{loc} holds no rank-local DCP metadata (__0.metadata, written by \
             torch.distributed.checkpoint.save(..., use_collectives=False))"
        )));
    }
    if let Some(w) = world_size {
        let beyond: Vec<u32> = ranks.iter().copied().filter(|&r| r >= w).collect();
        if !beyond.is_empty() {
            return Err(Error::Validation(format!(
                "{loc}: ranks {} have rank-local metadata, beyond world_size {w}: files of another \
                 save; nothing committed",
                fmt_ranks(&beyond)
            )));
        }
    }
    let n = world_size
        .unwrap_or(ranks.len() as u32)
        .max(ranks.last().map_or(0, |r| r + 1));
    let missing: Vec<u32> = (0..n).filter(|r| ranks.binary_search(r).is_err()).collect();
    if !missing.is_empty() {
        return Err(Error::Validation(format!(
            "{loc}: __{{rank}}.metadata of ranks {} is missing (present: ranks {}): those ranks did \
             not finish their save; nothing committed",
            fmt_ranks(&missing),
            fmt_ranks(&ranks)
        )));
    }
    let mut unfinished: Vec<u32> = files
        .iter()
        .filter_map(|f| data_rank(&f.name))
        .filter(|r| *r >= n)
        .collect();
    unfinished.sort_unstable();
    unfinished.dedup();
    if !unfinished.is_empty() {
        return Err(Error::Validation(format!(
            "{loc}: ranks {} wrote data files (__{{rank}}_*.distcp) but no __{{rank}}.metadata: \
             their save did not finish, or they belong to another save; nothing committed",
            fmt_ranks(&unfinished)
        )));
    }
    Ok(ranks)
}

/// What [`fold_ranks`] gives: the global index, validated, and how many replicas were dropped.
struct Folded {
    global: validate::Global,
    replicas_dropped: usize,
}

/// Reads the rank-local file of each of `ranks` (in order), keeps its items that are not replicas
/// of a lower rank's, and folds them into the global index.
///
/// Errors: as [`rank_items`]; [`Error::Validation`] of the fold (nothing committed).
fn fold_ranks(loc: &Location, ranks: &[u32], files: &[Listed]) -> Result<Folded> {
    let by_name: HashMap<&str, &Listed> = files.iter().map(|f| (f.name.as_str(), f)).collect();
    let fold = Fold::default();
    let mut parts = Vec::with_capacity(ranks.len());
    let mut replicas = Replicas::default();
    for &rank in ranks {
        let kept = replicas.keep(rank_items(loc, rank, &by_name)?);
        fold.add_part(&kept.part, kept.views())?;
        parts.push(kept.part);
    }
    let global = fold.finish(&parts).map_err(|e| match e {
        Error::Validation(m) => Error::Validation(format!("{m}; nothing committed")),
        other => other,
    })?;
    Ok(Folded {
        global,
        replicas_dropped: replicas.dropped,
    })
}

/// The items seen so far, in rank order, to keep an exact replica once, from the lowest rank (as
/// DCP's `dedup_save_plans` keeps one copy): a tensor chunk by key, offsets, sizes, dtype and
/// global shape; a byte object by key.
#[derive(Default)]
struct Replicas {
    chunks: HashSet<ChunkKey>,
    objects: HashSet<String>,
    /// Items dropped as replicas.
    dropped: usize,
}

/// What makes two tensor chunks replicas: key, offsets, sizes, dtype, global shape.
type ChunkKey = (String, Vec<u64>, Vec<u64>, String, Vec<u64>);

impl Replicas {
    /// `items` without the replicas of items seen before (which it then counts as seen). Pure.
    fn keep(&mut self, items: RankItems) -> RankItems {
        let mut kept = RankItems {
            part: items.part,
            tensors: Vec::new(),
            objects: Vec::new(),
        };
        for t in items.tensors {
            let replica = (
                t.fqn.clone(),
                t.offsets.clone(),
                t.sizes.clone(),
                t.dtype.clone(),
                t.shape.clone(),
            );
            if self.chunks.insert(replica) {
                kept.tensors.push(t);
            } else {
                self.dropped += 1;
            }
        }
        for o in items.objects {
            if self.objects.insert(o.fqn.clone()) {
                kept.objects.push(o);
            } else {
                self.dropped += 1;
            }
        }
        kept
    }
}

impl RankItems {
    /// The items as the fold reads a shardwise part's (no CRC-32s: DCP records none).
    fn views(&self) -> PartItems<'_> {
        let tensors = self
            .tensors
            .iter()
            .map(|t| TensorView {
                fqn: &t.fqn,
                dtype: &t.dtype,
                global_shape: Dims::from(&t.shape[..]),
                offsets: Dims::from(&t.offsets[..]),
                sizes: Dims::from(&t.sizes[..]),
                file: t.file,
                offset: t.offset,
                length: t.length,
                crc32: 0,
                blocks: Vec::new(),
            })
            .collect();
        let objects = self
            .objects
            .iter()
            .map(|o| ObjectView {
                fqn: &o.fqn,
                shard: None,
                file: o.file,
                offset: o.offset,
                length: o.length,
                crc32: 0,
            })
            .collect();
        (tensors, objects)
    }
}

/// How [`publish`] left `.metadata`.
#[derive(Debug, PartialEq)]
enum Published {
    /// Created: there was none.
    Created,
    /// A stale one (an earlier save's) was replaced.
    ReplacedStale,
    /// Byte-identical to the merge already (an earlier or racing merge).
    AlreadyMerged,
}

/// Publishes the merged `.metadata` `meta`: replacing a `stale` one, else only if absent.
///
/// Errors: [`Error::Validation`] when a different `.metadata` is there and not stale (left as it
/// is); storage errors.
fn publish(loc: &Location, meta: Vec<u8>, stale: bool) -> Result<Published> {
    if stale {
        loc.write(METADATA_FILE, meta)?;
        return Ok(Published::ReplacedStale);
    }
    if loc.write_new(METADATA_FILE, meta.clone())? {
        return Ok(Published::Created);
    }
    if loc.read(METADATA_FILE)?.as_deref() != Some(&meta[..]) {
        return Err(Error::Validation(format!(
            "{loc} already holds a .metadata that is not the merge of its rank-local metadata \
             and not older than all of them (another save's, or a merge of other files): it \
             is left as it is and nothing is committed; torch loads that .metadata, not the \
             rank-local files, so remove it if it belongs to an older save"
        )));
    }
    Ok(Published::AlreadyMerged)
}

/// Reads and checks rank `rank`'s `__{rank}.metadata`: the part of its data files and its items.
///
/// Errors: [`Error::Validation`] when it vanished, uses stream transforms, or as
/// [`rank_entries`]; [`Error::Corrupt`] when it is not DCP metadata; storage errors.
fn rank_items(loc: &Location, rank: u32, listed: &HashMap<&str, &Listed>) -> Result<RankItems> {
    let name = format!("__{rank}.metadata");
    let path = loc.path_of(&name);
    let bytes = loc.read(&name)?.ok_or_else(|| {
        Error::Validation(format!(
            "{} disappeared during the merge; nothing committed",
            path.display()
        ))
    })?;
    let md = read_metadata(&bytes).map_err(|e| Error::Corrupt {
        path: path.clone(),
        reason: e.0,
    })?;
    if let Some(((fqn, _), t)) = md.transforms.iter().next() {
        return Err(Error::Validation(format!(
            "rank {rank}: key {fqn} is stored with stream transforms {t:?} (DCP extensions such \
             as ZStandard), which the merged .metadata cannot describe; nothing committed"
        )));
    }
    let mut files = DataFiles::new(rank, &name, listed);
    let (tensors, objects) = rank_entries(rank, &md.entries, &mut files)?;
    let part = RankPart {
        format: PART_FORMAT,
        save_id: String::new(),
        rank,
        world_size: 0,
        megatron: false,
        published_at_ns: 0,
        publisher: String::new(),
        files: files.files,
        tensors: Vec::new(),
        objects: Vec::new(),
        common: None,
    };
    Ok(RankItems {
        part,
        tensors,
        objects,
    })
}

/// Rank `rank`'s items, from the entries of its metadata, each placed in `files`. Pure.
///
/// Errors: [`Error::Validation`] for an item without a storage entry, or as [`DataFiles::id`].
fn rank_entries(
    rank: u32,
    entries: &BTreeMap<String, Entry>,
    files: &mut DataFiles,
) -> Result<(Vec<TensorItem>, Vec<ObjectItem>)> {
    let mut tensors = Vec::new();
    let mut objects = Vec::new();
    for (fqn, entry) in entries {
        match entry {
            Entry::Tensor {
                dtype,
                global_shape,
                chunks,
            } => {
                for c in chunks {
                    let s = &c.storage;
                    if s.relative_path.is_empty() {
                        return Err(Error::Validation(format!(
                            "rank {rank}: key {fqn} chunk at offsets {:?} has no storage_data entry; \
                             nothing committed",
                            c.offsets
                        )));
                    }
                    let file = files.id(&s.relative_path, fqn, s.offset, s.length)?;
                    tensors.push(TensorItem {
                        fqn: fqn.clone(),
                        dtype: dtype.torch_name().to_string(),
                        shape: global_shape.clone(),
                        offsets: c.offsets.clone(),
                        sizes: c.sizes.clone(),
                        file,
                        offset: s.offset,
                        length: s.length,
                    });
                }
            }
            Entry::Bytes { storage: s } => {
                if s.relative_path.is_empty() {
                    return Err(Error::Validation(format!(
                        "rank {rank}: byte object {fqn} has no storage_data entry; nothing committed"
                    )));
                }
                let file = files.id(&s.relative_path, fqn, s.offset, s.length)?;
                objects.push(ObjectItem {
                    fqn: fqn.clone(),
                    file,
                    offset: s.offset,
                    length: s.length,
                });
            }
        }
    }
    Ok((tensors, objects))
}

/// The data files one rank's items are in, as its part lists them (in the order first named),
/// each checked against the directory listing when first named.
struct DataFiles<'a> {
    rank: u32,
    /// The rank's `__{rank}.metadata`, and its age in seconds (0 when not listed).
    name: &'a str,
    meta_age: f64,
    listed: &'a HashMap<&'a str, &'a Listed>,
    files: Vec<FileRecord>,
    ids: BTreeMap<String, u32>,
}

impl<'a> DataFiles<'a> {
    fn new(rank: u32, name: &'a str, listed: &'a HashMap<&'a str, &'a Listed>) -> DataFiles<'a> {
        DataFiles {
            rank,
            name,
            meta_age: listed.get(name).map_or(0.0, |l| l.age_s),
            listed,
            files: Vec::new(),
            ids: BTreeMap::new(),
        }
    }

    /// The index of file `rel`, which holds key `key`'s item at `offset` (`length` bytes). Pure.
    ///
    /// Errors: [`Error::Validation`] when the file is not listed, was modified after the rank's
    /// metadata, or ends before the item does.
    fn id(&mut self, rel: &str, key: &str, offset: u64, length: u64) -> Result<u32> {
        let rank = self.rank;
        if let Some(&id) = self.ids.get(rel) {
            let size = self.files[id as usize].size;
            return in_file(rank, key, rel, offset, length, size).map(|_| id);
        }
        // `read_metadata` has refused any path leaving the directory.
        let Some(f) = self.listed.get(rel) else {
            return Err(Error::Validation(format!(
                "rank {rank}: key {key} is stored in {rel}, which is missing; nothing committed"
            )));
        };
        // A rank writes every data file before its metadata (`write_data`, then `finish`): a data
        // file modified after it was rewritten by a later save.
        if f.age_s + 1e-3 < self.meta_age {
            let name = self.name;
            return Err(Error::Validation(format!(
                "rank {rank}: {rel} was modified {:.3}s after {name}: a later save rewrote it, so \
                 {name} describes other bytes (two saves mixed); nothing committed",
                self.meta_age - f.age_s
            )));
        }
        in_file(rank, key, rel, offset, length, f.size)?;
        let id = self.files.len() as u32;
        self.files.push(FileRecord {
            name: rel.to_string(),
            size: f.size,
            stamp: String::new(),
            sha256: None,
        });
        self.ids.insert(rel.to_string(), id);
        Ok(id)
    }
}

fn in_file(rank: u32, key: &str, rel: &str, offset: u64, length: u64, size: u64) -> Result<()> {
    if offset.checked_add(length).is_some_and(|end| end <= size) {
        return Ok(());
    }
    Err(Error::Validation(format!(
        "rank {rank}: key {key} at offset {offset} length {length} passes the end of {rel} \
         ({size} bytes); nothing committed"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(name: &str, age_s: f64) -> Listed {
        Listed {
            name: name.into(),
            size: 1,
            age_s,
        }
    }

    /// The error of `r`, as "InvalidArgument: m" or "Validation: m".
    fn message<T>(r: Result<T>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => format!("InvalidArgument: {m}"),
            Err(Error::Validation(m)) => format!("Validation: {m}"),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("no error"),
        }
    }

    #[test]
    fn ranks_to_merge_are_every_rank_below_n_and_no_other() {
        let loc = Location::local(std::path::Path::new("/ck"));
        let files =
            |names: &[&str]| -> Vec<Listed> { names.iter().map(|n| listed(n, 1.0)).collect() };
        let two = files(&[
            "__1.metadata",
            "__0_0.distcp",
            "__0.metadata",
            "__1_0.distcp",
        ]);
        assert_eq!(ranks_to_merge(&loc, &two, None).unwrap(), [0, 1]);
        assert_eq!(ranks_to_merge(&loc, &two, Some(2)).unwrap(), [0, 1]);
        assert!(
            message(ranks_to_merge(&loc, &files(&["__0_0.distcp"]), None))
                .starts_with("InvalidArgument: /ck holds no rank-local DCP metadata (__0.metadata")
        );
        assert_eq!(
            message(ranks_to_merge(&loc, &two, Some(1))),
            "Validation: /ck: ranks 1 have rank-local metadata, beyond world_size 1: files of \
             another save; nothing committed"
        );
        assert_eq!(
            message(ranks_to_merge(&loc, &two, Some(4))),
            "Validation: /ck: __{rank}.metadata of ranks 2-3 is missing (present: ranks 0-1): \
             those ranks did not finish their save; nothing committed"
        );
        let gap = files(&["__0.metadata", "__2.metadata"]);
        assert!(message(ranks_to_merge(&loc, &gap, None)).contains("of ranks 1 is missing"));
        let unfinished = files(&[
            "__0.metadata",
            "__1.metadata",
            "__2_0.distcp",
            "__2_1.distcp",
        ]);
        assert_eq!(
            message(ranks_to_merge(&loc, &unfinished, None)),
            "Validation: /ck: ranks 2 wrote data files (__{rank}_*.distcp) but no \
             __{rank}.metadata: their save did not finish, or they belong to another save; \
             nothing committed"
        );
    }

    fn tensor(fqn: &str, offsets: Vec<u64>, dtype: &str) -> TensorItem {
        TensorItem {
            fqn: fqn.into(),
            dtype: dtype.into(),
            shape: vec![4],
            sizes: vec![2],
            offsets,
            file: 0,
            offset: 0,
            length: 2,
        }
    }

    fn items(rank: u32, tensors: Vec<TensorItem>, objects: &[&str]) -> RankItems {
        RankItems {
            part: RankPart {
                format: PART_FORMAT,
                save_id: String::new(),
                rank,
                world_size: 0,
                megatron: false,
                published_at_ns: 0,
                publisher: String::new(),
                files: vec![],
                tensors: vec![],
                objects: vec![],
                common: None,
            },
            tensors,
            objects: objects
                .iter()
                .map(|o| ObjectItem {
                    fqn: o.to_string(),
                    file: 0,
                    offset: 0,
                    length: 1,
                })
                .collect(),
        }
    }

    /// An exact replica is kept once, from the first rank that has it; a chunk that differs in
    /// offsets or dtype is not a replica (the fold judges it).
    #[test]
    fn replicas_are_kept_once_from_the_lowest_rank() {
        let mut replicas = Replicas::default();
        let r0 = replicas.keep(items(
            0,
            vec![tensor("w", vec![0], "torch.float32")],
            &["step"],
        ));
        assert_eq!(
            (r0.tensors.len(), r0.objects.len(), replicas.dropped),
            (1, 1, 0)
        );
        let r1 = replicas.keep(items(
            1,
            vec![
                tensor("w", vec![0], "torch.float32"),
                tensor("w", vec![2], "torch.float32"),
                tensor("w", vec![0], "torch.bfloat16"),
            ],
            &["step", "rng"],
        ));
        assert_eq!(r1.part.rank, 1);
        let kept: Vec<(&[u64], &str)> = r1
            .tensors
            .iter()
            .map(|t| (&t.offsets[..], &t.dtype[..]))
            .collect();
        assert_eq!(
            kept,
            [(&[2][..], "torch.float32"), (&[0][..], "torch.bfloat16")]
        );
        assert_eq!(
            r1.objects.iter().map(|o| &o.fqn[..]).collect::<Vec<_>>(),
            ["rng"]
        );
        assert_eq!(replicas.dropped, 2);
        let (tensors, objects) = r1.views();
        assert_eq!(
            (tensors[0].fqn, tensors[0].crc32, objects[0].fqn),
            ("w", 0, "rng")
        );
    }

    /// A data file is checked once, when first named (there, not modified after the rank's
    /// metadata), and every item against its size; files are numbered in the order first named.
    #[test]
    fn data_files_are_checked_and_numbered_as_first_named() {
        let entries = [
            listed("__0.metadata", 5.0),
            Listed {
                name: "__0_0.distcp".into(),
                size: 100,
                age_s: 6.0,
            },
            Listed {
                name: "__0_1.distcp".into(),
                size: 10,
                age_s: 5.0,
            },
            Listed {
                name: "__0_2.distcp".into(),
                size: 10,
                age_s: 4.0,
            },
        ];
        let listed: HashMap<&str, &Listed> = entries.iter().map(|f| (f.name.as_str(), f)).collect();
        let mut files = DataFiles::new(0, "__0.metadata", &listed);
        assert_eq!(files.id("__0_0.distcp", "a", 0, 50).unwrap(), 0);
        assert_eq!(files.id("__0_1.distcp", "b", 0, 10).unwrap(), 1);
        assert_eq!(files.id("__0_0.distcp", "c", 50, 50).unwrap(), 0);
        assert_eq!(
            message(files.id("__0_0.distcp", "d", 60, 41)),
            "Validation: rank 0: key d at offset 60 length 41 passes the end of __0_0.distcp \
             (100 bytes); nothing committed"
        );
        assert!(message(files.id("__0_1.distcp", "e", u64::MAX, 2)).contains("passes the end"));
        assert_eq!(
            message(files.id("__0_9.distcp", "f", 0, 1)),
            "Validation: rank 0: key f is stored in __0_9.distcp, which is missing; nothing committed"
        );
        assert_eq!(
            message(files.id("__0_2.distcp", "g", 0, 1)),
            "Validation: rank 0: __0_2.distcp was modified 1.000s after __0.metadata: a later save \
             rewrote it, so __0.metadata describes other bytes (two saves mixed); nothing committed"
        );
        let names: Vec<(&str, u64)> = files.files.iter().map(|f| (&f.name[..], f.size)).collect();
        assert_eq!(names, [("__0_0.distcp", 100), ("__0_1.distcp", 10)]);
    }

    /// Each chunk of a tensor and each byte object becomes an item in its file; one without a
    /// storage entry is refused.
    #[test]
    fn rank_entries_place_every_item() {
        use crate::format::dtype::DType;
        use crate::format::metadata::{Chunk, StorageInfo};
        let entries = [
            listed("__1.metadata", 1.0),
            Listed {
                name: "__1_0.distcp".into(),
                size: 64,
                age_s: 1.0,
            },
        ];
        let listed: HashMap<&str, &Listed> = entries.iter().map(|f| (f.name.as_str(), f)).collect();
        let at = |offset: u64, rel: &str| StorageInfo {
            relative_path: rel.into(),
            offset,
            length: 8,
        };
        let chunk = |o: u64, rel: &str| Chunk {
            offsets: vec![o],
            sizes: vec![2],
            storage: at(8 * o, rel),
        };
        let tensor = |chunks| Entry::Tensor {
            dtype: DType::from_torch_name("torch.float32").unwrap(),
            global_shape: vec![4],
            chunks,
        };
        let mut md = BTreeMap::new();
        md.insert(
            "w".to_string(),
            tensor(vec![chunk(0, "__1_0.distcp"), chunk(2, "__1_0.distcp")]),
        );
        md.insert(
            "step".to_string(),
            Entry::Bytes {
                storage: at(40, "__1_0.distcp"),
            },
        );
        let mut files = DataFiles::new(1, "__1.metadata", &listed);
        let (tensors, objects) = rank_entries(1, &md, &mut files).unwrap();
        let placed: Vec<(&str, &[u64], u32, u64)> = tensors
            .iter()
            .map(|t| (&t.fqn[..], &t.offsets[..], t.file, t.offset))
            .collect();
        assert_eq!(placed, [("w", &[0][..], 0, 0), ("w", &[2][..], 0, 16)]);
        assert_eq!(
            (tensors[0].dtype.as_str(), &tensors[0].shape[..]),
            ("float32", &[4][..])
        );
        assert_eq!((objects[0].fqn.as_str(), objects[0].offset), ("step", 40));
        assert_eq!(files.files.len(), 1);

        let mut no_storage = BTreeMap::new();
        no_storage.insert("w".to_string(), tensor(vec![chunk(0, "")]));
        let mut files = DataFiles::new(1, "__1.metadata", &listed);
        assert_eq!(
            message(rank_entries(1, &no_storage, &mut files)),
            "Validation: rank 1: key w chunk at offsets [0] has no storage_data entry; nothing committed"
        );
        let mut no_storage = BTreeMap::new();
        no_storage.insert("step".to_string(), Entry::Bytes { storage: at(0, "") });
        assert_eq!(
            message(rank_entries(1, &no_storage, &mut files)),
            "Validation: rank 1: byte object step has no storage_data entry; nothing committed"
        );
    }

    /// `.metadata` is created if absent, left when identical, refused when another, and replaced
    /// when stale.
    #[test]
    fn publish_creates_keeps_refuses_or_replaces_the_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        assert_eq!(
            publish(&loc, b"m1".to_vec(), false).unwrap(),
            Published::Created
        );
        assert_eq!(
            publish(&loc, b"m1".to_vec(), false).unwrap(),
            Published::AlreadyMerged
        );
        assert!(message(publish(&loc, b"m2".to_vec(), false)).contains(
            "already holds a .metadata that is not the merge of its rank-local metadata"
        ));
        assert_eq!(loc.read(METADATA_FILE).unwrap(), Some(b"m1".to_vec()));
        assert_eq!(
            publish(&loc, b"m2".to_vec(), true).unwrap(),
            Published::ReplacedStale
        );
        assert_eq!(loc.read(METADATA_FILE).unwrap(), Some(b"m2".to_vec()));
    }

    #[test]
    fn metadata_older_than_a_rank_local_file_is_stale() {
        let merged = [
            listed("__0.metadata", 10.0),
            listed("__1.metadata", 9.0),
            listed(METADATA_FILE, 8.0),
        ];
        assert!(stale_metadata(&merged).is_empty());
        let rerun = [
            listed("__0.metadata", 1.0),
            listed("__1.metadata", 9.0),
            listed(METADATA_FILE, 8.0),
            listed("__0_0.distcp", 0.5),
        ];
        assert_eq!(stale_metadata(&rerun), ["__0.metadata (7.000s later)"]);
        assert!(stale_metadata(&rerun[..2]).is_empty(), "no .metadata");
    }

    #[test]
    fn names_of_rank_local_and_data_files() {
        assert_eq!(metadata_rank("__0.metadata"), Some(0));
        assert_eq!(metadata_rank("__12.metadata"), Some(12));
        for not in [
            "__01.metadata",
            "__.metadata",
            "__1.metadata.tmp",
            METADATA_FILE,
            "__a.metadata",
        ] {
            assert_eq!(metadata_rank(not), None, "{not}");
        }
        assert_eq!(data_rank("__3_0.distcp"), Some(3));
        assert_eq!(data_rank("__3_12.distcp"), Some(3));
        for not in [
            "__3.distcp",
            "__3_x.distcp",
            "__3_0.distcp.tmp",
            "3_0.distcp",
        ] {
            assert_eq!(data_rank(not), None, "{not}");
        }
    }
}
