//! The checksum sidecar, `.shardwise/<save_id>/checksums`: the CRC-32 of every item of a save as
//! it was written, and the CRC-32s of the blocks of each tensor's payload ([`crate::blockcrc`]).
//! torch and Megatron never open it; shardwise's readers and `verify` do. Which save's sidecar
//! describes a checkpoint's current `.metadata` is commit state (`commit::read_checksums`).
//!
//! Format: MessagePack of [`Checksums`] as `rmp_serde` writes structs (arrays of their fields in
//! declaration order, so names are not repeated). Fields added later carry `#[serde(default)]`:
//! sidecars of shardwise before block CRCs (2 fields; items of 6) still decode.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// File name of the sidecar inside a save's state directory.
pub const CHECKSUMS_FILE: &str = "checksums";

/// CRC-32 of one item's bytes as written; `offsets` is `None` for byte objects.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ItemChecksum {
    /// DCP key of the item.
    pub fqn: String,
    /// Chunk offsets in elements (tensors).
    pub offsets: Option<Vec<u64>>,
    /// File name inside the checkpoint directory.
    pub relative_path: String,
    /// Byte offset of the item in its file.
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    pub(crate) crc32: u32,
    /// CRC-32s of the blocks of a tensor's payload ([`crate::blockcrc`], [`Checksums::block_bytes`]
    /// each); empty for byte objects and in sidecars of shardwise before block CRCs.
    #[serde(default)]
    pub blocks: Vec<u32>,
}

/// The sidecar written at commit.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Checksums {
    /// The save attempt that committed.
    pub save_id: String,
    /// Every item of the checkpoint, with its CRC-32s.
    pub items: Vec<ItemChecksum>,
    /// Payload bytes per block CRC-32 ([`crate::blockcrc::BLOCK_BYTES`]); 0 in sidecars of
    /// shardwise before block CRCs.
    #[serde(default)]
    pub block_bytes: u64,
}

/// [`ItemChecksum`] borrowed, for encoding without copying a merge's strings.
#[derive(Serialize)]
pub struct ItemRef<'a> {
    /// See [`ItemChecksum::fqn`].
    pub fqn: &'a str,
    /// See [`ItemChecksum::offsets`].
    pub offsets: Option<&'a [u64]>,
    /// See [`ItemChecksum::relative_path`].
    pub relative_path: &'a str,
    /// Byte offset of the item in its file.
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    pub(crate) crc32: u32,
    pub(crate) blocks: &'a [u32],
}

fn encode_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("cannot encode checksums: {e}"))
}

/// Appends one item, encoded as an element of [`Checksums::items`], to `buf`. Items may be
/// encoded in pieces and written between the two halves of [`frame`].
///
/// Errors: [`Error::InvalidArgument`] if it cannot be encoded.
pub fn encode_item(buf: &mut Vec<u8>, item: &ItemRef) -> Result<()> {
    rmp_serde::encode::write(buf, item).map_err(encode_error)
}

/// The bytes before and after the items of the sidecar of save `save_id` with `items` items
/// ([`encode_item`]) and `block_bytes` as in [`Checksums::block_bytes`]: the sidecar is the first,
/// the items in order, then the second, equal to `rmp_serde`'s encoding of the [`Checksums`]
/// value. A sidecar of a GB is written that way as it is encoded, never held whole.
///
/// Errors: [`Error::InvalidArgument`] for more than 2^32 - 1 items.
pub fn frame(save_id: &str, items: usize, block_bytes: u64) -> Result<(Vec<u8>, Vec<u8>)> {
    // A struct as rmp_serde writes it: an array of its 3 fields.
    let mut head = vec![0x93];
    head.extend(rmp_serde::to_vec(save_id).map_err(encode_error)?);
    match items {
        0..=15 => head.push(0x90 | items as u8),
        16..=0xffff => {
            head.push(0xdc);
            head.extend((items as u16).to_be_bytes());
        }
        _ => {
            head.push(0xdd);
            let n = u32::try_from(items).map_err(|_| encode_error(format!("{items} items")))?;
            head.extend(n.to_be_bytes());
        }
    }
    let tail = rmp_serde::to_vec(&block_bytes).map_err(encode_error)?;
    Ok((head, tail))
}

/// Decodes sidecar bytes; `path` names the file in errors.
///
/// Errors: [`Error::Corrupt`] for bytes that are not a sidecar.
pub fn decode(bytes: &[u8], path: std::path::PathBuf) -> Result<Checksums> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Corrupt {
        path,
        reason: format!("undecodable checksum sidecar: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(fqn: &str, offsets: Option<Vec<u64>>, blocks: Vec<u32>) -> ItemChecksum {
        ItemChecksum {
            fqn: fqn.into(),
            offsets,
            relative_path: "__0_0.distcp".into(),
            offset: 5_000_000_000,
            length: 70_000,
            crc32: 0xdead_beef,
            blocks,
        }
    }

    fn encoded(sums: &Checksums) -> Vec<u8> {
        let (mut buf, tail) = frame(&sums.save_id, sums.items.len(), sums.block_bytes).unwrap();
        for i in &sums.items {
            let r = ItemRef {
                fqn: &i.fqn,
                offsets: i.offsets.as_deref(),
                relative_path: &i.relative_path,
                offset: i.offset,
                length: i.length,
                crc32: i.crc32,
                blocks: &i.blocks,
            };
            encode_item(&mut buf, &r).unwrap();
        }
        buf.extend(tail);
        buf
    }

    /// The framed encoding is rmp_serde's encoding of the whole value, for each array-length form
    /// (fixarray, array16, array32 need > 65535 items: checked on the header only).
    #[test]
    fn pieced_encoding_equals_rmp_serde_of_the_value() {
        for n in [0usize, 3, 15, 16, 300] {
            let sums = Checksums {
                save_id: "s-1".into(),
                items: (0..n)
                    .map(|i| match i % 2 {
                        0 => item("w", Some(vec![i as u64, 0]), vec![1, 2, i as u32]),
                        _ => item("o", None, vec![]),
                    })
                    .collect(),
                block_bytes: crate::blockcrc::BLOCK_BYTES,
            };
            let bytes = encoded(&sums);
            assert_eq!(bytes, rmp_serde::to_vec(&sums).unwrap(), "{n} items");
            assert_eq!(decode(&bytes, "x".into()).unwrap(), sums);
        }
        let (big, _) = frame("s", 70_000, 0).unwrap();
        assert_eq!(big, [0x93, 0xa1, b's', 0xdd, 0, 1, 0x11, 0x70]);
    }

    /// A sidecar written before block CRCs (2 fields; items of 6) reads with no blocks and a block
    /// size of 0 (its partial reads stay unchecked).
    #[test]
    fn a_sidecar_without_block_crcs_still_decodes() {
        #[derive(Serialize)]
        struct Item<'a>(&'a str, Option<[u64; 1]>, &'a str, u64, u64, u32);
        #[derive(Serialize)]
        struct Before<'a>(&'a str, Vec<Item<'a>>);
        let bytes =
            rmp_serde::to_vec(&Before("s", vec![Item("w", Some([0]), "f", 1, 2, 3)])).unwrap();
        let sums = decode(&bytes, "x".into()).unwrap();
        assert_eq!(sums.block_bytes, 0);
        assert_eq!((sums.items[0].crc32, sums.items[0].blocks.len()), (3, 0));
    }

    #[test]
    fn garbage_is_corrupt_naming_the_file() {
        let e = decode(b"\xc1nonsense", "/ck/.shardwise/s/checksums".into()).unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { path, reason } if path.ends_with("checksums")
                && reason.contains("undecodable checksum sidecar")),
            "{e}"
        );
    }
}
