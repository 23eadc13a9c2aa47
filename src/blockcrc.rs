//! Block CRC-32s of a tensor item's payload (the raw tensor bytes inside its torch.save archive),
//! so that a read of part of an item can be checked without reading the whole item.
//!
//! Rule (the only definition): the payload is cut into blocks of [`BLOCK_BYTES`] from its first
//! byte; block `i` is payload bytes `i * BLOCK_BYTES .. min((i + 1) * BLOCK_BYTES, len)` (the last
//! block may be shorter; an empty payload has no blocks). A save records one CRC-32 per block
//! beside the item's CRC-32 (part: [`crate::commit::part::TensorRecord::blocks`]; sidecar:
//! [`crate::format::sidecar::ItemChecksum::blocks`], the block size once in
//! [`crate::format::sidecar::Checksums::block_bytes`]). The bytes are hashed once: pieces are hashed in
//! sub-ranges cut at block boundaries ([`hash_piece`], [`PayloadCrc::update`]) and the sub-range
//! CRCs are combined into both the block CRCs and the payload CRC ([`PayloadCrc`]).
//!
//! Size: 1 MiB blocks cost 5 bytes of MessagePack each (a `u32`), so a rank that saves 16 GiB of
//! tensors adds 16384 CRCs, about 80 KiB, to its part and to the sidecar. A load widens a partial
//! read to block boundaries: at most one block (1 MiB) of extra bytes at each end of each
//! contiguous range it reads.

use std::ops::Range;

use crc32fast::Hasher;

/// Payload bytes per CRC-32 block (1 MiB: 0.1 ms of extra read per range end at 10 GB/s).
pub const BLOCK_BYTES: u64 = 1 << 20;

/// Number of blocks of a payload of `len` bytes.
pub fn count(len: u64, block: u64) -> u64 {
    len.div_ceil(block)
}

/// Payload bytes of block `i` of a payload of `len` bytes.
pub fn span(i: u64, len: u64, block: u64) -> Range<u64> {
    i * block..((i + 1) * block).min(len)
}

/// Indices of the blocks that bytes `r` (payload offsets, `r.end <= len`) touch; empty for an
/// empty range.
pub fn covering(r: &Range<u64>, block: u64) -> Range<u64> {
    if r.start >= r.end {
        return 0..0;
    }
    r.start / block..r.end.div_ceil(block)
}

/// The CRC-32 of one piece of an item's payload (starting at payload offset `at`), kept as the
/// CRCs of its sub-ranges cut at block boundaries: `(length, hasher)` in order.
pub struct PieceCrc {
    /// Index of the item (tensor) in the caller's list.
    pub item: usize,
    pub(crate) at: u64,
    parts: Vec<(u64, Hasher)>,
}

/// Hashes `bytes`, payload bytes `at..` of item `item`, once, in sub-ranges cut at block
/// boundaries.
pub fn hash_piece(item: usize, at: u64, bytes: &[u8]) -> PieceCrc {
    PieceCrc {
        item,
        at,
        parts: cut(at, bytes.len() as u64, BLOCK_BYTES)
            .map(|r| {
                let mut h = Hasher::new();
                h.update(&bytes[(r.start - at) as usize..(r.end - at) as usize]);
                (r.end - r.start, h)
            })
            .collect(),
    }
}

/// Bytes `at..at + len` cut at multiples of `block`.
fn cut(at: u64, len: u64, block: u64) -> impl Iterator<Item = Range<u64>> {
    let end = at + len;
    let mut pos = at;
    std::iter::from_fn(move || {
        (pos < end).then(|| {
            let next = ((pos / block + 1) * block).min(end);
            let r = pos..next;
            pos = next;
            r
        })
    })
}

/// One payload's CRC-32 and block CRC-32s, built from its bytes or pieces in payload order.
#[derive(Clone)]
pub struct PayloadCrc {
    whole: Hasher,
    open: Hasher,
    pos: u64,
    blocks: Vec<u32>,
}

impl Default for PayloadCrc {
    fn default() -> Self {
        PayloadCrc {
            whole: Hasher::new(),
            open: Hasher::new(),
            pos: 0,
            blocks: Vec::new(),
        }
    }
}

impl PayloadCrc {
    /// Adds the CRC of the next `len` payload bytes, which lie in one block.
    fn add(&mut self, len: u64, h: &Hasher) {
        self.whole.combine(h);
        self.open.combine(h);
        self.pos += len;
        if self.pos % BLOCK_BYTES == 0 && len > 0 {
            let done = std::mem::replace(&mut self.open, Hasher::new());
            self.blocks.push(done.finalize());
        }
    }

    /// Hashes the next bytes of the payload (in payload order), once.
    pub fn update(&mut self, bytes: &[u8]) {
        let at = self.pos;
        for r in cut(at, bytes.len() as u64, BLOCK_BYTES) {
            let mut h = Hasher::new();
            h.update(&bytes[(r.start - at) as usize..(r.end - at) as usize]);
            self.add(r.end - r.start, &h);
        }
    }

    /// Adds a piece that starts where the bytes so far end.
    ///
    /// Panics if it does not (the caller sorts the pieces of a payload that tile it).
    pub fn add_piece(&mut self, p: &PieceCrc) {
        assert_eq!(p.at, self.pos, "payload pieces tile the payload in order");
        for (len, h) in &p.parts {
            self.add(*len, h);
        }
    }

    /// The CRC-32 state of the payload bytes so far.
    pub fn payload(&self) -> &Hasher {
        &self.whole
    }

    /// The block CRC-32s, the last (shorter) block included.
    pub fn finish(mut self) -> Vec<u32> {
        if self.pos % BLOCK_BYTES != 0 {
            self.blocks.push(self.open.finalize());
        }
        self.blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    fn expected(d: &[u8]) -> Vec<u32> {
        d.chunks(BLOCK_BYTES as usize)
            .map(crc32fast::hash)
            .collect()
    }

    /// Pieces of any size, straddling block boundaries, added in order, give the per-block CRCs
    /// and the payload CRC of hashing each block and the payload directly; the last block is short.
    #[test]
    fn pieces_straddling_blocks_give_block_and_payload_crcs() {
        let b = BLOCK_BYTES as usize;
        let d = data(3 * b + 12_345);
        for cuts in [
            vec![d.len()],
            vec![1, b - 1, 1, 2 * b, d.len() - 3 * b - 1],
            vec![b / 2, b, b, d.len() - 2 * b - b / 2],
            vec![3 * b, 12_345],
        ] {
            assert_eq!(cuts.iter().sum::<usize>(), d.len());
            let mut seq = PayloadCrc::default();
            let mut pieces = Vec::new();
            let mut at = 0;
            for n in &cuts {
                seq.update(&d[at..at + n]);
                pieces.push(hash_piece(0, at as u64, &d[at..at + n]));
                at += n;
            }
            let mut joined = PayloadCrc::default();
            for p in &pieces {
                joined.add_piece(p);
            }
            for acc in [seq, joined] {
                assert_eq!(
                    acc.payload().clone().finalize(),
                    crc32fast::hash(&d),
                    "{cuts:?}"
                );
                assert_eq!(acc.finish(), expected(&d), "{cuts:?}");
            }
        }
    }

    #[test]
    fn exact_multiple_and_empty_payloads() {
        let d = data(2 * BLOCK_BYTES as usize);
        let mut acc = PayloadCrc::default();
        acc.update(&d);
        assert_eq!(acc.finish(), expected(&d));
        let mut empty = PayloadCrc::default();
        empty.update(&[]);
        empty.add_piece(&hash_piece(0, 0, &[]));
        assert_eq!(empty.payload().clone().finalize(), crc32fast::hash(&[]));
        assert!(empty.finish().is_empty());
        assert_eq!(count(0, BLOCK_BYTES), 0);
    }

    #[test]
    #[should_panic(expected = "tile the payload")]
    fn a_gap_between_pieces_is_a_bug() {
        let mut acc = PayloadCrc::default();
        acc.add_piece(&hash_piece(0, 5, b"abc"));
    }

    #[test]
    fn covering_and_span_widen_to_block_boundaries() {
        let b = 100;
        assert_eq!(covering(&(0..0), b), 0..0);
        assert_eq!(covering(&(0..1), b), 0..1);
        assert_eq!(covering(&(99..101), b), 0..2);
        assert_eq!(covering(&(100..200), b), 1..2);
        assert_eq!(covering(&(150..250), b), 1..3);
        assert_eq!(count(250, b), 3);
        assert_eq!(span(2, 250, b), 200..250);
        assert_eq!(span(1, 250, b), 100..200);
        assert_eq!(
            cut(150, 200, b).collect::<Vec<_>>(),
            vec![150..200, 200..300, 300..350]
        );
    }
}
