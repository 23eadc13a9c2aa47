//! Non-finite values (NaN, +-Inf) in the tensors a conversion writes (issue 44): counted in the
//! pass that already holds each tensor's values, so the scan costs one more read of bytes in
//! memory. A plain conversion reports them (`to-hf` and `from-hf` summaries, `nonfinite`); a
//! quantized one refuses them ([`refusal`]) unless asked to keep them: a quantizer's scales come
//! from the largest `|x|` of a block or scale group, so a NaN becomes a finite code and an
//! infinity gives its block an infinite scale (block FP8's `weight_scale_inv = inf`) or its NVFP4
//! scale group a tensor scale of 0, which turns every member, the clean ones too, into NaN when
//! dequantized.
//!
//! Bit patterns (IEEE 754 and the formats' own definitions): float32/float64/float16/bfloat16
//! have an all-ones exponent for Inf and NaN; `float8_e5m2` likewise (`0x7C`/`0x7D..0x7F` with
//! the sign); `float8_e4m3fn` has no infinity and NaN is `0x7F`/`0xFF` (torch's
//! `c10/util/Float8_e4m3fn.h`). Integer and bool tensors are always finite.

use shardwise::format::dtype::DType;

/// Non-finite values counted in one tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NonFinite {
    pub(crate) nan: u64,
    pub(crate) inf: u64,
}

impl NonFinite {
    /// NaN and infinities together.
    pub(crate) fn total(self) -> u64 {
        self.nan + self.inf
    }

    /// `3 (2 NaN, 1 infinite)`, for messages.
    pub(crate) fn describe(self) -> String {
        format!(
            "{} non-finite value{} ({} NaN, {} infinite)",
            self.total(),
            if self.total() == 1 { "" } else { "s" },
            self.nan,
            self.inf
        )
    }
}

/// Counts, in little-endian words of type `$w` (`$n` bytes) of `$bytes`, those whose exponent bits
/// (`$exp`) are all set, NaN when a mantissa bit (`$man`) is set too. Branch-free sums in `$s`
/// (as wide as the word, or u16 for bytes) over blocks of 32 Ki words, so that the loop
/// vectorizes in the word's lanes (one u64 sum per word ran at 3.4 GB/s).
macro_rules! count_words {
    ($bytes:expr, $w:ty, $s:ty, $n:literal, $exp:expr, $man:expr) => {{
        let (exp, man): ($w, $w) = ($exp, $man);
        let (mut nan, mut special) = (0u64, 0u64);
        for block in $bytes.chunks($n << 15) {
            let (mut n, mut s): ($s, $s) = (0, 0);
            for c in block.chunks_exact($n) {
                let w = <$w>::from_le_bytes(c.try_into().expect("a whole word"));
                let sp = (w & exp == exp) as $s;
                s += sp;
                n += sp & (w & man != 0) as $s;
            }
            nan += n as u64;
            special += s as u64;
        }
        NonFinite {
            nan,
            inf: special - nan,
        }
    }};
}

/// The non-finite values of `bytes`, little-endian elements of `dtype` (a trailing partial element
/// is not counted).
pub(crate) fn count(bytes: &[u8], dtype: DType) -> NonFinite {
    match dtype {
        DType::F32 => count_words!(bytes, u32, u32, 4, 0x7F80_0000, 0x007F_FFFF),
        DType::F64 => count_words!(
            bytes,
            u64,
            u64,
            8,
            0x7FF0_0000_0000_0000,
            0x000F_FFFF_FFFF_FFFF
        ),
        DType::BF16 => count_words!(bytes, u16, u16, 2, 0x7F80, 0x007F),
        DType::F16 => count_words!(bytes, u16, u16, 2, 0x7C00, 0x03FF),
        DType::F8E5M2 => count_words!(bytes, u8, u16, 1, 0x7C, 0x03),
        // No infinity: NaN is the one code with every exponent and mantissa bit set.
        DType::F8E4M3FN => NonFinite {
            nan: count_words!(bytes, u8, u16, 1, 0x7F, 0x7F).nan,
            inf: 0,
        },
        _ => NonFinite::default(),
    }
}

/// The non-finite values of float32 values in memory.
pub(crate) fn count_f32(x: &[f32]) -> NonFinite {
    let (mut nan, mut inf) = (0u64, 0u64);
    for block in x.chunks(1 << 16) {
        let (mut n, mut i) = (0u32, 0u32);
        for v in block {
            n += v.is_nan() as u32;
            i += v.is_infinite() as u32;
        }
        nan += n as u64;
        inf += i as u64;
    }
    NonFinite { nan, inf }
}

/// The message of `--quantize` `scheme` refusing HF tensor `name`, which holds `found` in `dtype`
/// (the output dtype its values are rounded to before quantization).
pub(crate) fn refusal(scheme: &str, name: &str, found: NonFinite, dtype: DType) -> String {
    format!(
        "--quantize {scheme}: {name} holds {} as {}: quantized, a NaN can become a finite code and an infinity an infinite or zero scale that turns its whole block or scale group into NaN when dequantized; nothing was written (find the tensor's source, or pass --allow-nonfinite to write it quantized anyway)",
        found.describe(),
        dtype.torch_name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nf(nan: u64, inf: u64) -> NonFinite {
        NonFinite { nan, inf }
    }

    #[test]
    fn every_float_dtype_counts_nan_and_infinities_apart() {
        let f32s = [
            1.0f32,
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            -0.0,
            f32::MAX,
        ];
        let bytes: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(count(&bytes, DType::F32), nf(1, 2));
        assert_eq!(count_f32(&f32s), nf(1, 2));
        let f64s = [f64::NAN, 1e308, f64::NEG_INFINITY];
        let bytes: Vec<u8> = f64s.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(count(&bytes, DType::F64), nf(1, 1));
        let bf: Vec<u8> = [f32::NAN, -f32::INFINITY, 3.0e38, 1.0]
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(count(&bf, DType::BF16), nf(1, 1));
        // 70000 does not fit float16: it is written as +Inf, and counted.
        let h: Vec<u8> = [f32::NAN, 70000.0, 65504.0, -1.0]
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(count(&h, DType::F16), nf(1, 1));
        assert_eq!(count(&[0x7C, 0xFC, 0x7D, 0x7B], DType::F8E5M2), nf(1, 2));
        assert_eq!(count(&[0x7F, 0xFF, 0x7E, 0x00], DType::F8E4M3FN), nf(2, 0));
        assert_eq!(count(&[0xFF; 8], DType::I64), nf(0, 0));
        assert_eq!(
            nf(2, 1).describe(),
            "3 non-finite values (2 NaN, 1 infinite)"
        );
        assert_eq!(
            nf(0, 1).describe(),
            "1 non-finite value (0 NaN, 1 infinite)"
        );
    }
}
