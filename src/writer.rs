//! Writes one rank's items into its `.distcp` data file: every tensor chunk and byte object becomes
//! a self-contained torch.save archive at a precomputed offset (dcp-format.md §2.1), byte objects
//! first, then tensors, as torch's `_write_files_from_queue` orders them. Payloads are split into
//! pieces that rayon copies with positioned writes while computing their CRC-32s; the CRCs are
//! combined per archive and the archive tails written last.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::format::zip::ArchiveLayout;
use crate::storage::DataFile;

/// Payload bytes per parallel write task.
const PIECE_BYTES: usize = 8 << 20;

/// One local chunk of a tensor to save.
pub struct TensorChunk<'a> {
    /// DCP key (Megatron's ShardedTensor `key`).
    pub fqn: String,
    pub dtype: DType,
    /// Global shape in elements, including prepended axes.
    pub global_shape: Vec<u64>,
    /// Global offsets of this chunk in elements, one per dimension.
    pub offsets: Vec<u64>,
    /// Chunk shape in elements (prepended axes of size 1 included).
    pub sizes: Vec<u64>,
    /// The chunk's elements, contiguous, little-endian, `prod(sizes) * itemsize` bytes.
    pub data: &'a [u8],
}

/// One byte object to save: `bytes` must already be a complete torch.save archive
/// (dcp-format.md §2.3); `fqn` is its DCP key (Megatron's ShardedObject `unique_key`).
pub struct ByteObject<'a> {
    pub fqn: String,
    pub bytes: &'a [u8],
}

/// Where one item landed: byte `offset` and `length` in the file, and the CRC-32 of its bytes
/// (recorded in the part and the checksum sidecar; DCP itself has no checksum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub offset: u64,
    pub length: u64,
    pub crc32: u32,
}

/// Where each item landed, tensors then objects in input order.
pub struct Written {
    pub tensors: Vec<Placed>,
    pub objects: Vec<Placed>,
    pub file_size: u64,
}

/// Checks a chunk's dtype, shapes and byte count.
///
/// Errors: [`Error::UnsupportedDtype`], [`Error::InvalidArgument`] naming the key.
pub fn check_chunk(c: &TensorChunk) -> Result<()> {
    if !c.dtype.writable() {
        return Err(Error::UnsupportedDtype(c.dtype.torch_name().to_string()));
    }
    let n = c.global_shape.len();
    if c.offsets.len() != n || c.sizes.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{}: global_shape {:?}, offsets {:?} and sizes {:?} must have the same number of dimensions",
            c.fqn, c.global_shape, c.offsets, c.sizes
        )));
    }
    let expect = c
        .sizes
        .iter()
        .try_fold(c.dtype.itemsize(), |acc, &s| acc.checked_mul(s));
    if expect != Some(c.data.len() as u64) {
        return Err(Error::InvalidArgument(format!(
            "{}: chunk of shape {:?} and dtype {} needs {:?} bytes, got {}",
            c.fqn,
            c.sizes,
            c.dtype.torch_name(),
            expect,
            c.data.len()
        )));
    }
    Ok(())
}

/// Writes all items of one rank into `file_path` and fsyncs it. `seed` makes the archives'
/// `serialization_id`s distinct per rank.
///
/// Errors: [`Error::InvalidArgument`] for malformed chunks, [`Error::Io`] for any write failure
/// (including a full disk at preallocation).
pub fn write_rank_file(
    file_path: &std::path::Path,
    seed: u64,
    tensors: &[TensorChunk],
    objects: &[ByteObject],
) -> Result<Written> {
    for t in tensors {
        check_chunk(t)?;
    }
    let mut cursor = 0u64;
    let mut object_pos = Vec::with_capacity(objects.len());
    for o in objects {
        object_pos.push((cursor, o.bytes.len() as u64));
        cursor += o.bytes.len() as u64;
    }
    let mut layouts = Vec::with_capacity(tensors.len());
    let mut tensor_pos = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let id = format!("{:040}", ((seed as u128) << 64) | i as u128);
        let l = ArchiveLayout::for_tensor(t.dtype, &t.sizes, &id);
        tensor_pos.push((cursor, l.len()));
        cursor += l.len();
        layouts.push(l);
    }
    let file = DataFile::create(file_path, cursor)?;

    // Phase 1: object archives, archive heads and payload pieces, all in parallel.
    enum Task<'a> {
        Raw(&'a [u8], u64),
        Piece {
            item: usize,
            bytes: &'a [u8],
            at: u64,
        },
    }
    let mut tasks: Vec<Task> = Vec::new();
    for (o, &(at, _)) in objects.iter().zip(&object_pos) {
        tasks.push(Task::Raw(o.bytes, at));
    }
    for (i, (t, l)) in tensors.iter().zip(&layouts).enumerate() {
        let at = tensor_pos[i].0;
        tasks.push(Task::Raw(&l.prefix, at));
        let base = at + l.prefix.len() as u64;
        for (k, piece) in t.data.chunks(PIECE_BYTES).enumerate() {
            tasks.push(Task::Piece {
                item: i,
                bytes: piece,
                at: base + (k * PIECE_BYTES) as u64,
            });
        }
    }
    let crcs: Vec<(usize, crc32fast::Hasher)> = tasks
        .par_iter()
        .map(|task| -> Result<Option<(usize, crc32fast::Hasher)>> {
            match task {
                Task::Raw(bytes, at) => file.write_at(bytes, *at).map(|_| None),
                Task::Piece { item, bytes, at } => {
                    let mut h = crc32fast::Hasher::new();
                    h.update(bytes);
                    file.write_at(bytes, *at)?;
                    Ok(Some((*item, h)))
                }
            }
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();

    // Phase 2: combine piece CRCs in order (tasks were built in order) and write archive tails.
    let mut per_item: Vec<crc32fast::Hasher> = (0..tensors.len())
        .map(|_| crc32fast::Hasher::new())
        .collect();
    for (item, h) in crcs {
        per_item[item].combine(&h);
    }
    let tensor_crcs = per_item
        .into_par_iter()
        .enumerate()
        .map(|(i, payload)| {
            let l = &layouts[i];
            let tail_at = tensor_pos[i].0 + l.prefix.len() as u64 + l.payload_len;
            let suffix = l.suffix(payload.clone().finalize());
            file.write_at(&suffix, tail_at)?;
            let mut item = crc32fast::Hasher::new();
            item.update(&l.prefix);
            item.combine(&payload);
            item.update(&suffix);
            Ok(item.finalize())
        })
        .collect::<Result<Vec<u32>>>()?;
    file.sync()?;
    let place = |&(offset, length): &(u64, u64), crc32| Placed {
        offset,
        length,
        crc32,
    };
    Ok(Written {
        tensors: tensor_pos
            .iter()
            .zip(tensor_crcs)
            .map(|(p, c)| place(p, c))
            .collect(),
        objects: object_pos
            .iter()
            .zip(objects)
            .map(|(p, o)| place(p, crc32fast::hash(o.bytes)))
            .collect(),
        file_size: cursor,
    })
}
