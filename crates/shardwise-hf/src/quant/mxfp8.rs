//! **MXFP8** (`--quantize mxfp8`, compressed-tensors' `mxfp8-quantized`; OCP Microscaling v1.0):
//! each 2-D linear weight `[rows, cols]` becomes `float8_e4m3fn` codes and one e8m0 scale byte per 32
//! consecutive values of a row (the scale is `2^(byte - 127)`). Activations are quantized at run
//! time by the engine (`input_activations.dynamic: true`), so nothing is calibrated.
//!
//! The recipe is what llm-compressor 0.14.0.1's `model_free_ptq(scheme="MXFP8")` computes with
//! compressed-tensors 0.19.0: `quantization/utils/mxfp_utils.py` (`round_to_power_2`,
//! `generate_mx_scales`, `maybe_convert_from_mx_exp`), `quantization/utils/helpers.py`
//! (`calculate_qparams`, `_get_dtype_eps`), `compressors/mx_utils.py` (`compress_mx_scale`) and
//! `quantization/lifecycle/forward_helpers.py` (`_quantize`). With `T` the weight's dtype and `amax`
//! the group's largest `|x|` (exact in `T`):
//! - `p = round_to_power_2(amax)` on `T`'s bits: add `2^(m - 2)` (`m` mantissa bits) and keep sign
//!   and exponent, so `amax` rounds down to a power of two unless its mantissa is at least 1.75;
//! - `byte = clamp(127 + floor(log2 p) - 8, 0, 255)` (8 = floor(log2 448)); `p = 0` gives 0;
//! - the scale `T(2^(byte - 127))` (1 where that underflows to 0 in `T`, the "eps" of a uint8
//!   scale), stored as `127 + floor(log2 scale)`;
//! - each code is `e4m3(clamp(T(x / scale), ±448))`.
//!
//! ModelOpt's MXFP8 (`torch/quantization/qtensor/mxfp8_tensor.py`, `_compute_e8m0_exponent`) picks
//! the exponent `ceil(log2(amax / 448))`, the smallest power of two for which no value saturates.
//! With `amax = m * 2^k` (`1 <= m < 2`) both rules give `k - 8` for `m < 1.75` and `k - 7` for
//! `m > 1.75`; they part at `m = 1.75` exactly (1 in 128 bfloat16 groups), where compressed-tensors
//! takes `k - 7` (amax lands on 224) and ModelOpt `k - 8` (amax lands on 448).
//! [`modelopt_exponent`] states ModelOpt's rule for the tests that show this.

use super::{f32_to_e4m3, round_to, E4M3_MAX};
use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;

/// Values per MXFP8 scale (OCP MX: 32).
pub(crate) const MXFP8_GROUP: u64 = 32;

/// `v` (>= 0, a value of dtype `t`) rounded to a power of two as compressed-tensors'
/// `round_to_power_2` does on `t`'s bits: `(bits + 2^(m - 2)) & sign_and_exponent_mask`.
fn round_to_power_2(v: f32, t: DType) -> f32 {
    match t {
        DType::BF16 => {
            let b = half::bf16::from_f32(v).to_bits();
            half::bf16::from_bits(b.wrapping_add(1 << 5) & 0xFF80).to_f32()
        }
        DType::F16 => {
            let b = half::f16::from_f32(v).to_bits();
            half::f16::from_bits(b.wrapping_add(1 << 8) & 0xFC00).to_f32()
        }
        _ => f32::from_bits(v.to_bits().wrapping_add(1 << 21) & 0xFF80_0000),
    }
}

/// The e8m0 scale byte of a group whose largest `|x|` is `amax` (dtype `t`), and the scale value
/// the codes are divided by (see the module docs).
fn scale_of(amax: f32, t: DType) -> (u8, f32) {
    let p = round_to_power_2(amax, t);
    let byte = if p == 0.0 {
        0
    } else {
        (127 + p.log2().floor() as i32 - 8).clamp(0, 255)
    };
    let mut v = [2f32.powi(byte - 127)];
    round_to(&mut v, t);
    let v = if v[0] == 0.0 { 1.0 } else { v[0] };
    ((127 + v.log2().floor() as i32) as u8, v)
}

/// ModelOpt's MXFP8 exponent of a group: `clamp(ceil(log2(amax / 448)), -127, 127)`, -127 for
/// `amax = 0` (biased: `+ 127`). Not written; documented beside the rule used.
#[cfg(test)]
fn modelopt_exponent(amax: f32) -> i32 {
    let d = amax / E4M3_MAX;
    let e = if d > 0.0 {
        d.log2().ceil() as i32
    } else {
        -127
    };
    e.clamp(-127, 127)
}

/// Quantizes `x` (`[rows, cols]` row-major, values already in dtype `t`, `cols` a multiple of
/// 32): `codes` gets `x.len()` e4m3 codes, `scales` `x.len() / 32` e8m0 bytes.
///
/// Errors: [`Error::Validation`] for buffer sizes that do not fit.
pub(crate) fn quantize(x: &[f32], t: DType, codes: &mut [u8], scales: &mut [u8]) -> Result<()> {
    let g = MXFP8_GROUP as usize;
    if x.len() % g != 0 || codes.len() != x.len() || scales.len() * g != x.len() {
        return Err(Error::Validation(format!(
            "MXFP8 quantization: {} values, {} codes, {} scales (32 values per scale)",
            x.len(),
            codes.len(),
            scales.len()
        )));
    }
    let mut q = vec![0f32; g];
    for ((xs, out), s) in x
        .chunks_exact(g)
        .zip(codes.chunks_exact_mut(g))
        .zip(scales.iter_mut())
    {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let (byte, scale) = scale_of(amax, t);
        *s = byte;
        // `x / scale` runs in the weight's dtype (the scale parameter has it).
        for (d, v) in q.iter_mut().zip(xs) {
            *d = v / scale;
        }
        round_to(&mut q, t);
        for (o, v) in out.iter_mut().zip(&q) {
            *o = f32_to_e4m3(v.clamp(-E4M3_MAX, E4M3_MAX));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::E4M3_TO_F32;
    use super::*;

    #[test]
    fn the_scale_is_the_power_of_two_below_amax_unless_its_mantissa_reaches_1_75() {
        // amax 1.5: p = 1, byte 127 - 8 = 119 (2^-8): 1.5 / 2^-8 = 384, below 448.
        assert_eq!(scale_of(1.5, DType::BF16), (119, 2f32.powi(-8)));
        // amax 1.75 (mantissa 1.75): rounds up to 2, byte 120, 1.75 * 128 = 224.
        assert_eq!(scale_of(1.75, DType::BF16).0, 120);
        // amax 1.7421875 (bf16 just below 1.75): stays at 1, 1.742 * 256 = 446 < 448.
        assert_eq!(scale_of(1.7421875, DType::BF16).0, 119);
        // Zero: byte 0, scale 2^-127.
        assert_eq!(scale_of(0.0, DType::BF16), (0, 2f32.powi(-127)));
        // float16: 2^-127 underflows to 0 and becomes 1 (byte 127).
        assert_eq!(scale_of(0.0, DType::F16), (127, 1.0));
        // ModelOpt's rule agrees but where amax's mantissa is 1.75 exactly.
        for amax in [
            1.0f32, 1.2, 1.5, 1.7421875, 1.7578125, 1.9, 3.0, 0.01, 3.5, 0.4375,
        ] {
            let ct = scale_of(amax, DType::BF16).0 as i32 - 127;
            let mo = modelopt_exponent(amax);
            let m = amax / 2f32.powi(amax.log2().floor() as i32);
            assert_eq!(ct - mo, (m == 1.75) as i32, "{amax}");
        }
    }

    #[test]
    fn codes_are_e4m3_of_x_over_the_scale() {
        let mut x = [0f32; 32];
        (x[0], x[1], x[2]) = (1.5, -0.75, 0.001);
        let (mut c, mut s) = ([0u8; 32], [0u8; 1]);
        quantize(&x, DType::BF16, &mut c, &mut s).unwrap();
        assert_eq!(s[0], 119);
        assert_eq!(E4M3_TO_F32[c[0] as usize], 384.0);
        assert_eq!(E4M3_TO_F32[c[1] as usize], -192.0);
        assert_eq!(E4M3_TO_F32[c[2] as usize], 0.25); // 0.256 -> 0.25 (step 2^-5 below 0.5)
        assert!(quantize(&x[..16], DType::BF16, &mut c[..16], &mut s).is_err());
    }
}
