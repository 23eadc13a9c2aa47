//! The quantized weight formats of official Hugging Face releases, both directions: dequantization
//! for `from-hf` (a quantized release becomes bf16/f16/f32 Megatron weights) and quantization for
//! `to-hf --quantize` (issue #22). Pure functions over little-endian byte buffers, no I/O.
//!
//! **Block-scaled FP8** (DeepSeek-V3, Kimi-K2, Qwen3 / Qwen3-Next FP8 releases; transformers
//! `quant_method: "fp8"`): the weight `[.., rows, cols]` is stored as `float8_e4m3fn` (safetensors
//! `F8_E4M3`), and beside it `<name>_scale_inv` (for `x.weight`: `x.weight_scale_inv`), one value
//! per `128 x 128` block, shape `[.., ceil(rows/128), ceil(cols/128)]` (the edge blocks are
//! partial). The scale is float32 in the DeepSeek-V3 release (some later Qwen FP8 releases store
//! bfloat16; both are read, float32 is written).
//! - Dequantize: `out = dtype(f32(fp8) * f32(scale_inv))`, the product in float32 rounded once to
//!   the output dtype (round to nearest even): DeepSeek-V3 `inference/kernel.py` `weight_dequant`,
//!   transformers 5.x `integrations/finegrained_fp8.py` `Fp8Dequantize._dequantize_one`, torch 2.15
//!   `distributed/checkpoint/quantized_hf_storage.py` `_dequantize_tensor`.
//! - Quantize: DeepGEMM's `per_block_cast_to_fp8` (deepseek-ai/DeepGEMM, copied into SGLang and
//!   vLLM): per block `amax = max(max |x|, 1e-4)` over the block's elements (a partial edge block's
//!   missing elements are zero padding there), `q = e4m3(x * ((1 / amax) * 448))` (torch evaluates
//!   DeepGEMM's `448.0 / x_amax` as `x_amax.reciprocal() * 448`), `scale_inv = amax / 448`, all in
//!   float32. transformers' own `Fp8Quantize` leaves a tensor with a partial edge block
//!   unquantized and would not give the `ceil` grid these releases have.
//!
//! **MXFP4** (gpt-oss; transformers `quant_method: "mxfp4"`, OCP Microscaling v1.0): a weight whose
//! last dimension has `G x 32` elements is stored as `<name>_blocks` uint8 `[.., G, 16]` (two e2m1
//! values per byte, the element of even index in the low nibble) and `<name>_scales` uint8 `[.., G]`
//! (e8m0: the block's scale is `2^(s - 127)`). transformers' gpt_oss parameter is the dequantized
//! `[E, rows, G*32]` transposed over its last two dimensions (`gate_up_proj` `[E, H, 2I]` from
//! blocks `[E, 2I, H/32, 16]`).
//! - Dequantize: `out = dtype(e2m1 * 2^(s - 127))`, the product in float32 rounded once (transformers
//!   5.x `integrations/mxfp4.py` `_convert_moe_packed_tensors`: LUT in the output dtype, then
//!   `torch.ldexp`, which multiplies by `2.0 ** s` in float32; torch's `_dequantize_tensor_mxfp4`
//!   likewise). A scale byte of 255 is NaN in the MX spec and is refused.
//! - Quantize: triton_kernels `numerics_details/mxfp.py` `downcast_to_mxfp_torch` (what transformers'
//!   `quantize_to_mxfp4` calls, on the weight cast to bfloat16 first): per 32-block
//!   `d = amax / 6` rounded up to a power of two (`(bits(d) + 0x7FFFFF) & 0x7F800000`), scale byte
//!   its biased exponent, each `x / d` rounded to e2m1 by that function's bit arithmetic (round
//!   half away on the last kept bit, saturating at 6).
//!
//! **NVFP4** (weight-only, compressed-tensors or ModelOpt layout) and **MXFP8** (compressed-tensors)
//! are written by `to-hf --quantize nvfp4` / `mxfp8` (issue #38): their recipes are in [`nvfp4`] and
//! [`mxfp8`]. NVFP4's per-tensor scale is shared by the linears that read one input
//! ([`scale_group`]), so those are quantized together.

mod mxfp8;
mod nvfp4;

pub(crate) use nvfp4::Nvfp4Layout;

use serde_json::{json, Value as Json};

use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;

/// The largest finite `float8_e4m3fn` value.
pub(crate) const E4M3_MAX: f32 = 448.0;
/// The weight block of every block-FP8 release (`weight_block_size` `[128, 128]`).
pub(crate) const FP8_BLOCK: [u64; 2] = [128, 128];
/// Elements per MXFP4 scale block (OCP MX: 32).
pub(crate) const MXFP4_BLOCK: u64 = 32;
/// The suffix of an FP8 weight's scale tensor name (`x.weight` -> `x.weight_scale_inv`).
pub(crate) const SCALE_INV_SUFFIX: &str = "_scale_inv";
/// The suffixes of an MXFP4 weight's two tensors (`x` -> `x_blocks`, `x_scales`).
pub(crate) const MXFP4_BLOCKS_SUFFIX: &str = "_blocks";
pub(crate) const MXFP4_SCALES_SUFFIX: &str = "_scales";

/// gpt-oss's `quantization_config.modules_to_not_convert` (openai/gpt-oss-20b and -120b
/// config.json): everything but the experts stays bf16.
pub(crate) const GPT_OSS_NOT_CONVERTED: &[&str] = &[
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
];

/// A quantization scheme of an HF folder, from its `quantization_config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// Block-scaled FP8 with `[block rows, block cols]` blocks.
    Fp8Block([u64; 2]),
    Mxfp4,
    /// Weight-only NVFP4 ([`nvfp4`]), in the given layout.
    Nvfp4(Nvfp4Layout),
    /// MXFP8 ([`mxfp8`]), compressed-tensors' `mxfp8-quantized`.
    Mxfp8,
}

/// The scheme a config.json's `quantization_config` declares; None without one.
///
/// Errors: [`Error::InvalidArgument`] for a `quant_method` other than `fp8` and `mxfp4`, an FP8
/// config whose `fmt` is not `e4m3` or whose `weight_block_size` is not two positive integers
/// (absent means per-tensor scales, which no release above uses: refused too), or an
/// `activation_scheme` other than `dynamic` (static activation scales are not weights we convert).
pub(crate) fn scheme(config: &Json) -> Result<Option<Scheme>> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let bad = |what: String| Error::InvalidArgument(format!("quantization_config: {what}"));
    match q.get("quant_method").and_then(|m| m.as_str()) {
        Some("fp8") => {
            if let Some(f) = q.get("fmt").filter(|f| !f.is_null()) {
                if f.as_str() != Some("e4m3") {
                    return Err(bad(format!("fmt {f}: only e4m3 is read")));
                }
            }
            if let Some(a) = q.get("activation_scheme").filter(|a| !a.is_null()) {
                if a.as_str() != Some("dynamic") {
                    return Err(bad(format!(
                        "activation_scheme {a}: only dynamic is read (static activation scales)"
                    )));
                }
            }
            let block = q
                .get("weight_block_size")
                .and_then(|b| b.as_array())
                .and_then(|b| match b.as_slice() {
                    [r, c] => Some([r.as_u64()?, c.as_u64()?]),
                    _ => None,
                })
                .filter(|b| b[0] > 0 && b[1] > 0)
                .ok_or_else(|| {
                    bad(format!(
                        "weight_block_size {}: two positive integers expected (per-tensor FP8 is not read)",
                        q.get("weight_block_size").unwrap_or(&Json::Null)
                    ))
                })?;
            Ok(Some(Scheme::Fp8Block(block)))
        }
        Some("mxfp4") => Ok(Some(Scheme::Mxfp4)),
        other => Err(bad(format!(
            "quant_method {other:?}: from-hf reads fp8 (block-scaled) and mxfp4"
        ))),
    }
}

/// The `quantization_config` of a block-FP8 folder, as the DeepSeek-V3 and Qwen FP8 releases
/// write it: `activation_scheme` `dynamic`, `fmt` `e4m3`, `quant_method` `fp8`,
/// `weight_block_size` `[128, 128]`, and `modules_to_not_convert` when given (DeepSeek-V3 has
/// none; Qwen3 and Qwen3-Next FP8 list `lm_head` and every per-layer module kept in high
/// precision, see [`fp8_modules_to_not_convert`]).
pub(crate) fn fp8_block_config(modules_to_not_convert: &[String]) -> Json {
    let mut q = json!({
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": FP8_BLOCK,
    });
    if !modules_to_not_convert.is_empty() {
        q["modules_to_not_convert"] = json!(modules_to_not_convert);
    }
    q
}

/// `modules_to_not_convert` as the Qwen FP8 releases derive it (Qwen3-Next-80B-A3B-Instruct-FP8,
/// Qwen3-Coder-480B-A35B-Instruct-FP8 config.json): `lm_head` and the module of every tensor
/// under `model.layers.` (a multimodal model's `model.language_model.layers.`), `mtp.` or a
/// vision tower copied as it is (`model.visual.`) that stays unquantized (norms, routers, shared-expert gates,
/// the GDN's `A_log`, `conv1d`, `dt_bias`, `in_proj_ba`, `norm`), sorted with layer numbers in
/// numeric order; the embedding and final norm are not listed. `kept`: the HF names of the
/// tensors written unquantized.
pub(crate) fn fp8_modules_to_not_convert<'a>(
    kept: impl IntoIterator<Item = &'a str>,
) -> Vec<String> {
    let mut mods: Vec<String> = kept
        .into_iter()
        .filter(|n| {
            *n == "lm_head.weight"
                || n.contains("layers.")
                || n.starts_with("mtp.")
                || n.starts_with("model.visual.")
        })
        .map(|n| n.rsplit_once('.').map_or(n, |(m, _)| m).to_string())
        .collect();
    mods.sort_by_key(|m| natural_key(m));
    mods.dedup();
    mods
}

/// Sort key with runs of digits compared as numbers (`layers.2` before `layers.10`).
fn natural_key(s: &str) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(|b| b.is_ascii_digit()).count();
        if digits > 0 {
            out.push((rest[..digits].parse().unwrap_or(u64::MAX), String::new()));
            rest = &rest[digits..];
        } else {
            let text = rest.bytes().take_while(|b| !b.is_ascii_digit()).count();
            out.push((0, rest[..text].to_string()));
            rest = &rest[text..];
        }
    }
    out
}

/// The `quantization_config` of an MXFP4 folder, as gpt-oss writes it.
pub(crate) fn mxfp4_config(modules_to_not_convert: &[&str]) -> Json {
    json!({"modules_to_not_convert": modules_to_not_convert, "quant_method": "mxfp4"})
}

/// The compressed-tensors release whose formats (`nvfp4-pack-quantized`, `mxfp8-quantized`) and
/// `quantization_config` are written: the one llm-compressor 0.14.0.1 requires (`==0.19.0`). Its
/// version is part of the config, as `model_free_ptq` writes it.
pub(crate) const COMPRESSED_TENSORS_VERSION: &str = "0.19.0";
/// The ModelOpt release whose `W4A16_NVFP4` export layout is written (`producer.version`).
pub(crate) const MODELOPT_VERSION: &str = "0.47.0";

/// compressed-tensors' `QuantizationArgs(...).model_dump()` of a float scheme's weights or
/// dynamic activations: `num_bits`, `group_size`, `strategy` and `scale_dtype` as given.
fn ct_args(num_bits: u32, group: u64, strategy: &str, scale_dtype: &str, dynamic: bool) -> Json {
    json!({
        "actorder": null, "block_structure": null, "dynamic": dynamic, "group_size": group,
        "num_bits": num_bits, "observer": null, "observer_kwargs": {}, "scale_dtype": scale_dtype,
        "strategy": strategy, "symmetric": true, "type": "float", "zp_dtype": null,
    })
}

/// The `quantization_config` llm-compressor 0.14.0.1's `model_free_ptq` writes for preset
/// `NVFP4A16` or `MXFP8` (`entrypoints/model_free/save_utils.py` `update_config`: the
/// compression version, `quant_method` `compressed-tensors`, an empty `transform_config`, then
/// `QuantizationConfig.model_dump()` in `compressed` status; presets from compressed-tensors
/// `quantization/quant_scheme.py`), with `ignore` the modules kept in the output dtype
/// ([`ignored_modules`]). None for the other schemes.
pub(crate) fn compressed_tensors_config(scheme: Scheme, ignore: &[String]) -> Option<Json> {
    let (preset, format, weights, inputs) = match scheme {
        Scheme::Nvfp4(Nvfp4Layout::CompressedTensors) => (
            "NVFP4A16",
            "nvfp4-pack-quantized",
            ct_args(
                4,
                nvfp4::NVFP4_GROUP,
                "tensor_group",
                "torch.float8_e4m3fn",
                false,
            ),
            Json::Null,
        ),
        Scheme::Mxfp8 => (
            "MXFP8",
            "mxfp8-quantized",
            ct_args(8, mxfp8::MXFP8_GROUP, "group", "torch.uint8", false),
            ct_args(8, mxfp8::MXFP8_GROUP, "group", "torch.uint8", true),
        ),
        _ => return None,
    };
    Some(json!({
        "config_groups": {preset: {
            "format": format, "input_activations": inputs, "output_activations": null,
            "targets": ["Linear"], "weights": weights,
        }},
        "format": format,
        "global_compression_ratio": null,
        "ignore": ignore,
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }))
}

/// ModelOpt's `hf_quant_config.json` of a `W4A16_NVFP4` export (nvidia-modelopt 0.47.0
/// `torch/export/quant_utils.py` `get_quant_config` / `process_layer_quant_config`): the producer,
/// `quant_algo`, `group_size` 16, `exclude_modules` (the modules kept, [`ignored_modules`]) and
/// `kv_cache_quant_algo` null (the KV cache is not quantized: that needs calibration too).
pub(crate) fn modelopt_hf_quant_config(exclude: &[String]) -> Json {
    json!({
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {
            "exclude_modules": exclude,
            "group_size": nvfp4::NVFP4_GROUP,
            "kv_cache_quant_algo": null,
            "quant_algo": "W4A16_NVFP4",
        },
    })
}

/// config.json's `quantization_config` beside [`modelopt_hf_quant_config`]: what ModelOpt's
/// `convert_hf_quant_config_format` (`torch/export/convert_hf_config.py`) makes of it for
/// `W4A16_NVFP4` (`quant_method` `modelopt`, what vLLM and transformers dispatch on).
pub(crate) fn modelopt_config(exclude: &[String]) -> Json {
    json!({
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"dynamic": false, "group_size": nvfp4::NVFP4_GROUP, "num_bits": 4, "type": "float"},
        }},
        "ignore": exclude,
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quant_algo": "W4A16_NVFP4",
        "quant_method": "modelopt",
    })
}

/// The modules whose weights are kept in the output dtype, as compressed-tensors' `ignore` and
/// ModelOpt's `exclude_modules` list them: the module of every kept `.weight` but those whose
/// module name ends in `norm`, in natural order. That is the set compressed-tensors' model-free
/// matching would otherwise take (`utils/match.py` `match_quantizable_tensors`: every `weight`
/// parameter, modules named `*norm` skipped), so `model_free_ptq` with this `ignore` quantizes
/// exactly the tensors written quantized; it holds the embedding, `lm_head`, the routers, and 1-D
/// weights such as Qwen3.5's `mtp.pre_fc_norm_embedding`. `kept`: the HF names of the tensors
/// written unquantized.
pub(crate) fn ignored_modules<'a>(kept: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut mods: Vec<String> = kept
        .into_iter()
        .filter_map(|n| n.strip_suffix(".weight"))
        .filter(|m| !m.ends_with("norm"))
        .map(str::to_string)
        .collect();
    mods.sort_by_key(|m| natural_key(m));
    mods.dedup();
    mods
}

// ---- to-hf --quantize ----------------------------------------------------------------------------

/// `--quantize` names of variants that store activation scales (NVFP4 W4A4's `input_scale`, the
/// global scale of each linear's input): a statistic of activations over calibration data, which
/// a conversion of the checkpoint's files does not have. llm-compressor's `model_free_ptq` refuses
/// them likewise ("Model Free PTQ cannot calibrate activations", `entrypoints/model_free/validate.py`).
const NEEDS_CALIBRATION: &[&str] = &["nvfp4-w4a4", "w4a4", "nvfp4a4", "nvfp4-a4"];

/// `--quantize`: the quantized form to-hf writes the weights in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    /// `fp8-block`: e4m3 weights with [`FP8_BLOCK`] blocks of float32 `weight_scale_inv`.
    Fp8Block,
    /// `mxfp4`: gpt_oss's experts as `*_blocks` / `*_scales`.
    Mxfp4,
    /// `nvfp4`: weight-only NVFP4 ([`nvfp4`]).
    Nvfp4,
    /// `mxfp8`: compressed-tensors' `mxfp8-quantized` ([`mxfp8`]).
    Mxfp8,
}

impl std::str::FromStr for Quantize {
    type Err = Error;

    /// Errors: [`Error::InvalidArgument`] for another name, or a variant that needs calibration
    /// ([`NEEDS_CALIBRATION`], naming it as the missing input).
    fn from_str(name: &str) -> Result<Quantize> {
        match name {
            "fp8-block" => Ok(Quantize::Fp8Block),
            "mxfp4" => Ok(Quantize::Mxfp4),
            "nvfp4" => Ok(Quantize::Nvfp4),
            "mxfp8" => Ok(Quantize::Mxfp8),
            n if NEEDS_CALIBRATION.contains(&n) => Err(Error::InvalidArgument(format!(
                "--quantize {n:?} needs calibration data: NVFP4 W4A4 stores input_scale, the global scale of each linear's activations, measured by running the model on calibration samples, and to-hf reads only the checkpoint's files; --quantize nvfp4 writes weight-only NVFP4 (W4A16_NVFP4 / NVFP4A16), whose scales come from the weights alone"
            ))),
            other => Err(Error::InvalidArgument(format!(
                "--quantize {other:?}: use fp8-block, mxfp4, nvfp4 or mxfp8"
            ))),
        }
    }
}

impl std::fmt::Display for Quantize {
    /// The name `--quantize` takes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quantize::Fp8Block => "fp8-block",
            Quantize::Mxfp4 => "mxfp4",
            Quantize::Nvfp4 => "nvfp4",
            Quantize::Mxfp8 => "mxfp8",
        })
    }
}

/// `--quantize-format`: the layout a quantized output is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizeFormat {
    /// `compressed-tensors` (the default; vLLM, SGLang, transformers).
    CompressedTensors,
    /// `modelopt`: ModelOpt's `W4A16_NVFP4` with `hf_quant_config.json` (TensorRT-LLM).
    ModelOpt,
}

impl std::str::FromStr for QuantizeFormat {
    type Err = Error;

    /// Errors: [`Error::InvalidArgument`] for another name.
    fn from_str(name: &str) -> Result<QuantizeFormat> {
        match name {
            "compressed-tensors" => Ok(QuantizeFormat::CompressedTensors),
            "modelopt" => Ok(QuantizeFormat::ModelOpt),
            other => Err(Error::InvalidArgument(format!(
                "--quantize-format {other:?}: use compressed-tensors or modelopt"
            ))),
        }
    }
}

impl std::fmt::Display for QuantizeFormat {
    /// The name `--quantize-format` takes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuantizeFormat::CompressedTensors => "compressed-tensors",
            QuantizeFormat::ModelOpt => "modelopt",
        })
    }
}

impl Scheme {
    /// The scheme of `--quantize` (`fp8-block`: [`FP8_BLOCK`] blocks; `mxfp4`; `nvfp4`; `mxfp8`)
    /// in `--quantize-format` (`compressed-tensors`, the default, or `modelopt` for `nvfp4`).
    ///
    /// Errors: [`Error::InvalidArgument`] for a format the scheme is not written in.
    pub(crate) fn from_user(quantize: Quantize, format: Option<QuantizeFormat>) -> Result<Scheme> {
        let scheme = match quantize {
            Quantize::Fp8Block => Scheme::Fp8Block(FP8_BLOCK),
            Quantize::Mxfp4 => Scheme::Mxfp4,
            Quantize::Nvfp4 => Scheme::Nvfp4(Nvfp4Layout::CompressedTensors),
            Quantize::Mxfp8 => Scheme::Mxfp8,
        };
        match (scheme, format) {
            (s, None) => Ok(s),
            (Scheme::Nvfp4(_), Some(QuantizeFormat::ModelOpt)) => {
                Ok(Scheme::Nvfp4(Nvfp4Layout::ModelOpt))
            }
            (Scheme::Nvfp4(_) | Scheme::Mxfp8, Some(QuantizeFormat::CompressedTensors)) => {
                Ok(scheme)
            }
            (_, Some(f)) => Err(Error::InvalidArgument(format!(
                "--quantize-format {:?} with --quantize {quantize}: nvfp4 is written as compressed-tensors (the default) or modelopt, mxfp8 as compressed-tensors; fp8-block and mxfp4 have their releases' one layout",
                f.to_string()
            ))),
        }
    }

    /// The `--quantize` name of the scheme, for messages.
    pub(crate) fn quantize_name(self) -> &'static str {
        match self {
            Scheme::Fp8Block(_) => "fp8-block",
            Scheme::Mxfp4 => "mxfp4",
            Scheme::Nvfp4(_) => "nvfp4",
            Scheme::Mxfp8 => "mxfp8",
        }
    }

    /// Whether the scheme keeps MTP layers unquantized: NVFP4 and MXFP8 follow ModelOpt's default
    /// exclusions ([`MODELOPT_DISABLED`] `mtp.*`; DeepSeek's MTP layer, `model.layers.{L}`, is one
    /// ModelOpt never sees, as transformers does not load it); block FP8 quantizes them as
    /// DeepSeek-V3's release does.
    pub(crate) fn keeps_mtp(self) -> bool {
        matches!(self, Scheme::Nvfp4(_) | Scheme::Mxfp8)
    }

    /// The elements per scale along the input dimension, which that dimension must be a
    /// multiple of (NVFP4: 16, MXFP8 and MXFP4: 32); None for block FP8 (partial blocks).
    pub(crate) fn group(self) -> Option<u64> {
        match self {
            Scheme::Fp8Block(_) => None,
            Scheme::Mxfp4 => Some(MXFP4_BLOCK),
            Scheme::Nvfp4(_) => Some(nvfp4::NVFP4_GROUP),
            Scheme::Mxfp8 => Some(mxfp8::MXFP8_GROUP),
        }
    }
}

/// ModelOpt's default exclusions (nvidia-modelopt 0.47.0
/// `modelopt_recipes/configs/ptq/units/default_disabled_quantizers.yaml`, applied by every PTQ
/// preset, `W4A16_NVFP4` and `MXFP8` included), as fnmatch patterns of a weight quantizer's name
/// (`<module>.weight_quantizer`); its `nn.Embedding` rule is [`FP8_KEPT_SUFFIXES`]'
/// `embed_tokens`. NVFP4 and MXFP8 keep these in the output dtype as well as what block FP8 keeps.
const MODELOPT_DISABLED: &[&str] = &[
    "*block_sparse_moe.gate*",
    "*linear_attn.conv1d*",
    "*linear_attn.in_proj_a*",
    "*linear_attn.in_proj_b*",
    "*lm_head*",
    "*mixer.conv1d*",
    "*mlp.gate.*",
    "*mlp.shared_expert_gate.*",
    "*output_layer*",
    "*proj_out.*",
    "*router*",
    "mtp.*",
    "output.*",
    "*embed_vision*",
    "*vision_tower*",
    "*visual*",
    "*vision_model*",
    "*multi_modal_projector*",
];

/// fnmatch with `*` only (the only wildcard [`MODELOPT_DISABLED`] uses).
fn glob(pattern: &str, s: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == s,
        Some((head, rest)) => {
            s.starts_with(head)
                && (0..=s.len() - head.len())
                    .filter(|&i| s.is_char_boundary(head.len() + i))
                    .any(|i| glob(rest, &s[head.len() + i..]))
        }
    }
}

/// Linears that read the same input and are fused into one by vLLM and SGLang (`qkv_proj`,
/// `gate_up_proj`, the experts' `w13`, DeepSeek MLA's `fused_qkv_a_proj`): as HF weight-name
/// suffixes, each after a `.`. Their NVFP4 tensor scales are one value, the fused weight's (vLLM
/// `compressed_tensors_w4a16_nvfp4.py` takes one `weight_global_scale` of the fused layer, its MoE
/// method warns when w1's and w3's differ). llm-compressor 0.14.0.1 fuses only the first set,
/// `mlp.gate_proj`/`mlp.up_proj` of a dense MLP, `w1`/`w3`, and MLA under DeepSeek's own names
/// (`wq_a`, `wkv_a_with_mqa`; `entrypoints/model_free/microscale.py`): the experts' and shared
/// experts' gate/up and HF's `q_a_proj`/`kv_a_proj_with_mqa` are groups here and not there.
const SCALE_GROUPS: &[&[&str]] = &[
    &[
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ],
    &["gate_proj.weight", "up_proj.weight"],
    &["w1.weight", "w3.weight"],
    &[
        "self_attn.q_a_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    ],
];

/// The scale group of HF weight `name` ([`SCALE_GROUPS`]): the names that share its NVFP4 tensor
/// scale share this key (their common prefix and the group). None for a weight in no group.
pub(crate) fn scale_group(name: &str) -> Option<String> {
    SCALE_GROUPS.iter().enumerate().find_map(|(k, members)| {
        members.iter().find_map(|m| {
            name.strip_suffix(m)
                .filter(|p| p.is_empty() || p.ends_with('.'))
                .map(|p| format!("{p}#{k}"))
        })
    })
}

/// HF weights that block-FP8 releases keep in high precision although they are 2-D linear
/// weights: the embedding and output head (`lm_head`, DeepSeek-V3's MTP `shared_head.head`), the
/// MoE routers (`mlp.gate`, mixtral's and minimax_m2's `block_sparse_moe.gate`, gpt_oss's
/// `mlp.router`), the shared expert's gate and the Gated DeltaNet's small `in_proj_ba` (Qwen3.5:
/// `in_proj_a`, `in_proj_b`), the MTP module's input projection (Qwen's `mtp.fc`, DeepSeek-V3's
/// `eh_proj`) and the DSA indexer's head weights (`weights_proj`). Sources:
/// Qwen3-Next-80B-A3B-Instruct-FP8 config.json `modules_to_not_convert` (lm_head, every
/// `mlp.gate`, `mlp.shared_expert_gate`, `linear_attn.in_proj_ba`, `mtp.fc`, norms, conv1d,
/// A_log, dt_bias); DeepSeek-V3 (its README_WEIGHTS.md: 128x128 blocks, float32
/// `weight_scale_inv`; the router `mlp.gate` and `lm_head` are not linear layers its FP8 kernels
/// run, and vLLM's `deepseek_mtp.py` builds `eh_proj` as a plain `nn.Linear` that cannot hold FP8).
const FP8_KEPT_SUFFIXES: &[&str] = &[
    "embed_tokens.weight",
    "lm_head.weight",
    "shared_head.head.weight",
    ".gate.weight",
    ".router.weight",
    "shared_expert_gate.weight",
    "linear_attn.in_proj_ba.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_b.weight",
    "mtp.fc.weight",
    ".eh_proj.weight",
    "indexer.weights_proj.weight",
];

/// gpt-oss's quantized tensors: the experts' fused projections (openai/gpt-oss-20b and -120b:
/// `mlp.experts.gate_up_proj_blocks` / `_scales`, `mlp.experts.down_proj_blocks` / `_scales`; their
/// biases stay bf16).
const MXFP4_QUANTIZED_SUFFIXES: &[&str] = &["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// Whether HF tensor `name` of `shape` is written quantized under `scheme`: for block FP8 every
/// 2-D `.weight` but those of [`FP8_KEPT_SUFFIXES`] (1-D norms, biases, `A_log`, `dt_bias`,
/// expert biases and the 3-D `conv1d` stay in the output dtype, as do gpt_oss's 3-D fused
/// experts); for NVFP4 and MXFP8 those but the ones ModelOpt keeps too ([`MODELOPT_DISABLED`]; the
/// caller keeps DeepSeek's MTP layers, see [`Scheme::keeps_mtp`]); for MXFP4 gpt_oss's fused
/// experts ([`MXFP4_QUANTIZED_SUFFIXES`]).
pub(crate) fn quantizes(scheme: Scheme, name: &str, shape: &[u64]) -> bool {
    let fp8 = shape.len() == 2
        && name.ends_with(".weight")
        && !FP8_KEPT_SUFFIXES.iter().any(|k| name.ends_with(k));
    match scheme {
        Scheme::Fp8Block(_) => fp8,
        Scheme::Nvfp4(_) | Scheme::Mxfp8 => {
            let quantizer = format!("{}.weight_quantizer", name.trim_end_matches(".weight"));
            fp8 && !MODELOPT_DISABLED.iter().any(|p| glob(p, &quantizer))
        }
        Scheme::Mxfp4 => {
            shape.len() == 3 && MXFP4_QUANTIZED_SUFFIXES.iter().any(|k| name.ends_with(k))
        }
    }
}

/// The `model_type`s with an MXFP4 release whose layout `--quantize mxfp4` writes.
pub(crate) const MXFP4_MODEL_TYPES: &[&str] = &["gpt_oss"];

/// The safetensors tensors that HF tensor `name` (`shape`, the transformers parameter's) is stored
/// as under `scheme`, in file order: (name, dtype, shape).
/// - Block FP8: `name` as e4m3fn codes of `shape`, then `name` + `_scale_inv`, float32
///   ([`fp8_scale_shape`]).
/// - MXFP4: the parameter `[.., rows, cols]` is gpt-oss's `[E, in, out]`, stored transposed:
///   `name_blocks` `[.., cols, rows/32, 16]` then `name_scales` `[.., cols, rows/32]`, both uint8.
/// - NVFP4 (`[rows, cols]`, see [`nvfp4`]): compressed-tensors `name_packed` uint8 `[rows, cols/2]`,
///   `name_scale` e4m3fn `[rows, cols/16]`, `name_global_scale` float32 `[1]`; ModelOpt `name`
///   uint8 `[rows, cols/2]`, `name_scale` e4m3fn `[rows, cols/16]`, `name_scale_2` float32 `[]`.
/// - MXFP8 (see [`mxfp8`]): `name` e4m3fn `[rows, cols]`, `name_scale` uint8 `[rows, cols/32]`.
pub(crate) fn stored(name: &str, shape: &[u64], scheme: Scheme) -> Vec<(String, DType, Vec<u64>)> {
    match scheme {
        Scheme::Fp8Block(block) => vec![
            (name.to_string(), DType::F8E4M3FN, shape.to_vec()),
            (
                format!("{name}{SCALE_INV_SUFFIX}"),
                DType::F32,
                fp8_scale_shape(shape, block),
            ),
        ],
        Scheme::Mxfp4 => {
            let t = transposed_shape(shape);
            let (lead, last) = t.split_at(t.len() - 1);
            let groups = last[0] / MXFP4_BLOCK;
            let blocks: Vec<u64> = lead
                .iter()
                .copied()
                .chain([groups, MXFP4_BLOCK / 2])
                .collect();
            let scales: Vec<u64> = lead.iter().copied().chain([groups]).collect();
            vec![
                (format!("{name}{MXFP4_BLOCKS_SUFFIX}"), DType::U8, blocks),
                (format!("{name}{MXFP4_SCALES_SUFFIX}"), DType::U8, scales),
            ]
        }
        Scheme::Nvfp4(layout) => {
            let (rows, cols) = (shape[0], shape[1]);
            let scales = vec![rows, cols / nvfp4::NVFP4_GROUP];
            match layout {
                Nvfp4Layout::CompressedTensors => vec![
                    (format!("{name}_packed"), DType::U8, vec![rows, cols / 2]),
                    (format!("{name}_scale"), DType::F8E4M3FN, scales),
                    (format!("{name}_global_scale"), DType::F32, vec![1]),
                ],
                Nvfp4Layout::ModelOpt => vec![
                    (name.to_string(), DType::U8, vec![rows, cols / 2]),
                    (format!("{name}_scale"), DType::F8E4M3FN, scales),
                    (format!("{name}_scale_2"), DType::F32, vec![]),
                ],
            }
        }
        Scheme::Mxfp8 => vec![
            (name.to_string(), DType::F8E4M3FN, shape.to_vec()),
            (
                format!("{name}_scale"),
                DType::U8,
                vec![shape[0], shape[1] / mxfp8::MXFP8_GROUP],
            ),
        ],
    }
}

/// `shape` with its last two dimensions swapped.
fn transposed_shape(shape: &[u64]) -> Vec<u64> {
    let mut t = shape.to_vec();
    let n = t.len();
    if n >= 2 {
        t.swap(n - 2, n - 1);
    }
    t
}

/// `x` (`shape`) with its last two dimensions swapped.
fn transpose_last2(x: &[f32], shape: &[u64]) -> Vec<f32> {
    let (mats, rows, cols) = matrices(shape);
    let mut out = vec![0f32; x.len()];
    for m in 0..mats {
        let base = m * rows * cols;
        for r in 0..rows {
            for c in 0..cols {
                out[base + c * rows + r] = x[base + r * cols + c];
            }
        }
    }
    out
}

/// Rounds float32 values to `dtype` (bfloat16 or float16, to nearest even, as torch's `.to`), in
/// place; float32 (or another dtype) leaves them as they are.
fn round_to(x: &mut [f32], dtype: DType) {
    match dtype {
        DType::BF16 => x
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        DType::F16 => x
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        _ => {}
    }
}

/// The values of an HF tensor as the quantizers read them (`values`: little-endian `dtype`,
/// float32, bfloat16 or float16): float32, rounded to `out` (the output dtype), in the same pass
/// that reads them, so that the quantization is that of the unquantized conversion's tensor.
///
/// Errors: [`Error::Validation`] naming `name` for another dtype.
pub(crate) fn prepared(name: &str, values: &[u8], dtype: DType, out: DType) -> Result<Vec<f32>> {
    let mut x = load_f32(values, dtype).map_err(|e| Error::Validation(format!("{name}: {e}")))?;
    round_to(&mut x, out);
    Ok(x)
}

/// The largest `|x|` of prepared values: a scale group's NVFP4 tensor scale is computed from the
/// largest of its members' ([`quantize_prepared`]'s `group_amax`).
pub(crate) fn amax(x: &[f32]) -> f32 {
    nvfp4::amax(x)
}

/// The bytes of the tensors [`stored`] lists for HF tensor `name` from its [`prepared`] values `x`
/// (`shape`, output dtype `out`), concatenated in that order: [`fp8_quantize_values`]'s codes then
/// its float32 scales (little-endian); [`mxfp4_quantize_values`]'s blocks then scales of the
/// transposed parameter; NVFP4's packed codes, scales and tensor scale, the last from
/// `group_amax` (the largest `|x|` of the tensor's scale group, [`amax`] of each member); MXFP8's
/// codes then scales.
///
/// Errors: those of the quantizers, naming `name`.
pub(crate) fn quantize_prepared(
    name: &str,
    scheme: Scheme,
    mut x: Vec<f32>,
    out: DType,
    shape: &[u64],
    group_amax: f32,
) -> Result<Vec<u8>> {
    let n = shape.iter().product::<u64>() as usize;
    let named = |e: Error| Error::Validation(format!("{name}: {e}"));
    if x.len() != n {
        return Err(named(Error::Validation(format!(
            "{} values for shape {shape:?}",
            x.len()
        ))));
    }
    match scheme {
        Scheme::Fp8Block(block) => {
            let ns = fp8_scale_shape(shape, block).iter().product::<u64>() as usize;
            let mut out = vec![0u8; n + 4 * ns];
            let mut scales = vec![0f32; ns];
            fp8_quantize_values(&x, shape, block, &mut out[..n], &mut scales).map_err(named)?;
            for (s, o) in scales.iter().zip(out[n..].chunks_exact_mut(4)) {
                o.copy_from_slice(&s.to_le_bytes());
            }
            Ok(out)
        }
        Scheme::Mxfp4 => {
            // transformers' quantize_to_mxfp4 quantizes the bfloat16 weight.
            round_to(&mut x, DType::BF16);
            let t = transpose_last2(&x, shape);
            let b = MXFP4_BLOCK as usize;
            let mut out = vec![0u8; n / 2 + n / b];
            let (blocks, scales) = out.split_at_mut(n / 2);
            mxfp4_quantize_values(&t, &transposed_shape(shape), blocks, scales).map_err(named)?;
            Ok(out)
        }
        Scheme::Nvfp4(layout) => {
            let g = nvfp4::NVFP4_GROUP as usize;
            let ts = nvfp4::tensor_scale(layout, group_amax, out);
            let mut bytes = vec![0u8; n / 2 + n / g + 4];
            let (packed, rest) = bytes.split_at_mut(n / 2);
            let (scales, tensor) = rest.split_at_mut(n / g);
            nvfp4::quantize(layout, &x, out, ts, packed, scales).map_err(named)?;
            tensor.copy_from_slice(&ts.to_le_bytes());
            Ok(bytes)
        }
        Scheme::Mxfp8 => {
            let g = mxfp8::MXFP8_GROUP as usize;
            let mut bytes = vec![0u8; n + n / g];
            let (codes, scales) = bytes.split_at_mut(n);
            mxfp8::quantize(&x, out, codes, scales).map_err(named)?;
            Ok(bytes)
        }
    }
}

// ---- e4m3fn ------------------------------------------------------------------------------------

/// `float8_e4m3fn` (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities, NaN
/// 0x7F/0xFF) as float32, every code.
static E4M3_TO_F32: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0usize;
    while c < 256 {
        let sign = ((c as u32) >> 7) << 31;
        let e = ((c >> 3) & 0xF) as u32;
        let m = (c & 7) as u32;
        let bits = if e == 0xF && m == 7 {
            0x7FC0_0000
        } else if e == 0 {
            if m == 0 {
                0
            } else {
                // m x 2^-9, normalised: leading bit p of m.
                let p = if m >= 4 {
                    2
                } else if m >= 2 {
                    1
                } else {
                    0
                };
                ((p + 127 - 9) << 23) | ((m - (1 << p)) << (23 - p))
            }
        } else {
            ((e + 127 - 7) << 23) | (m << 20)
        };
        t[c] = f32::from_bits(sign | bits);
        c += 1;
    }
    t
}

/// float32 to `float8_e4m3fn`, rounding to nearest even; magnitudes of 480 and more (and NaN)
/// give NaN (0x7F with the sign), as torch's `c10::Float8_e4m3fn` conversion
/// (`fp8e4m3fn_from_fp32_value`, c10/util/Float8_e4m3fn.h).
pub(crate) fn f32_to_e4m3(x: f32) -> u8 {
    const FP8_MAX: u32 = 1087 << 20; // 480.0
    const DENORM_MASK: u32 = 141 << 23; // 2^14: its ulp is e4m3's subnormal step 2^-9
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let mag = bits & 0x7FFF_FFFF;
    let code = if mag >= FP8_MAX {
        0x7F
    } else if mag < (121 << 23) {
        // Below 2^-6: the float addition rounds to a multiple of 2^-9 (to nearest even).
        (f32::from_bits(mag) + f32::from_bits(DENORM_MASK))
            .to_bits()
            .wrapping_sub(DENORM_MASK) as u8
    } else {
        let odd = (mag >> 20) & 1;
        ((mag
            .wrapping_add(((7u32).wrapping_sub(127) << 23).wrapping_add(0x7FFFF))
            .wrapping_add(odd))
            >> 20) as u8
    };
    code | sign
}

// ---- output dtypes -----------------------------------------------------------------------------

/// Where dequantized float32 values go: float32, or rounded once (to nearest even) to bfloat16 or
/// float16, as torch's `.to(dtype)` rounds.
trait Store {
    const SIZE: usize;
    fn put(v: f32, dst: &mut [u8]);
}
struct StoreF32;
struct StoreBf16;
struct StoreF16;
impl Store for StoreF32 {
    const SIZE: usize = 4;
    #[inline(always)]
    fn put(v: f32, dst: &mut [u8]) {
        dst.copy_from_slice(&v.to_le_bytes())
    }
}
impl Store for StoreBf16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn put(v: f32, dst: &mut [u8]) {
        dst.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes())
    }
}
impl Store for StoreF16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn put(v: f32, dst: &mut [u8]) {
        dst.copy_from_slice(&half::f16::from_f32(v).to_le_bytes())
    }
}

/// Reads little-endian float32, bfloat16 or float16 as float32 (exact).
fn load_f32(bytes: &[u8], dtype: DType) -> Result<Vec<f32>> {
    Ok(match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "{} values: float32, bfloat16 or float16 expected",
                other.torch_name()
            )))
        }
    })
}

/// An FP8 scale tensor (`weight_scale_inv`, float32 or bfloat16/float16) as float32.
///
/// Errors: [`Error::UnsupportedDtype`] naming `name` for another dtype.
pub(crate) fn scales_f32(name: &str, bytes: &[u8], dtype: DType) -> Result<Vec<f32>> {
    load_f32(bytes, dtype).map_err(|_| {
        Error::UnsupportedDtype(format!(
            "{name}: {} scales; float32, bfloat16 or float16 expected",
            dtype.torch_name()
        ))
    })
}

fn out_size(out: DType) -> Result<usize> {
    match out {
        DType::F32 => Ok(4),
        DType::BF16 | DType::F16 => Ok(2),
        other => Err(Error::UnsupportedDtype(format!(
            "dequantization to {}: float32, bfloat16 or float16 expected",
            other.torch_name()
        ))),
    }
}

/// `[.., rows, cols]` as (matrices, rows, cols); a 1-D shape is one row.
fn matrices(shape: &[u64]) -> (usize, usize, usize) {
    match shape {
        [] => (1, 1, 1),
        [c] => (1, 1, *c as usize),
        [lead @ .., r, c] => (
            lead.iter().product::<u64>() as usize,
            *r as usize,
            *c as usize,
        ),
    }
}

// ---- block FP8 ---------------------------------------------------------------------------------

/// The scale grid of a block-FP8 weight of shape `[.., rows, cols]`: `[.., ceil(rows/br),
/// ceil(cols/bc)]`.
pub(crate) fn fp8_scale_shape(shape: &[u64], block: [u64; 2]) -> Vec<u64> {
    let n = shape.len();
    let mut s = shape.to_vec();
    if n >= 2 {
        s[n - 2] = shape[n - 2].div_ceil(block[0]);
    }
    if n >= 1 {
        s[n - 1] = shape[n - 1].div_ceil(block[1]);
    }
    s
}

/// Dequantizes block-FP8 weight `name` (`weight`: e4m3fn codes of `shape` `[.., rows, cols]`;
/// `scale_inv`: its scale grid, [`fp8_scale_shape`]) into `dst` (`prod(shape)` values of `out`).
///
/// Errors: [`Error::Validation`] naming `name` when the sizes disagree (weight bytes, scales, or
/// `dst`); [`Error::UnsupportedDtype`] for an output dtype other than float32/bfloat16/float16.
pub(crate) fn fp8_dequantize(
    name: &str,
    weight: &[u8],
    shape: &[u64],
    scale_inv: &[f32],
    block: [u64; 2],
    out: DType,
    dst: &mut [u8],
) -> Result<()> {
    match out {
        DType::F32 => fp8_dequant_as::<StoreF32>(name, weight, shape, scale_inv, block, dst),
        DType::BF16 => fp8_dequant_as::<StoreBf16>(name, weight, shape, scale_inv, block, dst),
        DType::F16 => fp8_dequant_as::<StoreF16>(name, weight, shape, scale_inv, block, dst),
        other => out_size(other).map(|_| ()),
    }
}

fn fp8_dequant_as<S: Store>(
    name: &str,
    weight: &[u8],
    shape: &[u64],
    scale_inv: &[f32],
    block: [u64; 2],
    dst: &mut [u8],
) -> Result<()> {
    let n: u64 = shape.iter().product();
    let grid = fp8_scale_shape(shape, block);
    let ns: u64 = grid.iter().product();
    if weight.len() as u64 != n
        || scale_inv.len() as u64 != ns
        || dst.len() as u64 != n * S::SIZE as u64
    {
        return Err(Error::Validation(format!(
            "{name}: {} FP8 bytes and {} scales for shape {shape:?} (scale grid {grid:?}), {} output bytes",
            weight.len(),
            scale_inv.len(),
            dst.len()
        )));
    }
    let (mats, rows, cols) = matrices(shape);
    let (br, bc) = (block[0] as usize, block[1] as usize);
    let scols = cols.div_ceil(bc);
    let srows = rows.div_ceil(br);
    for m in 0..mats {
        for r in 0..rows {
            let row = (m * rows + r) * cols;
            let srow = &scale_inv[(m * srows + r / br) * scols..][..scols];
            let src = &weight[row..row + cols];
            let out = &mut dst[row * S::SIZE..(row + cols) * S::SIZE];
            for (b, &s) in srow.iter().enumerate() {
                let c0 = b * bc;
                let c1 = (c0 + bc).min(cols);
                for (q, o) in src[c0..c1]
                    .iter()
                    .zip(out[c0 * S::SIZE..c1 * S::SIZE].chunks_exact_mut(S::SIZE))
                {
                    S::put(E4M3_TO_F32[*q as usize] * s, o);
                }
            }
        }
    }
    Ok(())
}

/// Quantizes `x` (`shape` `[.., rows, cols]`) to block FP8: `weight` gets `prod(shape)` e4m3fn
/// codes, `scale_inv` the scale grid ([`fp8_scale_shape`]); the recipe is in the module docs.
///
/// Errors: [`Error::Validation`] for buffer sizes that do not fit `shape`.
fn fp8_quantize_values(
    x: &[f32],
    shape: &[u64],
    block: [u64; 2],
    weight: &mut [u8],
    scale_inv: &mut [f32],
) -> Result<()> {
    let n: u64 = shape.iter().product();
    let ns: u64 = fp8_scale_shape(shape, block).iter().product();
    if x.len() as u64 != n || weight.len() as u64 != n || scale_inv.len() as u64 != ns {
        return Err(Error::Validation(format!(
            "FP8 quantization of shape {shape:?}: {} values, {} output bytes, {} scales",
            x.len(),
            weight.len(),
            scale_inv.len()
        )));
    }
    let (mats, rows, cols) = matrices(shape);
    let (br, bc) = (block[0] as usize, block[1] as usize);
    let (srows, scols) = (rows.div_ceil(br), cols.div_ceil(bc));
    for m in 0..mats {
        for sr in 0..srows {
            let (r0, r1) = (sr * br, ((sr + 1) * br).min(rows));
            for sc in 0..scols {
                let (c0, c1) = (sc * bc, ((sc + 1) * bc).min(cols));
                let at = |r: usize| (m * rows + r) * cols;
                let mut amax = 0f32;
                for r in r0..r1 {
                    for v in &x[at(r) + c0..at(r) + c1] {
                        amax = amax.max(v.abs());
                    }
                }
                // DeepGEMM: `.amax(...).clamp(1e-4)` in float32; its `448.0 / x_amax` is torch's
                // `Tensor.__rtruediv__`, `x_amax.reciprocal() * 448`: two float32 roundings.
                let amax = amax.max(1e-4f32);
                let scale = (1.0 / amax) * E4M3_MAX;
                scale_inv[(m * srows + sr) * scols + sc] = amax / E4M3_MAX;
                for r in r0..r1 {
                    let (a, b) = (at(r) + c0, at(r) + c1);
                    for (w, v) in weight[a..b].iter_mut().zip(&x[a..b]) {
                        *w = f32_to_e4m3(v * scale);
                    }
                }
            }
        }
    }
    Ok(())
}

// ---- MXFP4 -------------------------------------------------------------------------------------

/// e2m1 codes as float32: sign bit 3, then exponent (2 bits, bias 1) and mantissa (1 bit).
const E2M1_TO_F32: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(s - 127)` as float32 for e8m0 byte `s` < 255 (s = 0: the subnormal 2^-127).
fn e8m0_to_f32(s: u8) -> f32 {
    if s == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((s as u32) << 23)
    }
}

/// The logical shape of an MXFP4 weight whose blocks tensor has shape `[.., G, 16]`: `[..,
/// G*32]`; None for a shape that is not that.
pub(crate) fn mxfp4_logical_shape(blocks_shape: &[u64]) -> Option<Vec<u64>> {
    match blocks_shape {
        [lead @ .., g, 16] => Some(lead.iter().copied().chain([g * MXFP4_BLOCK]).collect()),
        _ => None,
    }
}

/// Dequantizes MXFP4 weight `name` (`blocks` `[.., G, 16]`, `scales` `[.., G]`) into `dst`:
/// `[.., G*32]` values of `out` (not transposed, see the module docs).
///
/// Errors: [`Error::Validation`] naming `name` for sizes that disagree or a scale byte of 255
/// (NaN); [`Error::UnsupportedDtype`] for an output dtype other than float32/bfloat16/float16.
pub(crate) fn mxfp4_dequantize(
    name: &str,
    blocks: &[u8],
    scales: &[u8],
    out: DType,
    dst: &mut [u8],
) -> Result<()> {
    match out {
        DType::F32 => mxfp4_dequant_as::<StoreF32>(name, blocks, scales, dst),
        DType::BF16 => mxfp4_dequant_as::<StoreBf16>(name, blocks, scales, dst),
        DType::F16 => mxfp4_dequant_as::<StoreF16>(name, blocks, scales, dst),
        other => out_size(other).map(|_| ()),
    }
}

fn mxfp4_dequant_as<S: Store>(
    name: &str,
    blocks: &[u8],
    scales: &[u8],
    dst: &mut [u8],
) -> Result<()> {
    let half = (MXFP4_BLOCK / 2) as usize;
    if blocks.len() != scales.len() * half || dst.len() != blocks.len() * 2 * S::SIZE {
        return Err(Error::Validation(format!(
            "{name}: {} MXFP4 block bytes for {} scales ({half} per scale), {} output bytes",
            blocks.len(),
            scales.len(),
            dst.len()
        )));
    }
    if let Some(i) = scales.iter().position(|&s| s == 255) {
        return Err(Error::Validation(format!(
            "{name}: scale {i} is 255, NaN in the MX format (OCP Microscaling v1.0)"
        )));
    }
    let per_block = 2 * half * S::SIZE;
    for ((blk, &s), out) in blocks
        .chunks_exact(half)
        .zip(scales)
        .zip(dst.chunks_exact_mut(per_block))
    {
        let scale = e8m0_to_f32(s);
        for (b, o) in blk.iter().zip(out.chunks_exact_mut(2 * S::SIZE)) {
            let (lo, hi) = o.split_at_mut(S::SIZE);
            S::put(E2M1_TO_F32[(b & 0x0F) as usize] * scale, lo);
            S::put(E2M1_TO_F32[(b >> 4) as usize] * scale, hi);
        }
    }
    Ok(())
}

/// float32 to an e2m1 code as `downcast_to_mxfp_torch` computes it (its bit arithmetic, unsigned
/// shifts of 32 or more giving 0 as torch's `>>` on int32 does).
fn f32_to_e2m1(q: f32) -> u8 {
    let bits = q.to_bits();
    let sign = bits & 0x8000_0000;
    let exp = (bits >> 23) & 0xFF;
    let mut mant = bits & 0x7F_FFFF;
    const E8_BIAS: u32 = 127;
    const E2_BIAS: u32 = 1;
    if exp < E8_BIAS {
        let shift = E8_BIAS - exp - 1;
        mant = (0x40_0000 | (mant >> 1)).checked_shr(shift).unwrap_or(0);
    }
    let e = exp.max(E8_BIAS - E2_BIAS) - (E8_BIAS - E2_BIAS);
    let code = ((((e << 2) | (mant >> 21)) + 1) >> 1).min(0x7);
    ((sign >> 28) | code) as u8
}

/// Quantizes `x` (`shape` `[.., cols]`, `cols` a multiple of 32, values already rounded to
/// bfloat16 as transformers' `quantize_to_mxfp4` casts them) to MXFP4: `blocks` gets
/// `prod(shape) / 2` bytes (`[.., cols/32, 16]`), `scales` `prod(shape) / 32` e8m0 bytes.
///
/// Errors: [`Error::Validation`] for a last dimension that is not a multiple of 32 or buffers
/// that do not fit.
fn mxfp4_quantize_values(
    x: &[f32],
    shape: &[u64],
    blocks: &mut [u8],
    scales: &mut [u8],
) -> Result<()> {
    let b = MXFP4_BLOCK as usize;
    let n: u64 = shape.iter().product();
    if shape.last().is_none_or(|c| c % MXFP4_BLOCK != 0)
        || x.len() as u64 != n
        || blocks.len() * 2 != x.len()
        || scales.len() * b != x.len()
    {
        return Err(Error::Validation(format!(
            "MXFP4 quantization of shape {shape:?}: the last dimension must be a multiple of {b}; {} values, {} block bytes, {} scales",
            x.len(),
            blocks.len(),
            scales.len()
        )));
    }
    for ((xs, out), s) in x
        .chunks_exact(b)
        .zip(blocks.chunks_exact_mut(b / 2))
        .zip(scales.iter_mut())
    {
        let amax = xs.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = (amax / 6.0).to_bits();
        let rounded = d.wrapping_add(0x7F_FFFF) & 0x7F80_0000;
        *s = (rounded >> 23) as u8;
        let qs = if rounded == 0 {
            0.0
        } else {
            1.0 / f32::from_bits(rounded)
        };
        for (pair, o) in xs.chunks_exact(2).zip(out.iter_mut()) {
            *o = f32_to_e2m1(pair[0] * qs) | (f32_to_e2m1(pair[1] * qs) << 4);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quantizers over little-endian bytes of `src_dtype` (as the tests write their inputs).
    fn fp8_quantize(
        src: &[u8],
        src_dtype: DType,
        shape: &[u64],
        block: [u64; 2],
        weight: &mut [u8],
        scale_inv: &mut [f32],
    ) -> Result<()> {
        fp8_quantize_values(&load_f32(src, src_dtype)?, shape, block, weight, scale_inv)
    }

    fn mxfp4_quantize(
        src: &[u8],
        src_dtype: DType,
        shape: &[u64],
        blocks: &mut [u8],
        scales: &mut [u8],
    ) -> Result<()> {
        let mut x = load_f32(src, src_dtype)?;
        round_to(&mut x, DType::BF16);
        mxfp4_quantize_values(&x, shape, blocks, scales)
    }

    fn bf16_bytes(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn e4m3_codes() {
        // Hand-computed: 0x38 = 2^0, 0x7E = 1.75 x 2^8 = 448, 0x01 = 2^-9, 0x07 = 7 x 2^-9,
        // 0x08 = 2^-6 (smallest normal), 0xC4 = -1.5 x 2^1.
        assert_eq!(E4M3_TO_F32[0x38], 1.0);
        assert_eq!(E4M3_TO_F32[0x7E], 448.0);
        assert_eq!(E4M3_TO_F32[0x01], 2f32.powi(-9));
        assert_eq!(E4M3_TO_F32[0x07], 7.0 * 2f32.powi(-9));
        assert_eq!(E4M3_TO_F32[0x08], 2f32.powi(-6));
        assert_eq!(E4M3_TO_F32[0xC4], -3.0);
        assert!(E4M3_TO_F32[0x7F].is_nan() && E4M3_TO_F32[0xFF].is_nan());
        // Every finite code converts back to itself.
        for c in 0..=255u8 {
            if c & 0x7F != 0x7F {
                assert_eq!(f32_to_e4m3(E4M3_TO_F32[c as usize]), c, "code {c:#x}");
            }
        }
        // Rounding to nearest even: 1 + 2^-4 is halfway between 1 (0x38, even) and 1.125 (0x39).
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A); // halfway 1.125/1.25: to 1.25 (even)
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 0x02); // subnormal halfway: to 2 x 2^-9
        assert_eq!(f32_to_e4m3(464.0), 0x7E); // below 480 rounds to 448
        assert_eq!(f32_to_e4m3(480.0), 0x7F);
        assert_eq!(f32_to_e4m3(-2.0), 0xC0);
    }

    #[test]
    fn fp8_dequantizes_per_block_with_partial_edges() {
        // A [3, 5] weight in [2, 2] blocks: grid [2, 3]; the last row and column are partial.
        let shape = [3u64, 5];
        let block = [2u64, 2];
        assert_eq!(fp8_scale_shape(&shape, block), vec![2, 3]);
        let w: Vec<u8> = vec![0x38; 15]; // every code 1.0
        let s = [1.0f32, 2.0, 4.0, 0.5, 0.25, 8.0];
        let mut out = vec![0u8; 15 * 4];
        fp8_dequantize("w", &w, &shape, &s, block, DType::F32, &mut out).unwrap();
        #[rustfmt::skip]
        let want = [
            1.0, 1.0, 2.0, 2.0, 4.0,
            1.0, 1.0, 2.0, 2.0, 4.0,
            0.5, 0.5, 0.25, 0.25, 8.0,
        ];
        assert_eq!(f32s(&out), want);
        // bf16: 1.5 (0x3C) x 1.0078125 = 1.51171875 is exact in f32 and rounds to even in bf16
        // (1.51171875 = 0x3FC18000 -> 0x3FC2 = 1.515625).
        let mut out = vec![0u8; 2];
        fp8_dequantize(
            "w",
            &[0x3C],
            &[1, 1],
            &[1.0078125],
            [128, 128],
            DType::BF16,
            &mut out,
        )
        .unwrap();
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3FC2);
        // Sizes that disagree are refused with the name.
        let e = fp8_dequantize(
            "m.w",
            &w,
            &shape,
            &s[..5],
            block,
            DType::F32,
            &mut vec![0; 60],
        );
        assert!(e.unwrap_err().to_string().contains("m.w"));
    }

    #[test]
    fn fp8_quantizes_like_deepgemm() {
        // One [2, 3] block with amax 2: scale 448/2 = 224, scale_inv 2/448.
        let x = [1.0f32, -2.0, 0.5, 0.0, 0.25, 2.0];
        let (mut w, mut s) = (vec![0u8; 6], vec![0f32; 1]);
        fp8_quantize(
            &bf16_bytes(&x),
            DType::BF16,
            &[2, 3],
            [128, 128],
            &mut w,
            &mut s,
        )
        .unwrap();
        assert_eq!(s[0], 2.0 / 448.0);
        // 224 = 0x76 (1.75 x 2^7), -448 = 0xFE, 112 = 0x6E, 0, 56 = 0x66, 448 = 0x7E.
        assert_eq!(w, vec![0x76, 0xFE, 0x6E, 0x00, 0x66, 0x7E]);
        // An all-zero block takes amax 1e-4 (DeepGEMM's clamp).
        let (mut w, mut s) = (vec![1u8; 2], vec![0f32; 1]);
        fp8_quantize(
            &bf16_bytes(&[0.0, 0.0]),
            DType::BF16,
            &[1, 2],
            [128, 128],
            &mut w,
            &mut s,
        )
        .unwrap();
        assert_eq!((w, s[0]), (vec![0, 0], 1e-4f32 / 448.0));
        // Round trip of a [3, 5] tensor in [2, 2] blocks: every value within its block's step.
        let x: Vec<f32> = (0..15).map(|i| (i as f32 - 7.0) * 0.37).collect();
        let (mut w, mut s) = (vec![0u8; 15], vec![0f32; 6]);
        fp8_quantize(
            &bf16_bytes(&x),
            DType::BF16,
            &[3, 5],
            [2, 2],
            &mut w,
            &mut s,
        )
        .unwrap();
        let mut back = vec![0u8; 60];
        fp8_dequantize("x", &w, &[3, 5], &s, [2, 2], DType::F32, &mut back).unwrap();
        for (a, b) in f32s(&back).iter().zip(&x) {
            assert!(
                (a - half::bf16::from_f32(*b).to_f32()).abs() <= 0.07 * b.abs() + 1e-6,
                "{a} {b}"
            );
        }
    }

    #[test]
    fn mxfp4_dequantizes_low_nibble_first() {
        // One block of 32: byte 0x71 is (1 -> 0.5, 7 -> 6.0); scale 128 is 2^1.
        let mut blocks = vec![0u8; 16];
        blocks[0] = 0x71;
        blocks[15] = 0xF8; // (8 -> -0.0, 15 -> -6.0)
        let mut out = vec![0u8; 32 * 4];
        mxfp4_dequantize("b", &blocks, &[128], DType::F32, &mut out).unwrap();
        let v = f32s(&out);
        assert_eq!((v[0], v[1], v[2]), (1.0, 12.0, 0.0));
        assert_eq!(v[30].to_bits(), (-0.0f32).to_bits());
        assert_eq!(v[31], -12.0);
        // Scale 0 is 2^-127 (subnormal, exact); 255 is NaN and refused.
        mxfp4_dequantize("b", &blocks, &[0], DType::F32, &mut out).unwrap();
        assert_eq!(f32s(&out)[1], 6.0 * 2f32.powi(-127));
        let e = mxfp4_dequantize("x.gate_up_proj", &blocks, &[255], DType::F32, &mut out);
        assert!(e.unwrap_err().to_string().contains("x.gate_up_proj"));
        assert_eq!(mxfp4_logical_shape(&[2, 5, 3, 16]), Some(vec![2, 5, 96]));
        assert_eq!(mxfp4_logical_shape(&[2, 5, 3, 8]), None);
    }

    #[test]
    fn mxfp4_quantizes_like_downcast_to_mxfp_torch() {
        // amax 3: d = 0.5 exactly (scale byte 126), x/d = 2x: 1.25 -> 2.5 is halfway between 2 and
        // 3 and rounds up (the function's +1 >> 1), 0.6 -> 1.2 truncates to 1.0, 3 -> 6.
        let mut x = vec![0f32; 32];
        (x[0], x[1], x[2], x[3]) = (1.25, 0.6, -3.0, 0.1);
        let (mut b, mut s) = (vec![0u8; 16], vec![0u8; 1]);
        mxfp4_quantize(&bf16_bytes(&x), DType::BF16, &[32], &mut b, &mut s).unwrap();
        assert_eq!(s[0], 126);
        // 2.5 -> code 5 (3.0); 1.2 -> code 2 (1.0); -6 -> 0xF; 0.2 -> code 0 (below 0.25).
        assert_eq!(b[0], 0x25);
        assert_eq!(b[1], 0x0F);
        // amax 0: scale byte 0, every code 0.
        mxfp4_quantize(&bf16_bytes(&[0.0; 32]), DType::BF16, &[32], &mut b, &mut s).unwrap();
        assert_eq!((s[0], b.iter().all(|&c| c == 0)), (0, true));
        assert!(mxfp4_quantize(
            &bf16_bytes(&[0.0; 16]),
            DType::BF16,
            &[16],
            &mut b[..8],
            &mut s
        )
        .is_err());
    }

    #[test]
    fn what_is_quantized_and_how_it_is_stored() {
        let fp8 = Scheme::from_user(Quantize::Fp8Block, None).unwrap();
        for kept in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.mlp.router.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.linear_attn.in_proj_ba.weight",
            "model.layers.0.linear_attn.in_proj_a.weight",
            "mtp.fc.weight",
            "model.layers.3.eh_proj.weight",
            "model.layers.3.shared_head.head.weight",
        ] {
            assert!(!quantizes(fp8, kept, &[8, 8]), "{kept}");
        }
        for q in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.experts.3.gate_proj.weight",
            "model.layers.0.mlp.shared_expert.down_proj.weight",
            "model.layers.0.linear_attn.in_proj_qkvz.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "mtp.layers.0.self_attn.o_proj.weight",
        ] {
            assert!(quantizes(fp8, q, &[8, 8]), "{q}");
        }
        // Norms, biases, conv1d and gpt_oss's 3-D experts are not 2-D weights.
        assert!(!quantizes(
            fp8,
            "model.layers.0.input_layernorm.weight",
            &[8]
        ));
        assert!(!quantizes(
            fp8,
            "model.layers.0.linear_attn.conv1d.weight",
            &[8, 1, 4]
        ));
        assert!(!quantizes(
            fp8,
            "model.layers.0.self_attn.q_proj.bias",
            &[8, 8]
        ));
        assert!(quantizes(
            Scheme::Mxfp4,
            "model.layers.0.mlp.experts.gate_up_proj",
            &[4, 64, 64]
        ));
        assert!(!quantizes(
            Scheme::Mxfp4,
            "model.layers.0.mlp.experts.gate_up_proj_bias",
            &[4, 64]
        ));
        assert!(!quantizes(
            Scheme::Mxfp4,
            "model.layers.0.self_attn.q_proj.weight",
            &[8, 8]
        ));
        assert!("int4".parse::<Quantize>().is_err());
        // FP8: codes then the scale grid; MXFP4: the transposed parameter's blocks and scales.
        assert_eq!(
            stored("w.weight", &[300, 129], fp8),
            vec![
                ("w.weight".to_string(), DType::F8E4M3FN, vec![300, 129]),
                ("w.weight_scale_inv".to_string(), DType::F32, vec![3, 2]),
            ]
        );
        assert_eq!(
            stored("e.down_proj", &[4, 32, 64], Scheme::Mxfp4),
            vec![
                (
                    "e.down_proj_blocks".to_string(),
                    DType::U8,
                    vec![4, 64, 1, 16]
                ),
                ("e.down_proj_scales".to_string(), DType::U8, vec![4, 64, 1]),
            ]
        );
        // The bytes are the stored tensors' in order: a [2, 3] FP8 weight, then its one f32 scale.
        let x = [1.0f32, -2.0, 0.5, 0.0, 0.25, 2.0];
        let bytes = quantize("w", fp8, &bf16_bytes(&x), DType::BF16, DType::BF16, &[2, 3]).unwrap();
        assert_eq!(&bytes[..6], &[0x76, 0xFE, 0x6E, 0x00, 0x66, 0x7E]);
        assert_eq!(f32s(&bytes[6..]), vec![2.0 / 448.0]);
        // MXFP4 quantizes the transposed [.., 2, 32] of a [.., 32, 2] parameter: column 1 is all 3s.
        let p: Vec<f32> = (0..64)
            .map(|i| if i % 2 == 1 { 3.0 } else { 0.0 })
            .collect();
        let bytes = quantize(
            "e",
            Scheme::Mxfp4,
            &bf16_bytes(&p),
            DType::BF16,
            DType::BF16,
            &[1, 32, 2],
        )
        .unwrap();
        assert_eq!(bytes.len(), 32 + 2);
        assert!(bytes[..16].iter().all(|&b| b == 0) && bytes[16..32].iter().all(|&b| b == 0x77));
        assert_eq!(&bytes[32..], &[0, 126]); // amax 3: 3 / 6 = 2^-1
    }

    /// [`quantize_prepared`] of a tensor quantized alone, from its stored bytes.
    fn quantize(
        name: &str,
        scheme: Scheme,
        values: &[u8],
        dtype: DType,
        out: DType,
        shape: &[u64],
    ) -> Result<Vec<u8>> {
        let x = prepared(name, values, dtype, out)?;
        let a = amax(&x);
        quantize_prepared(name, scheme, x, out, shape, a)
    }

    #[test]
    fn quantization_configs() {
        let c = json!({"quantization_config": fp8_block_config(&[])});
        assert_eq!(scheme(&c).unwrap(), Some(Scheme::Fp8Block([128, 128])));
        assert!(c["quantization_config"]
            .get("modules_to_not_convert")
            .is_none());
        let c = json!({"quantization_config": mxfp4_config(GPT_OSS_NOT_CONVERTED)});
        assert_eq!(scheme(&c).unwrap(), Some(Scheme::Mxfp4));
        assert_eq!(scheme(&json!({})).unwrap(), None);
        for bad in [
            json!({"quant_method": "awq"}),
            json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            json!({"quant_method": "fp8"}),
            json!({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}),
        ] {
            assert!(
                scheme(&json!({"quantization_config": bad})).is_err(),
                "{bad}"
            );
        }
        let kept = [
            "model.embed_tokens.weight",
            "model.layers.10.input_layernorm.weight",
            "model.layers.2.mlp.gate.weight",
            "model.layers.2.input_layernorm.weight",
            "lm_head.weight",
            "model.norm.weight",
            "mtp.fc.weight",
        ];
        assert_eq!(
            fp8_modules_to_not_convert(kept),
            [
                "lm_head",
                "model.layers.2.input_layernorm",
                "model.layers.2.mlp.gate",
                "model.layers.10.input_layernorm",
                "mtp.fc"
            ]
        );
    }
}
