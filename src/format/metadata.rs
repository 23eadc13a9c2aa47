//! The global DCP `.metadata` pickle, in the "max-compat" profile that torch 2.3 through 2.15 load
//! (`../shared/reference/dcp-format.md` §3.7 and §7): protocol 2, `TensorProperties` as a 5-tuple
//! state, no `StorageMeta`, `_StorageInfo` without `transform_descriptors`, `version = "1.0.0"`.
//!
//! Class paths are those of `torch/distributed/checkpoint/metadata.py` and `filesystem.py`
//! (torch 2.3.1 – 2.15.0).

use std::collections::BTreeMap;

use crate::format::dtype::DType;
use crate::format::pickle::Pickler;

const M: &str = "torch.distributed.checkpoint.metadata";
const FS: &str = "torch.distributed.checkpoint.filesystem";

/// Where an item's bytes are: `relative_path` inside the checkpoint directory, byte `offset` and
/// `length` of its self-contained torch.save archive (`_StorageInfo`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StorageInfo {
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
}

/// One saved chunk of a tensor: global `offsets` and `sizes` in elements per dimension
/// (`ChunkStorageMetadata`), and where its archive is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub storage: StorageInfo,
}

/// One key of the checkpoint (`TensorStorageMetadata` or `BytesStorageMetadata`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    Tensor {
        dtype: DType,
        global_shape: Vec<u64>,
        chunks: Vec<Chunk>,
    },
    Bytes {
        storage: StorageInfo,
    },
}

/// Pickles the global metadata; keys are emitted in sorted order, chunks in the given order
/// (their position is the `MetadataIndex.index` hint).
pub fn emit_metadata(entries: &BTreeMap<String, Entry>) -> Vec<u8> {
    struct Map<'a>(Vec<(&'a str, &'a Entry)>);
    impl MetadataSource for Map<'_> {
        fn keys(&self) -> usize {
            self.0.len()
        }
        fn fqn(&self, key: usize) -> &str {
            self.0[key].0
        }
        fn tensor(&self, key: usize) -> Option<(DType, &[u64], usize)> {
            match self.0[key].1 {
                Entry::Tensor {
                    dtype,
                    global_shape,
                    chunks,
                } => Some((*dtype, global_shape, chunks.len())),
                Entry::Bytes { .. } => None,
            }
        }
        fn chunk(&self, key: usize, chunk: usize) -> (&[u64], &[u64]) {
            match self.0[key].1 {
                Entry::Tensor { chunks, .. } => (&chunks[chunk].offsets, &chunks[chunk].sizes),
                Entry::Bytes { .. } => (&[], &[]),
            }
        }
        fn storage(&self, key: usize, chunk: usize) -> (&str, u64, u64) {
            let s = match self.0[key].1 {
                Entry::Tensor { chunks, .. } => &chunks[chunk].storage,
                Entry::Bytes { storage } => storage,
            };
            (&s.relative_path, s.offset, s.length)
        }
    }
    emit_metadata_from(&Map(entries.iter().map(|(k, e)| (k.as_str(), e)).collect()))
}

/// The keys of a global `.metadata`, read by index, so that a merger can pickle its own compact
/// structures without building [`Entry`] values (millions of chunks at scale).
pub trait MetadataSource {
    /// Number of keys.
    fn keys(&self) -> usize;
    /// Key `key`'s fqn; keys must come in sorted order.
    fn fqn(&self, key: usize) -> &str;
    /// `(dtype, global_shape, number of chunks)` for a tensor key, `None` for a byte object.
    fn tensor(&self, key: usize) -> Option<(DType, &[u64], usize)>;
    /// Global `(offsets, sizes)` of a tensor key's chunk, in elements.
    fn chunk(&self, key: usize, chunk: usize) -> (&[u64], &[u64]);
    /// `(relative_path, offset, length)` of a chunk's archive (chunk 0 for a byte object).
    fn storage(&self, key: usize, chunk: usize) -> (&str, u64, u64);
}

/// [`emit_metadata`] for any [`MetadataSource`]: the same bytes for the same keys and chunks.
pub fn emit_metadata_from(src: &impl MetadataSource) -> Vec<u8> {
    let mut p = Pickler::new(true);
    object_start(&mut p, M, "Metadata");
    p.empty_dict();
    p.mark();

    p.str("state_dict_metadata");
    p.empty_dict();
    p.mark();
    for k in 0..src.keys() {
        p.str(src.fqn(k));
        match src.tensor(k) {
            Some((dtype, global_shape, chunks)) => {
                object_start(&mut p, M, "TensorStorageMetadata");
                p.empty_dict();
                p.mark();
                p.str("properties");
                tensor_properties(&mut p, dtype);
                p.str("size");
                torch_size(&mut p, global_shape);
                p.str("chunks");
                p.empty_list();
                p.mark();
                for c in 0..chunks {
                    let (offsets, sizes) = src.chunk(k, c);
                    object_start(&mut p, M, "ChunkStorageMetadata");
                    p.empty_dict();
                    p.mark();
                    p.str("offsets");
                    torch_size(&mut p, offsets);
                    p.str("sizes");
                    torch_size(&mut p, sizes);
                    p.setitems();
                    p.build();
                }
                p.appends();
                p.setitems();
                p.build();
            }
            // torch writes BytesStorageMetadata as GLOBAL, EMPTY_TUPLE, NEWOBJ with no BUILD.
            None => object_start(&mut p, M, "BytesStorageMetadata"),
        }
    }
    p.setitems();

    // planner_data: the flat path of every key, which lets `_EmptyStateDictLoadPlanner` and
    // `format_utils.dcp_to_torch_save` rebuild the dict on 2.3 as well (dcp-format.md §4.1).
    p.str("planner_data");
    p.empty_dict();
    p.mark();
    for k in 0..src.keys() {
        let fqn = src.fqn(k);
        p.str(fqn);
        p.str(fqn);
        p.tuple(1);
    }
    p.setitems();

    p.str("storage_data");
    p.empty_dict();
    p.mark();
    for k in 0..src.keys() {
        let fqn = src.fqn(k);
        match src.tensor(k) {
            Some((_, _, chunks)) => {
                for c in 0..chunks {
                    metadata_index(&mut p, fqn, Some(src.chunk(k, c).0), Some(c));
                    storage_info(&mut p, src.storage(k, c));
                }
            }
            None => {
                metadata_index(&mut p, fqn, None, None);
                storage_info(&mut p, src.storage(k, 0));
            }
        }
    }
    p.setitems();

    p.str("version");
    p.str("1.0.0");
    p.setitems();
    p.build();
    p.finish()
}

/// `GLOBAL cls; EMPTY_TUPLE; NEWOBJ` (a dataclass instance before its BUILD).
fn object_start(p: &mut Pickler, module: &str, name: &str) {
    p.global(module, name);
    p.empty_tuple();
    p.newobj();
}

fn torch_size(p: &mut Pickler, dims: &[u64]) {
    p.global("torch", "Size");
    p.int_tuple(dims);
    p.tuple(1);
    p.reduce();
}

/// `TensorProperties` with the 5-tuple state `(dtype, layout, requires_grad, memory_format, pin_memory)`.
fn tensor_properties(p: &mut Pickler, dtype: DType) {
    object_start(p, M, "TensorProperties");
    p.mark();
    p.global("torch", dtype.torch_name());
    p.global("torch.serialization", "_get_layout");
    p.str("torch.strided");
    p.tuple(1);
    p.reduce();
    p.bool(false);
    p.global(M, "_MEM_FORMAT_ENCODING");
    p.int(0);
    p.tuple(1);
    p.reduce();
    p.bool(false);
    p.tuple(5);
    p.build();
}

fn metadata_index(p: &mut Pickler, fqn: &str, offsets: Option<&[u64]>, index: Option<usize>) {
    object_start(p, M, "MetadataIndex");
    p.empty_dict();
    p.mark();
    p.str("fqn");
    p.str(fqn);
    if let Some(o) = offsets {
        p.str("offset");
        torch_size(p, o);
    }
    p.str("index");
    match index {
        Some(i) => p.int(i as i128),
        None => p.none(),
    }
    p.setitems();
    p.build();
}

fn storage_info(p: &mut Pickler, (relative_path, offset, length): (&str, u64, u64)) {
    object_start(p, FS, "_StorageInfo");
    p.empty_dict();
    p.mark();
    p.str("relative_path");
    p.str(relative_path);
    p.str("offset");
    p.int(offset as i128);
    p.str("length");
    p.int(length as i128);
    p.setitems();
    p.build();
}

/// Number of elements of a shape or box, None when it does not fit in a `u64` (no storage holds
/// that many). The one definition: layout checks, the reader, loads and diffs all count with it.
pub fn volume(sizes: &[u64]) -> Option<u64> {
    sizes.iter().try_fold(1u64, |a, &s| a.checked_mul(s))
}

/// Checks the chunks of one tensor key the way DCP's `_validate_global_plan` does at save time
/// (and its loader never does, dcp-format.md §4.2): every chunk lies inside `shape`, no two
/// overlap, and together they cover it exactly. `origin(i)` names chunk `i` in messages.
///
/// Errors: a message naming the key, the offending chunks' origins and their boxes.
pub fn check_layout(
    fqn: &str,
    shape: &[u64],
    chunks: &[&Chunk],
    origin: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    check_layout_boxes(
        fqn,
        shape,
        chunks.len(),
        &|i| (&chunks[i].offsets, &chunks[i].sizes),
        origin,
    )
}

/// [`check_layout`] for `n` chunks given as `(offsets, sizes)` by `chunk(i)`.
///
/// Errors: as [`check_layout`].
pub fn check_layout_boxes<'a>(
    fqn: &str,
    shape: &[u64],
    n: usize,
    chunk: &dyn Fn(usize) -> (&'a [u64], &'a [u64]),
    origin: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    for i in 0..n {
        let (offsets, sizes) = chunk(i);
        check_bounds(fqn, shape, offsets, sizes, &|| origin(i))?;
    }
    // Sweep along dimension 0: only chunks whose dim-0 ranges intersect are compared.
    let mut order: Vec<usize> = (0..n).filter(|&i| volume(chunk(i).1) != Some(0)).collect();
    let start0 = |i: usize| chunk(i).0.first().copied().unwrap_or(0);
    let end0 = |i: usize| {
        let (offsets, sizes) = chunk(i);
        offsets.first().map(|o| o + sizes[0]).unwrap_or(1)
    };
    order.sort_by(|&i, &j| chunk(i).0.cmp(chunk(j).0));
    let mut active: Vec<usize> = Vec::new();
    for &i in &order {
        active.retain(|&j| end0(j) > start0(i));
        for &j in &active {
            let ((ao, asz), (bo, bsz)) = (chunk(i), chunk(j));
            let overlap =
                (0..shape.len()).all(|d| ao[d] < bo[d] + bsz[d] && bo[d] < ao[d] + asz[d]);
            if overlap {
                let what = if ao == bo && asz == bsz {
                    "the same chunk"
                } else {
                    "overlapping chunks"
                };
                return Err(format!(
                    "key {fqn}: {} and {} both save {what} (offsets {bo:?} sizes {bsz:?} and offsets {ao:?} sizes {asz:?}); \
                     exactly one main replica (replica_id all zeros) may save each chunk",
                    origin(j),
                    origin(i),
                ));
            }
        }
        active.push(i);
    }
    // Counted in u128: the chunks lie inside the shape, so a sum past u64 is a coverage error too,
    // and a shape of more than 2^64 elements cannot be covered.
    let count = |s: &[u64]| volume(s).map_or(u128::MAX, u128::from);
    let covered: u128 = (0..n)
        .map(|i| count(chunk(i).1))
        .fold(0, u128::saturating_add);
    let total = count(shape);
    if covered != total {
        return Err(format!(
            "key {fqn}: the saved chunks cover {covered} of {total} elements of global shape {shape:?} (coverage gap)"
        ));
    }
    Ok(())
}

/// The bounds part of [`check_layout`] for one chunk: its offsets and sizes have the rank of
/// `shape` and lie inside it. `origin()` names the chunk in the message.
///
/// Errors: a message naming the key, the chunk's origin and its box.
pub fn check_bounds(
    fqn: &str,
    shape: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    origin: &dyn Fn() -> String,
) -> Result<(), String> {
    let inside = offsets.len() == shape.len()
        && sizes.len() == shape.len()
        && offsets
            .iter()
            .zip(sizes)
            .zip(shape)
            .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|e| e <= g));
    if inside {
        return Ok(());
    }
    Err(format!(
        "key {fqn}: {} saves chunk offsets {offsets:?} sizes {sizes:?}, outside the global shape {shape:?}",
        origin(),
    ))
}
