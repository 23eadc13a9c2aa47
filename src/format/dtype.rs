//! Tensor element types that the writer accepts, with their torch names and storage classes.
//!
//! Source: `torch/storage.py` (`_new_dtypes`, legacy `*Storage` classes) and
//! `torch/_utils.py` (`_rebuild_tensor_v2` / `_rebuild_tensor_v3`), torch 2.3.1 and 2.15.0.

use crate::error::{Error, Result};

/// A tensor dtype supported by the DCP writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
    F8E4M3FN,
    F8E5M2,
}

impl DType {
    pub const ALL: [DType; 12] = [
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
    ];

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
        }
    }

    /// Parses a torch dtype name, with or without the `torch.` prefix.
    ///
    /// Errors: [`Error::UnsupportedDtype`] for any other name (complex, uint16, float4, ...).
    pub fn from_torch_name(name: &str) -> Result<DType> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        let alias = match bare {
            "float" => "float32",
            "double" => "float64",
            "half" => "float16",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            other => other,
        };
        DType::ALL
            .into_iter()
            .find(|d| d.torch_name() == alias)
            .ok_or_else(|| Error::UnsupportedDtype(name.to_string()))
    }

    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
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
            DType::F8E4M3FN | DType::F8E5M2 => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_torch_name(d.torch_name()).unwrap(), d);
            assert_eq!(
                DType::from_torch_name(&format!("torch.{}", d.torch_name())).unwrap(),
                d
            );
        }
        assert!(matches!(
            DType::from_torch_name("torch.complex64"),
            Err(Error::UnsupportedDtype(_))
        ));
    }
}
