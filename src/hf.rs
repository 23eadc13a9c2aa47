//! `shardwise to-hf`: streaming conversion of a torch_dist / DCP checkpoint to Hugging Face
//! safetensors, from the files alone. Each HF tensor is read from only the chunk byte ranges it
//! needs, converted, and written at its precomputed offset by one of `threads` workers, so peak
//! memory is about `threads x largest HF tensor` whatever the model size.
//!
//! Name mapping: megatron-torch-dist.md §2.7 (checkpoint keys: layer-stacked
//! `decoder.layers.<sub>` with a leading layer axis, or `decoder.layers.{i}.<sub>`; experts with an
//! expert axis on `.experts.experts.`) and §4.3 (HF names and transforms: QKV split per query
//! group, SwiGLU `[gate; up]` split, vocabulary padding trimmed). Output files: safetensors
//! (`safetensors` crate header format) sharded as `model-0000k-of-0000n.safetensors` with
//! `model.safetensors.index.json`, as `transformers` writes them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::format::archive::records;
use crate::format::dtype::DType;
use crate::format::metadata::Entry;
use crate::format::unpickle::{unpickle, Value};
use crate::reader::Checkpoint;
use crate::storage::{atomic_write, create_dir_all, DataFile, Location};

/// Architectures with a mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Mixtral,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Arch> {
        Ok(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "mixtral" => Arch::Mixtral,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unsupported architecture {other:?}: shardwise maps llama, qwen2, qwen3, qwen3_moe and mixtral"
                )))
            }
        })
    }
    fn moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Mixtral)
    }
}

/// Options of a conversion.
#[derive(Clone, Debug)]
pub struct HfOptions {
    /// An HF `config.json`: the source of hyperparameters (checked against `common.pt` `args` when
    /// both exist) and copied to the output.
    pub config: Option<PathBuf>,
    /// Overrides the config's `model_type`.
    pub arch: Option<String>,
    /// Output dtype (float32, bfloat16 or float16); default: the checkpoint's.
    pub dtype: Option<DType>,
    /// Largest shard file, in bytes.
    pub max_shard_bytes: u64,
    /// Worker threads (each holds at most one HF tensor in memory).
    pub threads: usize,
    /// Skip checkpoint keys that no rule maps instead of failing.
    pub allow_unmapped: bool,
}

impl HfOptions {
    /// Options from user-facing values: `dtype` as bf16/fp16/fp32, `max_shard_size` like "5GB",
    /// `threads` defaulting to the number of CPUs.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad dtype or size.
    pub fn from_user(
        config: Option<PathBuf>,
        arch: Option<String>,
        dtype: Option<&str>,
        max_shard_size: &str,
        threads: Option<usize>,
        allow_unmapped: bool,
    ) -> Result<HfOptions> {
        let dtype = match dtype {
            None => None,
            Some("bf16" | "bfloat16") => Some(DType::BF16),
            Some("fp16" | "float16") => Some(DType::F16),
            Some("fp32" | "float32") => Some(DType::F32),
            Some(other) => {
                return Err(Error::InvalidArgument(format!(
                    "dtype {other:?}: use bf16, fp16 or fp32"
                )))
            }
        };
        Ok(HfOptions {
            config,
            arch,
            dtype,
            max_shard_bytes: parse_size(max_shard_size)?,
            threads: threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get())),
            allow_unmapped,
        })
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug, Serialize)]
pub struct HfSummary {
    pub tensors: usize,
    pub bytes: u64,
    pub files: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
    pub skipped_keys: usize,
}

/// Model dimensions the mapping needs.
#[derive(Clone, Debug, PartialEq)]
struct Dims {
    arch: Arch,
    num_layers: u64,
    hidden: u64,
    heads: u64,
    groups: u64,
    head_dim: u64,
    vocab_size: Option<u64>,
    tied: bool,
    num_experts: u64,
}

fn cfg_u64(cfg: &serde_json::Value, key: &str) -> Option<u64> {
    cfg.get(key).and_then(|v| v.as_u64())
}

fn dims_from_config(cfg: &serde_json::Value, arch: Option<&str>) -> Result<Dims> {
    let need = |k: &str| {
        cfg_u64(cfg, k)
            .ok_or_else(|| Error::InvalidArgument(format!("config.json has no integer {k:?}")))
    };
    let arch = Arch::parse(
        arch.or_else(|| cfg.get("model_type").and_then(|v| v.as_str()))
            .unwrap_or(""),
    )?;
    let heads = need("num_attention_heads")?;
    let hidden = need("hidden_size")?;
    Ok(Dims {
        arch,
        num_layers: need("num_hidden_layers")?,
        hidden,
        heads,
        groups: cfg_u64(cfg, "num_key_value_heads").unwrap_or(heads),
        head_dim: cfg_u64(cfg, "head_dim").unwrap_or(hidden / heads.max(1)),
        vocab_size: cfg_u64(cfg, "vocab_size"),
        tied: cfg
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        num_experts: cfg_u64(cfg, "num_experts")
            .or_else(|| cfg_u64(cfg, "num_local_experts"))
            .unwrap_or(0),
    })
}

/// Megatron's `args` (an `argparse.Namespace`) from the common state (`common.pt`, or the
/// `common_state` object of megatron-core 0.19), read as data: name → int/bool.
///
/// Errors: [`Error::Corrupt`] for a damaged common state (zip CRCs are checked by the reader).
fn megatron_args(ckpt: &Checkpoint) -> Result<Option<HashMap<String, i128>>> {
    let Some(common) = ckpt.read_common()? else {
        return Ok(None);
    };
    let bytes = common.bytes;
    let path = ckpt.dir().join(&common.source);
    let corrupt = |r: String| Error::Corrupt {
        path: path.clone(),
        reason: r,
    };
    let recs = records(&bytes).map_err(|e| corrupt(e.0))?;
    let Some(pkl) = recs.iter().find(|r| r.name.ends_with("data.pkl")) else {
        return Ok(None);
    };
    let top = unpickle(&bytes[pkl.start..pkl.start + pkl.len]).map_err(|e| corrupt(e.0))?;
    let Some(args) = top.get("args") else {
        return Ok(None);
    };
    let state = match &args {
        Value::Object(o) => o.state.borrow().clone(),
        _ => None,
    };
    let Some(Value::Dict(d)) = state.as_ref() else {
        return Ok(None);
    };
    let out = d
        .borrow()
        .iter()
        .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v.as_int()?)))
        .collect();
    Ok(Some(out))
}

/// Disagreements between the HF config and Megatron's args.
fn check_args(d: &Dims, args: &HashMap<String, i128>) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmp = |name: &str, ours: u64, key: &str| {
        if let Some(&v) = args.get(key) {
            if v != ours as i128 {
                out.push(format!(
                    "{name}: config.json says {ours}, common.pt args.{key} says {v}"
                ));
            }
        }
    };
    cmp("num_hidden_layers", d.num_layers, "num_layers");
    cmp("hidden_size", d.hidden, "hidden_size");
    cmp("num_attention_heads", d.heads, "num_attention_heads");
    if args.get("group_query_attention").is_some_and(|&g| g != 0) {
        cmp("num_key_value_heads", d.groups, "num_query_groups");
    }
    if args.contains_key("kv_channels") {
        cmp("head_dim", d.head_dim, "kv_channels");
    }
    if d.num_experts > 0 {
        cmp("num_experts", d.num_experts, "num_experts");
    }
    out
}

fn dims_from_args(args: &HashMap<String, i128>, arch: Option<&str>) -> Result<Dims> {
    let get = |k: &str| args.get(k).and_then(|&v| u64::try_from(v).ok());
    let need = |k: &str| {
        get(k).ok_or_else(|| {
            Error::InvalidArgument(format!("common.pt args has no {k}; pass --hf-config"))
        })
    };
    let arch = Arch::parse(arch.ok_or_else(|| {
        Error::InvalidArgument("without --hf-config, --arch is required".into())
    })?)?;
    let heads = need("num_attention_heads")?;
    let hidden = need("hidden_size")?;
    Ok(Dims {
        arch,
        num_layers: need("num_layers")?,
        hidden,
        heads,
        groups: if get("group_query_attention").unwrap_or(0) != 0 {
            need("num_query_groups")?
        } else {
            heads
        },
        head_dim: get("kv_channels").unwrap_or(hidden / heads.max(1)),
        vocab_size: None,
        tied: get("untie_embeddings_and_output_weights").unwrap_or(1) == 0,
        num_experts: get("num_experts").unwrap_or(0),
    })
}

/// A box of a checkpoint tensor (global offsets and sizes, in elements).
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub key: String,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// One HF tensor: the concatenation of its pieces (C order), reshaped to `shape`.
#[derive(Clone, Debug)]
pub(crate) struct HfTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub src_dtype: DType,
    pub pieces: Vec<Piece>,
}

/// The HF tensors a checkpoint converts to, in output order, and how many checkpoint keys the
/// mapping skips (optimizer state, extra state, objects, and unmapped keys when allowed).
pub(crate) struct Plan {
    pub tensors: Vec<HfTensor>,
    pub skipped: usize,
}

enum Mapped {
    Tensors(Vec<HfTensor>),
    Skip,
    Unmapped,
}

/// Where a per-layer key's sub-name sits in the checkpoint: the layer index (fixed) or the layer
/// axis (stacked), and whether an expert axis follows.
struct Site<'a> {
    key: &'a str,
    shape: &'a [u64],
    dtype: DType,
    /// Index of the layer axis when layer-stacked.
    stacked: bool,
}

fn skip_key(key: &str) -> bool {
    key.contains("_extra_state")
        || key.starts_with("optimizer.")
        || key.starts_with("rng_state")
        || key.starts_with("rerun_state_machine_state")
        || key.starts_with("common_state")
        || key.starts_with("content_metadata")
}

impl Dims {
    fn layer_prefix(&self, l: u64) -> String {
        format!("model.layers.{l}.")
    }

    /// Maps one checkpoint tensor key.
    fn map(&self, key: &str, shape: &[u64], dtype: DType) -> Result<Mapped> {
        if skip_key(key) {
            return Ok(Mapped::Skip);
        }
        let whole = |name: &str| HfTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            src_dtype: dtype,
            pieces: vec![Piece {
                key: key.to_string(),
                offsets: vec![0; shape.len()],
                sizes: shape.to_vec(),
            }],
        };
        match key {
            "embedding.word_embeddings.weight" | "output_layer.weight" => {
                let rows = self.vocab_size.unwrap_or(shape[0]).min(shape[0]);
                if shape.len() != 2 || shape[1] != self.hidden {
                    return Err(Error::Validation(format!(
                        "{key} has shape {shape:?}; hidden_size is {}",
                        self.hidden
                    )));
                }
                if self.vocab_size.is_some_and(|v| v > shape[0]) {
                    return Err(Error::Validation(format!(
                        "{key} has {} rows, fewer than vocab_size {}",
                        shape[0],
                        self.vocab_size.unwrap()
                    )));
                }
                let name = if key.starts_with("embedding") {
                    "model.embed_tokens.weight"
                } else {
                    "lm_head.weight"
                };
                let t = HfTensor {
                    name: name.into(),
                    shape: vec![rows, shape[1]],
                    src_dtype: dtype,
                    pieces: vec![Piece {
                        key: key.into(),
                        offsets: vec![0, 0],
                        sizes: vec![rows, shape[1]],
                    }],
                };
                return Ok(Mapped::Tensors(vec![t]));
            }
            "decoder.final_layernorm.weight" => {
                return Ok(Mapped::Tensors(vec![whole("model.norm.weight")]))
            }
            _ => {}
        }
        let Some(rest) = key.strip_prefix("decoder.layers.") else {
            return Ok(Mapped::Unmapped);
        };
        // `decoder.layers.{i}.sub` (one layer) or `decoder.layers.sub` (layer axis first).
        let (layers, sub, site) = match rest.split_once('.') {
            Some((i, sub)) if i.bytes().all(|b| b.is_ascii_digit()) && !i.is_empty() => {
                let l: u64 = i
                    .parse()
                    .map_err(|_| Error::Validation(format!("{key}: bad layer index")))?;
                (
                    vec![Some(l)],
                    sub,
                    Site {
                        key,
                        shape,
                        dtype,
                        stacked: false,
                    },
                )
            }
            _ => {
                if shape.is_empty() {
                    return Ok(Mapped::Unmapped);
                }
                (
                    (0..shape[0]).map(Some).collect(),
                    rest,
                    Site {
                        key,
                        shape,
                        dtype,
                        stacked: true,
                    },
                )
            }
        };
        let mut out = Vec::new();
        for l in layers.into_iter().flatten() {
            match self.map_layer(l, sub, &site)? {
                Some(mut v) => out.append(&mut v),
                None => return Ok(Mapped::Unmapped),
            }
        }
        Ok(Mapped::Tensors(out))
    }

    /// HF tensors of layer `l` from the checkpoint tensor at `site`; None when no rule matches.
    fn map_layer(&self, l: u64, sub: &str, site: &Site) -> Result<Option<Vec<HfTensor>>> {
        let p = self.layer_prefix(l);
        // The layer's box: leading layer axis fixed to l when stacked.
        let lead: (Vec<u64>, Vec<u64>) = if site.stacked {
            (vec![l], vec![1])
        } else {
            (vec![], vec![])
        };
        let inner: &[u64] = &site.shape[lead.0.len()..];
        // A box of the layer's tensor: rows [r0, r0+n) of dim `d0` (first inner dim) at prefix `pre`.
        let rows = |pre: &[u64], d_rest: &[u64], r0: u64, n: u64| -> Piece {
            let mut offsets = lead.0.clone();
            let mut sizes = lead.1.clone();
            offsets.extend_from_slice(pre);
            sizes.extend(std::iter::repeat_n(1, pre.len()));
            offsets.push(r0);
            sizes.push(n);
            offsets.extend(std::iter::repeat_n(0, d_rest.len()));
            sizes.extend_from_slice(d_rest);
            Piece {
                key: site.key.to_string(),
                offsets,
                sizes,
            }
        };
        let t = |name: String, shape: Vec<u64>, pieces: Vec<Piece>| HfTensor {
            name,
            shape,
            src_dtype: site.dtype,
            pieces,
        };
        let full = |name: &str| -> HfTensor {
            let pc = rows(
                &[],
                &inner[1.min(inner.len())..],
                0,
                inner.first().copied().unwrap_or(1),
            );
            let pc = if inner.is_empty() {
                Piece {
                    key: site.key.into(),
                    offsets: lead.0.clone(),
                    sizes: lead.1.clone(),
                }
            } else {
                pc
            };
            t(format!("{p}{name}"), inner.to_vec(), vec![pc])
        };
        // Row halves of a [2F, H] SwiGLU fc1 at expert prefix `pre`.
        let gate_up =
            |pre: &[u64], dims: &[u64], gate: String, up: String| -> Result<Vec<HfTensor>> {
                let (r, rest) = (dims[0], &dims[1..]);
                if r % 2 != 0 {
                    return Err(Error::Validation(format!(
                        "{}: SwiGLU fc1 has an odd row count {r}",
                        site.key
                    )));
                }
                let mut shape = vec![r / 2];
                shape.extend_from_slice(rest);
                Ok(vec![
                    t(gate, shape.clone(), vec![rows(pre, rest, 0, r / 2)]),
                    t(up, shape, vec![rows(pre, rest, r / 2, r / 2)]),
                ])
            };
        let moe_mlp = if self.arch == Arch::Mixtral {
            "block_sparse_moe"
        } else {
            "mlp"
        };
        let out = match sub {
            "self_attention.linear_qkv.weight" | "self_attention.linear_qkv.bias" => {
                let (g, n, h) = (self.groups, self.heads / self.groups.max(1), self.head_dim);
                let rows_total = inner[0];
                if self.heads % self.groups.max(1) != 0
                    || rows_total != g * (n + 2) * h
                    || (inner.len() == 2 && inner[1] != self.hidden)
                {
                    return Err(Error::Validation(format!(
                        "{}: shape {:?} does not fit {} heads in {} query groups of head_dim {} and hidden_size {}",
                        site.key, site.shape, self.heads, self.groups, h, self.hidden
                    )));
                }
                let rest = &inner[1..];
                let kind = if sub.ends_with("bias") {
                    "bias"
                } else {
                    "weight"
                };
                let block = |off: u64, len: u64| {
                    (0..g)
                        .map(|gi| rows(&[], rest, gi * (n + 2) * h + off, len))
                        .collect::<Vec<_>>()
                };
                let shape = |r: u64| {
                    let mut s = vec![r];
                    s.extend_from_slice(rest);
                    s
                };
                vec![
                    t(
                        format!("{p}self_attn.q_proj.{kind}"),
                        shape(g * n * h),
                        block(0, n * h),
                    ),
                    t(
                        format!("{p}self_attn.k_proj.{kind}"),
                        shape(g * h),
                        block(n * h, h),
                    ),
                    t(
                        format!("{p}self_attn.v_proj.{kind}"),
                        shape(g * h),
                        block((n + 1) * h, h),
                    ),
                ]
            }
            "self_attention.linear_proj.weight" => vec![full("self_attn.o_proj.weight")],
            "self_attention.linear_qkv.layer_norm_weight" | "input_layernorm.weight" => {
                vec![full("input_layernorm.weight")]
            }
            "mlp.linear_fc1.layer_norm_weight" | "pre_mlp_layernorm.weight" => {
                vec![full("post_attention_layernorm.weight")]
            }
            "self_attention.q_layernorm.weight" => vec![full("self_attn.q_norm.weight")],
            "self_attention.k_layernorm.weight" => vec![full("self_attn.k_norm.weight")],
            "mlp.linear_fc1.weight" => gate_up(
                &[],
                inner,
                format!("{p}mlp.gate_proj.weight"),
                format!("{p}mlp.up_proj.weight"),
            )?,
            "mlp.linear_fc2.weight" => vec![full("mlp.down_proj.weight")],
            "mlp.router.weight" => vec![full(&format!("{moe_mlp}.gate.weight"))],
            "mlp.router.expert_bias" => {
                vec![full(&format!("{moe_mlp}.gate.e_score_correction_bias"))]
            }
            "mlp.shared_experts.linear_fc1.weight" => gate_up(
                &[],
                inner,
                format!("{p}mlp.shared_expert.gate_proj.weight"),
                format!("{p}mlp.shared_expert.up_proj.weight"),
            )?,
            "mlp.shared_experts.linear_fc2.weight" => {
                vec![full("mlp.shared_expert.down_proj.weight")]
            }
            "mlp.shared_experts.gate_weight" => vec![full("mlp.shared_expert_gate.weight")],
            "mlp.experts.experts.linear_fc1.weight" | "mlp.experts.experts.linear_fc2.weight" => {
                let (e_count, dims) = (inner[0], &inner[1..]);
                let mut v = Vec::new();
                for e in 0..e_count {
                    let (gate, up, down) = if self.arch == Arch::Mixtral {
                        (
                            format!("{p}{moe_mlp}.experts.{e}.w1.weight"),
                            format!("{p}{moe_mlp}.experts.{e}.w3.weight"),
                            format!("{p}{moe_mlp}.experts.{e}.w2.weight"),
                        )
                    } else {
                        (
                            format!("{p}mlp.experts.{e}.gate_proj.weight"),
                            format!("{p}mlp.experts.{e}.up_proj.weight"),
                            format!("{p}mlp.experts.{e}.down_proj.weight"),
                        )
                    };
                    if sub.contains("fc1") {
                        v.extend(gate_up(&[e], dims, gate, up)?);
                    } else {
                        v.push(t(
                            down,
                            dims.to_vec(),
                            vec![rows(&[e], &dims[1..], 0, dims[0])],
                        ));
                    }
                }
                v
            }
            _ => return Ok(None),
        };
        Ok(Some(out))
    }

    /// Every HF tensor name the config requires.
    fn required(&self) -> BTreeSet<String> {
        let mut r = BTreeSet::new();
        r.insert("model.embed_tokens.weight".to_string());
        r.insert("model.norm.weight".to_string());
        if !self.tied {
            r.insert("lm_head.weight".to_string());
        }
        for l in 0..self.num_layers {
            let p = self.layer_prefix(l);
            for n in [
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            ] {
                r.insert(format!("{p}{n}"));
            }
            if matches!(self.arch, Arch::Qwen3 | Arch::Qwen3Moe) {
                r.insert(format!("{p}self_attn.q_norm.weight"));
                r.insert(format!("{p}self_attn.k_norm.weight"));
            }
            if self.arch == Arch::Qwen2 {
                for n in ["q_proj", "k_proj", "v_proj"] {
                    r.insert(format!("{p}self_attn.{n}.bias"));
                }
            }
            if self.arch.moe() {
                let (mlp, names) = if self.arch == Arch::Mixtral {
                    ("block_sparse_moe", ["w1", "w3", "w2"])
                } else {
                    ("mlp", ["gate_proj", "up_proj", "down_proj"])
                };
                r.insert(format!("{p}{mlp}.gate.weight"));
                for e in 0..self.num_experts {
                    for n in names {
                        r.insert(format!("{p}{mlp}.experts.{e}.{n}.weight"));
                    }
                }
            } else {
                for n in [
                    "mlp.gate_proj.weight",
                    "mlp.up_proj.weight",
                    "mlp.down_proj.weight",
                ] {
                    r.insert(format!("{p}{n}"));
                }
            }
        }
        r
    }
}

fn st_dtype(d: DType) -> Result<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Ok(match d {
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I64 => S::I64,
        DType::I32 => S::I32,
        DType::I16 => S::I16,
        DType::I8 => S::I8,
        DType::U8 => S::U8,
        DType::Bool => S::BOOL,
        DType::F8E4M3FN => S::F8_E4M3,
        DType::F8E5M2 => S::F8_E5M2,
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "{} in safetensors output",
                other.torch_name()
            )))
        }
    })
}

/// The checkpoint dtype of a safetensors dtype (the inverse of [`st_dtype`]); None for dtypes
/// DCP has no name for.
pub(crate) fn dtype_of_st(d: safetensors::Dtype) -> Option<DType> {
    DType::READABLE
        .iter()
        .copied()
        .find(|&t| st_dtype(t).ok() == Some(d))
}

/// Converts little-endian floats between float32, bfloat16 and float16.
fn convert(bytes: &[u8], from: DType, to: DType) -> Result<Vec<u8>> {
    use half::{bf16, f16};
    let vals: Vec<f32> = match from {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "conversion from {}",
                other.torch_name()
            )))
        }
    };
    Ok(match to {
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "conversion to {}",
                other.torch_name()
            )))
        }
    })
}

/// Converts the checkpoint at `ckpt` (a directory or an object-store prefix, read by ranged GETs)
/// into HF safetensors in the local directory `out_dir`; `progress(bytes)` is called as tensors
/// are written.
///
/// Errors: [`Error::InvalidArgument`] for missing or unusable hyperparameters; [`Error::Validation`]
/// for unmapped checkpoint keys (unless `allow_unmapped`), HF tensors the config requires that
/// the checkpoint does not produce, shapes that contradict the config, and config/args
/// disagreements; reader errors for damaged checkpoints; [`Error::Io`].
pub fn to_hf(
    ckpt: &Location,
    out_dir: &Path,
    opts: &HfOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<HfSummary> {
    let t0 = Instant::now();
    if out_dir.to_string_lossy().contains("://") {
        return Err(Error::InvalidArgument(format!(
            "to-hf writes to a local directory, not to {}",
            out_dir.display()
        )));
    }
    let ckpt = Checkpoint::open(ckpt)?;
    let Plan { tensors, skipped } = plan(&ckpt, opts)?;
    write_safetensors(&ckpt, &tensors, skipped, out_dir, opts, progress, t0)
}

/// Maps every tensor of `ckpt` to HF tensors (see [`to_hf`] for the checks and errors).
pub(crate) fn plan(ckpt: &Checkpoint, opts: &HfOptions) -> Result<Plan> {
    let args = megatron_args(ckpt)?;
    let config: Option<serde_json::Value> = match &opts.config {
        Some(p) => Some(
            serde_json::from_slice(&std::fs::read(p).map_err(Error::io("read", p))?)
                .map_err(|e| Error::InvalidArgument(format!("{}: not JSON: {e}", p.display())))?,
        ),
        None => None,
    };
    let dims = match (&config, &args) {
        (Some(c), _) => dims_from_config(c, opts.arch.as_deref())?,
        (None, Some(a)) => dims_from_args(a, opts.arch.as_deref())?,
        (None, None) => {
            return Err(Error::InvalidArgument(
                "no --hf-config and no Megatron args in common.pt: pass --hf-config".into(),
            ))
        }
    };
    if let (Some(_), Some(a)) = (&config, &args) {
        let diffs = check_args(&dims, a);
        if !diffs.is_empty() {
            return Err(Error::Validation(format!(
                "config.json disagrees with the checkpoint's args: {}",
                diffs.join("; ")
            )));
        }
    }

    let mut tensors: Vec<HfTensor> = Vec::new();
    let (mut unmapped, mut skipped) = (Vec::new(), 0usize);
    let mut stacked_layers: BTreeSet<u64> = BTreeSet::new();
    for (key, e) in &ckpt.metadata.entries {
        let Entry::Tensor {
            dtype,
            global_shape,
            ..
        } = e
        else {
            skipped += 1;
            continue;
        };
        match dims.map(key, global_shape, *dtype)? {
            Mapped::Tensors(v) => {
                if key.starts_with("decoder.layers.")
                    && !key["decoder.layers.".len()..].starts_with(|c: char| c.is_ascii_digit())
                {
                    stacked_layers.insert(global_shape[0]);
                }
                tensors.extend(v)
            }
            Mapped::Skip => skipped += 1,
            Mapped::Unmapped => unmapped.push(key.clone()),
        }
    }
    if !unmapped.is_empty() && !opts.allow_unmapped {
        return Err(Error::Validation(format!(
            "no rule maps these checkpoint keys (pass --allow-unmapped to skip them): {}",
            unmapped.join(", ")
        )));
    }
    skipped += unmapped.len();
    if let Some(l) = stacked_layers.iter().find(|&&l| l != dims.num_layers) {
        return Err(Error::Validation(format!(
            "the checkpoint stacks {l} layers; the config says num_hidden_layers = {}",
            dims.num_layers
        )));
    }
    let produced: BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    if produced.len() != tensors.len() {
        return Err(Error::Validation(
            "two checkpoint keys map to the same HF tensor".into(),
        ));
    }
    let missing: Vec<String> = dims
        .required()
        .into_iter()
        .filter(|n| !produced.contains(n.as_str()))
        .collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(20).map(|s| s.as_str()).collect();
        return Err(Error::Validation(format!(
            "{} HF tensors the config requires were not produced: {}",
            missing.len(),
            shown.join(", ")
        )));
    }
    // Deterministic order: by layer, then name.
    let layer_of = |n: &str| {
        n.strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<u64>().ok())
    };
    tensors.sort_by(|a, b| (layer_of(&a.name), &a.name).cmp(&(layer_of(&b.name), &b.name)));
    Ok(Plan { tensors, skipped })
}

/// Reads HF tensor `t` (its pieces, in order) into `buf` (`prod(shape) * itemsize` bytes of
/// `t.src_dtype`).
pub(crate) fn read_hf_tensor(ckpt: &Checkpoint, t: &HfTensor, buf: &mut [u8]) -> Result<()> {
    let item = t.src_dtype.itemsize();
    let mut at = 0usize;
    for pc in &t.pieces {
        let n = (pc.sizes.iter().product::<u64>() * item) as usize;
        ckpt.read_region(&pc.key, &pc.offsets, &pc.sizes, &mut buf[at..at + n])?;
        at += n;
    }
    Ok(())
}

fn write_safetensors(
    ckpt: &Checkpoint,
    tensors: &[HfTensor],
    skipped: usize,
    out_dir: &Path,
    opts: &HfOptions,
    progress: &(dyn Fn(u64) + Sync),
    t0: Instant,
) -> Result<HfSummary> {
    // Shards: greedy in order, each at most max_shard_bytes (a larger tensor gets its own file).
    let out_dtype = |t: &HfTensor| opts.dtype.unwrap_or(t.src_dtype);
    let nbytes = |t: &HfTensor| t.shape.iter().product::<u64>() * out_dtype(t).itemsize();
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let n = nbytes(t);
        if size > 0 && size + n > opts.max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().unwrap().push(i);
        size += n;
    }
    create_dir_all(out_dir)?;
    let count = shards.len();
    let file_name = |k: usize| format!("model-{:05}-of-{count:05}.safetensors", k + 1);
    // Headers first: every tensor's file and absolute offset are known before any data moves.
    let mut place: Vec<(usize, u64)> = vec![(0, 0); tensors.len()];
    let mut files = Vec::with_capacity(count);
    let mut weight_map = BTreeMap::new();
    for (k, idx) in shards.iter().enumerate() {
        let mut infos = Vec::with_capacity(idx.len());
        let mut at = 0usize;
        for &i in idx {
            let t = &tensors[i];
            let n = nbytes(t) as usize;
            infos.push((
                t.name.clone(),
                safetensors::tensor::TensorInfo {
                    dtype: st_dtype(out_dtype(t))?,
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    data_offsets: (at, at + n),
                },
            ));
            at += n;
            weight_map.insert(t.name.clone(), file_name(k));
        }
        let meta = safetensors::tensor::Metadata::new(
            Some(HashMap::from([("format".to_string(), "pt".to_string())])),
            infos,
        )
        .map_err(|e| Error::InvalidArgument(format!("safetensors header: {e}")))?;
        let mut header = serde_json::to_vec(&meta)
            .map_err(|e| Error::InvalidArgument(format!("safetensors header: {e}")))?;
        header.resize(header.len().next_multiple_of(8), b' ');
        let data_start = 8 + header.len() as u64;
        let path = out_dir.join(file_name(k));
        let f = DataFile::create(&path, data_start + at as u64)?;
        f.write_at(&(header.len() as u64).to_le_bytes(), 0)?;
        f.write_at(&header, 8)?;
        let mut off = 0u64;
        for &i in idx {
            place[i] = (k, data_start + off);
            off += nbytes(&tensors[i]);
        }
        files.push(f);
    }

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("thread pool: {e}")))?;
    let total: u64 = pool.install(|| {
        tensors
            .par_iter()
            .enumerate()
            .map(|(i, t)| -> Result<u64> {
                let item = t.src_dtype.itemsize();
                let mut buf = vec![0u8; (t.shape.iter().product::<u64>() * item) as usize];
                read_hf_tensor(ckpt, t, &mut buf)?;
                let out = out_dtype(t);
                let bytes = if out == t.src_dtype {
                    buf
                } else {
                    convert(&buf, t.src_dtype, out)?
                };
                let (k, off) = place[i];
                files[k].write_at(&bytes, off)?;
                progress(bytes.len() as u64);
                Ok(bytes.len() as u64)
            })
            .sum::<Result<u64>>()
    })?;
    for f in &files {
        f.sync()?;
    }
    #[derive(Serialize)]
    struct Index<'a> {
        metadata: BTreeMap<&'a str, u64>,
        weight_map: &'a BTreeMap<String, String>,
    }
    let index = Index {
        metadata: BTreeMap::from([("total_size", total)]),
        weight_map: &weight_map,
    };
    atomic_write(
        &out_dir.join("model.safetensors.index.json"),
        &serde_json::to_vec_pretty(&index).expect("serializable"),
    )?;
    if let Some(p) = &opts.config {
        let bytes = std::fs::read(p).map_err(Error::io("read", p))?;
        atomic_write(&out_dir.join("config.json"), &bytes)?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(HfSummary {
        tensors: tensors.len(),
        bytes: total,
        files: count,
        seconds,
        gb_per_s: total as f64 / seconds.max(1e-9) / 1e9,
        skipped_keys: skipped,
    })
}

/// Parses a size like `5GB`, `500MB`, `4GiB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("bad size {s:?}")))?;
    let mult: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(Error::InvalidArgument(format!(
                "bad size unit {other:?} in {s:?}"
            )))
        }
    };
    let v = num * mult;
    if !(v >= 1.0 && v.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "size {s:?} must be at least 1 byte"
        )));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert!(parse_size("5 parsecs").is_err() && parse_size("0").is_err());
    }

    #[test]
    fn qkv_splits_per_query_group() {
        let d = Dims {
            arch: Arch::Llama,
            num_layers: 2,
            hidden: 8,
            heads: 4,
            groups: 2,
            head_dim: 2,
            vocab_size: Some(10),
            tied: false,
            num_experts: 0,
        };
        let Mapped::Tensors(v) = d
            .map(
                "decoder.layers.self_attention.linear_qkv.weight",
                &[2, 16, 8],
                DType::F32,
            )
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(v.len(), 6);
        let k1 = v
            .iter()
            .find(|t| t.name == "model.layers.1.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k1.shape, vec![4, 8]);
        // group 0: rows [0,4) q, [4,6) k, [6,8) v; group 1 starts at 8.
        let starts: Vec<(u64, u64)> = k1
            .pieces
            .iter()
            .map(|p| (p.offsets[0], p.offsets[1]))
            .collect();
        assert_eq!(starts, vec![(1, 4), (1, 12)]);
    }
}
