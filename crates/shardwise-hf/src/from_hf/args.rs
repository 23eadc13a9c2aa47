//! The common state of a converted checkpoint, as Megatron-LM's `save_checkpoint` stores it
//! (`megatron/training/checkpointing.py` `generate_state_dict`): `args` (an `argparse.Namespace`),
//! `checkpoint_version` 3.0 and `iteration`, in `common.pt` (`torch.save`). megatron-core up to
//! 0.18 reads only `common.pt`; 0.19 still reads it before looking for its own `common_state`
//! object (`serialization.load_common_state_dict`), while an older release loading with
//! `strict=raise_all` would report a `common_state` object as a key no model asks for. So
//! `common.pt` is what every release loads.
//!
//! `args` holds the model fields: each row of the architecture's check table written back from
//! the config (the inverse of [`super::super::config`]'s reading of stored args, so `to-hf`
//! checks the config against them, and `to-hf --arch` builds the same config from them: the
//! router's top-k, scoring and groups, the RoPE base, the context length), every other field
//! Megatron-LM's `load_args_from_checkpoint` copies ([`fixed_args`]), Megatron's vocabulary padding (`padded_vocab_size`,
//! `make_vocab_size_divisible_by`, `tensor_model_parallel_size`), the layout flags
//! (`transformer_impl`, `moe_grouped_gemm`) and what the tensors show (`add_qkv_bias`,
//! `qk_layernorm`, `multi_latent_attention`). `no_save_optim` and `no_save_rng` say that there is
//! no optimizer or RNG state, so Megatron-LM does not look for them. Values are ints, floats,
//! bools, strings, None and tuples/lists of them, which megatron-core's safe unpickler loads
//! (`safe_globals.py` registers `argparse.Namespace`).

use std::collections::BTreeMap;

use super::super::config::{config_scaling, Scaling, YARN_ARGS};
use super::super::spec::{Check, Dims, LayerPattern, Rel};
use shardwise::error::{Error, Result};
use shardwise::format::pickle::Pickler;
use shardwise::format::zip::object_archive;

/// A value of `args`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Arg {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<Arg>),
    List(Vec<Arg>),
}

impl Arg {
    fn pickle(&self, p: &mut Pickler) {
        match self {
            Arg::None => p.none(),
            Arg::Bool(b) => p.bool(*b),
            Arg::Int(i) => p.int(*i as i128),
            Arg::Float(f) => p.float(*f),
            Arg::Str(s) => p.str(s),
            Arg::Tuple(v) => {
                if v.len() > 3 {
                    p.mark();
                }
                for x in v {
                    x.pickle(p);
                }
                p.tuple(v.len());
            }
            Arg::List(v) => {
                p.empty_list();
                p.put();
                if !v.is_empty() {
                    p.mark();
                    for x in v {
                        x.pickle(p);
                    }
                    p.appends();
                }
            }
        }
    }
}

/// What the conversion knows beyond the config.
pub(crate) struct Layout {
    pub te: bool,
    pub moe_grouped_gemm: bool,
    pub tensor_model_parallel_size: u64,
    pub make_vocab_size_divisible_by: u64,
    pub padded_vocab_size: u64,
    /// Tensor names of the HF folder (for the flags the tensors show).
    pub has_qkv_bias: bool,
    pub has_qk_norm: bool,
    pub mla: bool,
    pub add_bias_linear: bool,
}

/// A period `k >= 2` such that `on(l)` is exactly `(l + 1) % k != 0` (Megatron's int form of
/// `linear_attention_freq` and `window_attn_skip_freq`, 1-based layer numbers), if one exists.
fn period(on: &[bool]) -> Option<u64> {
    (2..=on.len() as u64 + 1).find(|&k| {
        on.iter()
            .enumerate()
            .all(|(l, &x)| x == ((l as u64 + 1) % k != 0))
    })
}

/// The smallest `(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset)` under which exactly the
/// layers `on` run their own DSA indexer, counted as megatron-core 0.19.2 does for a GPTModel
/// (`dsa.is_dsa_skip_topk_layer`: layer number `l + 1`, offset at least 1; the same reading as
/// [`super::super::config`]'s check of stored args), if any.
fn indexer_schedule(on: &[bool]) -> Option<(u64, u64)> {
    let n = on.len() as u64;
    (1..=n.max(1)).find_map(|freq| {
        (0..=n).find_map(|offset| {
            on.iter()
                .enumerate()
                .all(|(l, &x)| x == ((l as u64 + 1).saturating_sub(offset.max(1)) % freq == 0))
                .then_some((freq, offset))
        })
    })
}

/// Megatron-LM's `args` for a model of `d` converted as `lay` says.
///
/// Errors: [`Error::Validation`] when the config's DSA indexer layers (`indexer_types`) fit no
/// schedule Megatron's args can express.
pub(crate) fn megatron_args(d: &Dims, lay: &Layout) -> Result<BTreeMap<String, Arg>> {
    let mut a: BTreeMap<String, Arg> = BTreeMap::new();
    for c in d.spec.checks() {
        a.extend(row_args(d, lay, c)?.into_iter().map(|(k, v)| (k.into(), v)));
    }
    if d.spec.moe_layers == LayerPattern::Dense || d.num_experts == 0 {
        a.insert("num_experts".into(), Arg::None);
    }
    a.insert(
        "group_query_attention".into(),
        Arg::Bool(!lay.mla && d.groups != d.heads),
    );
    for (k, v) in layout_args(d, lay) {
        a.entry(k.into()).or_insert(v);
    }
    a.extend(moe_args(d)?);
    a.extend(rope_scaling(d)?);
    for (k, v) in fixed_args(d) {
        a.entry(k.into()).or_insert(v);
    }
    Ok(a)
}

/// An args integer.
fn int(v: u64) -> Arg {
    Arg::Int(v as i64)
}

/// The args check row `c` writes back from the config (the inverse of its reading in
/// [`super::super::config`]): each relation's rule, in one place.
///
/// Errors: [`indexer_args`]'.
fn row_args(d: &Dims, lay: &Layout, c: &Check) -> Result<Vec<(&'static str, Arg)>> {
    Ok(match c.rel {
        Rel::Eq => d
            .field(c.hf)
            .map(|v| (c.args, int(v)))
            .into_iter()
            .collect(),
        Rel::Not => vec![(c.args, Arg::Bool(!d.flag(c.hf).unwrap_or(d.tied)))],
        Rel::Same => vec![(c.args, Arg::Bool(d.flag(c.hf).unwrap_or(false)))],
        Rel::Vocab => {
            let mut a = vec![("padded_vocab_size", int(lay.padded_vocab_size))];
            a.extend(d.vocab_size.map(|v| ("vocab_size", int(v))));
            a
        }
        // As the config states it, else transformers' default (an integer stays one: DSA's
        // `index_topk` is Megatron's int `--dsa-indexer-topk`); a config built from the args
        // copies it back as stored.
        Rel::Float => number(d, c.hf, c.args)
            .map(|v| (c.args, v))
            .into_iter()
            .collect(),
        Rel::ArgsTrue | Rel::ArgsFalse => vec![(c.args, Arg::Bool(c.rel == Rel::ArgsTrue))],
        Rel::IndexerLayers => indexer_args(d, c)?,
        // A warning of to-hf only; norm_epsilon itself is the Float row's.
        Rel::MlaNormEps => Vec::new(),
        // The router's scoring: [`router`], written for every MoE family by [`moe_args`]; the
        // RoPE scaling: [`rope_scaling`].
        Rel::TopkNorm | Rel::Router | Rel::RopeScaling => Vec::new(),
        // The shared experts' size, `n_shared_experts x moe_intermediate_size`.
        Rel::SharedExperts => d
            .field("n_shared_experts*moe_intermediate_size")
            .filter(|_| d.num_experts > 0)
            .map(|v| (c.args, int(v)))
            .into_iter()
            .collect(),
        Rel::Activation => activation_args(d, c)?,
        Rel::MoeLayers => moe_layer_args(d),
        Rel::AttnLayers => attention_args(d),
        Rel::SlidingWindow => window_args(d),
    })
}

/// Megatron's form of a per-layer pattern: its period ([`period`]) when it has one, else the
/// list of 0/1.
fn freq(on: &[bool]) -> Arg {
    match period(on) {
        Some(k) => int(k),
        None => Arg::List(on.iter().map(|&x| Arg::Int(x as i64)).collect()),
    }
}

/// The DSA indexer's schedule ([`indexer_schedule`]) of the config's indexer layers.
///
/// Errors: [`Error::Validation`] when no schedule gives them.
fn indexer_args(d: &Dims, c: &Check) -> Result<Vec<(&'static str, Arg)>> {
    let on: Vec<bool> = (0..d.num_layers).map(|l| d.indexer(l)).collect();
    let (freq, offset) = indexer_schedule(&on).ok_or_else(|| {
        Error::Validation(format!(
            "indexer_types: no dsa_indexer_topk_freq and dsa_indexer_skip_topk_offset of Megatron give the layers' pattern {}",
            on.iter().map(|&f| if f { 'F' } else { 'S' }).collect::<String>()
        ))
    })?;
    Ok(vec![
        (c.args, int(freq)),
        ("dsa_indexer_skip_topk_offset", int(offset)),
    ])
}

/// SwiGLU's `--swiglu`: the gated MLP every family here computes with `silu`.
///
/// Errors: [`Error::Validation`] for another `hidden_act`, which no Megatron argument computes.
fn activation_args(d: &Dims, c: &Check) -> Result<Vec<(&'static str, Arg)>> {
    match d.value(c.hf) {
        Some(v) if v.as_str() != Some("silu") => Err(Error::Validation(format!(
            "{}: config.json says {v}: Megatron's gated MLP here is SwiGLU (--swiglu, silu); no Megatron argument computes act(gate) x up with another activation",
            c.hf
        ))),
        _ => Ok(vec![(c.args, Arg::Bool(true))]),
    }
}

/// `moe_layer_freq` of a model with experts: 1 when every layer is MoE, else the list.
fn moe_layer_args(d: &Dims) -> Vec<(&'static str, Arg)> {
    if d.num_experts == 0 {
        return Vec::new();
    }
    let all = d.moe_layers.iter().all(|&m| m);
    let freq = if all {
        Arg::Int(1)
    } else {
        Arg::List(d.moe_layers.iter().map(|&m| Arg::Int(m as i64)).collect())
    };
    vec![("moe_layer_freq", freq)]
}

/// Gated DeltaNet's linear attention layers.
fn attention_args(d: &Dims) -> Vec<(&'static str, Arg)> {
    let linear: Vec<bool> = (0..d.num_layers)
        .map(|l| d.layer_type(l).as_deref() == Some("linear_attention"))
        .collect();
    vec![
        (
            "experimental_attention_variant",
            Arg::Str("gated_delta_net".into()),
        ),
        ("linear_attention_freq", freq(&linear)),
    ]
}

/// gpt_oss's attention window and the layers it applies to (none without a windowed layer).
fn window_args(d: &Dims) -> Vec<(&'static str, Arg)> {
    let w = d.layer_windows();
    let Some(&Some(size)) = w.iter().find(|w| w.is_some()) else {
        return Vec::new();
    };
    let on: Vec<bool> = w.iter().map(|w| w.is_some()).collect();
    vec![
        (
            "window_size",
            Arg::Tuple(vec![int(size.saturating_sub(1)), Arg::Int(0)]),
        ),
        ("window_attn_skip_freq", freq(&on)),
    ]
}

/// The args of the layout, each unless a check row wrote it: the attention's query groups, the
/// dense FFN size, what every family here is (SwiGLU with RMSNorm and RoPE), what the tensors show
/// and how the checkpoint is laid out.
fn layout_args(d: &Dims, lay: &Layout) -> Vec<(&'static str, Arg)> {
    let mut a = vec![("num_query_groups", int(d.groups))];
    a.extend(
        d.field("intermediate_size")
            .map(|ffn| ("ffn_hidden_size", int(ffn))),
    );
    a.extend([
        ("swiglu", Arg::Bool(true)),
        ("normalization", Arg::Str("RMSNorm".into())),
        ("position_embedding_type", Arg::Str("rope".into())),
        ("add_position_embedding", Arg::Bool(false)),
        ("use_rotary_position_embeddings", Arg::Bool(true)),
        ("add_bias_linear", Arg::Bool(lay.add_bias_linear)),
        ("add_qkv_bias", Arg::Bool(lay.has_qkv_bias)),
        ("qk_layernorm", Arg::Bool(lay.has_qk_norm || lay.mla)),
        ("multi_latent_attention", Arg::Bool(lay.mla)),
        ("moe_grouped_gemm", Arg::Bool(lay.moe_grouped_gemm)),
        (
            "transformer_impl",
            Arg::Str(
                if lay.te {
                    "transformer_engine"
                } else {
                    "local"
                }
                .into(),
            ),
        ),
        (
            "tensor_model_parallel_size",
            int(lay.tensor_model_parallel_size),
        ),
        ("pipeline_model_parallel_size", Arg::Int(1)),
        (
            "make_vocab_size_divisible_by",
            int(lay.make_vocab_size_divisible_by),
        ),
        ("no_save_optim", Arg::Bool(true)),
        ("no_save_rng", Arg::Bool(true)),
    ]);
    a
}

/// The router's args: a model with experts' own ([`router`]), else what a dense run stores.
///
/// Errors: [`router`]'s.
fn moe_args(d: &Dims) -> Result<Vec<(String, Arg)>> {
    if d.num_experts > 0 {
        return router(d);
    }
    // What a dense run stores: Megatron's defaults (TransformerConfig, core_r0.19.0), unused
    // without experts. Never for an MoE model, whose top-k must come from its config.
    Ok([
        ("moe_layer_freq", Arg::Int(1)),
        ("moe_router_topk", Arg::Int(2)),
        ("moe_router_score_function", Arg::Str("softmax".into())),
        ("moe_router_pre_softmax", Arg::Bool(false)),
        ("moe_router_enable_expert_bias", Arg::Bool(false)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect())
}

/// A number of the config for args field `args` (top level or `rope_parameters`, else
/// transformers' default: [`Dims::value`]), as the config states it: an integer stays one, and so does an integral RoPE base (Megatron-LM's
/// `--rotary-base` is an int); a boolean stays one. None when absent or null.
fn number(d: &Dims, hf: &str, args: &str) -> Option<Arg> {
    match d.value(hf)? {
        serde_json::Value::Bool(b) => Some(Arg::Bool(*b)),
        v => match (v.as_i64(), v.as_f64()) {
            (Some(i), _) => Some(Arg::Int(i)),
            (None, Some(f)) if args == "rotary_base" && f.fract() == 0.0 => {
                Some(Arg::Int(f as i64))
            }
            (None, Some(f)) => Some(Arg::Float(f)),
            _ => None,
        },
    }
}

/// The router's scoring in Megatron's terms (MC 0.19 `moe_utils.py`
/// `topk_routing_with_score_function`), as [`super::super::config::family_router`] reads the
/// family: sigmoid scores with the expert bias, which Megatron always renormalises over the top-k,
/// or softmax, which renormalises its top-k unless `moe_router_pre_softmax` (softmax over all
/// experts, then top-k): HF's `norm_topk_prob` (else transformers' default) where the family's
/// config has it (the `TopkNorm` row), else always. The inverse of
/// [`super::super::config`]'s reading.
///
/// Errors: [`Error::Validation`] when `norm_topk_prob` is no boolean, or a sigmoid router's
/// `norm_topk_prob` is false (no Megatron router computes that).
fn router(d: &Dims) -> Result<Vec<(String, Arg)>> {
    let (sigmoid, always) = super::super::config::family_router(d);
    let norm = match d.spec.checks().find(|c| c.rel == Rel::TopkNorm) {
        Some(c) => d.flag(c.hf).ok_or_else(|| {
            Error::Validation(format!(
                "config.json has no boolean {}: whether the router renormalises its top-k decides Megatron's moe_router_pre_softmax",
                c.hf
            ))
        })?,
        None => always,
    };
    if sigmoid && !norm && d.field("num_experts_per_tok") != Some(1) {
        return Err(Error::Validation(
            "norm_topk_prob is false, but Megatron's sigmoid router always renormalises its top-k (megatron-core 0.19 moe_utils.py topk_routing_with_score_function): no Megatron model computes this routing".into(),
        ));
    }
    Ok(vec![
        (
            "moe_router_score_function".into(),
            Arg::Str(if sigmoid { "sigmoid" } else { "softmax" }.into()),
        ),
        (
            "moe_router_pre_softmax".into(),
            Arg::Bool(!sigmoid && !norm),
        ),
        ("moe_router_enable_expert_bias".into(), Arg::Bool(sigmoid)),
    ])
}

/// The config's RoPE scaling ([`config_scaling`]: `rope_parameters`, or transformers 4's
/// `rope_scaling`, `rope_type` or `type`; else transformers' default) in Megatron-LM's arguments (`arguments.py`, core_r0.19.0): none is `--rope-type
/// rope` (an MLA model's default is yarn), llama3's is `--use-rope-scaling` with
/// `--rope-scaling-factor` (megatron-core's llama3 scaling fixes low_freq_factor 1,
/// high_freq_factor 4 and original_max_position_embeddings 8192), yarn's `--rope-type yarn` with
/// its factor, `--yarn-original-max-position-embeddings`, `--yarn-beta-fast`, `--yarn-beta-slow`,
/// `--mscale` and `--mscale-all-dim`. (`load_args_from_checkpoint` copies none of them: they are
/// for to-hf, whose `--arch` refuses a scaling its config cannot describe.)
///
/// Errors: [`Error::Validation`] for a scaling Megatron has no arguments for (another type, or
/// llama3's with other fixed factors).
fn rope_scaling(d: &Dims) -> Result<Vec<(String, Arg)>> {
    let get = |k: &str| d.rope_params().and_then(|p| p.get(k));
    let float = |k: &str| {
        get(k)
            .and_then(|v| v.as_f64())
            .map_or(Arg::None, Arg::Float)
    };
    let mut a = vec![("use_rope_scaling".to_string(), Arg::Bool(false))];
    match config_scaling(d) {
        Scaling::Plain => a.push(("rope_type".into(), Arg::Str("rope".into()))),
        Scaling::Llama3(_) => {
            a = vec![
                ("use_rope_scaling".into(), Arg::Bool(true)),
                ("rope_scaling_factor".into(), float("factor")),
                ("rope_type".into(), Arg::Str("rope".into())),
            ];
        }
        Scaling::Yarn(_) => {
            a.push(("rope_type".into(), Arg::Str("yarn".into())));
            for (hf, args) in YARN_ARGS {
                let v = match get(hf).and_then(|v| v.as_i64()) {
                    Some(i) if hf.starts_with("original") => Arg::Int(i),
                    _ => float(hf),
                };
                a.push((args.to_string(), v));
            }
        }
        Scaling::Other(what) => {
            return Err(Error::Validation(format!(
                "{what}: Megatron-LM has no arguments for this RoPE scaling (--rope-type rope or yarn, --use-rope-scaling for llama3's with low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)"
            )))
        }
    }
    Ok(a)
}

/// The fields of Megatron-LM's `load_args_from_checkpoint` (`megatron/training/checkpointing.py`,
/// core_r0.19.0 f8837c0) that the config and the tensors do not already give (those are written
/// by the check rows above), with the value a training run of this model stores: what every
/// family here is (SwiGLU, RMSNorm, RoPE applied in halves, no dropout in transformers'
/// models but the attention's), and Megatron's own "not set" (None) for what has no HF source:
/// the training sequence length, the tokenizer, Mamba, heterogeneous layers, virtual pipeline
/// stages. The parallel sizes are a single rank's but for `--tensor-model-parallel-size`, whose
/// vocabulary padding the embedding has. `mtp_num_layers`: the MTP layers converted (None for
/// none, Megatron-LM's default).
fn fixed_args(d: &Dims) -> Vec<(&'static str, Arg)> {
    let dropout = number(d, "attention_dropout", "attention_dropout").unwrap_or(Arg::Float(0.0));
    vec![
        ("seq_length", Arg::None),
        // A model without dense layers states no dense FFN size (qwen3_5_moe): Megatron's "not
        // set" (`validate_args` then takes 4 x hidden_size, which no layer uses).
        ("ffn_hidden_size", Arg::None),
        // MLA's head sizes are its own rows; Megatron's kv_channels is unused by MLA.
        ("kv_channels", Arg::None),
        // transformers' default `partial_rotary_factor` (every family here), when the config
        // states none; Megatron's default too.
        ("rotary_percent", Arg::Float(1.0)),
        ("rotary_interleaved", Arg::Bool(false)),
        ("squared_relu", Arg::Bool(false)),
        ("apply_layernorm_1p", Arg::Bool(false)),
        ("apply_query_key_layer_scaling", Arg::Bool(false)),
        ("attention_dropout", dropout),
        ("hidden_dropout", Arg::Float(0.0)),
        ("mtp_hybrid_override_pattern", Arg::None),
        (
            "mtp_num_layers",
            match d.mtp_layers {
                0 => Arg::None,
                n => Arg::Int(n as i64),
            },
        ),
        ("mtp_use_repeated_layer", Arg::Bool(false)),
        ("spec", Arg::None),
        ("moe_ffn_hidden_size", Arg::None),
        ("moe_token_dispatcher_type", Arg::Str("allgather".into())),
        ("moe_single_grouped_weight", Arg::Bool(false)),
        ("moe_single_grouped_bias", Arg::Bool(false)),
        ("moe_shared_expert_intermediate_size", Arg::None),
        ("moe_router_topk_scaling_factor", Arg::None),
        ("mamba_state_dim", Arg::None),
        ("mamba_head_dim", Arg::None),
        ("mamba_num_groups", Arg::None),
        ("mamba_num_heads", Arg::None),
        ("hybrid_layer_pattern", Arg::None),
        ("heterogeneous_layers_config_path", Arg::None),
        ("heterogeneous_layers_config_encoded_json", Arg::None),
        ("moe_latent_size", Arg::None),
        ("tokenizer_model", Arg::None),
        ("tokenizer_type", Arg::None),
        ("tiktoken_pattern", Arg::None),
        ("ckpt_format", Arg::Str("torch_dist".into())),
        ("virtual_pipeline_model_parallel_size", Arg::None),
        ("num_layers_per_virtual_pipeline_stage", Arg::None),
        ("expert_model_parallel_size", Arg::Int(1)),
    ]
}

/// The bytes of `common.pt`: `torch.save({'args': Namespace(**args), 'checkpoint_version': 3.0,
/// 'iteration': iteration})`, pickled at protocol 2 as torch.save does (`argparse.Namespace`
/// through `NEWOBJ` and a `BUILD` of its `__dict__`).
pub(crate) fn common_pt(args: &BTreeMap<String, Arg>, iteration: u64) -> Vec<u8> {
    let mut p = Pickler::new(false);
    p.empty_dict();
    p.put();
    p.mark();
    p.str("args");
    p.global("argparse", "Namespace");
    p.empty_tuple();
    p.newobj();
    p.put();
    p.empty_dict();
    p.put();
    if !args.is_empty() {
        p.mark();
        for (k, v) in args {
            p.str(k);
            v.pickle(&mut p);
        }
        p.setitems();
    }
    p.build();
    p.str("checkpoint_version");
    p.float(3.0);
    p.str("iteration");
    p.int(iteration as i128);
    p.setitems();
    // torch.save names a fresh serialization id each time; a fixed one keeps the file a pure
    // function of its content (parts of one conversion on several machines agree).
    object_archive(&p.finish(), "0000000000000000000000000000000000000000")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_megatrons_int_form() {
        assert_eq!(period(&[true, false, true, false]), Some(2));
        assert_eq!(period(&[true, true, true, false]), Some(4));
        assert_eq!(period(&[true, false, false, true]), None);
    }

    #[test]
    fn indexer_schedules_are_megatrons() {
        assert_eq!(indexer_schedule(&[true; 4]), Some((1, 0)));
        // Layers 1, 3 and 5 (1-based) run their indexer: freq 2 from offset 1.
        assert_eq!(
            indexer_schedule(&[true, false, true, false, true]),
            Some((2, 0))
        );
        // Layers 1-2 run theirs, then every third from layer 5.
        let on = [true, true, false, false, true, false, false, true];
        let (f, o) = indexer_schedule(&on).unwrap();
        assert_eq!((f, o), (3, 2));
        assert_eq!(indexer_schedule(&[false, true]), None);
    }

    fn dims(extra: serde_json::Value) -> Dims {
        let mut cfg = serde_json::json!({"model_type": "deepseek_v3", "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 250});
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        Dims::from_config(&cfg, None).unwrap()
    }

    fn layout() -> Layout {
        Layout {
            te: true,
            moe_grouped_gemm: false,
            tensor_model_parallel_size: 2,
            make_vocab_size_divisible_by: 128,
            padded_vocab_size: 256,
            has_qkv_bias: false,
            has_qk_norm: false,
            mla: true,
            add_bias_linear: false,
        }
    }

    #[test]
    fn each_check_row_is_written_back_as_megatrons_args() {
        let d = dims(
            serde_json::json!({"n_routed_experts": 8, "first_k_dense_replace": 1,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
        );
        let row = |hf, args, rel| Check { hf, args, rel };
        let got = |c: Check| row_args(&d, &layout(), &c).unwrap();
        assert_eq!(
            got(row("hidden_size", "hidden_size", Rel::Eq)),
            vec![("hidden_size", Arg::Int(64))]
        );
        assert_eq!(
            got(row("vocab_size", "vocab_size", Rel::Vocab)),
            vec![
                ("padded_vocab_size", Arg::Int(256)),
                ("vocab_size", Arg::Int(250))
            ]
        );
        // An integral RoPE base is Megatron's int `--rotary-base`.
        assert_eq!(
            got(row("rope_theta", "rotary_base", Rel::Float)),
            vec![("rotary_base", Arg::Int(10000))]
        );
        assert_eq!(
            got(row("x", "y", Rel::ArgsFalse)),
            vec![("y", Arg::Bool(false))]
        );
        assert_eq!(
            got(row(
                "first_k_dense_replace",
                "moe_layer_freq",
                Rel::MoeLayers
            )),
            vec![("moe_layer_freq", Arg::List(vec![Arg::Int(0), Arg::Int(1)]))]
        );
        assert!(got(row("rms_norm_eps", "norm_epsilon", Rel::MlaNormEps)).is_empty());
        // Full attention everywhere is a period of n + 1; no windowed layer writes no window.
        assert_eq!(
            got(row("layer_types", "linear_attention_freq", Rel::AttnLayers)),
            vec![
                (
                    "experimental_attention_variant",
                    Arg::Str("gated_delta_net".into())
                ),
                ("linear_attention_freq", Arg::Int(3))
            ]
        );
        assert!(got(row("sliding_window", "window_size", Rel::SlidingWindow)).is_empty());
        assert_eq!(
            freq(&[true, false, false, true]),
            Arg::List(vec![Arg::Int(1), Arg::Int(0), Arg::Int(0), Arg::Int(1)])
        );
        let e = indexer_args(
            &dims(serde_json::json!({"indexer_types": ["shared", "full"]})),
            &row("indexer_types", "dsa_indexer_topk_freq", Rel::IndexerLayers),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("give the layers' pattern SF"), "{e}");
    }

    #[test]
    fn the_layout_and_a_dense_router_are_megatrons() {
        let d = dims(serde_json::json!({"intermediate_size": 96}));
        let a: BTreeMap<&str, Arg> = layout_args(&d, &layout()).into_iter().collect();
        assert_eq!(a["num_query_groups"], Arg::Int(4));
        assert_eq!(a["ffn_hidden_size"], Arg::Int(96));
        assert_eq!(a["qk_layernorm"], Arg::Bool(true));
        assert_eq!(a["transformer_impl"], Arg::Str("transformer_engine".into()));
        // Without experts: Megatron's defaults, not a router of the config.
        let m: BTreeMap<String, Arg> = moe_args(&d).unwrap().into_iter().collect();
        assert_eq!(
            (&m["moe_router_topk"], &m["moe_router_score_function"]),
            (&Arg::Int(2), &Arg::Str("softmax".into()))
        );
        // The whole: a check row's value stands over the layout's, a dense model's experts are
        // None, and MLA has no query groups.
        let all = megatron_args(&d, &layout()).unwrap();
        assert_eq!(all["num_experts"], Arg::None);
        assert_eq!(all["group_query_attention"], Arg::Bool(false));
        assert_eq!(all["hidden_size"], Arg::Int(64));
        assert_eq!(all["seq_length"], Arg::None);
    }

    #[test]
    fn rope_scaling_is_megatrons() {
        let get = |extra| {
            let a: BTreeMap<String, Arg> = rope_scaling(&dims(extra))
                .map_err(|e| e.to_string())?
                .into_iter()
                .collect();
            Ok::<_, String>(a)
        };
        // Plain RoPE is Megatron's `rope` (MLA would default to yarn).
        let a = get(serde_json::json!({})).unwrap();
        assert_eq!(a["rope_type"], Arg::Str("rope".into()));
        assert_eq!(a["use_rope_scaling"], Arg::Bool(false));
        // DeepSeek-V3's release: yarn, factor 40 from 4096 positions.
        let a = get(
            serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 40,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}}),
        )
        .unwrap();
        assert_eq!(a["rope_type"], Arg::Str("yarn".into()));
        assert_eq!(a["rotary_scaling_factor"], Arg::Float(40.0));
        assert_eq!(a["yarn_original_max_position_embeddings"], Arg::Int(4096));
        assert_eq!(a["yarn_beta_fast"], Arg::Float(32.0));
        assert_eq!(a["mscale_all_dim"], Arg::Float(1.0));
        // Llama 3.1's: megatron-core's fixed factors, or refused.
        let l3 = serde_json::json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        let a = get(l3.clone()).unwrap();
        assert_eq!(
            (&a["use_rope_scaling"], &a["rope_scaling_factor"]),
            (&Arg::Bool(true), &Arg::Float(8.0))
        );
        let mut other = l3;
        other["rope_parameters"]["high_freq_factor"] = serde_json::json!(2.0);
        assert!(get(other)
            .unwrap_err()
            .contains("rope_type \"llama3\" with another low_freq_factor"));
        let e = get(serde_json::json!({"rope_parameters": {"rope_type": "dynamic"}})).unwrap_err();
        assert!(e.contains("rope_type \"dynamic\""), "{e}");
    }

    #[test]
    fn the_router_is_megatrons() {
        let moe = serde_json::json!({"n_routed_experts": 8, "num_experts_per_tok": 2,
            "first_k_dense_replace": 0});
        let mut cfg = moe.clone();
        cfg["norm_topk_prob"] = serde_json::json!(true);
        let r: BTreeMap<String, Arg> = router(&dims(cfg)).unwrap().into_iter().collect();
        assert_eq!(r["moe_router_score_function"], Arg::Str("sigmoid".into()));
        assert_eq!(r["moe_router_enable_expert_bias"], Arg::Bool(true));
        assert_eq!(r["moe_router_pre_softmax"], Arg::Bool(false));
        // A sigmoid router that does not renormalise: no Megatron router computes it.
        let mut cfg = moe.clone();
        cfg["norm_topk_prob"] = serde_json::json!(false);
        let e = router(&dims(cfg)).err().unwrap().to_string();
        assert!(e.contains("always renormalises"), "{e}");
        // Absent: transformers' default (deepseek_v3's is true), as the served model computes.
        let r: BTreeMap<String, Arg> = router(&dims(moe)).unwrap().into_iter().collect();
        assert_eq!(r["moe_router_pre_softmax"], Arg::Bool(false));
        // Not a boolean: refused, not guessed.
        let mut cfg = serde_json::json!({"n_routed_experts": 8, "num_experts_per_tok": 2,
            "first_k_dense_replace": 0});
        cfg["norm_topk_prob"] = serde_json::json!("yes");
        let e = router(&dims(cfg)).err().unwrap().to_string();
        assert!(
            e.contains("config.json has no boolean norm_topk_prob"),
            "{e}"
        );
    }

    #[test]
    fn common_pt_is_a_torch_save_archive_of_the_dict() {
        let mut args = BTreeMap::new();
        args.insert("num_layers".to_string(), Arg::Int(2));
        args.insert(
            "window_size".to_string(),
            Arg::Tuple(vec![Arg::Int(3), Arg::Int(0)]),
        );
        args.insert(
            "moe_layer_freq".to_string(),
            Arg::List(vec![Arg::Int(0), Arg::Int(1)]),
        );
        args.insert("num_experts".to_string(), Arg::None);
        args.insert("rotary_percent".to_string(), Arg::Float(0.5));
        let bytes = common_pt(&args, 7);
        // Read back with our own unpickler (torch.load is exercised by the Python tests).
        let archive = shardwise::format::archive::Archive::read(&bytes[..]).unwrap();
        let pkl = archive.data_pkl().unwrap();
        let v =
            shardwise::format::unpickle::unpickle(&bytes[pkl.start..pkl.start + pkl.len]).unwrap();
        let iteration = v.get("iteration").unwrap();
        assert!(matches!(
            iteration,
            shardwise::format::unpickle::Value::Int(7)
        ));
    }
}
