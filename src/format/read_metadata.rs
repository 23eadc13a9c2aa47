//! Decodes a DCP `.metadata` pickle, as data, into [`Entry`] values (the same types the writer
//! emits). Handles torch 2.3–2.15 (`StorageMeta`, 5- and 6-tuple `TensorProperties`, pathlib
//! variants, `transform_descriptors`), torch ≤2.2's `_shard` classes, and Megatron's variants
//! (`mcore_data`, `MCoreMetadata`, `all_local_plans`), which are recognised by class name and
//! field, never by running their code (torch 2.3.1–2.15.0 `torch/distributed/checkpoint/metadata.py`,
//! megatron-core 0.13.1–0.19.2 `dist_checkpointing/strategies/torch.py`; a fixture of each form in
//! tests/fixtures/README.md).
//!
//! Speed and memory (a `.metadata` holds millions of chunks at scale, and every rank parses it):
//! the one opcode decoder of `format::unpickle` runs with a builder made for DCP ([`Dcp`]) instead
//! of the symbolic `Value` graph. Its values are 16-byte `Copy` handles: strings are positions in
//! the input (no copy), tuples of ints live in one flat `u64` arena (a `torch.Size` is a range of
//! it), and an object of a DCP class is a row of a table of its class, filled at `BUILD` from its
//! state dict, whose storage is then recycled. Memo references (class refs, `relative_path` and fqn
//! strings, sizes) are handle copies. `storage_data` is joined to the chunks through
//! `MetadataIndex.index`, the chunk's position that torch's planner records, checked against the
//! offsets (a map by offsets only when the hint is wrong).
//!
//! A `.metadata` of 8 MiB or more is decoded in parts on all cores (`format::split`) where rayon
//! has several threads: its batches of 1,000 chunks or storage entries each get their own [`Dcp`]
//! builder, the rest one more. The parts keep their own tables, never merged: [`Decoded`] lists a
//! batch's items where its splice stands in its container and follows a reference to the value
//! that another part handed over. A split decode that fails for any reason is redone
//! sequentially, so results and errors are those of the sequential decode (the fuzz target
//! compares the two).

use std::collections::{BTreeMap, HashMap};

use rayon::prelude::*;

use crate::format::dtype::DType;
use crate::format::metadata::{Chunk, Entry, StorageInfo};
use crate::format::pickle::FxBuildHasher;
use crate::format::split::{self, Plan, Sizes};
use crate::format::unpickle::{
    decode_batch, decode_skipping, decode_with_len, err, Build, UnpickleError,
};

/// A decoding failure, with the path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataError(pub String);

type R<T> = Result<T, MetadataError>;

fn bad<T>(msg: impl Into<String>) -> R<T> {
    Err(MetadataError(msg.into()))
}

/// Checks that a `relative_path` from `.metadata` names a file inside the checkpoint directory:
/// not empty, relative, no `..`, no root or prefix components. [`read_metadata`] refuses a
/// `.metadata` with any other path, so the paths of a decoded [`CheckpointMetadata`] need no
/// further check (a symlink inside the directory is the opener's to check).
///
/// Errors: a message naming the path.
pub fn check_relative_path(rel: &str) -> Result<(), String> {
    let p = std::path::Path::new(rel);
    if rel.is_empty()
        || p.components().any(|c| {
            !matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::CurDir
            )
        })
    {
        return Err(format!(
            "relative_path {rel:?} leaves the checkpoint directory"
        ));
    }
    Ok(())
}

/// What `.metadata` describes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointMetadata {
    /// Keys in sorted order. A tensor chunk whose storage entry is missing from `storage_data` has
    /// `relative_path` empty (reported by `verify`); every other `relative_path` passed
    /// [`check_relative_path`].
    pub entries: BTreeMap<String, Entry>,
    /// `transform_descriptors` per item (`stream.zstd/1`, ...), keyed like `storage_data`.
    pub transforms: HashMap<(String, Option<Vec<u64>>), Vec<String>>,
    /// The pickled top-level class (`torch...Metadata` or Megatron's `MCoreMetadata`).
    pub class: String,
    /// Megatron ≤0.15 `mcore_data[key]['nd_reformulated_orig_global_shape']`.
    pub nd_reformulated: BTreeMap<String, Vec<u64>>,
    /// The pickle's length in bytes, through its `STOP` opcode: bytes after it are never read
    /// (by this decoder or torch's `pickle.load`), and no writer leaves any ([`trailing_bytes`]).
    pub pickle_len: u64,
}

/// Why a `.metadata` of `file_len` bytes whose pickle ends at `pickle_len` ([`CheckpointMetadata`])
/// is damaged, or None when the pickle fills the file. No writer leaves bytes after a pickle's
/// `STOP`: they were appended later (torch's `pickle.load` ignores them).
pub fn trailing_bytes(file_len: u64, pickle_len: u64) -> Option<String> {
    (file_len > pickle_len).then(|| {
        format!(
            ".metadata has {} bytes after its pickle ends at byte {pickle_len}: no writer leaves \
             any, so they were appended to it (torch's pickle.load stops before them)",
            file_len - pickle_len
        )
    })
}

/// The DCP classes whose objects [`Dcp`] keeps, by class name (any module: torch ≤2.2 pickles
/// `TensorProperties` from `torch.distributed._shard`, Megatron its own `MCoreMetadata`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Top,
    Tensor,
    Bytes,
    Chunk,
    Props,
    Index,
    Storage,
    Size,
    Other,
}

impl Class {
    fn of(module: &str, name: &str) -> Class {
        match name {
            "Metadata" | "MCoreMetadata" => Class::Top,
            "TensorStorageMetadata" => Class::Tensor,
            "BytesStorageMetadata" => Class::Bytes,
            "ChunkStorageMetadata" => Class::Chunk,
            "TensorProperties" => Class::Props,
            "MetadataIndex" => Class::Index,
            "_StorageInfo" => Class::Storage,
            "Size" if module == "torch" => Class::Size,
            _ => Class::Other,
        }
    }

    /// Fields kept from a `BUILD` state dict, in record order.
    fn fields(self) -> &'static [&'static [u8]] {
        match self {
            Class::Tensor => &[b"properties", b"size", b"chunks"],
            Class::Chunk => &[b"offsets", b"sizes"],
            Class::Index => &[b"fqn", b"offset", b"index"],
            Class::Storage => &[
                b"relative_path",
                b"offset",
                b"length",
                b"transform_descriptors",
            ],
            _ => &[],
        }
    }
}

/// What a value that [`Dcp`] never reads was, for messages.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Float,
    Bytes,
    BigInt,
    Str,
    Call,
    Object,
    PersId,
}

/// A value of the DCP builder (16 bytes, `Copy`). Indices are into [`Dcp`]'s tables.
#[derive(Clone, Copy, Debug)]
enum V {
    /// A field its state did not set.
    Unset,
    None,
    Bool(bool),
    Int(i64),
    /// `len` bytes of the input at `at`, valid UTF-8.
    Str {
        len: u32,
        at: u64,
    },
    Global(u32),
    /// A tuple of non-negative ints: `ints[at..at + len]`.
    Ints {
        at: u32,
        len: u32,
    },
    /// A 1-tuple holding an `Ints` tuple (the argument of `torch.Size`).
    Wrap {
        at: u32,
        len: u32,
    },
    Size {
        at: u32,
        len: u32,
    },
    /// Any other tuple: `vals[at..at + len]`.
    Tuple {
        at: u32,
        len: u32,
    },
    List(u32),
    Dict(u32),
    /// An object of `globals[class]`; `rec` is its row in the table of its [`Class`].
    Obj {
        class: u32,
        rec: u32,
    },
    Other(Kind),
    /// In the main part of a split decode, the items of batch `k` (decoded apart) stand here;
    /// [`Decoded`] lists them in its place on read.
    Splice(u32),
    /// In a split decode, memo key `k`, set by another part: [`Decoded`] follows it on read to the
    /// value that part handed over.
    Ref(u32),
}

/// Builds the tables of a DCP `.metadata` while the decoder runs (see the module doc).
struct Dcp<'a> {
    input: &'a [u8],
    globals: Vec<(&'a str, &'a str, Class)>,
    ints: Vec<u64>,
    vals: Vec<V>,
    lists: Vec<Vec<V>>,
    /// `None` once a `BUILD` took the dict as the state of a kept object.
    dicts: Vec<Option<Vec<(V, V)>>>,
    /// Emptied dict storage, reused by the next dicts.
    spare: Vec<Vec<(V, V)>>,
    /// Per class, one row per object: the fields of `Class::fields`, or the whole state for
    /// `Top` and `Props`.
    tensors: Vec<[V; 3]>,
    chunks: Vec<[V; 2]>,
    indexes: Vec<[V; 3]>,
    storages: Vec<[V; 4]>,
    props: Vec<V>,
    tops: Vec<V>,
    /// Per kept class (`Class::slot`) and field, the `(position, length)` in the input of the key
    /// string that last named that field: torch memoizes its field names, so every object's state
    /// names its fields with the same few strings, and a position compare replaces a byte compare.
    field_at: [[(u64, u32); 4]; 4],
    /// In a split decode: how many [`V::Splice`]s this part made, the memo keys of its
    /// [`V::Ref`]s, and the values of its memo keys that other parts may refer to
    /// (`unpickle::PartValue`).
    splices: usize,
    refs: Vec<u32>,
    exports: Vec<(u32, V)>,
}

fn idx(n: usize) -> Result<u32, UnpickleError> {
    u32::try_from(n).map_err(|_| UnpickleError("pickle too large for the metadata tables".into()))
}

impl<'a> Dcp<'a> {
    fn new(input: &'a [u8]) -> Self {
        Dcp {
            input,
            globals: Vec::new(),
            ints: Vec::new(),
            vals: Vec::new(),
            lists: Vec::new(),
            dicts: Vec::new(),
            spare: Vec::new(),
            tensors: Vec::new(),
            chunks: Vec::new(),
            indexes: Vec::new(),
            storages: Vec::new(),
            props: Vec::new(),
            tops: Vec::new(),
            field_at: [[(u64::MAX, 0); 4]; 4],
            splices: 0,
            refs: Vec::new(),
            exports: Vec::new(),
        }
    }

    /// The field of `class` (one of the four with a row of fields) that key `k` names, if any.
    fn field_of(&mut self, slot: usize, fields: &[&[u8]], k: V) -> Option<usize> {
        let V::Str { len, at } = k else { return None };
        if let Some(f) = self.field_at[slot][..fields.len()]
            .iter()
            .position(|&p| p == (at, len))
        {
            return Some(f);
        }
        let f = fields.iter().position(|f| self.key_is(k, f))?;
        self.field_at[slot][f] = (at, len);
        Some(f)
    }

    fn text(&self, v: V) -> Option<&'a str> {
        match v {
            V::Str { len, at } => {
                let b = self.input.get(at as usize..at as usize + len as usize)?;
                std::str::from_utf8(b).ok()
            }
            _ => None,
        }
    }

    fn key_is(&self, v: V, key: &[u8]) -> bool {
        match v {
            V::Str { len, at } => {
                len as usize == key.len()
                    && self.input.get(at as usize..at as usize + len as usize) == Some(key)
            }
            _ => false,
        }
    }

    fn class_of(&self, v: V) -> Class {
        match v {
            V::Obj { class, .. } => self.globals[class as usize].2,
            _ => Class::Other,
        }
    }

    fn class_name(&self, v: V) -> Option<String> {
        match v {
            V::Obj { class, .. } => {
                let (m, n, _) = self.globals[class as usize];
                Some(format!("{m}.{n}"))
            }
            _ => None,
        }
    }

    fn kind(&self, v: V) -> String {
        match v {
            V::Unset => "missing".into(),
            V::None => "None".into(),
            V::Bool(_) => "bool".into(),
            V::Int(_) | V::Other(Kind::BigInt) => "int".into(),
            V::Str { .. } | V::Other(Kind::Str) => "str".into(),
            V::Other(Kind::Float) => "float".into(),
            V::Other(Kind::Bytes) => "bytes".into(),
            V::Global(g) => {
                let (m, n, _) = self.globals[g as usize];
                format!("global {m}.{n}")
            }
            V::Ints { .. } | V::Wrap { .. } | V::Tuple { .. } => "tuple".into(),
            V::Size { .. } => "call of global torch.Size".into(),
            V::List(_) => "list".into(),
            V::Dict(_) => "dict".into(),
            V::Obj { .. } => format!(
                "object of global {}",
                self.class_name(v).unwrap_or_default()
            ),
            V::Other(Kind::Call) => "call".into(),
            V::Other(Kind::Object) => "object".into(),
            V::Other(Kind::PersId) => "persistent id".into(),
            V::Splice(_) => "batch decoded apart".into(),
            V::Ref(_) => "value of another part".into(),
        }
    }

    /// The pairs of a dict value (empty for anything else).
    fn pairs(&self, v: V) -> &[(V, V)] {
        match v {
            V::Dict(d) => self.dicts[d as usize].as_deref().unwrap_or(&[]),
            _ => &[],
        }
    }

    /// `dict[key]` for a dict with string keys (the last pair wins, as in Python).
    fn get(&self, dict: V, key: &str) -> Option<V> {
        self.pairs(dict)
            .iter()
            .rev()
            .find(|(k, _)| self.key_is(*k, key.as_bytes()))
            .map(|(_, v)| *v)
    }

    fn dict_pairs(&self, v: V, what: &str) -> R<&[(V, V)]> {
        match v {
            V::Dict(d) => self.dicts[d as usize]
                .as_deref()
                .ok_or_else(|| MetadataError(format!("{what} is an object's state, not a dict"))),
            other => bad(format!("{what} is {}, not a dict", self.kind(other))),
        }
    }

    /// Items of a tuple or list (a tuple of ints has none as values: see [`Dcp::shape`]).
    fn items(&self, v: V) -> Option<&[V]> {
        match v {
            V::Tuple { at, len } => self.vals.get(at as usize..at as usize + len as usize),
            V::List(l) => Some(&self.lists[l as usize]),
            _ => None,
        }
    }

    /// `torch.Size((..))`, or a plain tuple/list of non-negative ints.
    fn shape(&self, v: V, what: &dyn Fn() -> String) -> R<&[u64]> {
        match v {
            V::Size { at, len } | V::Ints { at, len } => {
                Ok(&self.ints[at as usize..at as usize + len as usize])
            }
            V::Other(Kind::Call) => bad(format!("{}: bad torch.Size", what())),
            other => match self.items(other) {
                // Not all non-negative ints, or it would be `Ints`.
                Some(items) => {
                    let x = items
                        .iter()
                        .find(|x| !matches!(x, V::Int(i) if *i >= 0))
                        .copied()
                        .unwrap_or(V::Unset);
                    bad(format!("{}: {} is not a dimension", what(), self.kind(x)))
                }
                None => bad(format!("{} is {}, not a shape", what(), self.kind(other))),
            },
        }
    }

    fn dtype(&self, props: V, fqn: &str) -> R<DType> {
        let st = match props {
            V::Obj { rec, .. } if self.class_of(props) == Class::Props => self.props[rec as usize],
            _ => V::Unset,
        };
        // 2.3+: the state is the tuple (dtype, layout, requires_grad, memory_format, pin_memory[, strides]).
        let dtype = match st {
            V::Unset => return bad(format!("{fqn}: TensorProperties without state")),
            V::Tuple { at, len: 5 | 6 } => self.vals[at as usize],
            V::Dict(_) => self
                .get(st, "dtype")
                .ok_or_else(|| MetadataError(format!("{fqn}: TensorProperties without dtype")))?,
            other => {
                return bad(format!(
                    "{fqn}: TensorProperties state is {}",
                    self.kind(other)
                ))
            }
        };
        match dtype {
            V::Global(g) if self.globals[g as usize].0 == "torch" => {
                DType::from_torch_name(self.globals[g as usize].1)
                    .map_err(|e| MetadataError(format!("{fqn}: {e}")))
            }
            other => bad(format!("{fqn}: dtype is {}", self.kind(other))),
        }
    }

    fn uint(&self, v: V) -> Option<u64> {
        match v {
            V::Int(i) => u64::try_from(i).ok(),
            V::Bool(b) => Some(b as u64),
            _ => None,
        }
    }

    /// Sets the fields of object `rec` of `class` (one of the four with a row of fields) from its
    /// state's `pairs` (the last pair naming a field wins, as in Python).
    fn fill(&mut self, class: Class, rec: u32, pairs: &[(V, V)]) {
        let fields = class.fields();
        let slot = match class {
            Class::Tensor => 0,
            Class::Chunk => 1,
            Class::Index => 2,
            _ => 3,
        };
        let mut row = [V::Unset; 4];
        for &(k, v) in pairs {
            if let Some(f) = self.field_of(slot, fields, k) {
                row[f] = v;
            }
        }
        let r = rec as usize;
        let set = |dst: &mut [V]| {
            for (d, s) in dst.iter_mut().zip(row) {
                if !matches!(s, V::Unset) {
                    *d = s;
                }
            }
        };
        match class {
            Class::Tensor => set(&mut self.tensors[r]),
            Class::Chunk => set(&mut self.chunks[r]),
            Class::Index => set(&mut self.indexes[r]),
            _ => set(&mut self.storages[r]),
        }
    }

    /// Allocates an object's row in the table of its class.
    fn row(&mut self, class: Class) -> Result<u32, UnpickleError> {
        let (n, _) = match class {
            Class::Tensor => (self.tensors.len(), self.tensors.push([V::Unset; 3])),
            Class::Chunk => (self.chunks.len(), self.chunks.push([V::Unset; 2])),
            Class::Index => (self.indexes.len(), self.indexes.push([V::Unset; 3])),
            Class::Storage => (self.storages.len(), self.storages.push([V::Unset; 4])),
            Class::Props => (self.props.len(), self.props.push(V::Unset)),
            Class::Top => (self.tops.len(), self.tops.push(V::Unset)),
            Class::Bytes | Class::Size | Class::Other => (0, ()),
        };
        idx(n)
    }
}

impl<'a> Build<'a> for Dcp<'a> {
    type V = V;
    fn none(&mut self) -> V {
        V::None
    }
    fn bool(&mut self, b: bool) -> V {
        V::Bool(b)
    }
    fn int(&mut self, i: i128) -> V {
        i64::try_from(i).map_or(V::Other(Kind::BigInt), V::Int)
    }
    fn float(&mut self, _: f64) -> V {
        V::Other(Kind::Float)
    }
    fn str(&mut self, s: &'a str) -> V {
        // Every string the decoder hands over is a slice of the input.
        let at = (s.as_ptr() as usize).wrapping_sub(self.input.as_ptr() as usize);
        match u32::try_from(s.len()) {
            Ok(len) if at <= self.input.len() => V::Str { len, at: at as u64 },
            _ => V::Other(Kind::Str),
        }
    }
    fn bytes(&mut self, _: &'a [u8]) -> V {
        V::Other(Kind::Bytes)
    }
    fn tuple(&mut self, items: std::vec::Drain<'_, V>) -> Result<V, UnpickleError> {
        let items = items.as_slice();
        // A tuple's representation depends on its items (`Ints`, `Wrap`).
        if !self.refs.is_empty() && items.iter().any(|v| matches!(v, V::Ref(_))) {
            return err("a tuple of a value of another part");
        }
        if let [V::Ints { at, len }] = items {
            return Ok(V::Wrap { at: *at, len: *len });
        }
        if items.iter().all(|v| matches!(v, V::Int(i) if *i >= 0)) {
            let at = idx(self.ints.len())?;
            self.ints.extend(items.iter().map(|v| match v {
                V::Int(i) => *i as u64,
                _ => 0,
            }));
            return Ok(V::Ints {
                at,
                len: idx(items.len())?,
            });
        }
        let at = idx(self.vals.len())?;
        self.vals.extend_from_slice(items);
        Ok(V::Tuple {
            at,
            len: idx(items.len())?,
        })
    }
    fn empty_list(&mut self) -> Result<V, UnpickleError> {
        let l = idx(self.lists.len())?;
        self.lists.push(Vec::new());
        Ok(V::List(l))
    }
    fn empty_dict(&mut self) -> Result<V, UnpickleError> {
        let d = idx(self.dicts.len())?;
        self.dicts.push(Some(self.spare.pop().unwrap_or_default()));
        Ok(V::Dict(d))
    }
    fn append(&mut self, list: &V, items: std::vec::Drain<'_, V>) -> Result<(), UnpickleError> {
        match list {
            V::List(l) => {
                self.lists[*l as usize].extend(items);
                Ok(())
            }
            other => err(format!("APPEND(S) on a {}", self.kind(*other))),
        }
    }
    fn set_items(&mut self, dict: &V, items: std::vec::Drain<'_, V>) -> Result<(), UnpickleError> {
        match dict {
            V::Dict(d) => match &mut self.dicts[*d as usize] {
                Some(pairs) => {
                    let items = items.as_slice();
                    pairs.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                    Ok(())
                }
                None => err("SETITEM(S) on a dict already taken as an object's state"),
            },
            other => err(format!("SETITEM(S) on a {}", self.kind(*other))),
        }
    }
    fn global(&mut self, module: &'a str, name: &'a str) -> V {
        // A torch pickle memoizes its ~20 globals; a protocol-2 one repeats them per object.
        let recent = self.globals.len().saturating_sub(64);
        if let Some(g) = self.globals[recent..]
            .iter()
            .position(|&(m, n, _)| m == module && n == name)
        {
            return V::Global((recent + g) as u32);
        }
        match idx(self.globals.len()) {
            Ok(g) => {
                self.globals.push((module, name, Class::of(module, name)));
                V::Global(g)
            }
            Err(_) => V::Other(Kind::Call),
        }
    }
    fn stack_global(&mut self, module: V, name: V) -> Result<V, UnpickleError> {
        match (self.text(module), self.text(name)) {
            (Some(m), Some(n)) => Ok(self.global(m, n)),
            _ => err("STACK_GLOBAL needs two strings"),
        }
    }
    fn call(&mut self, func: V, args: V) -> Result<V, UnpickleError> {
        if matches!(func, V::Ref(_)) || matches!(args, V::Ref(_)) {
            return err("a call of a value of another part");
        }
        Ok(match (func, args) {
            (V::Global(g), V::Wrap { at, len }) if self.globals[g as usize].2 == Class::Size => {
                V::Size { at, len }
            }
            _ => V::Other(Kind::Call),
        })
    }
    fn new_obj(&mut self, class: V, _args: V) -> Result<V, UnpickleError> {
        match class {
            V::Ref(_) => err("an object of a value of another part"),
            V::Global(g) => {
                let rec = self.row(self.globals[g as usize].2)?;
                Ok(V::Obj { class: g, rec })
            }
            _ => Ok(V::Other(Kind::Object)),
        }
    }
    fn build(&mut self, obj: V, state: V) -> Result<V, UnpickleError> {
        if matches!(obj, V::Ref(_)) || matches!(state, V::Ref(_)) {
            return err("BUILD with a value of another part");
        }
        let V::Obj { rec, .. } = obj else {
            // BUILD on a call result (e.g. an object from copyreg): nothing DCP reads.
            return Ok(V::Other(Kind::Object));
        };
        let class = self.class_of(obj);
        match class {
            Class::Top => self.tops[rec as usize] = state,
            Class::Props => self.props[rec as usize] = state,
            Class::Tensor | Class::Chunk | Class::Index | Class::Storage => {
                let V::Dict(d) = state else {
                    return Ok(obj); // fields stay unset: reported where they are read
                };
                // The state's fields go into the object's row, and the dict's storage is reused.
                let Some(mut pairs) = self.dicts[d as usize].take() else {
                    return err("BUILD with a dict already taken as an object's state");
                };
                // `split::plan` never makes a batch of a dict that BUILD takes; this guards it
                // (the split decode then fails, and the caller decodes sequentially).
                if self.splices > 0 && pairs.iter().any(|(k, _)| matches!(k, V::Splice(_))) {
                    return err("BUILD with a state holding a batch decoded apart");
                }
                self.fill(class, rec, &pairs);
                pairs.clear();
                self.spare.push(pairs);
            }
            Class::Bytes | Class::Size | Class::Other => {}
        }
        Ok(obj)
    }
    fn pers_id(&mut self, _: V) -> Result<V, UnpickleError> {
        Ok(V::Other(Kind::PersId))
    }
    fn memo_ref(&mut self, idx: u32) -> Result<V, UnpickleError> {
        self.refs.push(idx);
        Ok(V::Ref(idx))
    }
    fn splice(&mut self, container: &V, batch: u32, dict: bool) -> Result<(), UnpickleError> {
        match (*container, dict) {
            (V::List(l), false) => self.lists[l as usize].push(V::Splice(batch)),
            (V::Dict(d), true) => match &mut self.dicts[d as usize] {
                Some(pairs) => pairs.push((V::Splice(batch), V::Unset)),
                None => return err("SETITEM(S) on a dict already taken as an object's state"),
            },
            (other, dict) => {
                let op = if dict { "SETITEM(S)" } else { "APPEND(S)" };
                return err(format!("{op} on a {}", self.kind(other)));
            }
        }
        self.splices += 1;
        Ok(())
    }
}

/// A value and the builder whose tables it indexes.
type At<'p, 'a> = (&'p Dcp<'a>, V);

/// The part that holds an exported value: a batch's index, or [`MAIN`].
const MAIN: u32 = u32::MAX;

/// What a decode made: the main part's builder and, in a split decode, each batch's (with the
/// list or dict that stood in for its container). The parts are not merged: a list or dict of one
/// part lists a batch's items where its [`V::Splice`] stands, and a [`V::Ref`] is followed to the
/// value another part handed over; every read goes through [`Decoded::at`], [`Decoded::items`] or
/// [`Decoded::pairs`], which do both.
struct Decoded<'a> {
    main: Dcp<'a>,
    parts: Vec<(Dcp<'a>, V)>,
    /// Memo key, part ([`MAIN`] or a batch) and value, sorted by key.
    exports: Vec<(u32, u32, V)>,
}

impl<'a> Decoded<'a> {
    /// A decode of one part only.
    fn whole(main: Dcp<'a>) -> Decoded<'a> {
        Decoded {
            main,
            parts: Vec::new(),
            exports: Vec::new(),
        }
    }

    /// Collects every part's exports, and checks that each [`V::Ref`] of every part finds one
    /// that is not itself a reference.
    fn link(main: Dcp<'a>, parts: Vec<(Dcp<'a>, V)>) -> Result<Decoded<'a>, UnpickleError> {
        let mut d = Decoded {
            main,
            parts,
            exports: Vec::new(),
        };
        let mut exports: Vec<(u32, u32, V)> = std::mem::take(&mut d.main.exports)
            .into_iter()
            .map(|(k, v)| (k, MAIN, v))
            .collect();
        for (i, (p, _)) in d.parts.iter_mut().enumerate() {
            let i = u32::try_from(i).map_err(|_| UnpickleError("too many batches".into()))?;
            exports.extend(
                std::mem::take(&mut p.exports)
                    .into_iter()
                    .map(|(k, v)| (k, i, v)),
            );
        }
        exports.sort_unstable_by_key(|e| e.0);
        d.exports = exports;
        let resolves = |k: &u32| {
            d.exports
                .binary_search_by_key(k, |e| e.0)
                .is_ok_and(|i| !matches!(d.exports[i].2, V::Ref(_)))
        };
        let all = d
            .main
            .refs
            .iter()
            .chain(d.parts.iter().flat_map(|(p, _)| &p.refs));
        if !all.clone().all(resolves) {
            return err("a value of another part that no part hands over");
        }
        Ok(d)
    }

    fn part(&self, p: u32) -> &Dcp<'a> {
        match p {
            MAIN => &self.main,
            p => &self.parts[p as usize].0,
        }
    }

    /// `v`, a placeholder followed to the value it stands for ([`Decoded::link`] checked that
    /// there is one).
    fn at<'p>(&'p self, b: &'p Dcp<'a>, v: V) -> At<'p, 'a> {
        match v {
            V::Ref(k) => match self.exports.binary_search_by_key(&k, |e| e.0) {
                Ok(i) => (self.part(self.exports[i].1), self.exports[i].2),
                Err(_) => (b, V::Unset),
            },
            v => (b, v),
        }
    }

    /// Items of a tuple or list, each batch's items where its splice stands (a tuple of ints has
    /// none as values: see [`Dcp::shape`]).
    fn items<'p>(&'p self, (b, v): At<'p, 'a>) -> Option<Vec<At<'p, 'a>>> {
        let (b, v) = self.at(b, v);
        let own = b.items(v)?;
        let mut out = Vec::with_capacity(own.len());
        for &x in own {
            match x {
                V::Splice(k) => {
                    let (p, holder) = &self.parts[k as usize];
                    out.extend(
                        p.items(*holder)
                            .unwrap_or(&[])
                            .iter()
                            .map(|&x| self.at(p, x)),
                    );
                }
                x => out.push(self.at(b, x)),
            }
        }
        Some(out)
    }

    /// The pairs of a dict (none for anything else), each batch's where its splice stands.
    fn pairs<'p>(&'p self, (b, v): At<'p, 'a>) -> Vec<(&'p Dcp<'a>, V, V)> {
        let (b, v) = self.at(b, v);
        let own = b.pairs(v);
        let mut out = Vec::with_capacity(own.len());
        for &(k, x) in own {
            match k {
                V::Splice(s) => {
                    let (p, holder) = &self.parts[s as usize];
                    out.extend(p.pairs(*holder).iter().map(|&(k, x)| (p, k, x)));
                }
                k => out.push((b, k, x)),
            }
        }
        out
    }

    /// [`Decoded::pairs`] of a value that must be a dict.
    fn dict_pairs<'p>(&'p self, (b, v): At<'p, 'a>, what: &str) -> R<Vec<(&'p Dcp<'a>, V, V)>> {
        let (b, v) = self.at(b, v);
        b.dict_pairs(v, what)?;
        Ok(self.pairs((b, v)))
    }

    /// `dict[key]` for a dict with string keys (the last pair wins, as in Python).
    fn get<'p>(&'p self, dict: At<'p, 'a>, key: &str) -> Option<At<'p, 'a>> {
        self.pairs(dict)
            .into_iter()
            .rev()
            .find(|(b, k, _)| b.key_is(*k, key.as_bytes()))
            .map(|(b, _, v)| self.at(b, v))
    }

    /// The [`Entry`] of key `fqn` from its `state_dict_metadata` value, storage not yet filled
    /// (an empty `relative_path`).
    fn entry(&self, fqn: &str, v: At<'_, 'a>) -> R<Entry> {
        let missing = || StorageInfo {
            relative_path: String::new(),
            offset: 0,
            length: 0,
        };
        let (b, v) = self.at(v.0, v.1);
        let rec = match (b.class_of(v), v) {
            (Class::Bytes, _) => return Ok(Entry::Bytes { storage: missing() }),
            (Class::Tensor, V::Obj { rec, .. }) => rec,
            _ => {
                return bad(format!(
                    "{fqn}: unknown storage metadata class {:?} ({})",
                    b.class_name(v).unwrap_or_default(),
                    b.kind(v)
                ))
            }
        };
        let [props, size, chunk_list] = b.tensors[rec as usize];
        if matches!(props, V::Unset) {
            return bad(format!("{fqn}: no properties"));
        }
        let (pb, props) = self.at(b, props);
        let dtype = pb.dtype(props, fqn)?;
        if matches!(size, V::Unset) {
            return bad(format!("{fqn}: no size"));
        }
        let (sb, size) = self.at(b, size);
        let global_shape = sb.shape(size, &|| format!("{fqn}: size"))?.to_vec();
        let list = self
            .items((b, chunk_list))
            .ok_or_else(|| MetadataError(format!("{fqn}: chunks is not a list")))?;
        let mut chunks = Vec::with_capacity(list.len());
        for (cb, c) in list {
            let [offsets, sizes] = match (cb.class_of(c), c) {
                (Class::Chunk, V::Obj { rec, .. }) => cb.chunks[rec as usize],
                _ => return bad(format!("{fqn}: chunk is {}", cb.kind(c))),
            };
            let ((ob, offsets), (zb, sizes)) = (self.at(cb, offsets), self.at(cb, sizes));
            chunks.push(Chunk {
                offsets: ob
                    .shape(offsets, &|| format!("{fqn}: chunk offsets"))?
                    .to_vec(),
                sizes: zb.shape(sizes, &|| format!("{fqn}: chunk sizes"))?.to_vec(),
                storage: missing(),
            });
        }
        Ok(Entry::Tensor {
            dtype,
            global_shape,
            chunks,
        })
    }
}

/// Inputs smaller than this are decoded sequentially: splitting pays only on large `.metadata`.
const SPLIT_MIN_INPUT: usize = 8 << 20;

/// Whether [`read_metadata`] splits `len` bytes: only a large pickle, and only where rayon has
/// several threads (on one, the split's opcode walk is a fifth more work for nothing).
fn splits(len: usize) -> bool {
    len >= SPLIT_MIN_INPUT && rayon::current_num_threads() > 1
}

/// Decodes `bytes` with the DCP builder: split into batches decoded in parallel ([`split`]) when
/// `sizes` is given and the pickle splits, else (and whenever a split decode fails) sequentially,
/// which gives every error.
/// Returns the decoded tables, the pickle's value and its length in bytes (through `STOP`).
fn decode_dcp<'a>(
    bytes: &'a [u8],
    sizes: Option<Sizes>,
) -> Result<(Decoded<'a>, V, usize), UnpickleError> {
    if let Some(plan) = sizes.and_then(|s| split::plan(bytes, s)) {
        if !plan.batches.is_empty() {
            match decode_split(bytes, plan) {
                Ok(done) => return Ok(done),
                Err(e) => tracing::debug!("metadata decoded sequentially: {e}"),
            }
        }
    }
    let mut b = Dcp::new(bytes);
    let (top, len) = decode_with_len(bytes, &mut b)?;
    Ok((Decoded::whole(b), top, len))
}

fn decode_split<'a>(
    bytes: &'a [u8],
    plan: Plan<'a>,
) -> Result<(Decoded<'a>, V, usize), UnpickleError> {
    let (main, parts) = {
        let plan = &plan;
        rayon::join(
            || {
                let mut b = Dcp::new(bytes);
                let ((top, exports), len) = decode_skipping(bytes, &mut b, plan)?;
                b.exports = exports;
                b.spare = Vec::new();
                Ok((b, top, len))
            },
            || {
                (0..plan.batches.len())
                    .into_par_iter()
                    .map(|k| {
                        let mut b = Dcp::new(bytes);
                        let (holder, exports) = decode_batch(bytes, &mut b, plan, k)?;
                        b.exports = exports;
                        b.spare = Vec::new();
                        Ok((b, holder))
                    })
                    .collect::<Result<Vec<_>, UnpickleError>>()
            },
        )
    };
    // The plan (8 bytes per memo key) goes before the entries are made.
    drop(plan);
    let (main, top, len) = main?;
    let d = Decoded::link(main, parts?)?;
    if let V::Ref(_) = top {
        return err("the pickle's value is a value of another part");
    }
    Ok((d, top, len))
}

/// Decodes `.metadata` bytes.
///
/// Errors: [`MetadataError`] for a pickle that is malformed or whose structure is not DCP metadata.
pub fn read_metadata(bytes: &[u8]) -> R<CheckpointMetadata> {
    read_metadata_split(bytes, splits(bytes.len()).then_some(Sizes::METADATA))
}

/// [`read_metadata`], split into batches of `sizes` (None: sequentially). The result does not
/// depend on `sizes` (the fuzz target checks it).
pub(crate) fn read_metadata_split(bytes: &[u8], sizes: Option<Sizes>) -> R<CheckpointMetadata> {
    let (mut d, top, pickle_len) = decode_dcp(bytes, sizes)
        .map_err(|e| MetadataError(format!("not a readable pickle: {e}")))?;
    // The parse's scratch goes before the entries are made: only the tables they come from stay.
    d.main.spare = Vec::new();
    let d = &d;
    let b = &d.main;
    let class = b.class_name(top).ok_or_else(|| {
        MetadataError(format!(
            "top-level value is {}, not a Metadata object",
            b.kind(top)
        ))
    })?;
    let V::Obj { rec, .. } = top else {
        unreachable!("class_name is Some only for objects")
    };
    if b.class_of(top) != Class::Top {
        return bad(format!(
            "top-level class is {class}, not torch.distributed.checkpoint.metadata.Metadata"
        ));
    }
    let st = match d.at(b, b.tops[rec as usize]) {
        (_, V::Unset) => return bad("Metadata without state"),
        st => st,
    };
    let sdm = d
        .get(st, "state_dict_metadata")
        .ok_or_else(|| MetadataError("Metadata without state_dict_metadata".into()))?;

    // The keys, in pickle order (a repeated key replaces the earlier one, as in Python).
    let mut keys: Vec<(&str, Entry)> = Vec::new();
    let mut by_fqn: HashMap<&str, usize> = HashMap::new();
    // Keys are made in parallel; the first error in pickle order is reported.
    let made: Vec<R<(&str, Entry)>> = d
        .dict_pairs(sdm, "state_dict_metadata")?
        .par_iter()
        .map(|&(kb, k, v)| {
            let (kb, k) = d.at(kb, k);
            let fqn = kb.text(k).ok_or_else(|| {
                MetadataError(format!("state_dict_metadata key is {}", kb.kind(k)))
            })?;
            Ok((fqn, d.entry(fqn, (kb, v))?))
        })
        .collect();
    for m in made {
        let (fqn, entry) = m?;
        match by_fqn.get(fqn) {
            Some(&i) => keys[i].1 = entry,
            None => {
                by_fqn.insert(fqn, keys.len());
                keys.push((fqn, entry));
            }
        }
    }

    let mut transforms = HashMap::new();
    if let Some(sd) = d.get(st, "storage_data") {
        join_storage(d, sd, &mut keys, &by_fqn, &mut transforms)?;
    }

    let mut nd_reformulated = BTreeMap::new();
    if let Some(mcore) = d.get(st, "mcore_data") {
        for (b, k, v) in d.pairs(mcore) {
            let (b, k) = d.at(b, k);
            if let (Some(key), Some((sb, shape))) = (
                b.text(k),
                d.get((b, v), "nd_reformulated_orig_global_shape"),
            ) {
                if let Ok(s) = sb.shape(shape, &|| key.to_string()) {
                    nd_reformulated.insert(key.to_string(), s.to_vec());
                }
            }
        }
    }
    let entries = keys.into_iter().map(|(k, e)| (k.to_string(), e)).collect();
    Ok(CheckpointMetadata {
        entries,
        transforms,
        class,
        nd_reformulated,
        pickle_len: pickle_len as u64,
    })
}

/// Fills each chunk's (and byte object's) storage from `storage_data`, a dict
/// `MetadataIndex(fqn, offset, index) -> _StorageInfo` keyed by `(fqn, offset)` (later entries win,
/// as in the Python dict). Every entry is checked, in order, also those of keys
/// `state_dict_metadata` lacks; then each key's entries are matched to its chunks, keys in
/// parallel (the chunk lists are visited in another order than `storage_data`'s: cache misses).
fn join_storage<'a>(
    d: &'a Decoded<'a>,
    sd: At<'a, 'a>,
    keys: &mut [(&'a str, Entry)],
    by_fqn: &HashMap<&'a str, usize>,
    transforms: &mut HashMap<(String, Option<Vec<u64>>), Vec<String>>,
) -> R<()> {
    // The entries are checked in parallel (each alone), then taken in order: the first error in
    // pickle order is reported, and paths are interned in a sequential pass.
    let checked: Vec<R<Checked>> = d
        .dict_pairs(sd, "storage_data")?
        .par_iter()
        .map(|&(b, k, v)| check_storage_entry(d, b, k, v, by_fqn))
        .collect();
    let Interned { paths, per_key } = intern_paths(d, checked, keys.len(), transforms)?;
    keys.par_iter_mut()
        .zip(per_key)
        .for_each(|((_, entry), items)| place_items(entry, items, &paths));
    Ok(())
}

/// One checked entry: where its chunk's offsets are (None for a byte object), the index hint, the
/// path (its input position until interned, then its index in `paths`), offset and length.
struct Item<'s> {
    offsets: Option<&'s [u64]>,
    hint: Option<u64>,
    path: u64,
    offset: u64,
    length: u64,
}

/// An entry of `storage_data` checked on its own.
struct Checked<'s> {
    fqn: &'s str,
    /// The key's position in `keys`; None when `state_dict_metadata` lacks it.
    key: Option<u32>,
    item: Item<'s>,
    /// The `relative_path` value.
    path: V,
    /// `transform_descriptors`, when it has some.
    transforms: Option<Vec<String>>,
}

/// Checks one `storage_data` entry, key `k` and value `v` of part `b`, alone (entries are checked
/// in parallel): a `MetadataIndex` with an fqn, a `_StorageInfo` with a string path and
/// non-negative offset and length.
///
/// Errors: a [`MetadataError`] naming the fqn and field.
fn check_storage_entry<'a>(
    d: &'a Decoded<'a>,
    b: &'a Dcp<'a>,
    k: V,
    v: V,
    by_fqn: &HashMap<&'a str, usize>,
) -> R<Checked<'a>> {
    let (kb, k) = d.at(b, k);
    let [fqn_v, offset_v, index_v] = match (kb.class_of(k), k) {
        (Class::Index, V::Obj { rec, .. }) => kb.indexes[rec as usize],
        _ => return bad(format!("storage_data key is {}", kb.kind(k))),
    };
    // A string value is valid UTF-8 (checked when decoded).
    let Some(fqn) = kb.text(d.at(kb, fqn_v).1) else {
        return bad("MetadataIndex without fqn");
    };
    let offsets = match d.at(kb, offset_v) {
        (_, V::Unset | V::None) => None,
        (ob, o) => Some(ob.shape(o, &|| format!("{fqn}: MetadataIndex.offset"))?),
    };
    let (vb, v) = d.at(b, v);
    let [path_v, off_v, len_v, tr_v] = match (vb.class_of(v), v) {
        (Class::Storage, V::Obj { rec, .. }) => vb.storages[rec as usize],
        _ => return bad(format!("{fqn}: storage info is {}", vb.kind(v))),
    };
    let path_v = d.at(vb, path_v).1;
    let V::Str { at: path, .. } = path_v else {
        return bad(format!("{fqn}: relative_path is not a string"));
    };
    let num = |x: V, name: &str| {
        vb.uint(d.at(vb, x).1)
            .ok_or_else(|| MetadataError(format!("{fqn}: {name} is not a non-negative int")))
    };
    let (offset, length) = (num(off_v, "offset")?, num(len_v, "length")?);
    let names = d.items((vb, tr_v)).map(|list| {
        list.iter()
            .filter_map(|&(tb, t)| tb.text(t).map(String::from))
            .collect::<Vec<String>>()
    });
    let item = Item {
        offsets,
        hint: kb.uint(d.at(kb, index_v).1),
        path,
        offset,
        length,
    };
    Ok(Checked {
        fqn,
        key: by_fqn.get(fqn).map(|&i| i as u32),
        item,
        path: path_v,
        transforms: names.filter(|n| !n.is_empty()),
    })
}

/// The checked entries' distinct paths, and each key's items (their `path` an index in `paths`).
struct Interned<'s> {
    paths: Vec<String>,
    per_key: Vec<Vec<Item<'s>>>,
}

/// Takes the checked entries in pickle order (the first error wins): records their
/// `transform_descriptors`, drops those of keys `state_dict_metadata` lacks, and interns the paths
/// of the others, grouping their items by key (`nkeys` keys).
///
/// Errors: the first entry's error; a `relative_path` that leaves the directory.
fn intern_paths<'s>(
    d: &Decoded,
    checked: Vec<R<Checked<'s>>>,
    nkeys: usize,
    transforms: &mut HashMap<(String, Option<Vec<u64>>), Vec<String>>,
) -> R<Interned<'s>> {
    // Each distinct path is checked once, when first met (a rank's entries share one string, so
    // the last one is tried first): every `relative_path` of a decoded `.metadata` names a file
    // inside the checkpoint directory. Positions are not chosen by the hash's adversary in any
    // useful way (each costs the input its bytes), so the fast hasher is fine here.
    let mut path_at: HashMap<u64, u32, FxBuildHasher> = HashMap::default();
    let mut last: Option<(u64, u32)> = None;
    let mut paths: Vec<String> = Vec::new();
    let mut per_key: Vec<Vec<Item>> = (0..nkeys).map(|_| Vec::new()).collect();
    for c in checked {
        let Checked {
            fqn,
            key,
            mut item,
            path: path_v,
            transforms: names,
        } = c?;
        if let Some(names) = names {
            transforms.insert((fqn.to_string(), item.offsets.map(|o| o.to_vec())), names);
        }
        let Some(key) = key else {
            continue; // a key state_dict_metadata does not have: nothing reads it
        };
        let path = match last {
            Some((pos, p)) if pos == item.path => p,
            _ => match path_at.get(&item.path) {
                Some(&p) => p,
                None => {
                    let text = d.main.text(path_v).unwrap_or_default();
                    check_relative_path(text)
                        .map_err(|why| MetadataError(format!("{fqn}: {why}")))?;
                    paths.push(text.to_string());
                    path_at.insert(item.path, (paths.len() - 1) as u32);
                    (paths.len() - 1) as u32
                }
            },
        };
        last = Some((item.path, path));
        item.path = path as u64;
        per_key[key as usize].push(item);
    }
    Ok(Interned { paths, per_key })
}

/// Gives one key's `entry` the storage of its `items` (in `storage_data` order): a byte object its
/// one storage, each chunk of a tensor the storage of the item with its offsets.
fn place_items(entry: &mut Entry, items: Vec<Item>, paths: &[String]) {
    // Per key, chunk positions by offsets, made only when neither hint finds the chunk.
    let mut by_offsets: Option<HashMap<Vec<u64>, usize>> = None;
    // The chunk after the last one matched: where an entry without a hint looks first
    // (Megatron's saves record no hint, but list a key's chunks in storage order).
    let mut next = 0usize;
    for it in items {
        let info = StorageInfo {
            relative_path: paths[it.path as usize].clone(),
            offset: it.offset,
            length: it.length,
        };
        match (&mut *entry, it.offsets) {
            (Entry::Bytes { storage }, None) => *storage = info,
            (Entry::Tensor { chunks, .. }, Some(offsets)) => {
                let hint = it.hint.map_or(next, |i| i as usize);
                if let Some(i) = find_chunk(chunks, offsets, hint, &mut by_offsets) {
                    chunks[i].storage = info;
                    next = i + 1;
                }
            }
            // A tensor key without offsets, or a byte object with them: nothing reads it.
            _ => {}
        }
    }
}

/// The position of the chunk at `offsets`: `hint` when that chunk has them, else looked up in
/// `by_offsets` (made on first need; the first chunk of equal offsets wins).
fn find_chunk(
    chunks: &[Chunk],
    offsets: &[u64],
    hint: usize,
    by_offsets: &mut Option<HashMap<Vec<u64>, usize>>,
) -> Option<usize> {
    if chunks.get(hint).is_some_and(|c| c.offsets == offsets) {
        return Some(hint);
    }
    by_offsets
        .get_or_insert_with(|| {
            let mut m = HashMap::new();
            for (i, c) in chunks.iter().enumerate() {
                m.entry(c.offsets.clone()).or_insert(i);
            }
            m
        })
        .get(offsets)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::metadata::emit_metadata;
    use crate::format::pickle::Pickler;

    #[test]
    fn reads_back_what_the_writer_emits() {
        let mut entries = BTreeMap::new();
        let info = |o| StorageInfo {
            relative_path: "__0_0.distcp".into(),
            offset: o,
            length: 10,
        };
        entries.insert(
            "w".to_string(),
            Entry::Tensor {
                dtype: DType::BF16,
                global_shape: vec![4, 2],
                chunks: vec![
                    Chunk {
                        offsets: vec![0, 0],
                        sizes: vec![2, 2],
                        storage: info(0),
                    },
                    Chunk {
                        offsets: vec![2, 0],
                        sizes: vec![2, 2],
                        storage: info(10),
                    },
                ],
            },
        );
        entries.insert(
            "o/shard_0_1".to_string(),
            Entry::Bytes { storage: info(20) },
        );
        let md = read_metadata(&emit_metadata(&entries)).unwrap();
        assert_eq!(md.entries, entries);
        assert_eq!(md.class, "torch.distributed.checkpoint.metadata.Metadata");
    }

    #[test]
    fn reads_a_metadata_of_more_than_a_million_stack_items() {
        // storage_data of 600,000 chunks puts 1,200,000 items above one MARK (over the fixed
        // stack bound that small inputs get).
        let n = 600_000u64;
        let chunks = (0..n)
            .map(|i| Chunk {
                offsets: vec![i],
                sizes: vec![1],
                storage: StorageInfo {
                    relative_path: "__0_0.distcp".into(),
                    offset: i * 10,
                    length: 10,
                },
            })
            .collect();
        let mut entries = BTreeMap::new();
        entries.insert(
            "w".to_string(),
            Entry::Tensor {
                dtype: DType::F32,
                global_shape: vec![n],
                chunks,
            },
        );
        let md = read_metadata(&emit_metadata(&entries)).unwrap();
        assert_eq!(md.entries, entries);
    }

    fn fixture_dirs() -> Vec<std::path::PathBuf> {
        let mut dirs = Vec::new();
        for group in ["dcp", "megatron"] {
            for e in std::fs::read_dir(crate::golden_fixtures().join(group)).unwrap() {
                dirs.push(e.unwrap().path());
            }
        }
        dirs.sort();
        assert!(dirs.len() >= 8, "{dirs:?}");
        dirs
    }

    fn json_dims(v: &serde_json::Value) -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect()
    }

    fn json_storage(v: &serde_json::Value) -> StorageInfo {
        StorageInfo {
            relative_path: v["relative_path"].as_str().unwrap().to_string(),
            offset: v["offset"].as_u64().unwrap(),
            length: v["length"].as_u64().unwrap(),
        }
    }

    /// Every golden `.metadata` (torch 2.3.1's 5-tuple layout without `storage_meta` through
    /// 2.15's 6-tuple; Megatron's with `mcore_data`, `all_local_plans` referring back to memoized
    /// chunks, and no index hints) decodes to what torch recorded in `expected.json`: every key's
    /// dtype and shape, every chunk's box and storage, every byte object's storage.
    #[test]
    fn golden_metadata_decodes_as_torch_recorded_it() {
        for dir in fixture_dirs() {
            let expected: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
            let md = read_metadata(&std::fs::read(dir.join(crate::format::METADATA_FILE)).unwrap())
                .unwrap_or_else(|e| panic!("{}: {}", dir.display(), e.0));
            assert_eq!(md.class, expected["metadata"]["class"].as_str().unwrap());
            let keys = expected["keys"].as_object().unwrap();
            assert_eq!(md.entries.len(), keys.len(), "{}", dir.display());
            for (key, k) in keys {
                let what = format!("{} {key}", dir.display());
                match (k["kind"].as_str().unwrap(), &md.entries[key]) {
                    (
                        "tensor",
                        Entry::Tensor {
                            dtype,
                            global_shape,
                            chunks,
                        },
                    ) => {
                        assert_eq!(dtype.torch_name(), k["dtype"].as_str().unwrap(), "{what}");
                        assert_eq!(global_shape, &json_dims(&k["shape"]), "{what}");
                        let want = k["chunks"].as_array().unwrap();
                        assert_eq!(chunks.len(), want.len(), "{what}");
                        for (c, w) in chunks.iter().zip(want) {
                            assert_eq!(c.offsets, json_dims(&w["offsets"]), "{what}");
                            assert_eq!(c.sizes, json_dims(&w["sizes"]), "{what}");
                            assert_eq!(c.storage, json_storage(&w["storage"]), "{what}");
                        }
                    }
                    ("bytes", Entry::Bytes { storage }) => {
                        assert_eq!(storage, &json_storage(&k["storage"]), "{what}")
                    }
                    (kind, e) => panic!("{what}: expected {kind}, got {e:?}"),
                }
            }
        }
    }

    /// A pickle of one tensor `w` of `n` row chunks (shape `[n, 2]`) whose `storage_data` lists the
    /// chunks in `order`, with `hint(i)` as each entry's `MetadataIndex.index`; chunk `i` is stored
    /// at byte offset `100 * i`. Protocol 2 with the writer's memo (`BINPUT`/`BINGET`).
    fn one_tensor(n: u64, order: &[u64], hint: &dyn Fn(u64) -> Option<i128>) -> Vec<u8> {
        const M: &str = "torch.distributed.checkpoint.metadata";
        let mut p = Pickler::new(true);
        let obj = |p: &mut Pickler, m: &str, c: &str| {
            p.global(m, c);
            p.empty_tuple();
            p.newobj();
        };
        let size = |p: &mut Pickler, dims: &[u64]| {
            p.global("torch", "Size");
            p.int_tuple(dims);
            p.tuple(1);
            p.reduce();
        };
        obj(&mut p, M, "Metadata");
        p.empty_dict();
        p.mark();
        p.str("state_dict_metadata");
        p.empty_dict();
        p.mark();
        p.str("w");
        obj(&mut p, M, "TensorStorageMetadata");
        p.empty_dict();
        p.mark();
        p.str("properties");
        obj(&mut p, M, "TensorProperties");
        p.mark();
        p.global("torch", "float32");
        p.none();
        p.bool(false);
        p.none();
        p.bool(false);
        p.tuple(5);
        p.build();
        p.str("size");
        size(&mut p, &[n, 2]);
        p.str("chunks");
        p.empty_list();
        p.mark();
        for i in 0..n {
            obj(&mut p, M, "ChunkStorageMetadata");
            p.empty_dict();
            p.mark();
            p.str("offsets");
            size(&mut p, &[i, 0]);
            p.str("sizes");
            size(&mut p, &[1, 2]);
            p.setitems();
            p.build();
        }
        p.appends();
        p.setitems();
        p.build();
        p.setitems();
        p.str("storage_data");
        p.empty_dict();
        p.mark();
        for &i in order {
            obj(&mut p, M, "MetadataIndex");
            p.empty_dict();
            p.mark();
            p.str("fqn");
            p.str("w");
            p.str("offset");
            size(&mut p, &[i, 0]);
            p.str("index");
            match hint(i) {
                Some(h) => p.int(h),
                None => p.none(),
            }
            p.setitems();
            p.build();
            obj(
                &mut p,
                "torch.distributed.checkpoint.filesystem",
                "_StorageInfo",
            );
            p.empty_dict();
            p.mark();
            p.str("relative_path");
            p.str(&format!("__{}_0.distcp", i % 3));
            p.str("offset");
            p.int(100 * i as i128);
            p.str("length");
            p.int(100);
            p.setitems();
            p.build();
        }
        p.setitems();
        p.setitems();
        p.build();
        p.finish()
    }

    fn storages(bytes: &[u8]) -> Vec<(String, u64)> {
        let md = read_metadata(bytes).unwrap();
        let Entry::Tensor { chunks, .. } = &md.entries["w"] else {
            panic!()
        };
        chunks
            .iter()
            .map(|c| (c.storage.relative_path.clone(), c.storage.offset))
            .collect()
    }

    #[test]
    fn storage_is_matched_by_offsets_whatever_the_index_hints_say() {
        let n = 300; // past 256 memo entries: LONG_BINPUT / LONG_BINGET too
        let want: Vec<(String, u64)> = (0..n)
            .map(|i| (format!("__{}_0.distcp", i % 3), 100 * i))
            .collect();
        let forward: Vec<u64> = (0..n).collect();
        let mut shuffled = forward.clone();
        shuffled.sort_by_key(|i| (i * 7919) % n);
        for (order, hint) in [
            (
                &forward,
                &(|i: u64| Some(i as i128)) as &dyn Fn(u64) -> Option<i128>,
            ),
            (&forward, &|_| None),  // Megatron: no hints, same order
            (&shuffled, &|_| None), // no hints, another order
            (&shuffled, &|i| Some(((i + 1) % n) as i128)), // every hint wrong
            (&shuffled, &|_| Some(1 << 40)), // hints past the end
            (&forward, &|_| Some(-1)),
        ] {
            assert_eq!(storages(&one_tensor(n, order, hint)), want);
        }
        // An entry listed twice: the later one wins, as in the Python dict.
        let mut twice = one_tensor(2, &[0, 1, 0], &|i| Some(i as i128));
        assert_eq!(storages(&twice)[0], ("__0_0.distcp".into(), 0));
        // A chunk without a storage entry keeps an empty path (verify reports it).
        twice = one_tensor(2, &[1], &|i| Some(i as i128));
        assert_eq!(storages(&twice)[0], (String::new(), 0));
    }

    /// Truncated, bit-flipped and shuffled versions of real `.metadata` files are errors or
    /// decode, never a panic; messages name what is wrong.
    #[test]
    fn split_decode_equals_the_sequential_one() {
        let tiny = Sizes {
            min_bytes: 1,
            max_bytes: 512,
        };
        let mut split_files = 0;
        for dir in fixture_dirs() {
            let bytes = std::fs::read(dir.join(crate::format::METADATA_FILE)).unwrap();
            let whole = read_metadata_split(&bytes, None).unwrap();
            for sizes in [tiny, Sizes::METADATA] {
                assert_eq!(
                    read_metadata_split(&bytes, Some(sizes)).unwrap(),
                    whole,
                    "{}",
                    dir.display()
                );
            }
            // The split path itself, not its sequential fallback, decodes every fixture that
            // has batches.
            let plan = split::plan(&bytes, tiny).expect("torch's pickles split");
            if !plan.batches.is_empty() {
                decode_split(&bytes, plan).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
                split_files += 1;
            }
        }
        assert!(split_files >= 8, "only {split_files} fixtures have batches");
        // Our own writer's pickle (protocol 2, BINPUT), 3 keys x 2,500 chunks: SETITEMS and
        // APPENDS batches of 1,000.
        let mut entries = BTreeMap::new();
        for t in 0..3u64 {
            let chunks = (0..2500u64)
                .map(|i| Chunk {
                    offsets: vec![i * 2, t],
                    sizes: vec![2, 1],
                    storage: StorageInfo {
                        relative_path: format!("__{}_0.distcp", i % 7),
                        offset: i * 100,
                        length: 100,
                    },
                })
                .collect();
            entries.insert(
                format!("layer.{t}.weight"),
                Entry::Tensor {
                    dtype: DType::F32,
                    global_shape: vec![5000, 3],
                    chunks,
                },
            );
        }
        let bytes = emit_metadata(&entries);
        let plan = split::plan(&bytes, Sizes::METADATA).unwrap();
        assert!(plan.batches.len() >= 10, "{:?}", plan.batches);
        let plan_len = plan.batches.len();
        let (b, top, len) = decode_split(&bytes, plan).unwrap();
        assert!(matches!(top, V::Obj { .. }) && b.parts.len() == plan_len);
        assert_eq!(len, bytes.len());
        let md = read_metadata_split(&bytes, Some(Sizes::METADATA)).unwrap();
        assert_eq!(md, read_metadata_split(&bytes, None).unwrap());
        assert_eq!(md.entries, entries);
        // Bytes after the pickle: both decodes stop at its STOP and say where it ends.
        let mut grown = bytes.clone();
        grown.extend_from_slice(&[0xAB; 4096]);
        for sizes in [Some(Sizes::METADATA), None] {
            let g = read_metadata_split(&grown, sizes).unwrap();
            assert_eq!((g.pickle_len, &g.entries), (bytes.len() as u64, &entries));
        }
        assert_eq!(trailing_bytes(bytes.len() as u64, bytes.len() as u64), None);
        let why = trailing_bytes(grown.len() as u64, bytes.len() as u64).unwrap();
        assert!(
            why.starts_with(".metadata has 4096 bytes after its pickle ends at byte"),
            "{why}"
        );
    }

    #[test]
    fn a_split_decode_falls_back_on_what_it_cannot_share() {
        // A list memoized outside a batch and appended to inside it: a part cannot change a
        // container of another part, so the whole pickle decodes sequentially (same result).
        let input = b"\x80\x02]q\x00]q\x01(h\x00(K\x01eK\x02K\x03K\x04e.";
        let sizes = Sizes {
            min_bytes: 1,
            max_bytes: usize::MAX,
        };
        let plan = split::plan(input, sizes).unwrap();
        assert_eq!(plan.batches.len(), 1);
        let e = decode_split(input, plan).err().unwrap();
        assert!(
            e.0.contains("APPEND(S) on a value of another part"),
            "{}",
            e.0
        );
        assert_eq!(
            read_metadata_split(input, Some(sizes)),
            read_metadata_split(input, None)
        );
        // Memo keys out of order: no plan.
        assert!(split::plan(b"\x80\x02K\x01q\x05.", sizes).is_none());
    }

    #[test]
    fn damaged_metadata_is_an_error_never_a_panic() {
        for dir in fixture_dirs().iter().take(5) {
            let good = std::fs::read(dir.join(crate::format::METADATA_FILE)).unwrap();
            for cut in (0..good.len()).step_by(7) {
                assert!(read_metadata(&good[..cut]).is_err());
            }
            let mut x = 0x9e3779b97f4a7c15u64;
            for _ in 0..3000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mut bad = good.clone();
                bad[(x % good.len() as u64) as usize] ^= 1 << (x >> 61);
                let _ = read_metadata(&bad);
            }
        }
        let e = |b: &[u8]| read_metadata(b).unwrap_err().0;
        assert!(e(b"\x80\x02K\x01.").contains("top-level value is int"));
        assert!(e(b"\x80\x02cos\nsystem\n)\x81.").contains("top-level class is os.system"));
        // A state dict taken by BUILD and then written through the memo.
        let reuse = b"\x80\x02ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n)\x81}q\x00b0h\x00(K\x01K\x02u.";
        assert!(e(reuse).contains("already taken"), "{}", e(reuse));
        // A memo index far past the others is kept aside, not allocated up to.
        assert!(e(b"\x80\x02K\x01r\xff\xff\xff\xff0j\xff\xff\xff\xff.")
            .contains("top-level value is int"));
        assert!(e(b"\x80\x02j\x00\x00\x00\x01.").contains("memo key 16777216 missing"));
    }

    fn chunk_at(offsets: &[u64]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: vec![1],
            storage: StorageInfo {
                relative_path: String::new(),
                offset: 0,
                length: 0,
            },
        }
    }

    /// The hint when it names the chunk, else the first chunk with the offsets; the map is made
    /// only when a hint misses.
    #[test]
    fn find_chunk_trusts_a_right_hint_only() {
        let chunks = [
            chunk_at(&[0]),
            chunk_at(&[4]),
            chunk_at(&[4]),
            chunk_at(&[8]),
        ];
        let mut by_offsets = None;
        assert_eq!(find_chunk(&chunks, &[8], 3, &mut by_offsets), Some(3));
        assert!(by_offsets.is_none());
        assert_eq!(find_chunk(&chunks, &[4], 0, &mut by_offsets), Some(1));
        assert_eq!(find_chunk(&chunks, &[0], 99, &mut by_offsets), Some(0));
        assert_eq!(find_chunk(&chunks, &[5], 1, &mut by_offsets), None);
        assert_eq!(by_offsets.map(|m| m.len()), Some(3));
    }

    /// Items without a hint look after the last chunk matched; a byte object takes its one item;
    /// an item of the other kind is ignored.
    #[test]
    fn place_items_fills_each_chunk_from_its_item() {
        let paths = ["a".to_string(), "b".to_string()];
        let item = |offsets: Option<&'static [u64]>, hint, path, offset| Item {
            offsets,
            hint,
            path,
            offset,
            length: 10,
        };
        let mut e = Entry::Tensor {
            dtype: DType::U8,
            global_shape: vec![12],
            chunks: vec![chunk_at(&[0]), chunk_at(&[4]), chunk_at(&[8])],
        };
        let items = vec![
            item(Some(&[4]), None, 0, 1), // no hint: tries chunk 0, found through the map
            item(Some(&[8]), None, 1, 2), // no hint: chunk 2, after the last matched
            item(Some(&[0]), Some(0), 1, 3),
            item(None, None, 0, 4),          // a tensor item without offsets
            item(Some(&[6]), Some(1), 0, 5), // offsets no chunk has
        ];
        place_items(&mut e, items, &paths);
        let Entry::Tensor { chunks, .. } = &e else {
            unreachable!()
        };
        let got: Vec<(&str, u64)> = chunks
            .iter()
            .map(|c| (c.storage.relative_path.as_str(), c.storage.offset))
            .collect();
        assert_eq!(got, vec![("b", 3), ("a", 1), ("b", 2)]);

        let mut e = Entry::Bytes {
            storage: chunk_at(&[]).storage,
        };
        place_items(
            &mut e,
            vec![item(None, None, 1, 7), item(Some(&[0]), None, 0, 8)],
            &paths,
        );
        let want = StorageInfo {
            relative_path: "b".into(),
            offset: 7,
            length: 10,
        };
        assert_eq!(e, Entry::Bytes { storage: want });
    }
}
