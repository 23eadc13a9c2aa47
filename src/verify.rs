//! `shardwise verify`: proves a checkpoint whole, or lists every problem with key, file and offset.
//!
//! Checks, for everything a loader reads:
//! - the commit: the state `shardwise status` reports ([`checkpoint_state`]; not committed or
//!   damaged is a problem, a `.metadata` that no commit of the directory wrote among them), and
//!   for a checkpoint shardwise saved, that a checksum sidecar checks its reads;
//! - `.metadata`: the layout of every tensor key (bounds, overlaps, coverage), every item inside
//!   its file;
//! - items: that they decode (tensor items: dtype and shape as `.metadata` says), the CRC-32 of
//!   every zip record that carries one (torch writes real CRCs; its reader never checks them), and,
//!   for checkpoints shardwise wrote, the CRC-32 recorded for the item in the checksum sidecar
//!   (through the reader, which checks it on every read);
//! - the common state: `common.pt` (megatron-core ≤ 0.18) or the `common_state` object (0.19):
//!   zip CRCs and a `data.pkl` that decodes (megatron-core 0.16.1 `strategies/common.py`, 0.19.2
//!   `serialization.py`); for a checkpoint
//!   shardwise committed, `common.pt` whole against the size and CRC-32 its `COMMITTED` record
//!   holds (a changed byte that no zip record's CRC covers is found too);
//! - a torch DCP `use_collectives=False` directory: no rank-local `__{rank}.metadata` newer than
//!   `.metadata` (a stale merge, [`crate::dcp_local::stale_metadata`]);
//! - every pickle a load unpickles: `.metadata` (torch's `pickle.load`), each item's `data.pkl`
//!   (`torch.load`; megatron-core 0.19's `common_state` object among the byte objects) and
//!   `common.pt`'s: every global it would import must be one a checkpoint of that kind holds
//!   ([`crate::format::globals`]); any other (`posix.system`, ...) is a problem naming it, found
//!   without unpickling anything;
//! - `metadata.json`: a JSON object whose `sharded_backend` is `torch_dist` and with no field
//!   megatron-core ≤ 0.18's `CheckpointingConfig(**config)` would refuse (`dist_checkpointing/core.py`).
//!
//! The quick mode reads no payload: layout, file sizes, sidecar placement, `metadata.json`, the
//! globals of `.metadata`, that the common state exists, and each item's archive structure and
//! pickle as torch reads them (a tensor item's headers, `data.pkl` and central directory, a byte
//! object whole), with no CRC-32 computed.

use rayon::prelude::*;
use serde::Serialize;

use crate::commit::part::{marker_rel, STATE_DIR};
use crate::commit::record::Digest;
use crate::commit::state::{checkpoint_state, save_ids, CheckpointState, Damage};
use crate::error::{Error, Result};
use crate::format::archive::{bad_record_crcs, object_tensors, Archive};
use crate::format::globals::{scan, Pickle};
use crate::format::metadata::{check_layout, Chunk, Entry, StorageInfo};
use crate::format::sidecar::CHECKSUMS_FILE;
use crate::format::METADATA_FILE;
use crate::format::{COMMON_FILE, METADATA_JSON_FILE};
use crate::reader::{Checkpoint, COMMON_STATE_PREFIX};
use crate::storage::Location;

/// One problem found.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Problem {
    /// The item's key, or the file's name (`common.pt`, `metadata.json`) for a file outside DCP.
    pub key: String,
    /// The data file, for a problem in an item.
    pub file: Option<String>,
    /// The item's byte offset in that file.
    pub offset: Option<u64>,
    /// What is wrong.
    pub message: String,
}

/// What `verify` found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Keys checked.
    pub keys: usize,
    /// Items (chunks and byte objects) checked.
    pub items: usize,
    /// Items whose CRC-32 was checked against the sidecar (0 in quick mode).
    pub sidecar_checked: usize,
    /// True when item data was not read (`--quick`).
    pub quick: bool,
    /// Every problem found; empty when the checkpoint is whole.
    pub problems: Vec<Problem>,
}

struct Item<'a> {
    key: &'a str,
    chunk: Option<(usize, &'a Chunk)>,
    path: &'a str,
    offset: u64,
    length: u64,
}

/// Fields of `metadata.json` that megatron-core ≤ 0.18 accepts (`CheckpointingConfig`, core.py).
const METADATA_JSON_FIELDS: [&str; 4] = [
    "sharded_backend",
    "sharded_backend_version",
    "common_backend",
    "common_backend_version",
];

/// Verifies the checkpoint at `loc` (directory or object-store prefix), reading every item;
/// `items(total)` is called once `.metadata` is decoded, with the number of items it names, then
/// `progress(n)` as items complete.
///
/// Errors: only when `.metadata` itself (or the checksum sidecar) cannot be read or decoded
/// (naming the globals outside the allow-list that `.metadata` holds, if any); every other
/// finding is a [`Problem`] in the report.
pub fn verify(
    loc: &Location,
    items: &dyn Fn(u64),
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report> {
    run(loc, false, items, progress)
}

/// `verify --quick`: the checks that need no item data (layout, item bounds against the real file
/// sizes, sidecar placement, `metadata.json`, presence of the common state).
///
/// Errors: as [`verify`].
pub fn verify_quick(loc: &Location) -> Result<Report> {
    run(loc, true, &|_| {}, &|_| {})
}

fn run(
    loc: &Location,
    quick: bool,
    total: &dyn Fn(u64),
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report> {
    let (ckpt, damage) = match Checkpoint::open_as_found(loc) {
        Ok(c) => c,
        // A `.metadata` that is no DCP metadata may still be one that pickle.load runs: the
        // error then says what it would import.
        Err(Error::Corrupt { path, reason }) => {
            let named = metadata_globals(loc).ok().flatten();
            return Err(Error::Corrupt {
                path,
                reason: named.map_or(reason.clone(), |p| format!("{}; {reason}", p.message)),
            });
        }
        Err(e) => return Err(e),
    };
    let hostile = metadata_globals(ckpt.location())?;
    let mut report = Report {
        keys: ckpt.metadata.entries.len(),
        quick,
        problems: hostile.into_iter().collect(),
        ..Default::default()
    };
    let mut items = Vec::new();
    for (key, entry) in &ckpt.metadata.entries {
        match entry {
            Entry::Tensor {
                global_shape,
                chunks,
                ..
            } => {
                let refs: Vec<&Chunk> = chunks.iter().collect();
                let origin = |i: usize| {
                    format!(
                        "chunk #{i} ({}@{})",
                        chunks[i].storage.relative_path, chunks[i].storage.offset
                    )
                };
                if let Err(message) = check_layout(key, global_shape, &refs, &origin) {
                    report.problems.push(Problem {
                        key: key.clone(),
                        file: None,
                        offset: None,
                        message,
                    });
                }
                for (i, c) in chunks.iter().enumerate() {
                    items.push(Item {
                        key,
                        chunk: Some((i, c)),
                        path: &c.storage.relative_path,
                        offset: c.storage.offset,
                        length: c.storage.length,
                    });
                }
            }
            Entry::Bytes { storage } => items.push(Item {
                key,
                chunk: None,
                path: &storage.relative_path,
                offset: storage.offset,
                length: storage.length,
            }),
        }
    }
    report.items = items.len();
    total(items.len() as u64);
    report.problems.extend(check_megatron_files(&ckpt));
    let (listed, _) = loc.list("")?;
    let newer = crate::dcp_local::stale_metadata(&listed);
    if !newer.is_empty() {
        report.problems.push(Problem {
            key: METADATA_FILE.into(),
            file: Some(METADATA_FILE.into()),
            offset: None,
            message: format!(
                "stale: modified before {} (a later torch DCP use_collectives=False save into this \
                 directory); torch loads this .metadata and would read that save's bytes at the \
                 earlier save's offsets; `shardwise merge` replaces it",
                newer.join(", ")
            ),
        });
    }

    let results: Vec<(Vec<Problem>, bool)> = items
        .par_iter()
        .map(|it| {
            let r = if quick {
                (check_structure(&ckpt, it), false)
            } else {
                check_item(&ckpt, it)
            };
            progress(1);
            r
        })
        .collect();
    for (problems, checked) in results {
        report.problems.extend(problems);
        report.sidecar_checked += checked as usize;
    }
    // First: it explains the others (another save's `.metadata` places items elsewhere).
    if let Some(p) = commit_problem(&ckpt, damage, !report.problems.is_empty())? {
        report.problems.insert(0, p);
    }
    Ok(report)
}

/// What verify knows of a checkpoint's commit.
struct CommitFacts<'a> {
    /// The state `shardwise status` reports ([`checkpoint_state`]), or the reader's damage when
    /// it opened a `.metadata` that no commit of the directory wrote (`replaced`).
    state: &'a CheckpointState,
    replaced: bool,
    /// `.shardwise/` holds saves.
    saves: bool,
    /// Reads are checked against a checksum sidecar ([`Checkpoint::has_checksums`]).
    sidecar: bool,
    /// verify's other checks found problems.
    found: bool,
}

/// The problem of the checkpoint's commit, if any ([`commit_problem_of`]): the reader's damage
/// when `open_as_found` gave one (what it judged is the `.metadata` verified), else the state
/// `status` reports. `found`: verify's other checks found problems.
///
/// Errors: storage errors reading the commit state.
fn commit_problem(
    ckpt: &Checkpoint,
    damage: Option<Damage>,
    found: bool,
) -> Result<Option<Problem>> {
    let loc = ckpt.location();
    let replaced = damage.is_some();
    let state = match damage {
        Some(d) => d.into(),
        None => checkpoint_state(loc)?,
    };
    let facts = CommitFacts {
        state: &state,
        replaced,
        saves: !save_ids(loc)?.is_empty(),
        sidecar: ckpt.has_checksums(),
        found,
    };
    Ok(commit_problem_of(loc, &facts))
}

/// The problem of a checkpoint's commit, if any: not committed or damaged as `status` says, or
/// saved by shardwise but with no checksum sidecar for its `.metadata` (without this problem,
/// `0 checked against save-time CRC-32s: OK` passed a checkpoint whose sidecar was deleted). Pure.
fn commit_problem_of(loc: &Location, f: &CommitFacts) -> Option<Problem> {
    let (key, message) = match f.state {
        // A data file, `common.pt` or `metadata.json` that `status` finds damaged is one of
        // verify's own problems already, with its key, file and offset; the state is the problem
        // only where none shows it (bytes cut past every item).
        CheckpointState::Damaged { .. } if f.found && !f.replaced => return None,
        CheckpointState::NotCommitted { reason } => (
            METADATA_FILE.to_string(),
            format!("not committed, as `shardwise status {loc}` says: {reason}"),
        ),
        CheckpointState::Damaged { reason, repairable } => {
            let damage = Damage {
                reason: reason.clone(),
                repairable: repairable.clone(),
            };
            (
                METADATA_FILE.to_string(),
                format!(
                    "damaged, as `shardwise status {loc}` says: {}",
                    damage.with_fix(loc)
                ),
            )
        }
        CheckpointState::Committed { .. } if f.sidecar || !f.saves => return None,
        CheckpointState::Committed { record: Some(r) } => (
            marker_rel(&r.save_id, CHECKSUMS_FILE),
            format!(
                "missing: save {} committed this .metadata with its checksum sidecar; no item can \
                 be checked against its save-time CRC-32",
                r.save_id
            ),
        ),
        CheckpointState::Committed { record: None } => (
            STATE_DIR.to_string(),
            "holds shardwise saves but no checksum sidecar of this .metadata: no item can be \
             checked against a save-time CRC-32"
                .to_string(),
        ),
    };
    Some(Problem {
        key,
        file: None,
        offset: None,
        message,
    })
}

/// The problem with the globals of `.metadata`, if any (`.metadata` missing: none, `open` says so).
fn metadata_globals(loc: &Location) -> Result<Option<Problem>> {
    let Some(bytes) = loc.read_held(METADATA_FILE)? else {
        return Ok(None);
    };
    Ok(scan(Pickle::Metadata, &bytes)
        .message()
        .map(|message| Problem {
            key: METADATA_FILE.into(),
            file: Some(METADATA_FILE.into()),
            offset: None,
            message,
        }))
}

/// The problem with the `data.pkl` of a torch.save archive, if any: globals a load would import
/// outside the allow-list, a pickle that cannot be checked, a storage its persistent ids name
/// that torch would not read whole from its record, or a tensor torch would fail to rebuild.
fn data_pkl_globals(blob: &[u8], archive: &Archive) -> Option<String> {
    let Ok(r) = archive.data_pkl() else {
        return Some(format!("no {}data.pkl record", archive.folder));
    };
    let found = scan(Pickle::TorchSave, &blob[r.start..r.start + r.len]);
    if let Some(m) = found.message() {
        return Some(m);
    }
    // Only a pickle that imports nothing unexpected is decoded further.
    let storage = found
        .storages
        .iter()
        .find_map(|s| archive.storage(s).err().map(|e| e.0));
    storage.or_else(|| object_tensors(archive, blob).err().map(|e| e.0))
}

fn item_problem(it: &Item, message: String) -> Problem {
    Problem {
        key: it.key.to_string(),
        file: Some(it.path.to_string()),
        offset: Some(it.offset),
        message,
    }
}

/// Problems an item has before any of its bytes is read.
fn check_placement(ckpt: &Checkpoint, it: &Item) -> Vec<Problem> {
    if it.path.is_empty() {
        return vec![Problem {
            key: it.key.to_string(),
            file: None,
            offset: None,
            message: "no storage_data entry for this chunk in .metadata".into(),
        }];
    }
    let mut problems = Vec::new();
    match ckpt.file_size(it.path) {
        Err(e) => problems.push(item_problem(it, strip(e))),
        Ok(size) if it.offset.checked_add(it.length).is_none_or(|e| e > size) => {
            problems.push(item_problem(
                it,
                format!(
                    "item at offset {} length {} passes the end of the file ({size} bytes)",
                    it.offset, it.length
                ),
            ))
        }
        Ok(_) => {}
    }
    let offsets = it.chunk.map(|(_, c)| c.offsets.as_slice());
    if let Some(r) = ckpt.recorded(it.key, offsets) {
        if (r.relative_path.as_str(), r.offset, r.length) != (it.path, it.offset, it.length) {
            problems.push(item_problem(
                it,
                format!(
                    "the checksum sidecar places this item at {}@{}+{}, .metadata at {}@{}+{}",
                    r.relative_path, r.offset, r.length, it.path, it.offset, it.length
                ),
            ));
        }
    } else if ckpt.has_checksums() {
        problems.push(item_problem(
            it,
            "the checksum sidecar has no CRC-32 for this item (the sidecar belongs to another save)"
                .into(),
        ));
    }
    problems
}

/// Quick mode's check of one item: its placement, then its archive and pickle as torch reads
/// them, without reading or hashing its payload ([`Checkpoint::chunk_structure`]; a byte object
/// is read whole).
fn check_structure(ckpt: &Checkpoint, it: &Item) -> Vec<Problem> {
    let mut problems = check_placement(ckpt, it);
    if !problems.is_empty() {
        return problems;
    }
    let found = match it.chunk {
        Some((i, _)) => ckpt.chunk_structure(it.key, i).err().map(strip),
        None => match ckpt.item_unchecked(it.key, &storage_of(it), 1 << 34) {
            Err(e) => Some(strip(e)),
            Ok(blob) => match Archive::read(&blob[..]) {
                Ok(archive) => data_pkl_globals(&blob, &archive),
                Err(e) => Some(format!("not a torch.save archive: {}", e.0)),
            },
        },
    };
    problems.extend(found.map(|m| item_problem(it, m)));
    problems
}

fn storage_of(it: &Item) -> StorageInfo {
    StorageInfo {
        relative_path: it.path.into(),
        offset: it.offset,
        length: it.length,
    }
}

/// Reads one item: decoding, zip CRCs and (through the reader) the sidecar CRC.
fn check_item(ckpt: &Checkpoint, it: &Item) -> (Vec<Problem>, bool) {
    if it.path.is_empty() {
        return (check_placement(ckpt, it), false);
    }
    let offsets = it.chunk.map(|(_, c)| c.offsets.as_slice());
    let checked = ckpt.recorded(it.key, offsets).is_some();
    let mut problems = Vec::new();
    if !checked && ckpt.has_checksums() {
        problems.extend(check_placement(ckpt, it));
    }
    let blob = match it.chunk {
        Some((i, _)) => ckpt.chunk(it.key, i).map(|(d, _)| d.blob),
        None => ckpt.item(it.key, None, &storage_of(it), 1 << 34),
    };
    let blob = match blob {
        Ok(b) => b,
        Err(e) => {
            problems.push(item_problem(it, strip(e)));
            return (problems, checked);
        }
    };
    match Archive::read(&blob[..]) {
        Ok(archive) => problems.extend(
            bad_record_crcs(&blob, &archive.records)
                .into_iter()
                .chain(data_pkl_globals(&blob, &archive))
                .map(|m| item_problem(it, m)),
        ),
        Err(e) => problems.push(item_problem(
            it,
            format!("not a torch.save archive: {}", e.0),
        )),
    }
    (problems, checked)
}

/// `metadata.json` and the common state.
fn check_megatron_files(ckpt: &Checkpoint) -> Vec<Problem> {
    let loc = ckpt.location();
    let file_problem = |name: &str, message: String| Problem {
        key: name.to_string(),
        file: Some(name.to_string()),
        offset: None,
        message,
    };
    let mut problems = Vec::new();
    let has_common_pt = match loc.size(COMMON_FILE) {
        Ok(Some(0)) => {
            problems.push(file_problem(COMMON_FILE, "empty file".into()));
            true
        }
        Ok(Some(_)) => true,
        Ok(None) => false,
        Err(e) => {
            problems.push(file_problem(COMMON_FILE, strip(e)));
            true
        }
    };
    // Whole-file size and CRC-32 against the commit record: a byte changed where no zip record's
    // CRC-32 looks (a header field, the central directory) is found too. Reported last, and only
    // when nothing else was found wrong with common.pt (one problem per damage).
    let mut whole = None;
    if let Some((r, want)) = ckpt.commit_record().and_then(|r| Some((r, r.common?))) {
        let got = match loc.read(COMMON_FILE) {
            Ok(b) => b.map(|b| Digest::of(&b)),
            Err(_) => Some(want), // unreadable: reported above
        };
        if got != Some(want) {
            let got = got.map_or("missing".into(), |g| {
                format!("{} bytes, CRC-32 {:08x},", g.size, g.crc32)
            });
            whole = Some(file_problem(
                COMMON_FILE,
                format!(
                    "{got} but save {} committed {} bytes, CRC-32 {:08x} (changed since the commit)",
                    r.save_id, want.size, want.crc32
                ),
            ));
        }
    }
    let has_common_state = ckpt
        .metadata
        .entries
        .keys()
        .any(|k| k.starts_with(COMMON_STATE_PREFIX));
    match loc.read(METADATA_JSON_FILE) {
        Err(e) => problems.push(file_problem(METADATA_JSON_FILE, strip(e))),
        Ok(None) if has_common_pt => problems.push(file_problem(
            METADATA_JSON_FILE,
            "missing: Megatron does not recognise the directory as a distributed checkpoint \
             without it (common.pt is there)"
                .into(),
        )),
        Ok(None) => {}
        Ok(Some(bytes)) => {
            if let Err(m) = check_metadata_json(&bytes) {
                problems.push(file_problem(METADATA_JSON_FILE, m));
            }
            if !has_common_pt && !has_common_state {
                problems.push(file_problem(
                    COMMON_FILE,
                    "missing, and no common_state object either: Megatron's loader has no \
                     common state to read"
                        .into(),
                ));
            }
        }
    }
    // Read in quick mode too: a small file, and what a load unpickles first.
    if has_common_pt || has_common_state {
        match ckpt.read_common() {
            // The common_state object is an item: its data.pkl was scanned with the items.
            Ok(Some(common)) if common.source == COMMON_FILE => {
                // read_common checked the archive.
                let found = Archive::read(&common.bytes[..])
                    .ok()
                    .and_then(|a| data_pkl_globals(&common.bytes, &a));
                if let Some(m) = found {
                    problems.push(file_problem(COMMON_FILE, m));
                }
            }
            Ok(_) => {}
            Err(e) => {
                let (key, file) = match (&e, has_common_pt) {
                    (_, true) => (COMMON_FILE.to_string(), Some(COMMON_FILE.to_string())),
                    (Error::Corrupt { path, .. }, false) => (
                        COMMON_STATE_PREFIX.to_string(),
                        path.file_name().map(|f| f.to_string_lossy().into_owned()),
                    ),
                    _ => (COMMON_STATE_PREFIX.to_string(), None),
                };
                problems.push(Problem {
                    key,
                    file,
                    offset: None,
                    message: strip(e),
                });
            }
        }
    }
    if let Some(p) = whole.filter(|_| !problems.iter().any(|q| q.key == COMMON_FILE)) {
        problems.push(p);
    }
    problems
}

fn check_metadata_json(bytes: &[u8]) -> std::result::Result<(), String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    match obj.get("sharded_backend").and_then(|b| b.as_str()) {
        Some("torch_dist") => {}
        Some(other) => {
            return Err(format!(
                "sharded_backend is {other:?}; a torch_dist checkpoint says \"torch_dist\""
            ))
        }
        None => return Err("no sharded_backend field".into()),
    }
    let unknown: Vec<&str> = obj
        .keys()
        .map(|k| k.as_str())
        .filter(|k| !METADATA_JSON_FIELDS.contains(k))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "unknown fields {unknown:?}: megatron-core ≤ 0.18 refuses to load the checkpoint"
        ));
    }
    Ok(())
}

fn strip(e: Error) -> String {
    match e {
        Error::Corrupt { reason, .. } => reason,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::record::{CommitRecord, CommitSummary};

    /// The commit state as `verify` reports it: every state `status` does not call committed is a
    /// problem (damage to a file only when verify's own checks did not show it), and so is a
    /// shardwise checkpoint whose reads no sidecar checks.
    #[test]
    fn commit_problems() {
        let loc = Location::local(std::path::Path::new("/ckpt"));
        let record: CommitRecord = serde_json::from_value(serde_json::json!({
            "save_id": "s", "committed_at_ns": 1, "metadata": {"size": 1, "crc32": 2},
            "common": null, "megatron": false, "files": [], "summary": CommitSummary::default(),
        }))
        .unwrap();
        let committed = CheckpointState::Committed {
            record: Some(record),
        };
        let torch = CheckpointState::Committed { record: None };
        let damaged = |repairable: Option<&str>| CheckpointState::Damaged {
            reason: "why".into(),
            repairable: repairable.map(String::from),
        };
        let not_committed = CheckpointState::NotCommitted {
            reason: "merger died".into(),
        };
        let (repairable, lost) = (damaged(Some("s")), damaged(None));
        let facts = |state, saves, sidecar| CommitFacts {
            state,
            replaced: false,
            saves,
            sidecar,
            found: false,
        };
        let status = "as `shardwise status /ckpt` says";
        let replaced = format!(
            "damaged, {status}: why; `shardwise merge --repair /ckpt` rebuilds it from save s's \
             parts"
        );
        let cases: [(CommitFacts, Option<(&str, String)>); 10] = [
            (facts(&committed, true, true), None),
            (facts(&torch, false, false), None),
            (
                facts(&committed, true, false),
                Some((
                    ".shardwise/s/checksums",
                    "missing: save s committed this .metadata with its checksum sidecar".into(),
                )),
            ),
            (
                facts(&torch, true, false),
                Some((
                    ".shardwise",
                    "holds shardwise saves but no checksum sidecar".into(),
                )),
            ),
            (
                facts(&not_committed, true, false),
                Some((".metadata", format!("not committed, {status}: merger died"))),
            ),
            (
                CommitFacts {
                    found: true,
                    ..facts(&not_committed, true, false)
                },
                Some((".metadata", format!("not committed, {status}: merger died"))),
            ),
            (
                facts(&repairable, true, false),
                Some((".metadata", replaced.clone())),
            ),
            (
                facts(&lost, false, false),
                Some((".metadata", format!("damaged, {status}: why"))),
            ),
            // The damaged file is among verify's own problems ...
            (
                CommitFacts {
                    found: true,
                    ..facts(&lost, false, false)
                },
                None,
            ),
            // ... but another `.metadata` explains them.
            (
                CommitFacts {
                    found: true,
                    replaced: true,
                    ..facts(&repairable, true, false)
                },
                Some((".metadata", replaced.clone())),
            ),
        ];
        for (f, want) in cases {
            let got = commit_problem_of(&loc, &f);
            let got = got.as_ref().map(|p| (p.key.as_str(), p.message.as_str()));
            let matches = match (got, &want) {
                (Some((key, message)), Some((k, m))) => {
                    key == *k && message.starts_with(m.as_str())
                }
                (got, want) => got.is_none() && want.is_none(),
            };
            assert!(
                matches,
                "{:?} saves {} sidecar {} found {}: {got:?}",
                f.state, f.saves, f.sidecar, f.found
            );
        }
    }
}
