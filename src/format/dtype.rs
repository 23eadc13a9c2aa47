//! Tensor element types that the writer accepts, with their torch names and storage classes.
//!
//! Source: `torch/storage.py` (`_new_dtypes`, legacy `*Storage` classes) and
//! `torch/_utils.py` (`_rebuild_tensor_v2` / `_rebuild_tensor_v3`), torch 2.3.1 and 2.15.0.

use crate::error::{Error, Result};

/// A tensor dtype supported by the DCP writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `torch.float32`.
    F32,
    /// `torch.float64`.
    F64,
    /// `torch.float16`.
    F16,
    /// `torch.bfloat16`.
    BF16,
    /// `torch.int64`.
    I64,
    /// `torch.int32`.
    I32,
    /// `torch.int16`.
    I16,
    /// `torch.int8`.
    I8,
    /// `torch.uint8`.
    U8,
    /// `torch.bool`.
    Bool,
    /// `torch.float8_e4m3fn`.
    F8E4M3FN,
    /// `torch.float8_e5m2`.
    F8E5M2,
    // Read-only: found in checkpoints torch wrote, never written by shardwise (see `writable`).
    /// `torch.complex64` (read only).
    C64,
    /// `torch.complex128` (read only).
    C128,
    /// `torch.uint16` (read only).
    U16,
    /// `torch.uint32` (read only).
    U32,
    /// `torch.uint64` (read only).
    U64,
}

impl DType {
    /// The dtypes the writer accepts: the first twelve of [`DType::READABLE`].
    pub const ALL: &'static [DType] = DType::READABLE.split_at(12).0;

    /// Every dtype the reader knows.
    pub const READABLE: [DType; 17] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
        DType::F8E4M3FN,
        DType::F8E5M2,
        DType::C64,
        DType::C128,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Whether the writer accepts it: complex and uint16/32/64 are left out because torch 2.4–2.5
    /// cannot load unsigned ones (the weights-only unpickler's allowlist; torch 2.6's
    /// `torch/storage.py` `_new_dtypes` adds them) and the max-compat profile names exactly
    /// the twelve in [`DType::ALL`].
    pub fn writable(self) -> bool {
        DType::ALL.contains(&self)
    }

    /// Whether it is a floating-point or complex dtype, the ones torch lets require gradients.
    pub fn is_floating(self) -> bool {
        matches!(
            self,
            DType::F32
                | DType::F64
                | DType::F16
                | DType::BF16
                | DType::F8E4M3FN
                | DType::F8E5M2
                | DType::C64
                | DType::C128
        )
    }

    /// The attribute name in the `torch` module (`torch.float32` → `"float32"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::Bool => "bool",
            DType::F8E4M3FN => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
        }
    }

    /// The dtype of a legacy typed-storage class name (`FloatStorage` → float32).
    pub fn from_legacy_storage(name: &str) -> Option<DType> {
        DType::READABLE
            .into_iter()
            .find(|d| d.legacy_storage() == Some(name))
    }

    /// Parses a torch dtype name, with or without the `torch.` prefix.
    ///
    /// Errors: [`Error::UnsupportedDtype`] for names the reader does not know (float4, bits, ...).
    pub fn from_torch_name(name: &str) -> Result<DType> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        let alias = match bare {
            "float" => "float32",
            "double" => "float64",
            "half" => "float16",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            "cfloat" => "complex64",
            "cdouble" => "complex128",
            other => other,
        };
        DType::READABLE
            .into_iter()
            .find(|d| d.torch_name() == alias)
            .ok_or_else(|| Error::UnsupportedDtype(name.to_string()))
    }

    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        match self {
            DType::C128 => 16,
            DType::F64 | DType::I64 | DType::C64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3FN | DType::F8E5M2 => 1,
        }
    }

    /// The legacy typed-storage class used by `_rebuild_tensor_v2`; `None` means the dtype is one of
    /// `torch.storage._new_dtypes()` and is pickled with `_rebuild_tensor_v3` + `UntypedStorage`.
    pub fn legacy_storage(self) -> Option<&'static str> {
        Some(match self {
            DType::F32 => "FloatStorage",
            DType::F64 => "DoubleStorage",
            DType::F16 => "HalfStorage",
            DType::BF16 => "BFloat16Storage",
            DType::I64 => "LongStorage",
            DType::I32 => "IntStorage",
            DType::I16 => "ShortStorage",
            DType::I8 => "CharStorage",
            DType::U8 => "ByteStorage",
            DType::Bool => "BoolStorage",
            DType::C64 => "ComplexFloatStorage",
            DType::C128 => "ComplexDoubleStorage",
            DType::F8E4M3FN | DType::F8E5M2 | DType::U16 | DType::U32 | DType::U64 => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::READABLE {
            assert_eq!(DType::from_torch_name(d.torch_name()).unwrap(), d);
            assert_eq!(
                DType::from_torch_name(&format!("torch.{}", d.torch_name())).unwrap(),
                d
            );
        }
        assert!(!DType::from_torch_name("torch.complex64")
            .unwrap()
            .writable());
        assert!(matches!(
            DType::from_torch_name("torch.float4_e2m1fn_x2"),
            Err(Error::UnsupportedDtype(_))
        ));
        assert_eq!(
            DType::from_legacy_storage("BFloat16Storage"),
            Some(DType::BF16)
        );
    }
}
