//! What one rank publishes for a save (its part), the markers a save leaves, and where they live.
//!
//! Layout inside the checkpoint directory, for save id `S`:
//! `.shardwise/S/<rank>.part` (one per rank), `.shardwise/S/common.pt` (rank 0's common state,
//! staged; renamed to `common.pt` at commit on local filesystems), `.shardwise/S/checksums`,
//! `.shardwise/S/FAILED` and `.shardwise/S/COMMITTED` (JSON, see [`Failed`] and
//! [`super::record::CommitRecord`]); the markers are [`Marker`]s.
//!
//! Part file: `SWPART02` magic, CRC-32 (u32 LE) of the body, body = MessagePack of [`RankPart`]
//! (structs as arrays, so field names are not repeated; a rank's part is O(its chunks)).

use serde::{Deserialize, Serialize};

use super::liveness::now_ns;
use crate::error::{Error, Result};
use crate::storage::{Listed, Location};

const MAGIC: &[u8; 8] = b"SWPART02";
/// Version of the part format this build writes (the `SWPART02` magic's number).
pub const PART_FORMAT: u32 = 2;
/// The directory of shardwise's state inside a checkpoint (parts, markers, staged `common.pt`).
pub const STATE_DIR: &str = ".shardwise";

/// A file a rank wrote: its name inside the checkpoint, its size in bytes and its storage identity
/// ([`Location::stamp`]) when the rank published its part.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileRecord {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Storage identity when the part was published ([`Location::stamp`]): a later change of the
    /// file shows as a different stamp.
    pub stamp: String,
    /// SHA-256 (hex) of the file's bytes as written, when the save writes megatron-core 0.19's
    /// integrity manifest ([`super::manifest`]).
    #[serde(default)]
    pub sha256: Option<String>,
}

/// One tensor chunk in a part: key, dtype name, global shape, chunk offsets/sizes (elements) and
/// where its archive is (index into `RankPart::files`, byte offset, length).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TensorRecord {
    /// DCP key (Megatron's ShardedTensor `key`).
    pub fqn: String,
    /// torch dtype name, e.g. `torch.bfloat16`.
    pub dtype: String,
    /// Global shape in elements.
    pub global_shape: Vec<u64>,
    /// Global offsets of the chunk in elements, one per dimension.
    pub offsets: Vec<u64>,
    /// Chunk shape in elements.
    pub sizes: Vec<u64>,
    /// Index into [`RankPart::files`] of the file that holds the chunk's archive.
    pub file: u32,
    /// Byte offset of the archive in that file.
    pub offset: u64,
    /// Length of the archive in bytes.
    pub length: u64,
    /// CRC-32 of the item's bytes.
    pub crc32: u32,
    /// CRC-32s of the blocks of the tensor's payload, [`crate::blockcrc::BLOCK_BYTES`] each (empty
    /// in parts of shardwise before block CRCs).
    #[serde(default)]
    pub blocks: Vec<u32>,
}

/// A Megatron ShardedObject's position: base `key`, `global_shape` and `global_offset`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectShard {
    /// Megatron's base key (ShardedObject `key`).
    pub key: String,
    /// Global shape of the object's sharding grid.
    pub global_shape: Vec<u64>,
    /// Position of this shard in that grid.
    pub global_offset: Vec<u64>,
}

/// One byte object in a part.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectRecord {
    /// DCP key (Megatron's ShardedObject `unique_key`).
    pub fqn: String,
    /// The ShardedObject's position, when the object is a Megatron ShardedObject.
    pub shard: Option<ObjectShard>,
    /// Index into [`RankPart::files`] of the file that holds the object.
    pub file: u32,
    /// Byte offset of the object in that file.
    pub offset: u64,
    /// Length of the object in bytes.
    pub length: u64,
    /// CRC-32 of the item's bytes.
    pub crc32: u32,
}

/// Everything one rank contributes to a save.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RankPart {
    /// Part format version ([`PART_FORMAT`]).
    pub format: u32,
    /// The save attempt the part belongs to.
    pub save_id: String,
    /// The publishing rank.
    pub rank: u32,
    /// Number of ranks of the save.
    pub world_size: u32,
    /// Write Megatron's `metadata.json` on commit (every rank of a save must agree).
    pub megatron: bool,
    /// Wall-clock time of publication, ns since the Unix epoch (the publisher's clock).
    pub published_at_ns: u64,
    /// The publishing process ([`super::liveness::publisher`]): tells a rank's own earlier attempt from a second
    /// process saving as the same rank.
    pub publisher: String,
    /// The files this rank wrote (its data file).
    pub files: Vec<FileRecord>,
    /// Its tensor chunks.
    pub tensors: Vec<TensorRecord>,
    /// Its byte objects.
    pub objects: Vec<ObjectRecord>,
    /// `common.pt` (staged under the save's directory), when this rank wrote it.
    pub common: Option<FileRecord>,
}

/// `.shardwise/<save_id>`, relative to the checkpoint.
pub fn save_rel(save_id: &str) -> String {
    format!("{STATE_DIR}/{save_id}")
}

/// `.shardwise/<save_id>/<name>`, relative to the checkpoint.
pub fn marker_rel(save_id: &str, name: &str) -> String {
    format!("{STATE_DIR}/{save_id}/{name}")
}

/// The markers a save leaves in its state directory, `.shardwise/<save_id>/<NAME>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marker {
    /// `COMMITTING`: the lock of a local merger (`super::lock`).
    Committing,
    /// `COMMITTED`: the commit record (`super::record::CommitRecord`, JSON).
    Committed,
    /// `FAILED`: why the merge failed ([`Failed`], JSON).
    Failed,
}

impl Marker {
    /// The marker's file name.
    pub fn name(self) -> &'static str {
        match self {
            Marker::Committing => "COMMITTING",
            Marker::Committed => "COMMITTED",
            Marker::Failed => "FAILED",
        }
    }

    /// `.shardwise/<save_id>/<NAME>`, relative to the checkpoint.
    pub fn rel(self, save_id: &str) -> String {
        marker_rel(save_id, self.name())
    }
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
    let part: RankPart = decode_body(bytes, &path)?;
    check_format(part.format, &path)?;
    Ok(part)
}

/// The MessagePack body of a part file after its magic and CRC check, decoded as `T`.
fn decode_body<'a, T: Deserialize<'a>>(bytes: &'a [u8], path: &std::path::Path) -> Result<T> {
    let corrupt = |reason: String| Error::Corrupt {
        path: path.to_path_buf(),
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
    rmp_serde::from_slice(&bytes[12..]).map_err(|e| corrupt(format!("undecodable: {e}")))
}

fn check_format(format: u32, path: &std::path::Path) -> Result<()> {
    if format != PART_FORMAT {
        return Err(Error::Corrupt {
            path: path.to_path_buf(),
            reason: format!("part format {format} is not {PART_FORMAT}"),
        });
    }
    Ok(())
}

/// A part decoded for a merge: its items borrow their strings from the part file's bytes and
/// keep up to four dimensions inline, so that decoding millions of chunks allocates per part,
/// not per chunk. The same MessagePack as [`RankPart`], field for field.
#[derive(Deserialize)]
pub struct PartView<'a> {
    format: u32,
    save_id: String,
    rank: u32,
    world_size: u32,
    megatron: bool,
    published_at_ns: u64,
    publisher: String,
    files: Vec<FileRecord>,
    #[serde(borrow)]
    tensors: Vec<TensorView<'a>>,
    #[serde(borrow)]
    objects: Vec<ObjectView<'a>>,
    common: Option<FileRecord>,
}

/// [`TensorRecord`] borrowed from a part file's bytes.
#[derive(Debug, Deserialize)]
pub struct TensorView<'a> {
    /// See [`TensorRecord::fqn`].
    pub fqn: &'a str,
    /// See [`TensorRecord::dtype`].
    pub dtype: &'a str,
    /// Global shape in elements.
    pub global_shape: Dims,
    /// Global offsets in elements.
    pub offsets: Dims,
    /// Chunk shape in elements.
    pub sizes: Dims,
    /// Index into the part's files.
    pub file: u32,
    /// Byte offset of the archive in that file.
    pub offset: u64,
    /// Length of the archive in bytes.
    pub length: u64,
    pub(crate) crc32: u32,
    #[serde(default)]
    pub(crate) blocks: Vec<u32>,
}

/// [`ObjectRecord`] borrowed from a part file's bytes.
#[derive(Debug, Deserialize)]
pub struct ObjectView<'a> {
    /// See [`ObjectRecord::fqn`].
    pub fqn: &'a str,
    /// See [`ObjectRecord::shard`].
    pub shard: Option<ObjectShard>,
    /// Index into the part's files.
    pub file: u32,
    /// Byte offset of the object in that file.
    pub offset: u64,
    /// Length of the object in bytes.
    pub length: u64,
    pub(crate) crc32: u32,
}

impl<'a> From<&'a TensorRecord> for TensorView<'a> {
    fn from(t: &'a TensorRecord) -> Self {
        TensorView {
            fqn: &t.fqn,
            dtype: &t.dtype,
            global_shape: Dims::from(&t.global_shape[..]),
            offsets: Dims::from(&t.offsets[..]),
            sizes: Dims::from(&t.sizes[..]),
            file: t.file,
            offset: t.offset,
            length: t.length,
            crc32: t.crc32,
            blocks: t.blocks.clone(),
        }
    }
}

impl<'a> From<&'a ObjectRecord> for ObjectView<'a> {
    fn from(o: &'a ObjectRecord) -> Self {
        ObjectView {
            fqn: &o.fqn,
            shard: o.shard.clone(),
            file: o.file,
            offset: o.offset,
            length: o.length,
            crc32: o.crc32,
        }
    }
}

/// The items of a part, as a merge folds them.
pub type PartItems<'a> = (Vec<TensorView<'a>>, Vec<ObjectView<'a>>);

/// Decodes a part file's bytes for a merge: the part without its items (`tensors` and `objects`
/// empty), and its items borrowed from `bytes`.
///
/// Errors: as [`decode_part`].
pub fn decode_part_items(
    bytes: &[u8],
    path: std::path::PathBuf,
) -> Result<(RankPart, PartItems<'_>)> {
    let v: PartView = decode_body(bytes, &path)?;
    check_format(v.format, &path)?;
    let header = RankPart {
        format: v.format,
        save_id: v.save_id,
        rank: v.rank,
        world_size: v.world_size,
        megatron: v.megatron,
        published_at_ns: v.published_at_ns,
        publisher: v.publisher,
        files: v.files,
        tensors: Vec::new(),
        objects: Vec::new(),
        common: v.common,
    };
    Ok((header, (v.tensors, v.objects)))
}

/// A shape, offsets or sizes: up to four dimensions inline, more on the heap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dims {
    /// Up to four values, the first `n` (the `u8`) of the array.
    Inline(u8, [u64; 4]),
    /// More than four values.
    Heap(Vec<u64>),
}

impl std::ops::Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match self {
            Dims::Inline(n, a) => &a[..*n as usize],
            Dims::Heap(v) => v,
        }
    }
}

impl From<&[u64]> for Dims {
    fn from(d: &[u64]) -> Self {
        if d.len() <= 4 {
            let mut a = [0; 4];
            a[..d.len()].copy_from_slice(d);
            Dims::Inline(d.len() as u8, a)
        } else {
            Dims::Heap(d.to_vec())
        }
    }
}

impl<'de> Deserialize<'de> for Dims {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Dims;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of dimensions")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Dims, A::Error> {
                let mut a = [0u64; 4];
                let mut n = 0;
                while let Some(x) = seq.next_element::<u64>()? {
                    if n == a.len() {
                        let mut v = a.to_vec();
                        v.push(x);
                        while let Some(x) = seq.next_element::<u64>()? {
                            v.push(x);
                        }
                        return Ok(Dims::Heap(v));
                    }
                    a[n] = x;
                    n += 1;
                }
                Ok(Dims::Inline(n as u8, a))
            }
        }
        d.deserialize_seq(Visit)
    }
}

/// Reads and checks one part file (`rel` inside the checkpoint).
///
/// Errors: as [`decode_part`]; [`Error::Io`]/[`Error::Remote`] if unreadable or gone.
pub fn read_part(loc: &Location, rel: &str) -> Result<RankPart> {
    decode_part(&read_part_bytes(loc, rel)?, loc.path_of(rel))
}

/// The bytes of one part file (`rel` inside the checkpoint).
///
/// Errors: [`Error::Io`]/[`Error::Remote`] if unreadable or gone.
pub fn read_part_bytes(loc: &Location, rel: &str) -> Result<Vec<u8>> {
    loc.read(rel)?.ok_or_else(|| Error::Io {
        op: "read",
        path: loc.path_of(rel),
        source: std::io::ErrorKind::NotFound.into(),
    })
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
    pub(crate) at_ns: u64,
    /// Why the save failed (the merger's error message).
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
        let _ = loc.write(&Marker::Failed.rel(save_id), bytes);
    }
}

/// The `FAILED` marker of `save_id`, if any. A marker that is not ours (older shardwise: plain
/// text) reads as written at time 0, i.e. before any attempt that is still running.
pub fn read_failed(loc: &Location, save_id: &str) -> Option<Failed> {
    let bytes = loc.read(&Marker::Failed.rel(save_id)).ok()??;
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
            publisher: "h:1:2".into(),
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
    fn a_part_decodes_the_same_for_a_merge() {
        let mut p = part();
        p.tensors.push(TensorRecord {
            fqn: "w".into(),
            dtype: "torch.float32".into(),
            global_shape: vec![8, 4, 2, 2, 2],
            offsets: vec![4, 0],
            sizes: vec![4, 4],
            file: 0,
            offset: 10,
            length: 20,
            crc32: 30,
            blocks: vec![1, 2],
        });
        p.objects.push(ObjectRecord {
            fqn: "o".into(),
            shard: None,
            file: 0,
            offset: 1,
            length: 2,
            crc32: 3,
        });
        let bytes = encode_part(&p).unwrap();
        let (header, (tensors, objects)) = decode_part_items(&bytes, "p".into()).unwrap();
        let back = RankPart {
            tensors: tensors
                .iter()
                .map(|t| TensorRecord {
                    fqn: t.fqn.into(),
                    dtype: t.dtype.into(),
                    global_shape: t.global_shape.to_vec(),
                    offsets: t.offsets.to_vec(),
                    sizes: t.sizes.to_vec(),
                    file: t.file,
                    offset: t.offset,
                    length: t.length,
                    crc32: t.crc32,
                    blocks: t.blocks.clone(),
                })
                .collect(),
            objects: objects
                .iter()
                .map(|o| ObjectRecord {
                    fqn: o.fqn.into(),
                    shard: o.shard.clone(),
                    file: o.file,
                    offset: o.offset,
                    length: o.length,
                    crc32: o.crc32,
                })
                .collect(),
            ..header
        };
        assert_eq!(back, p);
    }

    /// A tensor record of a part written before block CRCs (9 fields) reads with no blocks.
    #[test]
    fn records_without_block_crcs_still_decode() {
        #[derive(Serialize)]
        struct Before<'a>(
            &'a str,
            &'a str,
            [u64; 1],
            [u64; 1],
            [u64; 1],
            u32,
            u64,
            u64,
            u32,
        );
        let bytes =
            rmp_serde::to_vec(&Before("w", "torch.float32", [4], [0], [4], 0, 1, 2, 3)).unwrap();
        let t: TensorRecord = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!((t.crc32, t.blocks), (3, vec![]));
        let v: TensorView = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!((v.crc32, v.blocks), (3, vec![]));
    }

    #[test]
    fn save_ids_are_plain_names() {
        assert!(check_save_id("abc-1_2.3").is_ok());
        for bad in ["", ".x", "a/b", "..", &"x".repeat(129)] {
            assert!(check_save_id(bad).is_err(), "{bad:?}");
        }
    }
}
