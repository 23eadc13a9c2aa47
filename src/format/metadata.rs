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
