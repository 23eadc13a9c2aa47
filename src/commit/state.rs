//! What state a checkpoint directory and each of its saves are in: the one definition of
//! "committed", used by the save itself, `shardwise status`/`merge`, and the Python side (tracker,
//! retention).
//!
//! A directory is **committed** when its `.metadata` is the one a commit wrote and every file that
//! commit names is there:
//! - written by shardwise: a save's `COMMITTED` record ([`CommitRecord`]) whose `.metadata` size
//!   and CRC-32 equal the file's, whose data files all have at least their recorded sizes, whose
//!   `common.pt` has its recorded size and CRC-32, and whose `metadata.json` is there for Megatron
//!   saves;
//! - written by torch or Megatron (no `COMMITTED` record): `.metadata` parses as DCP metadata (as
//!   data, nothing executed), and every file it names lies inside the directory and is long enough
//!   for every item stored in it.
//!
//! A `.metadata` that a merger wrote before dying (no record yet) is not a checkpoint.

use std::collections::BTreeMap;

use super::gather::merge_problem;
use super::lock::dead_merger;
use super::part::{listed_parts, read_failed, read_part, Marker, STATE_DIR};
use super::record::{file_now, read_commit_record, CommitRecord, Digest, FileNow};
use super::wait::{stale_reason, Freshness};
use crate::error::Result;
use crate::format::metadata::Entry;
use crate::format::read_metadata::trailing_bytes;
use crate::format::METADATA_FILE;
use crate::format::{COMMON_FILE, METADATA_JSON_FILE};
use crate::storage::Location;

/// The state of a checkpoint directory.
#[derive(Clone, Debug, PartialEq)]
pub enum CheckpointState {
    /// `.metadata` and every file it needs are there. `record` is the commit's, `None` for a
    /// checkpoint written by torch or Megatron.
    Committed {
        /// The commit's record (`.shardwise/S/COMMITTED`).
        record: Option<CommitRecord>,
    },
    /// No checkpoint: no `.metadata`, or one that a merger left before committing.
    NotCommitted {
        /// Why: no `.metadata`, or the merger's state.
        reason: String,
    },
    /// A checkpoint was committed here but is no longer whole (`.metadata` or a file it needs was
    /// removed, replaced or truncated). `repairable` names the save whose parts can rebuild it.
    Damaged {
        /// Why the checkpoint is not whole.
        reason: String,
        /// The save whose parts can rebuild it (`shardwise merge --repair`), if any.
        repairable: Option<String>,
    },
}

/// Save ids under `.shardwise`, sorted.
///
/// Errors: storage errors when the directory exists but cannot be listed.
pub fn save_ids(loc: &Location) -> Result<Vec<String>> {
    let (_, mut ids) = loc.list(STATE_DIR)?;
    ids.sort();
    Ok(ids)
}

/// Why a checkpoint that a save committed is no longer whole, and the save whose parts can
/// rebuild it: the fields of [`CheckpointState::Damaged`], which a reader refusing a replaced
/// `.metadata` reports too ([`MetadataWriter::Replaced`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Damage {
    /// Why the checkpoint is not whole.
    pub reason: String,
    /// The save whose parts can rebuild it (`shardwise merge --repair`), if any.
    pub repairable: Option<String>,
}

impl Damage {
    /// The reason with what fixes it, for a reader of `loc`: `merge --repair` when the parts can
    /// rebuild it (otherwise the reason already says what to do instead).
    pub fn with_fix(&self, loc: &Location) -> String {
        match &self.repairable {
            Some(id) => format!(
                "{}; `shardwise merge --repair {loc}` rebuilds it from save {id}'s parts",
                self.reason
            ),
            None => self.reason.clone(),
        }
    }
}

impl From<Damage> for CheckpointState {
    fn from(d: Damage) -> CheckpointState {
        CheckpointState::Damaged {
            reason: d.reason,
            repairable: d.repairable,
        }
    }
}

/// The state of `loc` (see the module docs for the rules).
///
/// Errors: storage errors when `.metadata` or the state directory cannot be read.
pub fn checkpoint_state(loc: &Location) -> Result<CheckpointState> {
    let ids = save_ids(loc)?;
    let Records {
        records,
        legacy_marker,
    } = commit_records(loc, &ids);
    if records.is_empty() {
        return unrecorded_state(loc, &ids, legacy_marker);
    }
    let r = match metadata_record(loc, &records, None)? {
        Ok(r) => r,
        Err(found) => return Ok(metadata_damage(loc, &ids, &records, found)?.into()),
    };
    if let Some(problem) = missing_committed_file(loc, r)? {
        return Ok(damage(loc, &ids, &records, problem, r)?.into());
    }
    Ok(CheckpointState::Committed {
        record: Some(r.clone()),
    })
}

/// The damage of a directory whose saves left `records` (newest first) when its `.metadata` is not
/// one their commits wrote: `found` ([`metadata_record`]).
///
/// Errors: as [`damage`].
fn metadata_damage(
    loc: &Location,
    ids: &[String],
    records: &[CommitRecord],
    found: Found,
) -> Result<Damage> {
    let r = &records[0];
    let (m, id) = (r.metadata, &r.save_id);
    let reason = match found {
        Found::Absent => format!(".metadata is missing, although save {id} committed it"),
        Found::Other { size, crc32 } => format!(
            ".metadata ({size} bytes{}) is not the one save {id} committed ({} bytes, CRC-32 \
             {:08x}): replaced or damaged",
            crc32.map_or(String::new(), |c| format!(", CRC-32 {c:08x}")),
            m.size,
            m.crc32
        ),
        Found::Trailing { record, trailing } => {
            let r = &records[record];
            let reason = format!(
                ".metadata is the one save {} committed ({} bytes, CRC-32 {:08x}) followed by {} \
                 bytes that no writer leaves: appended since the commit (torch's pickle.load \
                 stops before them)",
                r.save_id, r.metadata.size, r.metadata.crc32, trailing
            );
            return damage(loc, ids, records, reason, r);
        }
    };
    damage(loc, ids, records, reason, r)
}

/// The damage `reason` to the checkpoint that `save` committed: repairable from `save`'s parts
/// when they would merge; otherwise the reason says what commits instead.
///
/// Errors: storage errors when a save cannot be listed or a file cannot be checked.
fn damage(
    loc: &Location,
    ids: &[String],
    records: &[CommitRecord],
    reason: String,
    save: &CommitRecord,
) -> Result<Damage> {
    let Some(why) = unmergeable(loc, &save.save_id)? else {
        return Ok(Damage {
            reason,
            repairable: Some(save.save_id.clone()),
        });
    };
    // A later save that stopped mid-commit (`overwrite`: its common.pt renamed into
    // place, its .metadata not yet) may still commit.
    let uncommitted: Vec<&String> = ids
        .iter()
        .filter(|id| !records.iter().any(|r| &r.save_id == *id))
        .collect();
    let (mergeable, _) = mergeable_saves(loc, &uncommitted)?;
    let instead = match mergeable.as_slice() {
        [] => "save again".to_string(),
        [one] => format!("`shardwise merge --save-id {one}` commits that save instead"),
        many => format!(
            "`shardwise merge --save-id ID` commits one of {} instead",
            many.join(", ")
        ),
    };
    Ok(Damage {
        reason: format!(
            "{reason}; save {}'s parts cannot rebuild it ({why}): {instead}",
            save.save_id
        ),
        repairable: None,
    })
}

/// The state of a directory whose saves (`ids`) left no commit record: no checkpoint, a
/// `.metadata` a merger left before committing, or one written by torch or Megatron (or
/// shardwise < 0.2, `legacy_marker`).
///
/// Errors: storage errors when `.metadata` cannot be read or a save cannot be listed.
fn unrecorded_state(
    loc: &Location,
    ids: &[String],
    legacy_marker: bool,
) -> Result<CheckpointState> {
    // Mapped locally: the decoder reads the pickle up to its STOP, never bytes after it.
    let Some(meta) = loc.read_held(METADATA_FILE)? else {
        return Ok(CheckpointState::NotCommitted {
            reason: ".metadata is absent".into(),
        });
    };
    if !ids.is_empty() && !legacy_marker {
        // `merge` takes the one uncommitted save by itself, else the one named by --save-id;
        // recommended only for a save whose parts it would take.
        let (mergeable, why_not) = mergeable_saves(loc, &ids.iter().collect::<Vec<_>>())?;
        let advice = match (ids.len(), mergeable.as_slice()) {
            (1, [_]) => "`shardwise merge` finishes it".to_string(),
            (_, [one]) => format!("`shardwise merge --save-id {one}` finishes it"),
            (_, []) => format!("no save's parts can finish it ({})", why_not.join("; ")),
            (_, many) => format!(
                "`shardwise merge --save-id ID` finishes it, ID one of {}",
                many.join(", ")
            ),
        };
        return Ok(CheckpointState::NotCommitted {
            reason: format!(
                ".metadata was written by a merger that did not finish the commit (no COMMITTED \
                 record); {advice}"
            ),
        });
    }
    Ok(match foreign_problem(loc, &meta)? {
        None => CheckpointState::Committed { record: None },
        Some(reason) => CheckpointState::Damaged {
            reason,
            repairable: None,
        },
    })
}

/// The commit records of saves `ids` of `loc`, newest first.
struct Records {
    records: Vec<CommitRecord>,
    /// A save of shardwise < 0.2 left its empty `COMMITTED` marker (no record to match).
    legacy_marker: bool,
}

fn commit_records(loc: &Location, ids: &[String]) -> Records {
    let mut records = Vec::new();
    let mut legacy_marker = false;
    for id in ids {
        if let Some(r) = read_commit_record(loc, id) {
            records.push(r);
        } else if loc.exists(&Marker::Committed.rel(id)) {
            legacy_marker = true;
        }
    }
    records.sort_by_key(|r| std::cmp::Reverse(r.committed_at_ns));
    Records {
        records,
        legacy_marker,
    }
}

/// A `.metadata` that no record of its directory wrote ([`metadata_record`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Found {
    /// There is none.
    Absent,
    /// Other bytes, of `size`; `crc32` when they were read (a size some record has).
    Other {
        /// Size in bytes.
        size: u64,
        /// CRC-32 of the whole file, when read.
        crc32: Option<u32>,
    },
    /// The `.metadata` of `records[record]`, followed by `trailing` more bytes.
    Trailing {
        /// Index into the records.
        record: usize,
        /// Bytes after those the record's commit wrote.
        trailing: u64,
    },
}

/// The record among `records` (newest first) whose commit wrote the `.metadata` of `loc`: the one
/// rule for "which save wrote `.metadata`" (commit state, retention, and the reader's choice of
/// checksums all ask it).
/// - `read`: the `.metadata` bytes the caller already holds; the record is the one with their size
///   and CRC-32 (these bytes, not a later file, are the ones being trusted).
/// - Otherwise by the file's storage stamp alone while it has the one a record holds (no read:
///   this is what keeps `status` and retention O(1) in the `.metadata` size), else by the size and
///   CRC-32 of the file.
///
/// Only as many bytes as the longest record no longer than the file are looked at (read, or
/// hashed of `read`): a `.metadata` grown by gigabytes costs no more than the committed one.
/// `Err`: which `.metadata` it is instead ([`Found`]), the newest record's followed by trailing
/// bytes among them.
///
/// Errors: storage errors.
pub(crate) fn metadata_record<'a>(
    loc: &Location,
    records: &'a [CommitRecord],
    read: Option<&[u8]>,
) -> Result<std::result::Result<&'a CommitRecord, Found>> {
    let size = match read {
        Some(meta) => meta.len() as u64,
        None => {
            let Some(stamp) = loc.stamp(METADATA_FILE)? else {
                return Ok(Err(Found::Absent));
            };
            if let Some(r) = records
                .iter()
                .find(|r| r.metadata_stamp.as_deref() == Some(stamp.as_str()))
            {
                return Ok(Ok(r));
            }
            match loc.size(METADATA_FILE)? {
                Some(size) => size,
                None => return Ok(Err(Found::Absent)),
            }
        }
    };
    let Some(longest) = records
        .iter()
        .map(|r| r.metadata.size)
        .filter(|&n| n <= size)
        .max()
    else {
        return Ok(Err(Found::Other { size, crc32: None }));
    };
    let held;
    let prefix: &[u8] = match read {
        Some(meta) => &meta[..longest as usize],
        None => {
            held = loc.open_data(METADATA_FILE)?.read_range(0..longest)?;
            &held
        }
    };
    let digest = |n: u64| Digest::of(&prefix[..(n as usize).min(prefix.len())]);
    if let Some(r) = records
        .iter()
        .find(|r| r.metadata.size == size && digest(size) == r.metadata)
    {
        return Ok(Ok(r));
    }
    if let Some(k) = records
        .iter()
        .position(|r| r.metadata.size < size && digest(r.metadata.size) == r.metadata)
    {
        return Ok(Err(Found::Trailing {
            record: k,
            trailing: size - records[k].metadata.size,
        }));
    }
    let crc32 = (longest == size).then(|| digest(size).crc32);
    Ok(Err(Found::Other { size, crc32 }))
}

/// Who wrote a checkpoint's current `.metadata`, as far as shardwise can tell.
#[derive(Clone, Debug, PartialEq)]
pub enum MetadataWriter {
    /// The commit of a shardwise save, by its record (same `.metadata` size and CRC-32).
    Commit(CommitRecord),
    /// No save left a commit record: torch, Megatron, or shardwise < 0.2.
    Unrecorded,
    /// Saves left records, none of them of this `.metadata`: another writer replaced it (or it
    /// was damaged). The damage is the one [`checkpoint_state`] reports for these bytes.
    Replaced(Damage),
}

/// Who wrote `.metadata` bytes `meta` of `loc` ([`metadata_record`]; the newest matching record
/// wins), and when no save did although saves left records, the damage [`checkpoint_state`]
/// reports (its parts are read then, to say whether they can rebuild it).
///
/// Errors: storage errors listing the saves.
pub fn metadata_writer(loc: &Location, meta: &[u8]) -> Result<MetadataWriter> {
    let ids = save_ids(loc)?;
    let Records { records, .. } = commit_records(loc, &ids);
    if records.is_empty() {
        return Ok(MetadataWriter::Unrecorded);
    }
    Ok(match metadata_record(loc, &records, Some(meta))? {
        Ok(r) => MetadataWriter::Commit(r.clone()),
        Err(found) => MetadataWriter::Replaced(metadata_damage(loc, &ids, &records, found)?),
    })
}

/// Whether `loc` holds a committed checkpoint ([`checkpoint_state`]); unreadable counts as not.
pub fn is_committed(loc: &Location) -> bool {
    matches!(checkpoint_state(loc), Ok(CheckpointState::Committed { .. }))
}

/// The first file a shardwise commit needs that is missing or has changed.
///
/// A data file is needed up to its committed size, as a torch or Megatron `.metadata` needs its
/// files up to their last item ([`foreign_problem`]): a loader reads every item at its recorded
/// offset and length and never past them, so bytes appended after the commit change nothing it
/// reads, and `verify` (which reads every item, against its save-time CRC-32) finds the
/// checkpoint whole. Shorter is damage: an item is cut.
fn missing_committed_file(loc: &Location, r: &CommitRecord) -> Result<Option<String>> {
    for (name, size) in &r.files {
        let found = loc.size(name)?;
        if found.is_none_or(|f| f < *size) {
            let found = found.map_or("is missing".into(), |s| format!("has {s} bytes"));
            return Ok(Some(format!(
                "data file {name} {found}, save {} committed {size} bytes",
                r.save_id
            )));
        }
    }
    if let Some(d) = r.common {
        let now = match file_now(loc, COMMON_FILE, d, r.common_stamp.as_deref())? {
            FileNow::Holds => None,
            FileNow::Missing => Some("missing".to_string()),
            FileNow::Differs(n) => Some(format!("{} bytes, CRC-32 {:08x}", n.size, n.crc32)),
        };
        if let Some(now) = now {
            return Ok(Some(format!(
                "{COMMON_FILE} is {now} (save {} committed {} bytes, CRC-32 {:08x})",
                r.save_id, d.size, d.crc32
            )));
        }
    }
    if r.megatron && !loc.exists(METADATA_JSON_FILE) {
        return Ok(Some(format!(
            "metadata.json is missing (save {} is a Megatron save)",
            r.save_id
        )));
    }
    Ok(None)
}

/// The files a torch or Megatron `.metadata` names, each with the length it needs (bytes), or why
/// it is not DCP metadata, or bytes follow its pickle ([`trailing_bytes`]).
fn needed_files(meta: &[u8]) -> std::result::Result<BTreeMap<String, u64>, String> {
    let parsed = crate::format::read_metadata::read_metadata(meta)
        .map_err(|e| format!(".metadata is not DCP metadata: {}", e.0))?;
    if let Some(why) = trailing_bytes(meta.len() as u64, parsed.pickle_len) {
        return Err(why);
    }
    let mut need: BTreeMap<String, u64> = BTreeMap::new();
    for entry in parsed.entries.values() {
        let storages: Vec<_> = match entry {
            Entry::Tensor { chunks, .. } => chunks.iter().map(|c| &c.storage).collect(),
            Entry::Bytes { storage } => vec![storage],
        };
        for s in storages {
            let end = s.offset.saturating_add(s.length);
            let e = need.entry(s.relative_path.clone()).or_default();
            *e = (*e).max(end);
        }
    }
    Ok(need)
}

/// For a checkpoint without a commit record: why its `.metadata` is not a whole checkpoint.
fn foreign_problem(loc: &Location, meta: &[u8]) -> Result<Option<String>> {
    let need = match needed_files(meta) {
        Ok(n) => n,
        Err(why) => return Ok(Some(why)),
    };
    // Every name is confined to the directory: `read_metadata` refuses any other.
    for (name, end) in need {
        if name.is_empty() {
            return Ok(Some(
                ".metadata names no file for an item (a chunk without a storage_data entry)".into(),
            ));
        }
        match loc.size(&name)? {
            Some(size) if size >= end => {}
            found => {
                let found = found.map_or("is missing".into(), |s| format!("has {s} bytes"));
                return Ok(Some(format!(
                    "data file {name} {found}; .metadata needs {end} bytes"
                )));
            }
        }
    }
    Ok(None)
}

/// The data files a committed checkpoint in state `state` reads, by name (empty when not
/// committed): what a save with `overwrite` must not write to before its own commit.
///
/// Errors: storage errors reading `.metadata`.
pub fn files_in_use(loc: &Location, state: &CheckpointState) -> Result<Vec<String>> {
    Ok(match state {
        CheckpointState::Committed { record: Some(r) } => {
            r.files.iter().map(|(n, _)| n.clone()).collect()
        }
        CheckpointState::Committed { record: None } => match loc.read(METADATA_FILE)? {
            Some(meta) => needed_files(&meta)
                .unwrap_or_default()
                .into_keys()
                .collect(),
            None => Vec::new(),
        },
        _ => Vec::new(),
    })
}

/// The state of one save (`.shardwise/<save_id>`), for `shardwise status`.
#[derive(Clone, Debug, PartialEq)]
pub enum SaveState {
    /// The save committed.
    Committed,
    /// A live merger holds the `COMMITTING` lock.
    Merging,
    /// The merger died holding the lock (`holder`: its pid and host); `shardwise merge` takes over.
    Interrupted {
        /// The dead merger's pid and host.
        holder: String,
    },
    /// The merger gave up; `mergeable` when `shardwise merge` would now commit.
    Failed {
        /// The merger's reason.
        reason: String,
        /// Every rank's part is now present, its data files unchanged, and the parts pass every
        /// check the merge makes (`gather::merge_problem`): `shardwise merge` would commit.
        mergeable: bool,
    },
    /// Waiting for parts (see [`crate::commit::wait::missing_ranks`]); `stale` parts describe
    /// files that changed since they were published.
    Incomplete {
        /// Ranks whose part was ignored, with why (an earlier attempt's, or its data file changed).
        stale: Vec<(u32, String)>,
    },
}

impl SaveState {
    /// One line for people.
    pub fn describe(&self) -> String {
        match self {
            SaveState::Committed => "committed".into(),
            SaveState::Merging => "merging".into(),
            SaveState::Interrupted { holder } => format!(
                "interrupted: its merger ({holder}) died holding the lock; `shardwise merge` takes over"
            ),
            SaveState::Failed { reason, mergeable } => {
                if *mergeable {
                    format!(
                        "failed earlier ({reason}), but every rank's part is now present: \
                         `shardwise merge` would commit it"
                    )
                } else {
                    format!("failed: {reason}")
                }
            }
            SaveState::Incomplete { stale } => {
                let mut s = "not committed".to_string();
                for (r, why) in stale {
                    s += &format!("; rank {r}: {why}");
                }
                s
            }
        }
    }

    /// A short name for `--json`.
    pub fn name(&self) -> &'static str {
        match self {
            SaveState::Committed => "committed",
            SaveState::Merging => "merging",
            SaveState::Interrupted { .. } => "interrupted",
            SaveState::Failed { .. } => "failed",
            SaveState::Incomplete { .. } => "incomplete",
        }
    }
}

/// The state of save `save_id` with `world_size` ranks (0 when unknown: no part is readable).
///
/// Errors: storage errors when the save cannot be listed.
pub fn save_state(loc: &Location, save_id: &str, world_size: u32) -> Result<SaveState> {
    if loc.exists(&Marker::Committed.rel(save_id)) {
        return Ok(SaveState::Committed);
    }
    if let Some(holder) = dead_merger(loc, save_id) {
        return Ok(SaveState::Interrupted { holder });
    }
    if loc.exists(&Marker::Committing.rel(save_id)) {
        return Ok(SaveState::Merging);
    }
    let (present, stale) = part_states(loc, save_id, world_size)?;
    let complete = world_size > 0 && present.iter().all(|&p| p);
    if let Some(f) = read_failed(loc, save_id) {
        // Recommended only when the merge would commit: the parts that are all there now pass
        // every check the merge makes (a save that failed its validation fails it again).
        let mergeable = complete && merge_problem(loc, save_id, world_size)?.is_none();
        return Ok(SaveState::Failed {
            reason: f.reason,
            mergeable,
        });
    }
    Ok(SaveState::Incomplete { stale })
}

/// Per rank, whether it has a part a merge takes; and each listed part it would not take, with why.
type PartStates = (Vec<bool>, Vec<(u32, String)>);

/// Per rank of `0..world_size`: whether save `save_id` has a part that a merge would take (readable,
/// its files unchanged since it was published: [`stale_reason`], the check `merge` makes), and
/// why each other listed part would not be taken.
///
/// Errors: storage errors when the save cannot be listed or a file cannot be checked.
fn part_states(loc: &Location, save_id: &str, world_size: u32) -> Result<PartStates> {
    let any = Freshness {
        since_ns: None,
        failed_since_ns: 0,
    };
    let mut present = vec![false; world_size as usize];
    let mut stale = Vec::new();
    for (r, _) in listed_parts(loc, save_id)? {
        if r >= world_size {
            continue;
        }
        let why = match read_part(loc, &super::part::part_rel(save_id, r)) {
            Ok(p) => stale_reason(loc, &p, &any)?,
            Err(e) => Some(format!("unreadable part: {e}")),
        };
        match why {
            None => present[r as usize] = true,
            Some(why) => stale.push((r, why)),
        }
    }
    Ok((present, stale))
}

/// Why the parts of save `save_id` would not merge now (`merge`, `merge --repair`), or None when
/// they would: every rank of the `world_size` they record has a part [`part_states`] takes. What
/// `status` checks before it recommends either command, and `repair` before it changes anything.
///
/// Errors: storage errors when the save cannot be listed or a file cannot be checked.
pub fn unmergeable(loc: &Location, save_id: &str) -> Result<Option<String>> {
    let listed = listed_parts(loc, save_id)?;
    let Some(world_size) = listed
        .iter()
        .find_map(|(r, _)| read_part(loc, &super::part::part_rel(save_id, *r)).ok())
        .map(|p| p.world_size)
    else {
        return Ok(Some("no readable part".into()));
    };
    let (present, stale) = part_states(loc, save_id, world_size)?;
    let missing: Vec<String> = (0..world_size)
        .filter(|&r| !present[r as usize] && !stale.iter().any(|(s, _)| *s == r))
        .map(|r| r.to_string())
        .collect();
    let mut why: Vec<String> = stale
        .into_iter()
        .map(|(r, w)| format!("rank {r}: {w}"))
        .collect();
    if !missing.is_empty() {
        why.push(format!("no part from ranks [{}]", missing.join(", ")));
    }
    Ok((!why.is_empty()).then(|| why.join("; ")))
}

/// Of saves `ids`, those whose parts would merge, and why each other would not.
///
/// Errors: as [`unmergeable`].
fn mergeable_saves<'i>(loc: &Location, ids: &[&'i String]) -> Result<(Vec<&'i str>, Vec<String>)> {
    let mut mergeable = Vec::new();
    let mut why_not = Vec::new();
    for id in ids {
        match unmergeable(loc, id)? {
            None => mergeable.push(id.as_str()),
            Some(why) => why_not.push(format!("save {id}: {why}")),
        }
    }
    Ok((mergeable, why_not))
}

/// Data files (`__<rank>_<n>.distcp`) in `loc` that no committed record and no part names: what
/// ranks that died before publishing their part left behind.
///
/// Errors: storage errors when `loc` cannot be listed.
pub fn orphaned_data_files(loc: &Location) -> Result<Vec<String>> {
    let (files, _) = loc.list("")?;
    let mut named = std::collections::HashSet::new();
    for id in save_ids(loc)? {
        if let Some(r) = read_commit_record(loc, &id) {
            // The record names the files of every part of its save: the parts (whose item
            // records grow with the chunks) need not be read.
            named.extend(r.files.into_iter().map(|(n, _)| n));
            continue;
        }
        for (rank, _) in listed_parts(loc, &id)? {
            if let Ok(p) = read_part(loc, &super::part::part_rel(&id, rank)) {
                named.extend(p.files.into_iter().map(|f| f.name));
            }
        }
    }
    if named.is_empty() && loc.exists(METADATA_FILE) {
        // A torch or Megatron checkpoint: its files are named by .metadata.
        return Ok(Vec::new());
    }
    let mut orphans: Vec<String> = files
        .into_iter()
        .map(|f| f.name)
        .filter(|n| is_data_file_name(n) && !named.contains(n))
        .collect();
    orphans.sort();
    Ok(orphans)
}

/// `__<rank>_<n>.distcp`, the data-file names torch's `FileSystemWriter` and shardwise use.
pub fn is_data_file_name(name: &str) -> bool {
    let Some(stem) = name
        .strip_prefix("__")
        .and_then(|s| s.strip_suffix(".distcp"))
    else {
        return false;
    };
    let mut it = stem.split('_');
    matches!(
        (it.next(), it.next(), it.next()),
        (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty()
            && a.bytes().all(|c| c.is_ascii_digit()) && b.bytes().all(|c| c.is_ascii_digit())
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::testing::committed;

    /// The one rule for "which save wrote `.metadata`": by the storage stamp without reading while
    /// the file keeps it (so a same-size rewrite that kept the mtime passes: the documented price of
    /// O(1) status), by the bytes the caller holds when given, else by reading the file.
    #[test]
    fn metadata_record_by_stamp_by_held_bytes_then_by_reading() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        committed(&loc, "s", 2, true);
        let Records { records, .. } = commit_records(&loc, &save_ids(&loc).unwrap());
        assert_eq!(records.len(), 1);
        assert!(records[0].metadata_stamp.is_some());
        let path = dir.path().join(METADATA_FILE);
        let original = std::fs::read(&path).unwrap();
        let found = |read: Option<&[u8]>| {
            metadata_record(&loc, &records, read)
                .unwrap()
                .map(|r| r.save_id.clone())
        };
        assert_eq!(found(None), Ok("s".into()));
        // Same size, other bytes, the old mtime put back: the stamp still matches, no read.
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        let mut other = original.clone();
        other[0] ^= 0xff;
        std::fs::write(&path, &other).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(found(None), Ok("s".into()));
        // The bytes a reader holds are judged by their own digest.
        let other_found = Found::Other {
            size: other.len() as u64,
            crc32: Some(Digest::of(&other).crc32),
        };
        assert_eq!(found(Some(&other)), Err(other_found.clone()));
        assert_eq!(found(Some(&original)), Ok("s".into()));
        // A new mtime (past the kernel's coarse clock tick): the stamp no longer matches, the
        // file is read.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&path, &other).unwrap();
        assert_eq!(found(None), Err(other_found));
        std::fs::write(&path, &original).unwrap();
        assert_eq!(found(None), Ok("s".into()));
        // Bytes appended: only the committed length is read, and the record is named.
        let mut grown = original.clone();
        grown.extend_from_slice(&[0; 100]);
        std::fs::write(&path, &grown).unwrap();
        let trailing = Found::Trailing {
            record: 0,
            trailing: 100,
        };
        assert_eq!(found(None), Err(trailing.clone()));
        assert_eq!(found(Some(&grown)), Err(trailing));
        // Shorter than any record: nothing to read.
        std::fs::write(&path, &original[..10]).unwrap();
        let short = Found::Other {
            size: 10,
            crc32: None,
        };
        assert_eq!(found(None), Err(short));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(found(None), Err(Found::Absent));
        assert!(matches!(
            metadata_writer(&loc, &other).unwrap(),
            MetadataWriter::Replaced(_)
        ));
    }

    /// The state a damaged committed directory must have.
    #[derive(Debug, PartialEq)]
    enum Want {
        Committed {
            recorded: bool,
        },
        NotCommitted(&'static str),
        Damaged {
            repairable: bool,
            reason: &'static str,
        },
    }
    use Want::*;

    /// Damages the directory of a committed checkpoint.
    type Damage = fn(&std::path::Path);

    /// The one definition of "committed", as tables (the tests below, one per kind of damage):
    /// each damage to a committed directory (save `s` of 2 ranks) and the state it gives;
    /// `is_committed` agrees with each.
    fn assert_states(cases: &[(&str, Damage, Want)]) {
        for (what, damage, want) in cases {
            let dir = tempfile::tempdir().unwrap();
            let loc = Location::local(dir.path());
            committed(&loc, "s", 2, true);
            damage(dir.path());
            let got = checkpoint_state(&loc).unwrap();
            let matches = match (&got, want) {
                (CheckpointState::Committed { record }, Committed { recorded }) => {
                    record.is_some() == *recorded
                }
                (CheckpointState::NotCommitted { reason }, NotCommitted(r)) => reason.contains(r),
                (
                    CheckpointState::Damaged {
                        reason,
                        repairable: rep,
                    },
                    Damaged {
                        repairable,
                        reason: r,
                    },
                ) => reason.contains(r) && (rep.as_deref() == Some("s")) == *repairable,
                _ => false,
            };
            assert!(matches, "{what}: got {got:?}, want {want:?}");
            assert_eq!(
                is_committed(&loc),
                matches!(want, Committed { .. }),
                "{what}"
            );
        }
    }

    #[test]
    fn an_intact_checkpoint_is_committed() {
        assert_states(&[
            ("whole", |_| {}, Committed { recorded: true }),
            (
                // Bytes past every item: nothing a loader reads changed.
                "data file grown",
                |d| {
                    use std::io::Write;
                    let mut f = std::fs::OpenOptions::new()
                        .append(true)
                        .open(d.join("__1_0.distcp"))
                        .unwrap();
                    f.write_all(b"appended").unwrap()
                },
                Committed { recorded: true },
            ),
            (
                "written by torch (no shardwise state)",
                |d| std::fs::remove_dir_all(d.join(".shardwise")).unwrap(),
                Committed { recorded: false },
            ),
        ]);
    }

    /// What the commit wrote from the parts (`.metadata`, `metadata.json`) can be written again.
    #[test]
    fn lost_commit_files_are_repairable() {
        assert_states(&[
            (
                ".metadata removed",
                |d| std::fs::remove_file(d.join(METADATA_FILE)).unwrap(),
                Damaged {
                    repairable: true,
                    reason: ".metadata is missing, although save s committed it",
                },
            ),
            (
                ".metadata replaced",
                |d| std::fs::write(d.join(METADATA_FILE), b"other").unwrap(),
                Damaged {
                    repairable: true,
                    reason: "is not the one save s committed",
                },
            ),
            (
                "metadata.json removed",
                |d| std::fs::remove_file(d.join("metadata.json")).unwrap(),
                Damaged {
                    repairable: true,
                    reason: "metadata.json is missing",
                },
            ),
        ]);
    }

    /// What the ranks wrote (data files, `common.pt`) cannot be rebuilt from the parts.
    #[test]
    fn damaged_rank_files_are_not_repairable() {
        assert_states(&[
            (
                "data file truncated",
                |d| std::fs::write(d.join("__1_0.distcp"), [0u8; 3]).unwrap(),
                Damaged {
                    repairable: false,
                    reason: "data file __1_0.distcp has 3 bytes, save s committed 80 bytes; save \
                             s's parts cannot rebuild it (rank 1: its data file __1_0.distcp was \
                             replaced or changed since the part was published): save again",
                },
            ),
            (
                "data file removed",
                |d| std::fs::remove_file(d.join("__0_0.distcp")).unwrap(),
                Damaged {
                    repairable: false,
                    reason: "data file __0_0.distcp is missing",
                },
            ),
            (
                "common.pt changed",
                |d| std::fs::write(d.join("common.pt"), b"PK commoN").unwrap(),
                Damaged {
                    repairable: false,
                    reason: "common.pt is 9 bytes, CRC-32",
                },
            ),
            (
                "written by torch, data file truncated",
                |d| {
                    std::fs::remove_dir_all(d.join(".shardwise")).unwrap();
                    std::fs::write(d.join("__1_0.distcp"), [0u8; 71]).unwrap()
                },
                Damaged {
                    repairable: false,
                    reason: "data file __1_0.distcp has 71 bytes; .metadata needs 72 bytes",
                },
            ),
        ]);
    }

    #[test]
    fn an_unfinished_commit_is_not_committed() {
        assert_states(&[
            (
                "merger died before COMMITTED",
                |d| std::fs::remove_file(d.join(".shardwise/s/COMMITTED")).unwrap(),
                NotCommitted("merger that did not finish the commit (no COMMITTED record); `shardwise merge` finishes it"),
            ),
            (
                "merger died before COMMITTED, a data file changed since",
                |d| {
                    std::fs::remove_file(d.join(".shardwise/s/COMMITTED")).unwrap();
                    std::fs::write(d.join("__1_0.distcp"), [0u8; 3]).unwrap()
                },
                NotCommitted("no save's parts can finish it (save s: rank 1: its data file"),
            ),
            (
                "empty directory",
                |d| {
                    std::fs::remove_dir_all(d).unwrap();
                    std::fs::create_dir(d).unwrap()
                },
                NotCommitted(".metadata is absent"),
            ),
        ]);
    }

    #[test]
    fn the_metadata_writer_is_the_newest_matching_record() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        assert_eq!(
            metadata_writer(&loc, b"x").unwrap(),
            MetadataWriter::Unrecorded
        );
        committed(&loc, "s", 1, false);
        let meta = loc.read(METADATA_FILE).unwrap().unwrap();
        assert!(
            matches!(metadata_writer(&loc, &meta).unwrap(), MetadataWriter::Commit(r) if r.save_id == "s")
        );
        // The damage a reader is told is the state `status` gives once the file holds those bytes.
        let MetadataWriter::Replaced(damage) = metadata_writer(&loc, b"other").unwrap() else {
            panic!("not replaced")
        };
        assert_eq!(damage.repairable.as_deref(), Some("s"));
        std::fs::write(dir.path().join(METADATA_FILE), b"other").unwrap();
        assert_eq!(checkpoint_state(&loc).unwrap(), damage.into());
    }

    #[test]
    fn data_file_names() {
        assert!(is_data_file_name("__0_0.distcp"));
        assert!(is_data_file_name("__12_3.distcp"));
        for n in [
            "__0.distcp",
            "__a_0.distcp",
            "_0_0.distcp",
            "__0_0_0.distcp",
            "__0_0.distcp.tmp",
        ] {
            assert!(!is_data_file_name(n), "{n}");
        }
    }
}
