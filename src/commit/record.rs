//! `.shardwise/<save_id>/COMMITTED`: what the commit of a save wrote ([`CommitRecord`]), the
//! summary a commit reports ([`CommitSummary`]), and the error of a save that did not commit.
//! Whether a record makes its directory committed is decided in [`super::state`].

use serde::{Deserialize, Serialize};

use super::part::Marker;
use crate::error::Error;
use crate::storage::Location;

/// Summary of a committed save; sizes in bytes.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CommitSummary {
    /// The save had already been committed (by a racing merger or an earlier merge); the counts
    /// are then that commit's.
    pub already_committed: bool,
    pub keys: usize,
    pub tensor_chunks: usize,
    pub byte_objects: usize,
    pub data_bytes: u64,
    pub metadata_bytes: u64,
    /// The `COMMITTING` lock of a merger that had died was taken over.
    pub took_over_dead_merger: bool,
}

/// Size in bytes and CRC-32 of a file's whole content.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Digest {
    pub size: u64,
    pub crc32: u32,
}

impl Digest {
    pub fn of(bytes: &[u8]) -> Digest {
        Digest {
            size: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
        }
    }
}

/// `.shardwise/S/COMMITTED` (JSON): what the commit of save `S` wrote.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CommitRecord {
    pub save_id: String,
    /// Wall-clock time of the commit, ns since the Unix epoch (the merger's clock).
    pub committed_at_ns: u64,
    pub metadata: Digest,
    /// `common.pt`, when the save has one.
    pub common: Option<Digest>,
    /// Megatron save: `metadata.json` is part of the checkpoint.
    pub megatron: bool,
    /// The data files (name inside the checkpoint, size in bytes).
    pub files: Vec<(String, u64)>,
    pub summary: CommitSummary,
}

/// The `COMMITTED` record of `save_id`, if it has one that parses.
pub fn read_commit_record(loc: &Location, save_id: &str) -> Option<CommitRecord> {
    let bytes = loc.read(&Marker::Committed.rel(save_id)).ok()??;
    serde_json::from_slice(&bytes).ok()
}

/// [`Error::NotCommitted`] for save `save_id` in `loc`, with `reason`.
pub(crate) fn not_committed(loc: &Location, save_id: &str, reason: String) -> Error {
    Error::NotCommitted {
        dir: loc.display_path(),
        save_id: save_id.into(),
        reason,
    }
}
