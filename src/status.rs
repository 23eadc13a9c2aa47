//! The state of a checkpoint directory and of each save in it, as named steps: what `shardwise
//! status` prints and `shardwise.status` returns. [`status_report`] reads the directory's
//! [`CheckpointState`] and its orphaned data files, then each save's [`save_status`]: its ranks
//! from the commit record ([`ranks_of_record`]) or from its parts ([`ranks_of_parts`], pure), its
//! state and missing ranks.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::commit::part::{listed_parts, read_part, save_rel, RankPart};
use crate::commit::record::{read_commit_record, SaveLayout};
use crate::commit::state::{checkpoint_state, orphaned_data_files, save_state, CheckpointState};
use crate::commit::wait::missing_ranks;
use crate::error::Result;
use crate::storage::Location;

/// What `shardwise status --json` prints (README, "JSON output"), and `shardwise.status` returns.
#[derive(Serialize)]
pub struct StatusReport {
    /// The checkpoint directory or URL, as given.
    pub dir: String,
    /// committed, not_committed or damaged.
    pub checkpoint: &'static str,
    /// Why it is not committed or damaged; null when committed.
    pub reason: Option<String>,
    /// Data files no part and no commit names (ranks that died before publishing).
    pub orphaned_data_files: Vec<String>,
    /// Each save attempt found under `.shardwise/`, in save id order.
    pub saves: Vec<SaveStatus>,
}

/// One save attempt (`.shardwise/<save_id>`) of a checkpoint directory.
#[derive(Serialize)]
pub struct SaveStatus {
    /// The attempt's id.
    pub save_id: String,
    /// committed, merging, interrupted, failed or incomplete.
    pub state: &'static str,
    /// The state in words, with the reason and what to do.
    pub detail: String,
    /// Number of ranks of the save.
    pub world_size: u32,
    /// Ranks whose part (or commit record entry) is there.
    pub present: usize,
    /// Ranks without a current part, ascending.
    pub missing: Vec<u32>,
    /// Each present rank, ascending.
    pub ranks: Vec<RankStatus>,
    /// Tensor keys of the save.
    pub key_count: usize,
    /// Each tensor key's layout; only when asked (`--keys`): on a committed save it costs a read
    /// of every part.
    pub keys: Vec<KeyLayout>,
}

/// One rank of a save, from its part or from the commit record.
#[derive(Serialize)]
pub struct RankStatus {
    /// The rank.
    pub rank: u32,
    /// Seconds since its part file was written (its publication).
    pub age_s: f64,
    /// Its tensor chunks.
    pub tensor_chunks: usize,
    /// Its byte objects.
    pub byte_objects: usize,
    /// Total size of its files in bytes.
    pub bytes: u64,
    /// Its files, names inside the checkpoint.
    pub files: Vec<String>,
    /// It wrote `common.pt`.
    pub common: bool,
    /// Why its part could not be read, when it could not.
    pub error: Option<String>,
}

/// A tensor key as the parts of a save describe it (fields named as in `inspect --json`).
#[derive(Serialize)]
pub struct KeyLayout {
    /// The tensor's key.
    pub key: String,
    /// torch dtype name.
    pub dtype: String,
    /// Global shape in elements.
    pub global_shape: Vec<u64>,
    /// Chunks published for this key.
    pub chunks: usize,
    /// Ranks that published them, ascending.
    pub ranks: Vec<u32>,
}

/// The checkpoint format, in words, from the class of its pickled `.metadata`.
pub fn format_name(class: &str) -> &'static str {
    if class.ends_with(".MCoreMetadata") {
        "Megatron-Core torch_dist"
    } else {
        "PyTorch DCP"
    }
}

/// The state of `dir` and of each save in it: what `shardwise status` shows; with `keys`, each
/// save's tensor keys too. A committed save's ranks come from its `COMMITTED` record (a few KiB,
/// whatever the number of chunks); its parts, whose item records grow with the chunks, are read
/// only for `keys`, for a save not committed, or for a record without a layout (older shardwise).
///
/// Errors: storage errors when `dir` or its state directory cannot be read, also when `dir` is
/// missing or not a directory.
pub fn status_report(dir: &Location, keys: bool) -> Result<(CheckpointState, StatusReport)> {
    // The save ids first: they resolve `dir`, so a file given for it is refused as not a
    // checkpoint directory rather than failing the listing of a path under it.
    let ids = save_ids(dir)?;
    let checkpoint = checkpoint_state(dir)?;
    let orphans = orphaned_data_files(dir)?;
    let saves = ids
        .into_iter()
        .map(|id| save_status(dir, id, keys))
        .collect::<Result<Vec<_>>>()?;
    let (state, reason) = match &checkpoint {
        CheckpointState::Committed { .. } => ("committed", None),
        CheckpointState::NotCommitted { reason } => ("not_committed", Some(reason.clone())),
        CheckpointState::Damaged { reason, .. } => ("damaged", Some(reason.clone())),
    };
    let report = StatusReport {
        dir: dir.to_string(),
        checkpoint: state,
        reason,
        orphaned_data_files: orphans,
        saves,
    };
    Ok((checkpoint, report))
}

/// The ids of the saves in `dir`.
///
/// Errors: storage errors, also when `dir` is missing or not a directory.
pub fn save_ids(dir: &Location) -> Result<Vec<String>> {
    // Missing, not a directory and not allowed to look are three different answers, which
    // resolving the directory gives (listing a missing one would read as "no saves").
    dir.canonical()?;
    crate::commit::state::save_ids(dir)
}

/// A save's ranks as [`save_status`] reports them, from its commit record or its parts.
struct SaveRanks {
    world_size: u32,
    /// Parts present.
    present: usize,
    ranks: Vec<RankStatus>,
    key_count: usize,
    /// Each tensor key's layout; empty unless asked for and read from the parts.
    keys: Vec<KeyLayout>,
}

/// Save `id`'s status: its ranks (from its commit record unless `keys` asks for the parts or it
/// has none with a layout), its state and its missing ranks.
///
/// Errors: storage errors when the save's directory cannot be read.
fn save_status(dir: &Location, id: String, keys: bool) -> Result<SaveStatus> {
    let recorded = if keys {
        None
    } else {
        read_commit_record(dir, &id).and_then(|r| r.layout)
    };
    let SaveRanks {
        world_size,
        present,
        ranks,
        key_count,
        keys: layout,
    } = match recorded {
        Some(l) => ranks_of_record(dir, &id, &l)?,
        None => {
            let parts = read_parts(dir, &id);
            let mut r = ranks_of_parts(&parts);
            if !keys {
                r.keys = Vec::new();
            }
            r
        }
    };
    let state = save_state(dir, &id, world_size)?;
    let missing = if world_size > 0 {
        missing_ranks(dir, &id, world_size)?
    } else {
        Vec::new()
    };
    Ok(SaveStatus {
        save_id: id,
        state: state.name(),
        detail: state.describe(),
        world_size,
        present,
        missing,
        ranks,
        key_count,
        keys: layout,
    })
}

/// `(rank, part or error, age in seconds)` of every part file of a save.
pub fn read_parts(dir: &Location, save_id: &str) -> Vec<(u32, Result<RankPart>, f64)> {
    let listed = listed_parts(dir, save_id).unwrap_or_default();
    let mut out: Vec<_> = listed
        .into_iter()
        .map(|(r, f)| {
            let rel = format!("{}/{}", save_rel(save_id), f.name);
            (r, read_part(dir, &rel), f.age_s)
        })
        .collect();
    out.sort_by_key(|(r, _, _)| *r);
    out
}

/// The parts present (listed, not read) of committed save `id` and each one's rank as its commit
/// `layout` recorded it, with the part's age; no key layouts.
///
/// Errors: storage errors when the save's directory cannot be listed.
fn ranks_of_record(dir: &Location, id: &str, layout: &SaveLayout) -> Result<SaveRanks> {
    let ages: BTreeMap<u32, f64> = listed_parts(dir, id)?
        .into_iter()
        .map(|(r, f)| (r, f.age_s))
        .collect();
    let ranks = layout
        .ranks
        .iter()
        .filter_map(|r| {
            Some(RankStatus {
                rank: r.rank,
                age_s: *ages.get(&r.rank)?,
                tensor_chunks: r.tensor_chunks,
                byte_objects: r.byte_objects,
                bytes: r.bytes,
                files: r.files.clone(),
                common: r.common,
                error: None,
            })
        })
        .collect();
    Ok(SaveRanks {
        world_size: layout.ranks.len() as u32,
        present: ages.len(),
        ranks,
        key_count: layout.tensor_keys,
        keys: Vec::new(),
    })
}

/// Each part's rank status, and the tensor keys the parts describe (in key order); the world
/// size is the first readable part's (0 when none is).
fn ranks_of_parts(parts: &[(u32, Result<RankPart>, f64)]) -> SaveRanks {
    let mut layout: BTreeMap<&str, KeyLayout> = BTreeMap::new();
    let mut ranks = Vec::new();
    for (rank, p, age_s) in parts {
        match p {
            Err(e) => ranks.push(RankStatus {
                rank: *rank,
                age_s: *age_s,
                tensor_chunks: 0,
                byte_objects: 0,
                bytes: 0,
                files: Vec::new(),
                common: false,
                error: Some(e.to_string()),
            }),
            Ok(p) => {
                for t in &p.tensors {
                    let e = layout.entry(&t.fqn).or_insert_with(|| KeyLayout {
                        key: t.fqn.clone(),
                        dtype: t.dtype.clone(),
                        global_shape: t.global_shape.clone(),
                        chunks: 0,
                        ranks: Vec::new(),
                    });
                    e.chunks += 1;
                    if e.ranks.last() != Some(rank) {
                        e.ranks.push(*rank);
                    }
                }
                ranks.push(RankStatus {
                    rank: *rank,
                    age_s: *age_s,
                    tensor_chunks: p.tensors.len(),
                    byte_objects: p.objects.len(),
                    bytes: p.files.iter().map(|f| f.size).sum(),
                    files: p.files.iter().map(|f| f.name.clone()).collect(),
                    common: p.common.is_some(),
                    error: None,
                })
            }
        }
    }
    let world_size = parts
        .iter()
        .find_map(|(_, p, _)| p.as_ref().ok().map(|p| p.world_size))
        .unwrap_or(0);
    SaveRanks {
        world_size,
        present: parts.len(),
        ranks,
        key_count: layout.len(),
        keys: layout.into_values().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::testing::{committed, publish};
    use crate::error::Error;

    #[test]
    fn the_format_is_named_by_the_metadata_class() {
        assert_eq!(
            format_name("megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata"),
            "Megatron-Core torch_dist"
        );
        assert_eq!(
            format_name("torch.distributed.checkpoint.metadata.Metadata"),
            "PyTorch DCP"
        );
    }

    /// A committed save's ranks come from its record; `keys` reads the parts for the layout.
    #[test]
    fn a_committed_save_from_its_record_and_with_keys_from_its_parts() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        committed(&loc, "s", 2, true);
        let (state, report) = status_report(&loc, false).unwrap();
        assert!(matches!(state, CheckpointState::Committed { .. }));
        assert_eq!((report.checkpoint, report.reason), ("committed", None));
        assert!(report.orphaned_data_files.is_empty());
        let [s] = report.saves.as_slice() else {
            panic!("one save")
        };
        assert_eq!((s.save_id.as_str(), s.state), ("s", "committed"));
        assert_eq!((s.world_size, s.present, s.key_count), (2, 2, 1));
        assert!(s.missing.is_empty() && s.keys.is_empty());
        let ranks: Vec<_> = s.ranks.iter().map(|r| (r.rank, r.common)).collect();
        assert_eq!(ranks, [(0, true), (1, false)]);
        assert!(s
            .ranks
            .iter()
            .all(|r| r.tensor_chunks == 1 && r.error.is_none()));

        let (_, report) = status_report(&loc, true).unwrap();
        let [s] = report.saves.as_slice() else {
            panic!("one save")
        };
        let [k] = s.keys.as_slice() else {
            panic!("one key")
        };
        assert_eq!((k.key.as_str(), k.dtype.as_str()), ("w", "torch.uint8"));
        assert_eq!((k.global_shape.as_slice(), k.chunks), (&[4u64][..], 2));
        assert_eq!(k.ranks, [0, 1]);
    }

    /// A save whose rank 1 never published: not committed, rank 1 missing, the key counted from
    /// rank 0's part alone.
    #[test]
    fn an_incomplete_save_names_its_missing_ranks() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 0, 2, false);
        let (state, report) = status_report(&loc, false).unwrap();
        assert!(matches!(state, CheckpointState::NotCommitted { .. }));
        assert_eq!(report.checkpoint, "not_committed");
        assert!(report.reason.is_some());
        let [s] = report.saves.as_slice() else {
            panic!("one save")
        };
        assert_eq!(s.state, "incomplete");
        assert_eq!((s.world_size, s.present, s.key_count), (2, 1, 1));
        assert_eq!(s.missing, [1]);
        assert!(s.keys.is_empty(), "keys only when asked");
    }

    #[test]
    fn a_missing_directory_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(&dir.path().join("absent"));
        assert!(status_report(&loc, false).is_err());
        // A file is not a checkpoint directory, and the error says so, naming the file.
        let file = dir.path().join("common.pt");
        std::fs::write(&file, b"PK").unwrap();
        let e = status_report(&Location::local(&file), false)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("a checkpoint is a directory") && e.contains(&file.display().to_string()),
            "{e}"
        );
        let (_, report) = status_report(&Location::local(dir.path()), false).unwrap();
        assert!(report.saves.is_empty());
    }

    /// An unreadable part is a rank with its error, and the world size comes from a readable one.
    #[test]
    fn ranks_of_parts_keep_unreadable_parts_and_merge_key_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 0, 3, false);
        publish(&loc, "s", 2, 3, false);
        let mut parts = read_parts(&loc, "s");
        assert_eq!(parts.len(), 2);
        parts.insert(1, (1, Err(Error::InvalidArgument("torn".into())), 5.0));
        let r = ranks_of_parts(&parts);
        assert_eq!((r.world_size, r.present, r.key_count), (3, 3, 1));
        let errors: Vec<_> = r.ranks.iter().map(|r| (r.rank, r.error.clone())).collect();
        assert_eq!(
            errors,
            [
                (0, None),
                (1, Some(Error::InvalidArgument("torn".into()).to_string())),
                (2, None)
            ]
        );
        assert_eq!(
            (r.keys[0].chunks, r.keys[0].ranks.as_slice()),
            (2, &[0, 2][..])
        );
        let none = ranks_of_parts(&parts[1..2]);
        assert_eq!((none.world_size, none.key_count), (0, 0));
    }
}
