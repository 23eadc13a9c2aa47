//! The global DCP `.metadata` pickle, in the "max-compat" profile that torch 2.3 through 2.15 load
//! (each reads it with a plain `pickle.load`, `FileSystemReader.read_metadata`; torch ≤ 2.14's
//! `TensorProperties.__setstate__` takes exactly 5 fields and torch 2.3 has no `StorageMeta`):
//! protocol 2, `TensorProperties` as a 5-tuple state, no `StorageMeta`, `_StorageInfo` without
//! `transform_descriptors`, `version = "1.0.0"`. What each release writes instead: the golden
//! fixtures, tests/fixtures/README.md.
//!
//! Class paths are those of `torch/distributed/checkpoint/metadata.py` and `filesystem.py`
//! (torch 2.3.1 – 2.15.0).

use std::collections::BTreeMap;

use crate::error::Result;
use crate::format::dtype::DType;
use crate::format::pickle::Pickler;

const M: &str = "torch.distributed.checkpoint.metadata";
const FS: &str = "torch.distributed.checkpoint.filesystem";

/// Where an item's bytes are: `relative_path` inside the checkpoint directory, byte `offset` and
/// `length` of its self-contained torch.save archive (`_StorageInfo`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StorageInfo {
    /// File name inside the checkpoint directory.
    pub relative_path: String,
    /// Byte offset of the archive in the file.
    pub offset: u64,
    /// Length of the archive in bytes.
    pub length: u64,
}

/// One saved chunk of a tensor: global `offsets` and `sizes` in elements per dimension
/// (`ChunkStorageMetadata`), and where its archive is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Global offsets in elements, one per dimension.
    pub offsets: Vec<u64>,
    /// Chunk shape in elements.
    pub sizes: Vec<u64>,
    /// Where the chunk's archive is stored.
    pub storage: StorageInfo,
}

/// One key of the checkpoint (`TensorStorageMetadata` or `BytesStorageMetadata`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A tensor (`TensorStorageMetadata`) and its saved chunks.
    Tensor {
        /// The tensor's dtype.
        dtype: DType,
        /// Global shape in elements.
        global_shape: Vec<u64>,
        /// The saved chunks, in `.metadata`'s order.
        chunks: Vec<Chunk>,
    },
    /// A byte object (`BytesStorageMetadata`).
    Bytes {
        /// Where the object's bytes are.
        storage: StorageInfo,
    },
}

/// Pickles the global metadata; keys are emitted in sorted order, chunks in the given order
/// (their position is the `MetadataIndex.index` hint).
pub fn emit_metadata(entries: &BTreeMap<String, Entry>) -> Vec<u8> {
    emit_metadata_from(&Map::of(entries))
}

/// Sorted entries as a [`MetadataSource`].
struct Map<'a>(Vec<(&'a str, &'a Entry)>);

impl<'a> Map<'a> {
    fn of(entries: &'a BTreeMap<String, Entry>) -> Map<'a> {
        Map(entries.iter().map(|(k, e)| (k.as_str(), e)).collect())
    }
}
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
    /// Number of distinct file ids that [`MetadataSource::file_id`] gives (0: it gives none).
    fn files(&self) -> usize {
        0
    }
    /// An id below [`MetadataSource::files`] of the file that [`MetadataSource::storage`] names,
    /// the same id only for the same `relative_path`: the pickler then looks each file name up
    /// once instead of once per chunk.
    fn file_id(&self, _key: usize, _chunk: usize) -> Option<usize> {
        None
    }
}

/// [`emit_metadata`] for any [`MetadataSource`]: the same bytes for the same keys and chunks.
pub fn emit_metadata_from(src: &impl MetadataSource) -> Vec<u8> {
    let mut p = Pickler::new(true);
    emit(src, &mut p, &mut |_| Ok(())).expect("no output to fail");
    p.finish()
}

/// Bytes of pickle buffered before [`write_metadata`] hands them on.
const FLUSH_BYTES: usize = 1 << 20;

/// [`emit_metadata_from`] handed to `out` piece by piece (about 1 MiB each) as it is pickled, so
/// that a `.metadata` of a GB is written while it is made and never held whole.
///
/// Errors: those of `out`, as soon as it returns one.
pub fn write_metadata(
    src: &impl MetadataSource,
    out: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut p = Pickler::new(true);
    emit(src, &mut p, &mut |p| {
        if p.buf.len() >= FLUSH_BYTES {
            out(&p.buf)?;
            p.buf.clear();
        }
        Ok(())
    })?;
    out(&p.finish())
}

/// Memo indices of the values pickled once per chunk ([`Pickler::str_in`]).
#[derive(Default)]
struct Slots {
    chunk_class: Option<u32>,
    index_class: Option<u32>,
    storage_class: Option<u32>,
    size: Option<u32>,
    offsets: Option<u32>,
    sizes: Option<u32>,
    fqn: Option<u32>,
    offset: Option<u32>,
    index: Option<u32>,
    relative_path: Option<u32>,
    length: Option<u32>,
}

/// Items per `MARK ... SETITEMS`/`APPENDS` batch, as CPython's pickler writes them
/// (`Lib/pickle.py`, `_BATCHSIZE`): a reader decodes the batches of a large `.metadata` in
/// parallel (`format::split`).
const BATCH: usize = 1000;

/// Counts the items of one open container batch and starts a new batch every [`BATCH`].
struct Batches {
    items: usize,
    dict: bool,
}

impl Batches {
    fn new(dict: bool) -> Batches {
        Batches { items: 0, dict }
    }
    /// After an item: closes the batch and opens the next when it is full.
    fn item(&mut self, p: &mut Pickler) {
        self.items += 1;
        if self.items % BATCH == 0 {
            if self.dict {
                p.setitems();
            } else {
                p.appends();
            }
            p.mark();
        }
    }
}

/// Pickles `src` into `p`, calling `flush(p)` between chunks (it may drain `p.buf`).
fn emit(
    src: &impl MetadataSource,
    p: &mut Pickler,
    flush: &mut dyn FnMut(&mut Pickler) -> Result<()>,
) -> Result<()> {
    let mut slot = Slots::default();
    let mut file_slots: Vec<Option<u32>> = vec![None; src.files()];
    state_start(p, &mut None, M, "Metadata");

    p.str("state_dict_metadata");
    p.empty_dict();
    p.mark();
    let mut keys = Batches::new(true);
    for k in 0..src.keys() {
        p.str(src.fqn(k));
        match src.tensor(k) {
            Some((dtype, global_shape, chunks)) => {
                state_start(p, &mut None, M, "TensorStorageMetadata");
                p.str("properties");
                tensor_properties(p, dtype);
                p.str("size");
                torch_size(p, &mut slot.size, global_shape);
                p.str("chunks");
                p.empty_list();
                p.mark();
                let mut items = Batches::new(false);
                for c in 0..chunks {
                    let (offsets, sizes) = src.chunk(k, c);
                    state_start(p, &mut slot.chunk_class, M, "ChunkStorageMetadata");
                    p.str_in(&mut slot.offsets, "offsets");
                    torch_size(p, &mut slot.size, offsets);
                    p.str_in(&mut slot.sizes, "sizes");
                    torch_size(p, &mut slot.size, sizes);
                    p.setitems();
                    p.build();
                    items.item(p);
                    flush(p)?;
                }
                p.appends();
                p.setitems();
                p.build();
            }
            // torch writes BytesStorageMetadata as GLOBAL, EMPTY_TUPLE, NEWOBJ with no BUILD.
            None => object_start(p, &mut None, M, "BytesStorageMetadata"),
        }
        keys.item(p);
    }
    p.setitems();

    // planner_data: the flat path of every key, which lets `_EmptyStateDictLoadPlanner` and
    // `format_utils.dcp_to_torch_save` rebuild the dict on 2.3 as well (torch 2.3.1
    // `default_planner.py`).
    p.str("planner_data");
    p.empty_dict();
    p.mark();
    let mut keys = Batches::new(true);
    for k in 0..src.keys() {
        let fqn = src.fqn(k);
        p.str(fqn);
        p.str(fqn);
        p.tuple(1);
        keys.item(p);
    }
    p.setitems();
    flush(p)?;

    p.str("storage_data");
    p.empty_dict();
    p.mark();
    let mut items = Batches::new(true);
    for k in 0..src.keys() {
        let fqn = src.fqn(k);
        let mut fqn_slot = None;
        let chunks = src.tensor(k).map(|(_, _, n)| n);
        for c in 0..chunks.unwrap_or(1) {
            let offsets = chunks.map(|_| src.chunk(k, c).0);
            // MetadataIndex(fqn, offset, index).
            state_start(p, &mut slot.index_class, M, "MetadataIndex");
            p.str_in(&mut slot.fqn, "fqn");
            p.str_in(&mut fqn_slot, fqn);
            if let Some(o) = offsets {
                p.str_in(&mut slot.offset, "offset");
                torch_size(p, &mut slot.size, o);
            }
            p.str_in(&mut slot.index, "index");
            match chunks {
                Some(_) => p.int(c as i128),
                None => p.none(),
            }
            p.setitems();
            p.build();
            // _StorageInfo(relative_path, offset, length).
            let (relative_path, offset, length) = src.storage(k, c);
            state_start(p, &mut slot.storage_class, FS, "_StorageInfo");
            p.str_in(&mut slot.relative_path, "relative_path");
            match src.file_id(k, c).and_then(|f| file_slots.get_mut(f)) {
                Some(file_slot) => p.str_in(file_slot, relative_path),
                None => p.str(relative_path),
            }
            p.str_in(&mut slot.offset, "offset");
            p.int(offset as i128);
            p.str_in(&mut slot.length, "length");
            p.int(length as i128);
            p.setitems();
            p.build();
            items.item(p);
            flush(p)?;
        }
    }
    p.setitems();

    p.str("version");
    p.str("1.0.0");
    p.setitems();
    p.build();
    Ok(())
}

/// `GLOBAL cls; EMPTY_TUPLE; NEWOBJ` (a dataclass instance before its BUILD); `class` is the memo
/// slot of the class ([`Pickler::global_in`]).
fn object_start(p: &mut Pickler, class: &mut Option<u32>, module: &str, name: &str) {
    p.global_in(class, module, name);
    p.empty_tuple();
    p.newobj();
}

/// [`object_start`], then `EMPTY_DICT; MARK`: the state dict of its BUILD opened.
fn state_start(p: &mut Pickler, class: &mut Option<u32>, module: &str, name: &str) {
    object_start(p, class, module, name);
    p.empty_dict();
    p.mark();
}

/// `torch.Size(dims)`; `size` is the memo slot of the `torch.Size` global.
fn torch_size(p: &mut Pickler, size: &mut Option<u32>, dims: &[u64]) {
    p.global_in(size, "torch", "Size");
    p.int_tuple(dims);
    p.tuple(1);
    p.reduce();
}

/// `TensorProperties` with the 5-tuple state `(dtype, layout, requires_grad, memory_format, pin_memory)`.
fn tensor_properties(p: &mut Pickler, dtype: DType) {
    object_start(p, &mut None, M, "TensorProperties");
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

/// Number of elements of a shape or box, None when it does not fit in a `u64` (no storage holds
/// that many). The one definition: layout checks, the reader, loads and diffs all count with it.
pub fn volume(sizes: &[u64]) -> Option<u64> {
    sizes.iter().try_fold(1u64, |a, &s| a.checked_mul(s))
}

/// Checks the chunks of one tensor key the way DCP's `_validate_global_plan` does at save time
/// (`default_planner.py`, torch 2.3.1–2.15.0; its loader, `planner_helpers.py`, never does): every
/// chunk lies inside `shape`, no two overlap, and together they cover it exactly. `origin(i)` names
/// chunk `i` in messages.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A map whose strings collide with the emitter's own (keys named like field names, a file
    /// named like a key), with dimensions past 3 (MARK tuples) and ints of every opcode width, a
    /// byte object, and file names shared across keys: every memo reuse rule is exercised.
    fn tricky_map() -> BTreeMap<String, Entry> {
        let storage = |path: &str, offset: u64| StorageInfo {
            relative_path: path.into(),
            offset,
            length: 70_000 + offset,
        };
        let chunk = |offsets: Vec<u64>, sizes: Vec<u64>, path: &str, offset: u64| Chunk {
            offsets,
            sizes,
            storage: storage(path, offset),
        };
        let mut m = BTreeMap::new();
        for (k, fqn) in ["offsets", "w", "sizes", "fqn", "__1_0.distcp", "x.y"]
            .iter()
            .enumerate()
        {
            let k = k as u64;
            let chunks = vec![
                chunk(vec![0, 0], vec![2, 300], "__0_0.distcp", k),
                chunk(vec![2, 0], vec![2, 300], "__1_0.distcp", k << 33),
                chunk(vec![4, 0], vec![1 << 20, 300], "w", 1 << 31),
            ];
            m.insert(
                fqn.to_string(),
                Entry::Tensor {
                    dtype: if k % 2 == 0 { DType::BF16 } else { DType::F32 },
                    global_shape: vec![(1 << 20) + 4, 300],
                    chunks,
                },
            );
        }
        m.insert(
            "big".into(),
            Entry::Tensor {
                dtype: DType::I64,
                global_shape: vec![2, 3, 4, 5, 70_000],
                chunks: vec![chunk(vec![0; 5], vec![2, 3, 4, 5, 70_000], "offset", 9)],
            },
        );
        m.insert(
            "rng".into(),
            Entry::Bytes {
                storage: storage("__0_0.distcp", 5),
            },
        );
        m
    }

    /// The bytes of [`tricky_map`] as the emitter of shardwise 0.3 (before the memo slots and the
    /// streamed output) wrote them: size and CRC-32. The `.metadata` of a merge must not change.
    #[test]
    fn metadata_bytes_are_unchanged() {
        let bytes = emit_metadata(&tricky_map());
        assert_eq!(
            (bytes.len(), crc32fast::hash(&bytes)),
            (3294, 4291089072),
            "the .metadata bytes changed"
        );
    }

    /// [`write_metadata`] hands on the bytes of [`emit_metadata`], in pieces of about a MiB.
    #[test]
    fn streamed_metadata_is_the_same_bytes() {
        let mut map = tricky_map();
        let chunk = |i: u64| Chunk {
            offsets: vec![i],
            sizes: vec![1],
            storage: StorageInfo {
                relative_path: format!("__{}_0.distcp", i % 97),
                offset: i,
                length: 1,
            },
        };
        for k in 0..40 {
            let chunks = (0..1000).map(chunk).collect();
            let e = Entry::Tensor {
                dtype: DType::F32,
                global_shape: vec![1000],
                chunks,
            };
            map.insert(format!("layer.{k}"), e);
        }
        let bytes = emit_metadata(&map);
        let mut pieces = Vec::new();
        write_metadata(&Map::of(&map), &mut |b| Ok(pieces.push(b.to_vec()))).unwrap();
        assert!(pieces.len() > 2, "{} pieces", pieces.len());
        assert!(pieces.concat() == bytes);
    }
}
