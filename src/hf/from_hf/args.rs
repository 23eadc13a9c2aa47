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
//! checks the config against them), Megatron's vocabulary padding (`padded_vocab_size`,
//! `make_vocab_size_divisible_by`, `tensor_model_parallel_size`), the layout flags
//! (`transformer_impl`, `moe_grouped_gemm`) and what the tensors show (`add_qkv_bias`,
//! `qk_layernorm`, `multi_latent_attention`). `no_save_optim` and `no_save_rng` say that there is
//! no optimizer or RNG state, so Megatron-LM does not look for them. Values are ints, floats,
//! bools, strings, None and tuples/lists of them, which megatron-core's safe unpickler loads
//! (`safe_globals.py` registers `argparse.Namespace`).

use std::collections::BTreeMap;

use super::super::spec::{Dims, LayerPattern, Rel};
use crate::error::{Error, Result};
use crate::format::pickle::Pickler;
use crate::format::zip::object_archive;

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
    let int = |v: u64| Arg::Int(v as i64);
    for c in d.spec.checks() {
        match c.rel {
            Rel::Eq => {
                if let Some(v) = d.field(c.hf) {
                    a.insert(c.args.into(), int(v));
                }
            }
            Rel::Not => {
                a.insert(c.args.into(), Arg::Bool(!d.flag(c.hf).unwrap_or(d.tied)));
            }
            Rel::Same => {
                a.insert(c.args.into(), Arg::Bool(d.flag(c.hf).unwrap_or(false)));
            }
            Rel::Vocab => {
                a.insert("padded_vocab_size".into(), int(lay.padded_vocab_size));
                if let Some(v) = d.vocab_size {
                    a.insert("vocab_size".into(), int(v));
                }
            }
            Rel::Float => {
                if let Some(v) = d.float(c.hf) {
                    // Megatron-LM's --rotary-base is an int.
                    let arg = if c.args == "rotary_base" && v.fract() == 0.0 {
                        Arg::Int(v as i64)
                    } else {
                        Arg::Float(v)
                    };
                    a.insert(c.args.into(), arg);
                }
            }
            Rel::ArgsTrue | Rel::ArgsFalse => {
                a.insert(c.args.into(), Arg::Bool(c.rel == Rel::ArgsTrue));
            }
            Rel::IndexerLayers => {
                let on: Vec<bool> = (0..d.num_layers).map(|l| d.indexer(l)).collect();
                let (freq, offset) = indexer_schedule(&on).ok_or_else(|| {
                    Error::Validation(format!(
                        "indexer_types: no dsa_indexer_topk_freq and dsa_indexer_skip_topk_offset of Megatron give the layers' pattern {}",
                        on.iter().map(|&f| if f { 'F' } else { 'S' }).collect::<String>()
                    ))
                })?;
                a.insert(c.args.into(), int(freq));
                a.insert("dsa_indexer_skip_topk_offset".into(), int(offset));
            }
            // A warning of to-hf only; norm_epsilon itself is the Float row's.
            Rel::MlaNormEps => {}
            // The fields a config built from to-hf's args takes (context length, router
            // settings): no tensor depends on them, and from-hf's args describe the tensors.
            Rel::Derived | Rel::TopkNorm | Rel::SharedExperts => {}
            Rel::MoeLayers => {
                if d.num_experts > 0 {
                    let all = d.moe_layers.iter().all(|&m| m);
                    let freq = if all {
                        Arg::Int(1)
                    } else {
                        Arg::List(d.moe_layers.iter().map(|&m| Arg::Int(m as i64)).collect())
                    };
                    a.insert("moe_layer_freq".into(), freq);
                }
            }
            Rel::AttnLayers => {
                let linear: Vec<bool> = (0..d.num_layers)
                    .map(|l| d.layer_type(l).as_deref() == Some("linear_attention"))
                    .collect();
                a.insert(
                    "experimental_attention_variant".into(),
                    Arg::Str("gated_delta_net".into()),
                );
                let freq = match period(&linear) {
                    Some(k) => int(k),
                    None => Arg::List(linear.iter().map(|&x| Arg::Int(x as i64)).collect()),
                };
                a.insert("linear_attention_freq".into(), freq);
            }
            Rel::SlidingWindow => {
                let w = d.layer_windows();
                if let Some(&Some(size)) = w.iter().find(|w| w.is_some()) {
                    a.insert(
                        "window_size".into(),
                        Arg::Tuple(vec![int(size.saturating_sub(1)), Arg::Int(0)]),
                    );
                    let on: Vec<bool> = w.iter().map(|w| w.is_some()).collect();
                    let freq = match period(&on) {
                        Some(k) => int(k),
                        None => Arg::List(on.iter().map(|&x| Arg::Int(x as i64)).collect()),
                    };
                    a.insert("window_attn_skip_freq".into(), freq);
                }
            }
        }
    }
    if d.spec.moe_layers == LayerPattern::Dense || d.num_experts == 0 {
        a.insert("num_experts".into(), Arg::None);
    }
    // Every family here is SwiGLU with RMSNorm and RoPE.
    let groups = d.groups;
    a.entry("num_query_groups".into()).or_insert(int(groups));
    a.insert(
        "group_query_attention".into(),
        Arg::Bool(!lay.mla && groups != d.heads),
    );
    if let Some(ffn) = d.field("intermediate_size") {
        a.entry("ffn_hidden_size".into()).or_insert(int(ffn));
    }
    for (k, v) in [
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
    ] {
        a.entry(k.into()).or_insert(v);
    }
    if let Some(eps) = d.float("rms_norm_eps") {
        a.insert("norm_epsilon".into(), Arg::Float(eps));
    }
    if let Some(m) = d.field("max_position_embeddings") {
        a.insert("max_position_embeddings".into(), int(m));
    }
    Ok(a)
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
        let recs = crate::format::archive::records(&bytes).unwrap();
        let pkl = recs.iter().find(|r| r.name.ends_with("data.pkl")).unwrap();
        let v = crate::format::unpickle::unpickle(&bytes[pkl.start..pkl.start + pkl.len]).unwrap();
        let iteration = v.get("iteration").unwrap();
        assert!(matches!(iteration, crate::format::unpickle::Value::Int(7)));
    }
}
