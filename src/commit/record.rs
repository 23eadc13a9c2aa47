//! `.shardwise/<save_id>/COMMITTED`: what the commit of a save wrote ([`CommitRecord`]), the
//! summary a commit reports ([`CommitSummary`]), and the error of a save that did not commit.
//! Whether a record makes its directory committed is decided in [`super::state`].

use serde::{Deserialize, Serialize};

use super::part::Marker;
use crate::error::Error;
use crate::format::METADATA_FILE;
use crate::storage::Location;

/// Summary of a committed save; sizes in bytes.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CommitSummary {
    /// The save had already been committed (by a racing merger or an earlier merge); the counts
    /// are then that commit's.
    pub already_committed: bool,
    /// Keys in `.metadata`.
    pub keys: usize,
    /// Tensor chunks in `.metadata`.
    pub tensor_chunks: usize,
    /// Byte objects in `.metadata`.
    pub byte_objects: usize,
    /// Bytes of the data files the checkpoint reads.
    pub data_bytes: u64,
    /// Size of `.metadata` in bytes.
    pub metadata_bytes: u64,
    /// The `COMMITTING` lock of a merger that had died was taken over.
    pub took_over_dead_merger: bool,
}

/// Size in bytes and CRC-32 of a file's whole content.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Digest {
    /// Size in bytes.
    pub size: u64,
    pub(crate) crc32: u32,
}

impl Digest {
    pub(crate) fn of(bytes: &[u8]) -> Digest {
        Digest {
            size: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
        }
    }
}

/// The [`Digest`] of bytes seen piece by piece (a file streamed as it is made), and their
/// SHA-256 when asked (for the integrity manifest).
pub struct Digester {
    size: u64,
    crc: crc32fast::Hasher,
    sha256: Option<sha2::Sha256>,
}

impl Digester {
    pub(crate) fn new(sha256: bool) -> Digester {
        Digester {
            size: 0,
            crc: crc32fast::Hasher::new(),
            sha256: sha256.then(<sha2::Sha256 as sha2::Digest>::new),
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.size += bytes.len() as u64;
        self.crc.update(bytes);
        if let Some(s) = &mut self.sha256 {
            sha2::Digest::update(s, bytes);
        }
    }

    /// The digest, and the SHA-256 in hex when asked.
    pub fn finish(self) -> (Digest, Option<String>) {
        let digest = Digest {
            size: self.size,
            crc32: self.crc.finalize(),
        };
        let sha = self
            .sha256
            .map(|s| super::manifest::hex(&sha2::Digest::finalize(s).into()));
        (digest, sha)
    }
}

/// `.shardwise/S/COMMITTED` (JSON): what the commit of save `S` wrote.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CommitRecord {
    /// The save attempt that committed.
    pub save_id: String,
    /// Wall-clock time of the commit, ns since the Unix epoch (the merger's clock).
    pub committed_at_ns: u64,
    /// `.metadata` as committed.
    pub metadata: Digest,
    /// `common.pt`, when the save has one.
    pub common: Option<Digest>,
    /// Megatron save: `metadata.json` is part of the checkpoint.
    pub megatron: bool,
    /// The data files (name inside the checkpoint, size in bytes).
    pub files: Vec<(String, u64)>,
    pub(crate) summary: CommitSummary,
    /// The storage stamps ([`Location::stamp`]: size and mtime in ns locally, the ETag on object
    /// stores) of `.metadata` and `common.pt` right after this commit wrote them. While a file
    /// keeps its stamp, its digest above holds without reading the file (issue 27: `status`,
    /// `is_committed` and retention cost a `stat`, not a read of a `.metadata` of several GB).
    /// Absent in records written before shardwise 0.4: the files are then read and CRC'd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_stamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) common_stamp: Option<String>,
    /// What each rank's part held, so that `status` of a committed save reads this record, not
    /// the parts (their item records grow with the chunks: 0.93 MiB of parts for a 4.7 MiB
    /// `.metadata`, issue 37). Absent in records written before it was added: the parts are
    /// read then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<SaveLayout>,
}

/// The layout of a committed save, as `status` prints it: its tensor keys and, per rank, what
/// its part held. Size: one entry per rank, whatever the number of chunks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SaveLayout {
    /// Keys saved as tensors (ShardedTensors), not byte objects.
    pub tensor_keys: usize,
    /// In rank order.
    pub ranks: Vec<RankLayout>,
}

/// What one rank's part held: its chunk and object counts and its files (names inside the
/// checkpoint, total size in bytes).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RankLayout {
    /// The rank.
    pub rank: u32,
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
}

impl CommitRecord {
    /// Records the stamps `.metadata` and `common.pt` have now: called by the commit after it
    /// wrote them and before it writes this record.
    ///
    /// Errors: storage errors.
    pub fn stamp_files(&mut self, loc: &Location) -> Result<(), Error> {
        self.metadata_stamp = loc.stamp(METADATA_FILE)?;
        if self.common.is_some() {
            self.common_stamp = loc.stamp(crate::format::COMMON_FILE)?;
        }
        Ok(())
    }

    /// The record as `COMMITTED`'s JSON bytes.
    ///
    /// Errors: [`Error::InvalidArgument`] when it cannot be encoded.
    pub fn to_json(&self) -> Result<Vec<u8>, Error> {
        serde_json::to_vec(self)
            .map_err(|e| Error::InvalidArgument(format!("cannot encode the commit record: {e}")))
    }
}

/// What a committed file holds now, against the digest its commit recorded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FileNow {
    /// The committed bytes.
    Holds,
    /// Other bytes: their digest.
    Differs(Digest),
    /// The file is gone.
    Missing,
}

/// Whether `rel` in `loc` still holds the bytes of `digest`: by a `stat` when the file still has
/// `stamp`, the one storage gave right after the commit wrote it; otherwise (no stamp recorded,
/// the file was copied without its timestamps, touched or replaced) by reading it whole.
///
/// Errors: storage errors.
pub fn file_now(
    loc: &Location,
    rel: &str,
    digest: Digest,
    stamp: Option<&str>,
) -> Result<FileNow, Error> {
    if let Some(stamp) = stamp {
        if loc.stamp(rel)?.as_deref() == Some(stamp) {
            return Ok(FileNow::Holds);
        }
    }
    Ok(match loc.read(rel)?.map(|b| Digest::of(&b)) {
        None => FileNow::Missing,
        Some(now) if now == digest => FileNow::Holds,
        Some(now) => FileNow::Differs(now),
    })
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
