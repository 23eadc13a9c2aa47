//! What one rank publishes for a save (its part), the markers a save leaves, and where they live.
//!
//! Layout inside the checkpoint directory, for save id `S`:
//! `.shardwise/S/<rank>.part` (one per rank), `.shardwise/S/common.pt` (rank 0's common state,
//! staged; renamed to `common.pt` at commit on local filesystems), `.shardwise/S/checksums`,
//! `.shardwise/S/FAILED` and `.shardwise/S/COMMITTED` (JSON, see [`Failed`] and [`CommitRecord`]).
//!
//! Part file: `SWPART02` magic, CRC-32 (u32 LE) of the body, body = MessagePack of [`RankPart`]
//! (structs as arrays, so field names are not repeated; a rank's part is O(its chunks)).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::storage::{Listed, Location};

const MAGIC: &[u8; 8] = b"SWPART02";
pub const PART_FORMAT: u32 = 2;
pub const STATE_DIR: &str = ".shardwise";
pub const COMMON_FILE: &str = "common.pt";

/// Megatron's `metadata.json` in the 4-field form that megatron-core ≤0.18 requires and 0.19 accepts
/// (megatron-torch-dist.md §1.3, `CheckpointingConfig` in `dist_checkpointing/core.py`).
pub const MEGATRON_METADATA_JSON: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

/// A file a rank wrote: its name inside the checkpoint, its size in bytes and its storage identity
/// ([`Location::stamp`]) when the rank published its part.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileRecord {
    pub name: String,
    pub size: u64,
    pub stamp: String,
    /// SHA-256 (hex) of the file's bytes as written, when the save writes megatron-core 0.19's
    /// integrity manifest ([`crate::integrity`]).
    #[serde(default)]
    pub sha256: Option<String>,
}

/// One tensor chunk in a part: key, dtype name, global shape, chunk offsets/sizes (elements) and
/// where its archive is (index into `RankPart::files`, byte offset, length).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TensorRecord {
    pub fqn: String,
    pub dtype: String,
    pub global_shape: Vec<u64>,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub file: u32,
    pub offset: u64,
    pub length: u64,
    /// CRC-32 of the item's bytes.
    pub crc32: u32,
}

/// A Megatron ShardedObject's position: base `key`, `global_shape` and `global_offset`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectShard {
    pub key: String,
    pub global_shape: Vec<u64>,
    pub global_offset: Vec<u64>,
}

/// One byte object in a part.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectRecord {
    pub fqn: String,
    pub shard: Option<ObjectShard>,
    pub file: u32,
    pub offset: u64,
    pub length: u64,
    /// CRC-32 of the item's bytes.
    pub crc32: u32,
}

/// Everything one rank contributes to a save.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RankPart {
    pub format: u32,
    pub save_id: String,
    pub rank: u32,
    pub world_size: u32,
    /// Write Megatron's `metadata.json` on commit (every rank of a save must agree).
    pub megatron: bool,
    /// Wall-clock time of publication, ns since the Unix epoch (the publisher's clock).
    pub published_at_ns: u64,
    pub files: Vec<FileRecord>,
    pub tensors: Vec<TensorRecord>,
    pub objects: Vec<ObjectRecord>,
    /// `common.pt` (staged under the save's directory), when this rank wrote it.
    pub common: Option<FileRecord>,
}

/// Wall-clock now, ns since the Unix epoch.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// `.shardwise/<save_id>`, relative to the checkpoint.
pub fn save_rel(save_id: &str) -> String {
    format!("{STATE_DIR}/{save_id}")
}

/// `.shardwise/<save_id>/<name>`, relative to the checkpoint.
pub fn marker_rel(save_id: &str, name: &str) -> String {
    format!("{STATE_DIR}/{save_id}/{name}")
}

/// `.shardwise/<save_id>/<rank>.part`, relative to the checkpoint.
pub fn part_rel(save_id: &str, rank: u32) -> String {
    format!("{STATE_DIR}/{save_id}/{rank}.part")
}

/// Checks that a save id is a plain name (it becomes a directory name).
pub fn check_save_id(save_id: &str) -> Result<()> {
    let ok = !save_id.is_empty()
        && save_id.len() <= 128
        && save_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !save_id.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "save_id {save_id:?} must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

/// Encodes a part as its file bytes.
pub fn encode_part(part: &RankPart) -> Result<Vec<u8>> {
    let body = rmp_serde::to_vec(part)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode part: {e}")))?;
    let mut bytes = Vec::with_capacity(body.len() + 12);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    bytes.extend_from_slice(&body);
    Ok(bytes)
}

/// Publishes a rank's part atomically and only if absent (local: tmp, fsync, link, directory
/// fsync; object store: conditional create). Returns its path inside the checkpoint.
///
/// Errors: [`Error::Validation`] when the rank's part already exists (two processes saved as the
/// same rank of one save); storage errors.
pub fn write_part(loc: &Location, part: &RankPart) -> Result<String> {
    check_save_id(&part.save_id)?;
    let rel = part_rel(&part.save_id, part.rank);
    if !loc.write_new(&rel, encode_part(part)?)? {
        return Err(Error::Validation(format!(
            "rank {} already published a part for save {} in {loc}: two processes saved as the \
             same rank (or reuse a save_id: pass a fresh one)",
            part.rank, part.save_id
        )));
    }
    Ok(rel)
}

/// Decodes a part file's bytes; `path` names it in errors.
///
/// Errors: [`Error::Corrupt`] on a bad magic, CRC, encoding or format version.
pub fn decode_part(bytes: &[u8], path: std::path::PathBuf) -> Result<RankPart> {
    let corrupt = |reason: String| Error::Corrupt {
        path: path.clone(),
        reason,
    };
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        let reason = if bytes.starts_with(b"SWPART") {
            "a part of an older shardwise version (save again to replace it)"
        } else {
            "not a shardwise part (bad magic)"
        };
        return Err(corrupt(reason.into()));
    }
    let crc = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    if crc32fast::hash(&bytes[12..]) != crc {
        return Err(corrupt("CRC mismatch".into()));
    }
    let part: RankPart =
        rmp_serde::from_slice(&bytes[12..]).map_err(|e| corrupt(format!("undecodable: {e}")))?;
    if part.format != PART_FORMAT {
        return Err(corrupt(format!(
            "part format {} is not {PART_FORMAT}",
            part.format
        )));
    }
    Ok(part)
}

/// Reads and checks one part file (`rel` inside the checkpoint).
///
/// Errors: as [`decode_part`]; [`Error::Io`]/[`Error::Remote`] if unreadable or gone.
pub fn read_part(loc: &Location, rel: &str) -> Result<RankPart> {
    let bytes = loc.read(rel)?.ok_or_else(|| Error::Io {
        op: "read",
        path: loc.path_of(rel),
        source: std::io::ErrorKind::NotFound.into(),
    })?;
    decode_part(&bytes, loc.path_of(rel))
}

/// The part files published for `save_id` (one listing), as `(rank, file)`, any rank number.
///
/// Errors: storage errors when the save's directory cannot be listed.
pub fn listed_parts(loc: &Location, save_id: &str) -> Result<Vec<(u32, Listed)>> {
    let (files, _) = loc.list(&save_rel(save_id))?;
    Ok(files
        .into_iter()
        .filter_map(|f| {
            let rank = f.name.strip_suffix(".part")?.parse::<u32>().ok()?;
            Some((rank, f))
        })
        .collect())
}

/// `.shardwise/S/FAILED`: why the merge of a save failed, and when (ns since the epoch, the
/// writer's clock), so that a waiter can tell a marker of its own attempt from an earlier one's.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Failed {
    pub at_ns: u64,
    pub reason: String,
}

/// Publishes `FAILED` for `save_id` (replacing an earlier one). Best effort: the caller is already
/// reporting an error.
pub fn publish_failed(loc: &Location, save_id: &str, reason: &str) {
    let f = Failed {
        at_ns: now_ns(),
        reason: reason.to_string(),
    };
    if let Ok(bytes) = serde_json::to_vec(&f) {
        let _ = loc.write(&marker_rel(save_id, "FAILED"), bytes);
    }
}

/// The `FAILED` marker of `save_id`, if any. A marker that is not ours (older shardwise: plain
/// text) reads as written at time 0, i.e. before any attempt that is still running.
pub fn read_failed(loc: &Location, save_id: &str) -> Option<Failed> {
    let bytes = loc.read(&marker_rel(save_id, "FAILED")).ok()??;
    Some(serde_json::from_slice(&bytes).unwrap_or_else(|_| Failed {
        at_ns: 0,
        reason: String::from_utf8_lossy(&bytes).into_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part() -> RankPart {
        RankPart {
            format: PART_FORMAT,
            save_id: "s1".into(),
            rank: 3,
            world_size: 4,
            megatron: true,
            published_at_ns: 7,
            files: vec![FileRecord {
                name: "__3_0.distcp".into(),
                size: 10,
                stamp: "1:2:10:3.000000004".into(),
                sha256: None,
            }],
            tensors: vec![],
            objects: vec![],
            common: None,
        }
    }

    #[test]
    fn part_round_trips_and_detects_damage() {
        let bytes = encode_part(&part()).unwrap();
        assert_eq!(decode_part(&bytes, "p".into()).unwrap(), part());
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(decode_part(&bad, "p".into())
            .unwrap_err()
            .to_string()
            .contains("CRC mismatch"));
        let mut old = bytes;
        old[..8].copy_from_slice(b"SWPART01");
        assert!(decode_part(&old, "p".into())
            .unwrap_err()
            .to_string()
            .contains("older shardwise"));
    }

    #[test]
    fn save_ids_are_plain_names() {
        assert!(check_save_id("abc-1_2.3").is_ok());
        for bad in ["", ".x", "a/b", "..", &"x".repeat(129)] {
            assert!(check_save_id(bad).is_err(), "{bad:?}");
        }
    }
}
