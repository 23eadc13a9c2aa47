//! **NVFP4**, weight-only (`--quantize nvfp4`): each 2-D linear weight `[rows, cols]` becomes e2m1
//! codes (two per byte, the element of even index in the low nibble), one `float8_e4m3fn` scale per
//! 16 consecutive values of a row, and one float32 scale for the whole tensor, shared by the linears
//! that read the same input ([`super::scale_group`]). Two recipes, one per layout written:
//!
//! - **compressed-tensors** (`nvfp4-pack-quantized`; what llm-compressor 0.14.0.1's
//!   `model_free_ptq(scheme="NVFP4A16")` computes with compressed-tensors 0.19.0). Source:
//!   `compressed_tensors/quantization/utils/helpers.py` (`generate_gparam`, `calculate_qparams`,
//!   `_get_dtype_eps`), `quantization/lifecycle/forward_helpers.py` (`_quantize`),
//!   `quantization/utils/fp4_utils.py` (`cast_to_fp4`), `compressors/nvfp4/helpers.py`
//!   (`pack_fp4_to_uint8`), `quantization/lifecycle/initialize.py` (the scale parameter has the
//!   weight's dtype); llm-compressor `observers/base.py` (`get_global_scale`: the absolute maximum
//!   over the fused observers). With `W` the weight in the output dtype `T` and `A` the largest `|W|`
//!   of its scale group:
//!   - global scale `g = T(T(1 / max(A, tiny(T))) * 2688)`, 1.0 when that is not finite (2688 =
//!     448 x 6, the e4m3 and e2m1 maxima; torch evaluates `2688 / A` as `A.reciprocal() * 2688`),
//!     each step in float32 rounded to `T` (bfloat16 for `--dtype bf16`: llm-compressor keeps its
//!     statistics in the weight's dtype);
//!   - per 16 values, `s = e4m3(clamp(g * T(amax / 6), ±448))`; a scale of 0 (an all-zero group)
//!     becomes 0.125, the "eps" of float8_e4m3fn in `_get_dtype_eps`;
//!   - each code is `e2m1(x / (s / g))`, both divisions in float32, by [`e2m1_code`].
//!
//!   Stored (compressed-tensors `NVFP4PackedCompressor.compression_param_names`): `x.weight_packed`
//!   uint8 `[rows, cols/2]`, `x.weight_scale` e4m3 `[rows, cols/16]`, `x.weight_global_scale`
//!   float32 `[1]` (= g).
//! - **ModelOpt** (`W4A16_NVFP4`, for TensorRT-LLM; nvidia-modelopt 0.47.0
//!   `torch/quantization/qtensor/nvfp4_tensor.py`: `get_weights_scaling_factor_2`,
//!   `get_weights_scaling_factor`, `_cast_per_block_scale_to_fp8`, `quantize`, `_cast_fp4`):
//!   - `scale_2 = A / 2688` in float32 (ModelOpt's amax is the weight's, exact in float32; its
//!     unified HF export gives fused linears their largest amax, `preprocess_linear_fusion`);
//!   - per 16 values `s = e4m3(clamp(amax / (6 * scale_2), 2^-9, 448))`, 1.0 for an all-zero group;
//!   - each code is `e2m1(x / (s * scale_2))`, in float32.
//!
//!   Stored (ModelOpt `unified_export_hf`): `x.weight` uint8 `[rows, cols/2]`, `x.weight_scale` e4m3
//!   `[rows, cols/16]`, `x.weight_scale_2` float32 `[]`. `scale_2` is about `1 / g` of the
//!   compressed-tensors recipe, not exactly: `g` is rounded to the weight's dtype first. A tensor
//!   that is zero everywhere (`A = 0`) makes ModelOpt divide 0 by 0 (NaN scales); here its scales are
//!   1.0, its codes 0 and its `scale_2` 0, which dequantizes to the zeros it holds.
//!
//! Both dequantize to `e2m1 * s / g` (`e2m1 * s * scale_2`); vLLM and SGLang read one global scale
//! for a fused linear (the first or the largest), which is why a scale group shares one.

use super::{round_to, E4M3_MAX, E4M3_TO_F32};
use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;

/// Values per NVFP4 scale (NVIDIA's NVFP4: 16, compressed-tensors `group_size` 16).
pub(crate) const NVFP4_GROUP: u64 = 16;
/// e2m1's largest magnitude.
const E2M1_MAX: f32 = 6.0;
/// The e4m3 code of 0.125, the scale compressed-tensors gives an all-zero group.
const E4M3_EIGHTH: u8 = 0x20;
/// The e4m3 code of 1.0, the scale ModelOpt gives an all-zero group.
const E4M3_ONE: u8 = 0x38;

/// Which NVFP4 layout (and recipe, see the module docs) is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Nvfp4Layout {
    /// compressed-tensors' `nvfp4-pack-quantized` (vLLM, SGLang, transformers).
    CompressedTensors,
    /// ModelOpt's `W4A16_NVFP4` (TensorRT-LLM; vLLM's ModelOpt loader).
    ModelOpt,
}

/// The e2m1 code of `q`: the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code, larger
/// magnitudes to 6; the sign bit (8) is set for every negative `q`, also one that rounds to 0 (not
/// for -0.0). compressed-tensors' `cast_to_fp4` (`sign(x) * rounded |x|`) and `pack_fp4_to_uint8`
/// (`signbit`), and ModelOpt's `_cast_fp4` (`searchsorted` over the bounds 0.25, 0.75, 1.25, 1.75,
/// 2.5, 3.5, 5, the odd bounds rounding up), agree on every float32.
pub(crate) fn e2m1_code(q: f32) -> u8 {
    let a = q.abs();
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    code | if q < 0.0 { 8 } else { 0 }
}

/// The largest `|x|` (0 for none): the statistic a scale group's global scale comes from.
pub(crate) fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, v| a.max(v.abs()))
}

/// The smallest positive normal value of `t` (torch's `finfo(t).tiny`).
fn tiny(t: DType) -> f32 {
    match t {
        DType::F16 => half::f16::MIN_POSITIVE.to_f32(),
        _ => f32::MIN_POSITIVE,
    }
}

/// The float32 scale stored beside the codes for a scale group whose largest `|x|` is `group_amax`
/// (`t`: the weight's dtype): compressed-tensors' global scale `g`, or ModelOpt's `scale_2`.
pub(crate) fn tensor_scale(layout: Nvfp4Layout, group_amax: f32, t: DType) -> f32 {
    match layout {
        Nvfp4Layout::CompressedTensors => {
            // `448.0 * 6.0 / amax` is torch's `Tensor.__rtruediv__`, `amax.reciprocal() * 2688`:
            // two roundings in `t`.
            let mut r = [1.0 / group_amax.max(tiny(t))];
            round_to(&mut r, t);
            let mut g = [r[0] * 2688.0];
            round_to(&mut g, t);
            if g[0].is_finite() {
                g[0]
            } else {
                1.0
            }
        }
        Nvfp4Layout::ModelOpt => group_amax / (E2M1_MAX * E4M3_MAX),
    }
}

/// Quantizes `x` (`[rows, cols]` in row-major order, values already in dtype `t`, `cols` a multiple
/// of 16) with the tensor scale `ts` ([`tensor_scale`]): `packed` gets `rows * cols / 2` bytes,
/// `scales` `rows * cols / 16` e4m3 codes.
///
/// Errors: [`Error::Validation`] for buffer sizes that do not fit.
pub(crate) fn quantize(
    layout: Nvfp4Layout,
    x: &[f32],
    t: DType,
    ts: f32,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<()> {
    let g = NVFP4_GROUP as usize;
    if x.len() % g != 0 || packed.len() * 2 != x.len() || scales.len() * g != x.len() {
        return Err(Error::Validation(format!(
            "NVFP4 quantization: {} values, {} packed bytes, {} scales (16 values per scale)",
            x.len(),
            packed.len(),
            scales.len()
        )));
    }
    // ModelOpt's per-block divisor `6 * scale_2`, once per tensor as its broadcast computes it.
    let den = E2M1_MAX * ts;
    for ((xs, out), s) in x
        .chunks_exact(g)
        .zip(packed.chunks_exact_mut(g / 2))
        .zip(scales.iter_mut())
    {
        let a = amax(xs);
        let (code, divisor) = match layout {
            Nvfp4Layout::CompressedTensors => {
                let mut local = [a / E2M1_MAX];
                round_to(&mut local, t);
                let mut code = super::f32_to_e4m3((ts * local[0]).clamp(-E4M3_MAX, E4M3_MAX));
                if E4M3_TO_F32[code as usize] == 0.0 {
                    code = E4M3_EIGHTH;
                }
                (code, E4M3_TO_F32[code as usize] / ts)
            }
            Nvfp4Layout::ModelOpt if ts == 0.0 => (E4M3_ONE, f32::INFINITY),
            Nvfp4Layout::ModelOpt => {
                let local = a / den;
                let local = if local == 0.0 { 1.0 } else { local };
                let code = super::f32_to_e4m3(local.clamp(2f32.powi(-9), E4M3_MAX));
                (code, E4M3_TO_F32[code as usize] * ts)
            }
        };
        *s = code;
        for (pair, o) in xs.chunks_exact(2).zip(out.iter_mut()) {
            *o = e2m1_code(pair[0] / divisor) | (e2m1_code(pair[1] / divisor) << 4);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounds_to_nearest_even_with_the_sign_of_negatives() {
        // Ties: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0.
        let cases = [
            (0.0, 0),
            (0.25, 0),
            (0.2500001, 1),
            (0.75, 2),
            (1.25, 2),
            (1.2500001, 3),
            (1.75, 4),
            (2.5, 4),
            (2.5000002, 5),
            (3.5, 6),
            (5.0, 6),
            (5.0000005, 7),
            (1e9, 7),
        ];
        for (q, code) in cases {
            assert_eq!(e2m1_code(q), code, "{q}");
            assert_eq!(e2m1_code(-q), if q == 0.0 { 0 } else { code | 8 }, "-{q}");
        }
        // A negative value that rounds to 0 keeps its sign (compressed-tensors: -0.0, signbit).
        assert_eq!(e2m1_code(-0.1), 8);
    }

    #[test]
    fn compressed_tensors_scales_are_computed_in_the_weight_dtype() {
        // A = 1.6953125 (bf16): 1 / A = 0.58986 rounds to 0.58984375 (151/256) in bfloat16, x 2688
        // = 1585.5 rounds to 1584.
        let g = tensor_scale(Nvfp4Layout::CompressedTensors, 1.6953125, DType::BF16);
        assert_eq!(g, 1584.0);
        // A = 211/1024 = 0.2060546875 (from a test model's expert): 2688 / A = 13045.08 would round to 13056;
        // 1 / A rounds to 4.84375 first, x 2688 = 13020 rounds to 12992 (llm-compressor's value).
        let g = tensor_scale(Nvfp4Layout::CompressedTensors, 211.0 / 1024.0, DType::BF16);
        assert_eq!(g, 12992.0);
        assert_eq!(
            tensor_scale(Nvfp4Layout::CompressedTensors, 1.6953125, DType::F32),
            (1.0 / 1.6953125f32) * 2688.0
        );
        // All zero: 2688 / tiny overflows, the global scale falls back to 1.
        assert_eq!(
            tensor_scale(Nvfp4Layout::CompressedTensors, 0.0, DType::BF16),
            1.0
        );
        // One group of 16 with amax 6 and g = 448: s = e4m3(448 * 1) = 448, divisor 1.
        let mut x = [0f32; 16];
        (x[0], x[1], x[2], x[3]) = (6.0, -3.0, 0.5, -0.1);
        let (mut p, mut s) = ([0u8; 8], [0u8; 1]);
        quantize(
            Nvfp4Layout::CompressedTensors,
            &x,
            DType::BF16,
            448.0,
            &mut p,
            &mut s,
        )
        .unwrap();
        assert_eq!(E4M3_TO_F32[s[0] as usize], 448.0);
        assert_eq!(p[..2], [0x7 | (0xD << 4), 0x1 | (0x8 << 4)]);
        // An all-zero group gets scale 0.125 and codes 0.
        quantize(
            Nvfp4Layout::CompressedTensors,
            &[0.0; 16],
            DType::BF16,
            1.0,
            &mut p,
            &mut s,
        )
        .unwrap();
        assert_eq!((s[0], p), (E4M3_EIGHTH, [0; 8]));
    }

    #[test]
    fn modelopt_scales_are_float32_and_zero_groups_get_one() {
        let ts = tensor_scale(Nvfp4Layout::ModelOpt, 6.0, DType::BF16);
        assert_eq!(ts, 6.0 / 2688.0);
        let mut x = [0f32; 32];
        (x[0], x[1]) = (6.0, 1.5);
        let (mut p, mut s) = ([0u8; 16], [0u8; 2]);
        quantize(Nvfp4Layout::ModelOpt, &x, DType::BF16, ts, &mut p, &mut s).unwrap();
        // Group 0: 6 / (6 * 6/2688) = 448; group 1 is zero: scale 1.0.
        assert_eq!((E4M3_TO_F32[s[0] as usize], s[1]), (448.0, E4M3_ONE));
        assert_eq!(p[0], 0x7 | (0x3 << 4));
        // A tensor that is zero everywhere: scale_2 0, scales 1.0, codes 0 (ModelOpt: NaN).
        quantize(
            Nvfp4Layout::ModelOpt,
            &[0.0; 32],
            DType::BF16,
            0.0,
            &mut p,
            &mut s,
        )
        .unwrap();
        assert_eq!((s, p), ([E4M3_ONE; 2], [0; 16]));
        assert!(quantize(
            Nvfp4Layout::ModelOpt,
            &x[..8],
            DType::BF16,
            ts,
            &mut p,
            &mut s
        )
        .is_err());
    }
}
