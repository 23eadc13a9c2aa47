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
    let mut p = Pickler::new(true);
    object_start(&mut p, M, "Metadata");
    p.empty_dict();
    p.mark();

    p.str("state_dict_metadata");
    p.empty_dict();
    p.mark();
    for (fqn, entry) in entries {
        p.str(fqn);
        match entry {
            Entry::Tensor {
                dtype,
                global_shape,
                chunks,
            } => {
                object_start(&mut p, M, "TensorStorageMetadata");
                p.empty_dict();
                p.mark();
                p.str("properties");
                tensor_properties(&mut p, *dtype);
                p.str("size");
                torch_size(&mut p, global_shape);
                p.str("chunks");
                p.empty_list();
                p.mark();
                for c in chunks {
                    object_start(&mut p, M, "ChunkStorageMetadata");
                    p.empty_dict();
                    p.mark();
                    p.str("offsets");
                    torch_size(&mut p, &c.offsets);
                    p.str("sizes");
                    torch_size(&mut p, &c.sizes);
                    p.setitems();
                    p.build();
                }
                p.appends();
                p.setitems();
                p.build();
            }
            // torch writes BytesStorageMetadata as GLOBAL, EMPTY_TUPLE, NEWOBJ with no BUILD.
            Entry::Bytes { .. } => object_start(&mut p, M, "BytesStorageMetadata"),
        }
    }
    p.setitems();

    // planner_data: the flat path of every key, which lets `_EmptyStateDictLoadPlanner` and
    // `format_utils.dcp_to_torch_save` rebuild the dict on 2.3 as well (dcp-format.md §4.1).
    p.str("planner_data");
    p.empty_dict();
    p.mark();
    for fqn in entries.keys() {
        p.str(fqn);
        p.str(fqn);
        p.tuple(1);
    }
    p.setitems();

    p.str("storage_data");
    p.empty_dict();
    p.mark();
    for (fqn, entry) in entries {
        match entry {
            Entry::Tensor { chunks, .. } => {
                for (i, c) in chunks.iter().enumerate() {
                    metadata_index(&mut p, fqn, Some(&c.offsets), Some(i));
                    storage_info(&mut p, &c.storage);
                }
            }
            Entry::Bytes { storage } => {
                metadata_index(&mut p, fqn, None, None);
                storage_info(&mut p, storage);
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

fn storage_info(p: &mut Pickler, s: &StorageInfo) {
    object_start(p, FS, "_StorageInfo");
    p.empty_dict();
    p.mark();
    p.str("relative_path");
    p.str(&s.relative_path);
    p.str("offset");
    p.int(s.offset as i128);
    p.str("length");
    p.int(s.length as i128);
    p.setitems();
    p.build();
}

/// Number of elements of a shape, without overflow.
pub fn volume(sizes: &[u64]) -> u128 {
    sizes.iter().map(|&s| s as u128).product()
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
    for (i, c) in chunks.iter().enumerate() {
        let inside = c.offsets.len() == shape.len()
            && c.sizes.len() == shape.len()
            && c.offsets
                .iter()
                .zip(&c.sizes)
                .zip(shape)
                .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|e| e <= g));
        if !inside {
            return Err(format!(
                "key {fqn}: {} saves chunk offsets {:?} sizes {:?}, outside the global shape {shape:?}",
                origin(i),
                c.offsets,
                c.sizes
            ));
        }
    }
    // Sweep along dimension 0: only chunks whose dim-0 ranges intersect are compared.
    let mut order: Vec<usize> = (0..chunks.len())
        .filter(|&i| volume(&chunks[i].sizes) > 0)
        .collect();
    let start0 = |i: usize| chunks[i].offsets.first().copied().unwrap_or(0);
    let end0 = |i: usize| {
        chunks[i]
            .offsets
            .first()
            .map(|o| o + chunks[i].sizes[0])
            .unwrap_or(1)
    };
    order.sort_by(|&i, &j| chunks[i].offsets.cmp(&chunks[j].offsets));
    let mut active: Vec<usize> = Vec::new();
    for &i in &order {
        active.retain(|&j| end0(j) > start0(i));
        for &j in &active {
            let (a, b) = (chunks[i], chunks[j]);
            let overlap = (0..shape.len()).all(|d| {
                a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d]
            });
            if overlap {
                let what = if a.offsets == b.offsets && a.sizes == b.sizes {
                    "the same chunk"
                } else {
                    "overlapping chunks"
                };
                return Err(format!(
                    "key {fqn}: {} and {} both save {what} (offsets {:?} sizes {:?} and offsets {:?} sizes {:?}); \
                     exactly one main replica (replica_id all zeros) may save each chunk",
                    origin(j),
                    origin(i),
                    b.offsets,
                    b.sizes,
                    a.offsets,
                    a.sizes
                ));
            }
        }
        active.push(i);
    }
    let covered: u128 = chunks.iter().map(|c| volume(&c.sizes)).sum();
    let total = volume(shape);
    if covered != total {
        return Err(format!(
            "key {fqn}: the saved chunks cover {covered} of {total} elements of global shape {shape:?} (coverage gap)"
        ));
    }
    Ok(())
}
