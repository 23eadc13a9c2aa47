//! The globals a load imports from a checkpoint's pickles, and the ones a checkpoint legitimately
//! holds: the one rule `verify` applies to every pickle that torch or Megatron unpickles on load.
//!
//! Unpickling imports every global a `GLOBAL`/`STACK_GLOBAL` opcode names (`find_class`, which
//! runs the module's import code) and calls what `REDUCE`/`NEWOBJ`/`BUILD` are given, so a pickle
//! whose globals include `posix.system` or `builtins.eval` runs code on load. Which loader reads
//! which pickle, and how strictly (torch 2.3.1–2.15.0 `torch/distributed/checkpoint/filesystem.py`
//! and `default_planner.py`; megatron-core 0.16.1 `dist_checkpointing/strategies/common.py` and
//! 0.19.2 `serialization.py`):
//! - `.metadata`: plain `pickle.load` in every torch 2.3–2.15 (`FileSystemReader.read_metadata`),
//!   no restriction at all: [`Pickle::Metadata`];
//! - every item's `data.pkl` and `common.pt`'s: `torch.load`, with `weights_only=False` for byte
//!   objects (megatron-core 0.19's `common_state` among them) in 2.4–2.15 and for every item in
//!   2.3, and `common.pt` with torch's default (`weights_only=False` before 2.6): [`Pickle::TorchSave`].
//!
//! The globals are collected by the opcode decoder of `format::unpickle` with a builder that keeps
//! only strings (for `STACK_GLOBAL`) and the globals: nothing is imported or called. A pickle that
//! fails to decode still yields the globals found before the failure, which `pickle.load` would
//! have imported (and maybe called) before failing at the same opcode.

use std::collections::BTreeSet;

use std::rc::Rc;

use crate::format::archive::{PidFields, StorageRef};
use crate::format::unpickle::{decode, Build, UnpickleError};

/// Which loader reads a pickle, and so which globals it may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pickle {
    /// A DCP `.metadata` (`pickle.load`).
    Metadata,
    /// The `data.pkl` of a torch.save archive: an item, `common.pt` (`torch.load`).
    TorchSave,
}

/// torch dtypes, `GLOBAL 'torch' '<name>'` (a dtype pickles as its name): the dtypes of torch
/// 2.15.0's weights-only allow-list (`torch/_weights_only_unpickler.py`, `_get_allowed_globals`).
const DTYPES: &[&str] = &[
    "bcomplex32",
    "bfloat16",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bool",
    "complex128",
    "complex32",
    "complex64",
    "float16",
    "float32",
    "float4_e2m1fn_x2",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int1",
    "int16",
    "int2",
    "int3",
    "int32",
    "int4",
    "int5",
    "int6",
    "int64",
    "int7",
    "int8",
    "qint32",
    "qint8",
    "quint2x4",
    "quint4x2",
    "quint8",
    "uint1",
    "uint16",
    "uint2",
    "uint3",
    "uint32",
    "uint4",
    "uint5",
    "uint6",
    "uint64",
    "uint7",
    "uint8",
];

/// The classes a DCP `.metadata` pickles, by module as the pickle stores it (each golden fixture's
/// `pickle_globals`, tests/fixtures/README.md), besides `torch.<dtype>` ([`DTYPES`]):
/// torch 2.3–2.15's `metadata.py` and `filesystem.py`, torch ≤ 2.2's `_shard` copies, the
/// `SavePlan`s megatron-core ≤ 0.19 keeps in `all_local_plans` (`planner.py`, with
/// `filesystem._StoragePrefix` as their `storage_data`), megatron-core 0.15's `MCoreMetadata` and
/// `MCoreSavePlan` (`strategies/torch.py`), and the `pathlib` path of `StorageMeta.checkpoint_id`
/// (`pathlib._local` when Python 3.13 wrote it).
const METADATA_GLOBALS: &[(&str, &[&str])] = &[
    (
        "torch.distributed.checkpoint.metadata",
        &[
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
            "MetadataIndex",
            "StorageMeta",
        ],
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        &["_StorageInfo", "_StoragePrefix"],
    ),
    (
        "torch.distributed.checkpoint.planner",
        &[
            "SavePlan",
            "WriteItem",
            "WriteItemType",
            "TensorWriteData",
            "BytesIOWriteData",
        ],
    ),
    (
        "torch.distributed._shard.sharded_tensor.metadata",
        &["TensorProperties", "MEM_FORMAT_ENCODING"],
    ),
    (
        "megatron.core.dist_checkpointing.strategies.torch",
        &["MCoreMetadata", "MCoreSavePlan"],
    ),
    ("torch", &["Size"]),
    ("torch.serialization", &["_get_layout"]),
    ("pathlib", &["PosixPath", "WindowsPath"]),
    ("pathlib._local", &["PosixPath", "WindowsPath"]),
];

/// What a torch.save `data.pkl` in a checkpoint may name, besides `torch.<dtype>` ([`DTYPES`]):
/// torch 2.15.0's weights-only allow-list (`torch/_weights_only_unpickler.py`,
/// `_get_allowed_globals`: tensors, storages, parameters, `torch.Size`, `torch.device`, layouts,
/// qschemes, `OrderedDict`), and what megatron-core 0.19.2 registers on top of it for its
/// checkpoints (`megatron/core/safe_globals.py`, `SAFE_GLOBALS`: `args` as an
/// `argparse.Namespace` with its enums and configs, RNG state as numpy arrays and
/// `torch._C.Generator`, `BytesIO`), each by the module its pickle names (`numpy.core` under
/// numpy 1, `numpy._core` under numpy 2; `pathlib._local` under Python 3.13).
const TORCH_SAVE_GLOBALS: &[(&str, &[&str])] = &[
    ("_codecs", &["encode"]),
    ("builtins", &["bytearray", "complex", "set"]),
    ("collections", &["Counter", "OrderedDict"]),
    (
        "torch",
        &[
            "BFloat16Storage",
            "BFloat16Tensor",
            "BoolStorage",
            "BoolTensor",
            "ByteStorage",
            "ByteTensor",
            "CharStorage",
            "CharTensor",
            "ComplexDoubleStorage",
            "ComplexFloatStorage",
            "DoubleStorage",
            "DoubleTensor",
            "FloatStorage",
            "FloatTensor",
            "HalfStorage",
            "HalfTensor",
            "IntStorage",
            "IntTensor",
            "LongStorage",
            "LongTensor",
            "QInt32Storage",
            "QInt8Storage",
            "QUInt2x4Storage",
            "QUInt4x2Storage",
            "QUInt8Storage",
            "ShortStorage",
            "ShortTensor",
            "Size",
            "Tensor",
            "device",
            "per_channel_affine",
            "per_channel_affine_float_qparams",
            "per_channel_symmetric",
            "per_tensor_affine",
            "per_tensor_symmetric",
        ],
    ),
    ("torch._tensor", &["_rebuild_from_type_v2"]),
    (
        "torch._utils",
        &[
            "_rebuild_device_tensor_from_cpu_tensor",
            "_rebuild_device_tensor_from_numpy",
            "_rebuild_meta_tensor_no_storage",
            "_rebuild_parameter",
            "_rebuild_parameter_with_state",
            "_rebuild_qtensor",
            "_rebuild_sparse_tensor",
            "_rebuild_tensor",
            "_rebuild_tensor_v2",
            "_rebuild_tensor_v3",
            "_rebuild_wrapper_subclass",
        ],
    ),
    (
        "torch.cuda",
        &[
            "BFloat16Storage",
            "BFloat16Tensor",
            "BoolStorage",
            "BoolTensor",
            "ByteStorage",
            "ByteTensor",
            "CharStorage",
            "CharTensor",
            "ComplexDoubleStorage",
            "ComplexFloatStorage",
            "DoubleStorage",
            "DoubleTensor",
            "FloatStorage",
            "FloatTensor",
            "HalfStorage",
            "HalfTensor",
            "IntStorage",
            "IntTensor",
            "LongStorage",
            "LongTensor",
            "ShortStorage",
            "ShortTensor",
        ],
    ),
    (
        "torch.cuda.sparse",
        &[
            "BFloat16Tensor",
            "ByteTensor",
            "CharTensor",
            "DoubleTensor",
            "FloatTensor",
            "HalfTensor",
            "IntTensor",
            "LongTensor",
            "ShortTensor",
        ],
    ),
    ("torch.nn.parameter", &["Parameter"]),
    ("torch.serialization", &["_get_layout"]),
    (
        "torch.sparse",
        &[
            "BFloat16Tensor",
            "ByteTensor",
            "CharTensor",
            "DoubleTensor",
            "FloatTensor",
            "HalfTensor",
            "IntTensor",
            "LongTensor",
            "ShortTensor",
        ],
    ),
    ("torch.storage", &["TypedStorage", "UntypedStorage"]),
    // megatron-core 0.19.2 SAFE_GLOBALS.
    ("types", &["SimpleNamespace"]),
    ("pathlib", &["PosixPath"]),
    ("pathlib._local", &["PosixPath"]),
    ("numpy.core.multiarray", &["_reconstruct"]),
    ("numpy._core.multiarray", &["_reconstruct"]),
    ("numpy", &["ndarray", "dtype"]),
    ("numpy.dtypes", &["UInt32DType"]),
    ("argparse", &["Namespace"]),
    (
        "megatron.core.transformer.enums",
        &[
            "AttnBackend",
            "CudaGraphModule",
            "CudaGraphScope",
            "InferenceCudaGraphScope",
        ],
    ),
    ("megatron.core.enums", &["ModelType"]),
    (
        "megatron.core.optimizer.optimizer_config",
        &["OptimizerConfig"],
    ),
    (
        "megatron.core.rerun_state_machine",
        &["RerunDiagnostic", "RerunMode", "RerunState"],
    ),
    ("_io", &["BytesIO"]),
    ("signal", &["Signals"]),
    ("torch._C", &["Generator"]),
];

/// Whether a checkpoint's pickle of kind `pickle` may name global `module.name`.
pub fn allowed(pickle: Pickle, module: &str, name: &str) -> bool {
    let table = match pickle {
        Pickle::Metadata => METADATA_GLOBALS,
        Pickle::TorchSave => TORCH_SAVE_GLOBALS,
    };
    (module == "torch" && DTYPES.contains(&name))
        || table
            .iter()
            .any(|(m, names)| *m == module && names.contains(&name))
}

/// What scanning a pickle found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// Every global unpickling imports, as `module.name`, sorted.
    pub imported: Vec<String>,
    /// Globals the pickle names outside the allow-list, as `module.name`, sorted.
    pub refused: Vec<String>,
    /// The storages its persistent ids name (a torch.save pickle's tensors), in order.
    pub storages: Vec<StorageRef>,
    /// Why the pickle does not decode to its end (`pickle.load` fails there too, after importing
    /// the globals found before it, or cannot be checked here: `EXT*`), or a persistent id the
    /// loader refuses.
    pub error: Option<UnpickleError>,
}

impl Scan {
    /// One line for a report of `file` (a file name, or an item's file and key), None when clean.
    pub fn message(&self) -> Option<String> {
        let refused = (!self.refused.is_empty()).then(|| {
            format!(
                "pickle names {} outside the classes a checkpoint holds: unpickling it \
                 (torch.load / pickle.load) imports and may run it; shardwise never unpickles it",
                self.refused.join(", ")
            )
        });
        let error = self
            .error
            .as_ref()
            .map(|e| format!("pickle cannot be checked for what a load would import: {e}"));
        match (refused, error) {
            (Some(r), Some(e)) => Some(format!("{r}; {e}")),
            (r, e) => r.or(e),
        }
    }
}

/// The globals `pickle` would import when unpickled that a checkpoint's pickle of kind `kind` does
/// not hold. Never imports or calls anything; memory O(input length) as in `format::unpickle`.
pub fn scan(kind: Pickle, pickle: &[u8]) -> Scan {
    let mut b = Imports {
        kind,
        globals: BTreeSet::new(),
        storages: Vec::new(),
    };
    let error = decode(pickle, &mut b).err();
    let name = |(m, n): &(&str, &str)| format!("{m}.{n}");
    let refused = b
        .globals
        .iter()
        .filter(|(m, n)| !allowed(kind, m, n))
        .map(name)
        .collect();
    let imported = b.globals.iter().map(name).collect();
    Scan {
        imported,
        refused,
        storages: b.storages,
        error,
    }
}

/// A builder that keeps only what `STACK_GLOBAL` and a persistent id need (strings, ints,
/// globals, tuples), the globals named and the storages referenced.
struct Imports<'a> {
    kind: Pickle,
    globals: BTreeSet<(&'a str, &'a str)>,
    storages: Vec<StorageRef>,
}

#[derive(Clone)]
enum Sym<'a> {
    Str(&'a str),
    Int(i128),
    Global(&'a str),
    Tuple(Rc<[Sym<'a>]>),
    Other,
}

type R<T> = Result<T, UnpickleError>;

impl<'a> Build<'a> for Imports<'a> {
    type V = Sym<'a>;
    fn none(&mut self) -> Sym<'a> {
        Sym::Other
    }
    fn bool(&mut self, _: bool) -> Sym<'a> {
        Sym::Other
    }
    fn int(&mut self, i: i128) -> Sym<'a> {
        Sym::Int(i)
    }
    fn float(&mut self, _: f64) -> Sym<'a> {
        Sym::Other
    }
    fn str(&mut self, s: &'a str) -> Sym<'a> {
        Sym::Str(s)
    }
    fn bytes(&mut self, _: &'a [u8]) -> Sym<'a> {
        Sym::Other
    }
    fn tuple(&mut self, items: std::vec::Drain<'_, Sym<'a>>) -> R<Sym<'a>> {
        Ok(Sym::Tuple(items.collect()))
    }
    fn empty_list(&mut self) -> R<Sym<'a>> {
        Ok(Sym::Other)
    }
    fn empty_dict(&mut self) -> R<Sym<'a>> {
        Ok(Sym::Other)
    }
    fn append(&mut self, _: &Sym<'a>, _: std::vec::Drain<'_, Sym<'a>>) -> R<()> {
        Ok(())
    }
    fn set_items(&mut self, _: &Sym<'a>, _: std::vec::Drain<'_, Sym<'a>>) -> R<()> {
        Ok(())
    }
    fn global(&mut self, module: &'a str, name: &'a str) -> Sym<'a> {
        self.globals.insert((module, name));
        Sym::Global(name)
    }
    fn stack_global(&mut self, module: Sym<'a>, name: Sym<'a>) -> R<Sym<'a>> {
        match (module, name) {
            (Sym::Str(m), Sym::Str(n)) => Ok(self.global(m, n)),
            // pickle.load refuses these too ("STACK_GLOBAL requires str"), importing nothing.
            _ => Err(UnpickleError("STACK_GLOBAL needs two strings".into())),
        }
    }
    fn call(&mut self, _: Sym<'a>, _: Sym<'a>) -> R<Sym<'a>> {
        Ok(Sym::Other)
    }
    fn new_obj(&mut self, _: Sym<'a>, _: Sym<'a>) -> R<Sym<'a>> {
        Ok(Sym::Other)
    }
    fn build(&mut self, _: Sym<'a>, _: Sym<'a>) -> R<Sym<'a>> {
        Ok(Sym::Other)
    }
    fn pers_id(&mut self, pid: Sym<'a>) -> R<Sym<'a>> {
        if self.kind == Pickle::Metadata {
            // pickle.load has no persistent_load: it fails here.
            return Err(UnpickleError(
                "a persistent id, which pickle.load of a .metadata cannot resolve".into(),
            ));
        }
        let items: &[Sym<'a>] = match &pid {
            Sym::Tuple(t) => t,
            _ => &[],
        };
        let text = |i: usize| match items.get(i) {
            Some(Sym::Str(s)) => Some(*s),
            _ => None,
        };
        let r = StorageRef::from_fields(PidFields {
            items: items.len(),
            typename: text(0),
            class: match items.get(1) {
                Some(Sym::Global(n)) => Some(*n),
                _ => None,
            },
            key: text(2),
            numel: match items.get(4) {
                Some(Sym::Int(i)) => Some(*i),
                _ => None,
            },
        })
        .map_err(|e| UnpickleError(e.0))?;
        self.storages.push(r);
        Ok(Sym::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GLOBAL 'posix' 'system'`, `(S'touch x' t R .`: what `pickle.dumps` of a reduce to
    /// `os.system` writes at protocol 0/2.
    fn system_call(proto: u8) -> Vec<u8> {
        let mut p = vec![0x80, proto];
        p.extend_from_slice(b"cposix\nsystem\n");
        p.extend_from_slice(b"X\x07\x00\x00\x00touch x\x85R.");
        p
    }

    #[test]
    fn a_call_of_os_system_is_refused_in_every_kind() {
        for kind in [Pickle::Metadata, Pickle::TorchSave] {
            let s = scan(kind, &system_call(2));
            assert_eq!(s.refused, ["posix.system"]);
            assert!(s.error.is_none());
            assert!(s.message().unwrap().contains("posix.system"));
        }
    }

    #[test]
    fn stack_global_through_the_memo_is_seen() {
        // protocol 4: SHORT_BINUNICODE 'builtins' MEMOIZE, SHORT_BINUNICODE 'eval' MEMOIZE,
        // BINGET 0, BINGET 1, STACK_GLOBAL: the strings reach STACK_GLOBAL from the memo.
        let mut p = vec![0x80, 4];
        p.extend_from_slice(b"\x8c\x08builtins\x94\x8c\x04eval\x94h\x00h\x01\x93.");
        assert_eq!(scan(Pickle::Metadata, &p).refused, ["builtins.eval"]);
    }

    #[test]
    fn globals_before_a_decode_failure_are_reported_with_it() {
        let mut p = system_call(2);
        p.pop(); // no STOP: pickle.load imports and calls, then fails at the end
        let s = scan(Pickle::TorchSave, &p);
        assert_eq!(s.refused, ["posix.system"]);
        let m = s.message().unwrap();
        assert!(
            m.contains("posix.system") && m.contains("cannot be checked"),
            "{m}"
        );
    }

    #[test]
    fn what_each_loader_reads_is_allowed_only_there() {
        let md = "torch.distributed.checkpoint.metadata";
        assert!(allowed(Pickle::Metadata, md, "Metadata"));
        assert!(allowed(Pickle::Metadata, "torch", "bfloat16"));
        assert!(!allowed(Pickle::TorchSave, md, "Metadata"));
        assert!(allowed(
            Pickle::TorchSave,
            "torch._utils",
            "_rebuild_tensor_v2"
        ));
        assert!(allowed(Pickle::TorchSave, "argparse", "Namespace"));
        assert!(!allowed(Pickle::Metadata, "argparse", "Namespace"));
        // Exact: a name in an allowed module, or an allowed name in another module, is refused.
        assert!(!allowed(Pickle::TorchSave, "torch", "load"));
        assert!(!allowed(
            Pickle::TorchSave,
            "torch._utils",
            "_rebuild_from_type"
        ));
        assert!(!allowed(Pickle::Metadata, "os", "Metadata"));
        assert!(!allowed(Pickle::Metadata, "torch", "strided"));
    }

    #[test]
    fn a_clean_pickle_has_no_message() {
        let s = scan(Pickle::Metadata, b"\x80\x02ctorch\nSize\n)\x85R.");
        assert_eq!(
            (s.imported.as_slice(), s.refused.len()),
            (&["torch.Size".to_string()][..], 0)
        );
        assert_eq!(s.message(), None);
    }

    /// INST and OBJ import and call too (protocol 0/1); pickle.load runs them.
    #[test]
    fn inst_and_obj_are_seen() {
        let s = scan(Pickle::TorchSave, b"(S'x'\niposix\nsystem\n.");
        assert_eq!(
            (s.refused.as_slice(), s.error.is_none()),
            (&["posix.system".to_string()][..], true)
        );
        let s = scan(Pickle::TorchSave, b"(cposix\nsystem\nS'x'\no.");
        assert_eq!(s.refused, ["posix.system"]);
    }

    /// A torch.save pickle's persistent ids must be storages (torch's persistent_load asserts
    /// it); a `.metadata` may hold none (pickle.load has no persistent_load).
    #[test]
    fn persistent_ids_are_storages_or_an_error() {
        let storage = b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x03tQ.";
        let s = scan(Pickle::TorchSave, storage);
        assert_eq!(s.error, None);
        assert_eq!(
            s.storages,
            [StorageRef {
                class: Some(crate::format::dtype::DType::F32),
                key: "0".into(),
                numel: 3
            }]
        );
        assert!(scan(Pickle::Metadata, storage).error.is_some());
        let text = scan(Pickle::TorchSave, b"Pfoo\n.");
        assert!(
            text.message().unwrap().contains("persistent_load"),
            "{text:?}"
        );
    }
}
