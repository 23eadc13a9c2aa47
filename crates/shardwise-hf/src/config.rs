//! Hyperparameters of a conversion: from the HF `config.json` (transformers' field names and
//! defaults) or, without one, from Megatron's stored `args` through the architecture's check rows;
//! and the checks of one against the other ([`super::spec::Check`]).

use serde_json::{Map, Value as Json};

use super::families;
use super::layout::HybridPattern;
use super::spec::{ArchSpec, Check, Dims, LayerPattern, Rel, When, MAX_COUNT, MTP_FIELDS};
use shardwise::error::{Error, Result};
use shardwise::format::archive::Archive;
use shardwise::format::dtype::DType;
use shardwise::format::unpickle::{unpickle, Value};
use shardwise::reader::Checkpoint;

impl Dims {
    /// Dims from an HF config; `arch` overrides its `model_type`.
    ///
    /// Errors: [`Error::InvalidArgument`] for an unknown architecture or a missing required field.
    pub fn from_config(cfg: &Json, arch: Option<&str>) -> Result<Dims> {
        let Json::Object(cfg) = cfg else {
            return Err(Error::InvalidArgument(
                "config.json is not a JSON object".into(),
            ));
        };
        let Some(name) = arch.or_else(|| cfg.get("model_type").and_then(|v| v.as_str())) else {
            return Err(Error::InvalidArgument(
                "config.json has no model_type: pass --arch (llama, qwen3_moe, ...)".into(),
            ));
        };
        let spec = families::arch(name)?;
        // A multimodal config (Qwen3.5's) holds the text model's fields in `text_config`; the
        // names it implies (`model.language_model.*` beside a vision tower) are set by the caller,
        // which knows whether a vision tower comes with it (`--base-hf`) or `--text-only`.
        let mut cfg = cfg.clone();
        let multimodal = if let Some(Json::Object(text)) = cfg.get("text_config").cloned() {
            if spec.multimodal.is_none() {
                return Err(Error::InvalidArgument(format!(
                    "config.json is a multimodal config (it has a text_config) of {}, whose multimodal layout shardwise does not know: pass its text model's config",
                    spec.model_types[0]
                )));
            }
            cfg.extend(text);
            true
        } else {
            false
        };
        let mut d = Dims::new(spec, cfg)?;
        d.multimodal = multimodal;
        Ok(d)
    }

    /// The MTP layer count config.json declares (the family's field, else transformers'
    /// default for it; 0 for a family without MTP).
    pub fn declared_mtp(&self) -> u64 {
        self.spec
            .mtp
            .map_or(0, |m| self.field(m.field).unwrap_or(m.default))
    }
    /// Dims from Megatron's args alone: each check row's config field from its args field.
    ///
    /// Errors: [`Error::InvalidArgument`] when `arch` is absent or args lack a required field.
    pub fn from_args(args: &Args, arch: Option<&str>) -> Result<Dims> {
        let spec = families::arch(arch.ok_or_else(|| {
            Error::InvalidArgument("without --hf-config, --arch is required".into())
        })?)?;
        let mut cfg = Map::new();
        for c in spec.checks() {
            for (k, v) in row_from_args(spec, c, args) {
                cfg.insert(k.into(), v);
            }
        }
        // Plain RoPE unless the args say a scaling: never the family's default scaling (gpt_oss's
        // yarn), which the args did not train with.
        let rope = rope_scaling_from_args(args).unwrap_or_else(|| {
            let mut plain = Map::new();
            plain.insert("rope_type".into(), "default".into());
            plain.into()
        });
        cfg.insert("rope_parameters".into(), rope);
        check_required_from_args(spec, &cfg)?;
        let mut d = Dims::new(spec, cfg)?;
        // Only what the args say: a field they do not say is refused by `config_from_args`
        // (`unsaid`), never filled with transformers' default here.
        d.defaults.clear();
        Ok(d)
    }

    /// gpt_oss's attention window of each layer (None: full attention): `sliding_window` on the
    /// layers `layer_types` calls `sliding_attention`, transformers' default every even layer.
    pub(crate) fn layer_windows(&self) -> Vec<Option<u64>> {
        let types = self.cfg.get("layer_types").and_then(|v| v.as_array());
        (0..self.num_layers)
            .map(|l| {
                let sliding = match types {
                    Some(t) => {
                        t.get(l as usize).and_then(|v| v.as_str()) == Some("sliding_attention")
                    }
                    None => l % 2 == 0,
                };
                if sliding {
                    self.field("sliding_window")
                } else {
                    None
                }
            })
            .collect()
    }
}

/// The config fields check row `c` gives a config built from the args ([`Dims::from_args`]):
/// each relation's reading of its args field, in one place; none when the args do not say it.
fn row_from_args(spec: &ArchSpec, c: &Check, args: &Args) -> Vec<(&'static str, Json)> {
    let one = |v: Option<Json>| -> Vec<(&'static str, Json)> {
        v.map(|v| (c.hf, v)).into_iter().collect()
    };
    match c.rel {
        Rel::Eq => one(args.field(c.args).map(Json::from)),
        Rel::Not => one(args.flag(c.args).map(|v| Json::from(!v))),
        Rel::Same => one(args.flag(c.args).map(Json::from)),
        // The tokenizer's vocabulary when the args store it (`--vocab-size`; the padding
        // beyond it is trimmed, checked by `check_vocab`), else the embedding's rows
        // are kept.
        Rel::Vocab => one(args.field("vocab_size").map(Json::from)),
        // As stored: an integer stays one (DSA's `index_topk`).
        Rel::Float => one(args
            .raw(c.args)
            .filter(|v| v.is_number() || v.is_boolean())
            .cloned()),
        Rel::TopkNorm => one(topk_norm_from_args(c, args).map(Json::from)),
        Rel::SharedExperts => one(shared_experts_from_args(c, args).map(Json::from)),
        // The family's own (its rules), SwiGLU's silu (transformers' default), and the RoPE scaling
        // (`rope_scaling_from_args`, refused by `config_from_args`).
        Rel::Router | Rel::Activation | Rel::RopeScaling => Vec::new(),
        Rel::AttnLayers => args
            .attn_layers()
            .map(|p| ("layer_types", p.into()))
            .into_iter()
            .collect(),
        Rel::ArgsTrue | Rel::ArgsFalse | Rel::MlaNormEps => Vec::new(),
        Rel::IndexerLayers => one(args.indexer_layers().map(|p| {
            p.iter()
                .map(|&full| if full { "full" } else { "shared" })
                .collect::<Vec<&str>>()
                .into()
        })),
        Rel::SlidingWindow => sliding_window_from_args(c, args),
        Rel::MoeLayers => moe_layers_from_args(spec.moe_layers, args),
    }
}

/// `norm_topk_prob` from the router's scoring: a sigmoid router renormalises its top-k, a
/// softmax one unless `moe_router_pre_softmax` (see [`Rel::TopkNorm`]).
fn topk_norm_from_args(c: &Check, args: &Args) -> Option<bool> {
    match args.raw(c.args).and_then(|v| v.as_str()) {
        Some("sigmoid") => Some(true),
        _ => args.flag("moe_router_pre_softmax").map(|pre| !pre),
    }
}

/// deepseek_v3's `n_shared_experts`: the shared experts' size in experts' sizes (see
/// [`Rel::SharedExperts`]); none when it is no whole number of them.
fn shared_experts_from_args(c: &Check, args: &Args) -> Option<u64> {
    if !args.0.contains_key(c.args) {
        return None;
    }
    let shared = args.field(c.args).unwrap_or(0);
    let each = args.field("moe_ffn_hidden_size").filter(|&f| f > 0);
    each.filter(|f| shared % f == 0).map(|f| shared / f)
}

/// gpt_oss's `sliding_window` (the first windowed layer's) and `layer_types` from the args'
/// windows of each layer.
fn sliding_window_from_args(c: &Check, args: &Args) -> Vec<(&'static str, Json)> {
    let n = args.field("num_layers").unwrap_or(0);
    let Some(w) = args.layer_windows(n) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if let Some(&Some(size)) = w.iter().find(|w| w.is_some()) {
        out.push((c.hf, size.into()));
    }
    let types: Vec<&str> = w
        .iter()
        .map(|w| match w {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    out.push(("layer_types", types.into()));
    out
}

/// The MoE layer pattern from the args, in the field of the family's [`LayerPattern`].
fn moe_layers_from_args(pattern: LayerPattern, args: &Args) -> Vec<(&'static str, Json)> {
    let Some(p) = args.moe_layers() else {
        return Vec::new();
    };
    let dense: Vec<u64> = (0..p.len() as u64).filter(|&l| !p[l as usize]).collect();
    let leading = p.iter().take_while(|&&m| !m).count();
    match pattern {
        LayerPattern::FirstKDense => vec![("first_k_dense_replace", leading.into())],
        LayerPattern::QwenSparseStep => vec![("mlp_only_layers", dense.into())],
        // Every layer or none is MoE whatever the config says.
        LayerPattern::AllMoe | LayerPattern::Dense => Vec::new(),
    }
}

/// Megatron's RoPE scaling (`--use-rope-scaling`, llama3's; `--rope-type yarn`), as the
/// config's rope type: a config built from the args describes plain RoPE only, so
/// `config_from_args` refuses it rather than drop the scaling.
fn rope_scaling_from_args(args: &Args) -> Option<Json> {
    let scaling = match args.raw("rope_type").and_then(|v| v.as_str()) {
        Some("yarn") => "yarn (args.rope_type)",
        _ if args.flag("use_rope_scaling") == Some(true) => "llama3 (args.use_rope_scaling)",
        _ => return None,
    };
    let mut rope = Map::new();
    rope.insert("rope_type".into(), scaling.into());
    Some(rope.into())
}

/// Checks that the args gave the fields no model can be built without.
///
/// Errors: [`Error::InvalidArgument`] naming the first args field missing.
fn check_required_from_args(spec: &ArchSpec, cfg: &Map<String, Json>) -> Result<()> {
    let need = ["num_hidden_layers", "hidden_size", "num_attention_heads"];
    if let Some(missing) = need.iter().find(|k| !cfg.contains_key(**k)) {
        let arg = spec
            .checks()
            .find(|c| c.hf == *missing)
            .map_or("", |c| c.args);
        return Err(Error::InvalidArgument(format!(
            "the checkpoint's args have no {arg}; pass --hf-config"
        )));
    }
    Ok(())
}

/// Args fields whose None Megatron computes as a number (megatron-core 0.19 `moe_utils.py`
/// `topk_routing_with_score_function`: no scaling factor scales by 1; no groups is one group, all
/// of it kept).
const NONE_MEANS: &[(&str, f64)] = &[
    ("moe_router_topk_scaling_factor", 1.0),
    ("moe_router_num_groups", 1.0),
    ("moe_router_group_topk", 1.0),
];

/// Megatron's `args` (an `argparse.Namespace`), its attributes as JSON values (ints, floats,
/// bools, strings, None and lists of them; other objects as null).
pub(crate) struct Args(pub Map<String, Json>);

impl Args {
    fn raw(&self, k: &str) -> Option<&Json> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    /// A boolean args field (false when absent, as argparse's store_true default).
    pub fn flag(&self, k: &str) -> Option<bool> {
        match self.raw(k) {
            Some(Json::Bool(b)) => Some(*b),
            Some(v) => v.as_u64().map(|n| n != 0),
            None => self.0.contains_key(k).then_some(false),
        }
    }

    /// The HybridModel layer pattern a hybrid run stores (Megatron-LM's `hybrid_layer_pattern`, or
    /// the deprecated `hybrid_override_pattern` it replaces; `arguments.py` `validate_args`): the
    /// field's name and value. None for a GPTModel's args.
    pub fn hybrid_pattern(&self) -> Option<(&'static str, &str)> {
        ["hybrid_layer_pattern", "hybrid_override_pattern"]
            .into_iter()
            .find_map(|f| Some((f, self.raw(f)?.as_str().filter(|p| !p.is_empty())?)))
    }

    /// The args field a layer pattern comes from: a hybrid run's pattern, else `field`.
    fn pattern_field<'a>(&self, field: &'a str) -> &'a str {
        self.hybrid_pattern().map_or(field, |(f, _)| f)
    }

    /// The stored pattern, parsed (None for a GPTModel's args or a pattern that does not pair:
    /// `Layout::detect` refuses that one first).
    fn hybrid(&self) -> Option<HybridPattern> {
        let (f, p) = self.hybrid_pattern()?;
        HybridPattern::parse(p, f).ok()
    }

    /// An integer args field with Megatron's defaults (`validate_args`): `num_query_groups` is
    /// `num_attention_heads` without `group_query_attention`, `kv_channels` defaults to
    /// `hidden_size / num_attention_heads`, `moe_ffn_hidden_size` to `ffn_hidden_size`,
    /// `num_experts` None is 0. `num_layers` counts HF layers: a hybrid run's counts every
    /// attention and every MLP layer of its pattern, two per HF layer. None when absent (the
    /// check is then reported as unchecked).
    pub fn field(&self, k: &str) -> Option<u64> {
        let raw = |k: &str| self.raw(k).and_then(|v| v.as_u64());
        match k {
            "num_layers" if self.hybrid_pattern().is_some() => Some(self.hybrid()?.hf_layers()),
            "num_query_groups" if self.flag("group_query_attention") != Some(true) => {
                raw("num_attention_heads")
            }
            "kv_channels" => raw(k).or_else(|| {
                Some(raw("hidden_size")? / raw("num_attention_heads").filter(|&h| h > 0)?)
            }),
            "moe_ffn_hidden_size" => raw(k).or_else(|| raw("ffn_hidden_size")),
            "num_experts" => raw(k).or_else(|| self.0.contains_key(k).then_some(0)),
            _ => raw(k),
        }
    }

    /// Megatron's attention window of each of `n` layers as an HF `sliding_window` (None: full
    /// attention): `window_size` (left, right) is `left + 1` tokens, on layers (Megatron's 1-based
    /// numbers, [`Args::attention_number`]) not a multiple of an int `window_attn_skip_freq`, or
    /// those a list marks 1 (MC `is_layer_window_attention`). A right window other than 0 is no HF sliding window: it shows
    /// as `u64::MAX`. None when args have no `window_size` field.
    pub fn layer_windows(&self, n: u64) -> Option<Vec<Option<u64>>> {
        if !self.0.contains_key("window_size") {
            return None;
        }
        let w = self.raw("window_size").and_then(|v| v.as_array()).map(|a| {
            match (
                a.first().and_then(|x| x.as_i64()),
                a.get(1).and_then(|x| x.as_i64()),
            ) {
                (Some(left), Some(0)) if left >= 0 => left as u64 + 1,
                _ => u64::MAX,
            }
        });
        let freq = self.raw("window_attn_skip_freq");
        Some(
            (0..n)
                .map(|l| {
                    let l = self.attention_number(l);
                    let windowed = match freq {
                        None => true,
                        Some(Json::Array(a)) => {
                            a.get(l as usize - 1).and_then(|x| x.as_i64()).unwrap_or(0) != 0
                        }
                        Some(f) => f.as_u64().is_some_and(|f| f == 0 || l % f != 0),
                    };
                    w.filter(|_| windowed)
                })
                .collect(),
        )
    }

    /// A number of the args (None when absent or not a number).
    pub fn float(&self, k: &str) -> Option<f64> {
        self.raw(k).and_then(|v| v.as_f64())
    }

    /// A number of the args as Megatron computes with it: the stored number, or for a None the
    /// number Megatron then uses ([`NONE_MEANS`]); None when absent, or None with no such number.
    pub fn value(&self, k: &str) -> Option<f64> {
        match self.0.get(k)? {
            Json::Null => NONE_MEANS.iter().find(|(f, _)| *f == k).map(|(_, v)| *v),
            v => v.as_f64(),
        }
    }

    /// Per layer, the attention type (`linear_attention` or `full_attention`):
    /// `linear_attention_freq` (an int N: full attention iff (i + 1) % N == 0; a list: 1 linear,
    /// 0 full), all `full_attention` when `experimental_attention_variant` is not
    /// `gated_delta_net`. None when args lack `num_layers`, or the variant with no frequency.
    pub fn attn_layers(&self) -> Option<Vec<String>> {
        let n = self.field("num_layers")? as usize;
        let name = |linear: bool| {
            if linear {
                "linear_attention"
            } else {
                "full_attention"
            }
            .to_string()
        };
        if let Some(p) = self.hybrid() {
            // A hybrid pattern names each attention: Gated DeltaNet 'G' is linear attention.
            return Some((0..n as u64).map(|l| name(p.mixer(l) == b'G')).collect());
        }
        if self
            .raw("experimental_attention_variant")
            .and_then(|v| v.as_str())
            != Some("gated_delta_net")
        {
            return Some(vec![name(false); n]);
        }
        match self.raw("linear_attention_freq")? {
            Json::Array(a) => Some(a.iter().map(|x| name(x.as_u64() == Some(1))).collect()),
            v => {
                let k = v.as_u64()?.max(1) as usize;
                Some((0..n).map(|i| name((i + 1) % k != 0)).collect())
            }
        }
    }

    /// Per layer, MoE or not: `moe_layer_freq` (an int k: every k-th layer from 0; a list of
    /// 0/1), all dense without experts; a hybrid run's pattern instead ('E' MLPs; a HybridModel
    /// ignores `moe_layer_freq`). None when args lack `num_layers`.
    pub fn moe_layers(&self) -> Option<Vec<bool>> {
        let n = self.field("num_layers")? as usize;
        if let Some(p) = self.hybrid() {
            return Some((0..n as u64).map(|l| p.mlp(l) == b'E').collect());
        }
        if self.field("num_experts").unwrap_or(0) == 0 {
            return Some(vec![false; n]);
        }
        match self.raw("moe_layer_freq") {
            None => Some(vec![true; n]),
            Some(Json::Array(a)) => Some(a.iter().map(|x| x.as_u64() == Some(1)).collect()),
            Some(v) => {
                let k = v.as_u64()?.max(1) as usize;
                Some((0..n).map(|l| l % k == 0).collect())
            }
        }
    }

    /// Per HF layer, whether its DSA attention runs its own indexer: megatron-core's schedule
    /// (`dsa.is_dsa_skip_topk_layer`): with `dsa_indexer_topk_freq` f > 1 and
    /// `dsa_indexer_skip_topk_offset` o, Megatron layer n ([`Args::attention_number`]) skips iff
    /// max(n - max(o, 1), 0) % f != 0. None when args lack `num_layers`.
    pub fn indexer_layers(&self) -> Option<Vec<bool>> {
        let n = self.field("num_layers")?;
        let freq = self.field("dsa_indexer_topk_freq").unwrap_or(1).max(1);
        let offset = self
            .field("dsa_indexer_skip_topk_offset")
            .unwrap_or(0)
            .max(1);
        Some(
            (0..n)
                .map(|l| self.attention_number(l).saturating_sub(offset) % freq == 0)
                .collect(),
        )
    }

    /// Megatron's 1-based layer number (`layer_number`, what its per-layer schedules count) of HF
    /// layer `l`'s attention: l + 1, or 2l + 1 in a hybrid run (an MLP layer follows each).
    fn attention_number(&self, l: u64) -> u64 {
        if self.hybrid_pattern().is_some() {
            2 * l + 1
        } else {
            l + 1
        }
    }
}

/// The stored args of `ckpt`: `args` from the common state (`common.pt`, or the `common_state`
/// byte object inside the `.distcp` files of megatron-core 0.19), read as data by the safe
/// unpickler. None when the checkpoint has no common state or it holds no `args`.
///
/// Errors: [`Error::Corrupt`] for a damaged common state (zip CRCs are checked by the reader).
pub(crate) fn megatron_args(ckpt: &Checkpoint) -> Result<Option<Args>> {
    let Some(common) = ckpt.read_common()? else {
        return Ok(None);
    };
    let bytes = common.bytes;
    let path = ckpt.dir().join(&common.source);
    let corrupt = |r: String| Error::Corrupt {
        path: path.clone(),
        reason: r,
    };
    let archive = Archive::read(&bytes[..]).map_err(|e| corrupt(e.0))?;
    let pkl = archive.data_pkl().map_err(|e| corrupt(e.0))?;
    let top = unpickle(&bytes[pkl.start..pkl.start + pkl.len]).map_err(|e| corrupt(e.0))?;
    // common.pt holds the state dict; megatron-core 0.19's `common_state` object holds it as the
    // one item of a list (its loader takes `loaded[0]`, serialization.py
    // `load_common_state_dict`).
    let state = match top.items() {
        Some(items) => match items.into_iter().next() {
            Some(first) => first,
            None => return Ok(None),
        },
        None => (*top).clone(),
    };
    let Some(args) = state.get("args") else {
        return Ok(None);
    };
    let state = match &args {
        Value::Object(o) => o.state.borrow().clone(),
        _ => None,
    };
    let Some(Value::Dict(d)) = state.as_ref() else {
        return Ok(None);
    };
    let out: Map<String, Json> = d
        .borrow()
        .iter()
        .filter_map(|(k, v)| Some((k.as_str()?.to_string(), json_of(v, 0))))
        .collect();
    // Per-layer tables are built from these (attention and MoE patterns): an absurd count is
    // refused before any is.
    for k in ["num_layers", "mtp_num_layers", "num_experts"] {
        if let Some(n) = out
            .get(k)
            .and_then(|v| v.as_u64())
            .filter(|&n| n > MAX_COUNT)
        {
            return Err(corrupt(format!(
                "args.{k} = {n} is more than any model holds (at most {MAX_COUNT})"
            )));
        }
    }
    Ok(Some(Args(out)))
}

/// A plain pickle value as JSON (nested lists to a small depth; anything else null).
fn json_of(v: &Value, depth: usize) -> Json {
    match v {
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => i64::try_from(*i).map_or(Json::Null, Json::from),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(Json::Null, Json::Number),
        Value::Str(s) => Json::String(s.to_string()),
        Value::Tuple(_) | Value::List(_) if depth < 4 => Json::Array(
            v.items()
                .unwrap_or_default()
                .iter()
                .map(|x| json_of(x, depth + 1))
                .collect(),
        ),
        _ => Json::Null,
    }
}

/// Checks the config's values as Megatron and the serving engines compute with them (the config's
/// own or transformers' defaults): a positive, finite norm epsilon; a positive integer context
/// length; an MTP layer count that is a non-negative integer (not -1, "1", null, 1.5 or true,
/// which transformers and vLLM would read otherwise than from-hf); for a model with experts a
/// router top-k from 1 to the experts, and a group-limited router whose groups fit
/// ([`check_router_groups`]); a boolean where a check row reads one. Run by from-hf before
/// anything is planned and by to-hf before anything is written (on a config built from the args
/// too). `source` names the config in messages (`config.json`, or the config built from the
/// args).
///
/// Errors: [`Error::InvalidArgument`] naming the field and its value.
pub(crate) fn check_values(d: &Dims, source: &str) -> Result<()> {
    let bad = |k: &str, v: &Json, why: &str| Err(value_error(d, source, k, v, why));
    let positive = |v: &Json| v.as_f64().is_some_and(|x| x > 0.0 && x.is_finite());
    if let Some(v) = d.value("rms_norm_eps").filter(|v| !positive(v)) {
        return bad(
            "rms_norm_eps",
            v,
            "the norms' epsilon must be a positive number (Megatron's --norm-epsilon)",
        );
    }
    if let Some(v) = d
        .value("max_position_embeddings")
        .filter(|v| v.as_u64().unwrap_or(0) == 0)
    {
        return bad(
            "max_position_embeddings",
            v,
            "the context length must be a positive integer",
        );
    }
    for k in MTP_FIELDS {
        if let Some(v) = d.cfg.get(*k).filter(|v| v.as_u64().is_none()) {
            return bad(k, v, "an MTP layer count must be a non-negative integer");
        }
    }
    for c in d
        .spec
        .checks()
        .filter(|c| matches!(c.rel, Rel::TopkNorm | Rel::Same | Rel::Not))
    {
        if let Some(v) = d.cfg.get(c.hf).filter(|v| !v.is_boolean()) {
            return bad(c.hf, v, "must be true or false");
        }
    }
    if d.num_experts > 0 {
        check_router_groups(d, source)?;
    }
    Ok(())
}

/// `"<source>: <k> = <v>: <why>"`, the value marked as transformers' default when the config does
/// not state it.
fn value_error(d: &Dims, source: &str, k: &str, v: &Json, why: &str) -> Error {
    let default = if d.stated(k) {
        ""
    } else {
        " (transformers' default: the config has none)"
    };
    Error::InvalidArgument(format!("{source}: {k} = {v}{default}: {why}"))
}

/// The router of a model with `d.num_experts` experts: `num_experts_per_tok` picks 1 to all of
/// them; a group-limited router (a family with `n_group`, `topk_group`) has `n_group` dividing the
/// experts into groups of at least 2 (transformers scores a group by its top 2), `topk_group` from
/// 1 to `n_group`, and its kept groups hold the top-k; with more than one group, Megatron scores a
/// group by its top `topk / topk_group` (MC 0.19 `moe_utils.py` `group_limited_topk`), so that
/// must be transformers' 2.
///
/// Errors: [`Error::InvalidArgument`] naming the field and its value.
fn check_router_groups(d: &Dims, source: &str) -> Result<()> {
    let e = d.num_experts;
    let int = |k: &str| d.value(k).map(|v| (v.as_u64(), v.clone()));
    let bad = |k: &str, v: &Json, why: String| Err(value_error(d, source, k, v, &why));
    let topk = match int("num_experts_per_tok") {
        Some((Some(k), _)) if (1..=e).contains(&k) => k,
        Some((_, v)) => {
            return bad(
                "num_experts_per_tok",
                &v,
                format!("a router picks 1 to {e} experts per token (num_experts {e})"),
            )
        }
        None => return Ok(()),
    };
    if !d.spec.checks().any(|c| c.hf == "n_group") {
        return Ok(());
    }
    let (Some((g, gv)), Some((kg, kgv))) = (int("n_group"), int("topk_group")) else {
        return Ok(());
    };
    let Some(g) = g.filter(|&g| g >= 1 && e % g == 0 && (g == 1 || e / g >= 2)) else {
        return bad(
            "n_group",
            &gv,
            format!("the groups must split num_experts {e} evenly, at least 2 experts each"),
        );
    };
    let Some(kg) = kg.filter(|&k| (1..=g).contains(&k)) else {
        return bad(
            "topk_group",
            &kgv,
            format!("a router keeps 1 to n_group = {g} groups"),
        );
    };
    if topk > kg * (e / g) {
        return bad(
            "num_experts_per_tok",
            &Json::from(topk),
            format!("topk_group = {kg} groups of {} experts hold fewer", e / g),
        );
    }
    if g > 1 && topk / kg != 2 {
        return bad(
            "topk_group",
            &kgv,
            format!(
                "with n_group = {g}, transformers scores a group by its top 2 experts and Megatron by its top num_experts_per_tok / topk_group = {topk} / {kg}: the two route differently unless that is 2"
            ),
        );
    }
    Ok(())
}

/// The MTP layers to convert, and what to warn about: the checkpoint holds `in_ckpt` of them
/// (`mtp.layers.{k}.*`), `args.mtp_num_layers` must say the same, and config.json must declare
/// them (`num_nextn_predict_layers`, `mtp_num_hidden_layers`; see [`super::spec::MtpSpec`]). A
/// config that declares MTP layers for a checkpoint without any converts with a warning
/// (transformers' deepseek_v3 and glm4_moe configs declare 1 by default); the config.json
/// written then says how many were converted. `drop` (`--drop-mtp`) converts none.
///
/// Errors: [`Error::Validation`] naming both sides when the args disagree with the checkpoint,
/// or when the checkpoint's MTP layers cannot all be converted (the config declares another
/// count, the family has no MTP layout, or its layout holds one MTP layer and there are more),
/// unless `drop`.
pub(crate) fn mtp_layers(
    d: &Dims,
    in_ckpt: u64,
    args: Option<&Args>,
    drop: bool,
) -> Result<(u64, Vec<String>)> {
    let declared = d.declared_mtp();
    let field = d.spec.mtp.map_or("num_nextn_predict_layers", |m| m.field);
    let model_type = d.spec.model_types[0];
    if let Some((f, p)) = args.and_then(|a| a.hybrid_pattern()) {
        let depths = super::layout::mtp_depths(p, &format!("args.{f} {p:?}"))?;
        if depths != in_ckpt {
            return Err(Error::Validation(format!(
                "args.{f} {p:?} has {depths} MTP depth(s) (after '/'), the checkpoint holds {in_ckpt} MTP layer(s) (mtp.layers.*)"
            )));
        }
    }
    if let Some(a) = args.and_then(|a| a.field("mtp_num_layers")) {
        if a != in_ckpt {
            return Err(Error::Validation(format!(
                "args.mtp_num_layers says {a}, the checkpoint holds {in_ckpt} MTP layer(s) (mtp.layers.*)"
            )));
        }
    }
    if drop {
        let note = if in_ckpt > 0 {
            vec![format!(
                "--drop-mtp: the checkpoint's {in_ckpt} MTP layer(s) are not converted; config.json says {field} 0"
            )]
        } else {
            Vec::new()
        };
        return Ok((0, note));
    }
    let refuse = |why: String| {
        Err(Error::Validation(format!(
            "the checkpoint holds {in_ckpt} MTP layer(s) (mtp.layers.*){why}; pass --drop-mtp to convert without them"
        )))
    };
    match d.spec.mtp {
        _ if in_ckpt == 0 && declared > 0 => Ok((
            0,
            vec![format!(
                "config.json's {field} says {declared}{}, but the checkpoint holds no MTP layers: none converted, and the config.json written says {field} 0",
                if d.field(field).is_none() {
                    " (transformers' default)"
                } else {
                    ""
                }
            )],
        )),
        _ if in_ckpt == 0 => Ok((0, Vec::new())),
        None => refuse(
            match super::rules::MTP_NOT_RELEASED
                .iter()
                .find(|(t, _)| d.spec.model_types.contains(t))
            {
                Some((_, why)) => format!(", but {why}"),
                None => format!(", but shardwise knows no HF layout of MTP layers for {model_type}"),
            },
        ),
        Some(_) if declared != in_ckpt => refuse(format!(
            ", but config.json's {field} says {declared}{}",
            if d.field(field).is_none() {
                " (absent)"
            } else {
                ""
            }
        )),
        Some(m) if in_ckpt > 1 && !m.per_layer_names() => refuse(format!(
            ", but {model_type}'s HF layout holds one MTP module (mtp.fc, mtp.norm, ...)"
        )),
        Some(_) => Ok((in_ckpt, Vec::new())),
    }
}

/// The multimodal config keys a text-only config leaves out.
const MULTIMODAL_KEYS: &[&str] = &[
    "text_config",
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_token_id",
];

/// The config.json to write beside the weights: `given` (the `--hf-config` bytes) as it is when
/// the conversion changes nothing it says; otherwise rewritten (keys sorted, as transformers
/// writes them): the text model's own config for `--text-only` of a multimodal config
/// (`text_config` over the top-level fields, `model_type` and `architectures` of the text
/// model), and the family's MTP field set to the MTP layers converted.
///
/// Errors: [`Error::InvalidArgument`] when `given` is not a JSON object.
pub(crate) fn output_config(given: &[u8], d: &Dims, text_only: bool) -> Result<Vec<u8>> {
    let Ok(Json::Object(orig)) = serde_json::from_slice::<Json>(given) else {
        return Err(Error::InvalidArgument(
            "config.json is not a JSON object".into(),
        ));
    };
    let mut out = orig.clone();
    if let (true, true, Some(mm)) = (text_only, d.multimodal, d.spec.multimodal) {
        let text = match orig.get("text_config") {
            Some(Json::Object(t)) => t.clone(),
            _ => Map::new(),
        };
        out.retain(|k, _| !MULTIMODAL_KEYS.contains(&k.as_str()));
        out.extend(text);
        out.insert("model_type".into(), mm.text_model_type.into());
        out.insert("architectures".into(), vec![mm.text_architecture].into());
    }
    if let Some(m) = d.spec.mtp {
        let target = match out.get_mut("text_config") {
            Some(Json::Object(t)) => t,
            _ => &mut out,
        };
        if target
            .get(m.field)
            .and_then(|v| v.as_u64())
            .unwrap_or(m.default)
            != d.mtp_layers
        {
            target.insert(m.field.into(), d.mtp_layers.into());
        }
    }
    if out == orig {
        return Ok(given.to_vec());
    }
    let mut bytes = serde_json::to_vec_pretty(&Json::Object(out)).expect("serializable");
    bytes.push(b'\n');
    Ok(bytes)
}

/// `config` (config.json bytes) with `quantization_config` set to `q`, or removed when None; the
/// bytes as they are when that changes nothing.
///
/// Errors: [`Error::InvalidArgument`] when `config` is not a JSON object.
pub(crate) fn with_quantization(config: &[u8], q: Option<&Json>) -> Result<Vec<u8>> {
    let Ok(Json::Object(mut out)) = serde_json::from_slice::<Json>(config) else {
        return Err(Error::InvalidArgument(
            "config.json is not a JSON object".into(),
        ));
    };
    let before = out.get("quantization_config").cloned();
    match q {
        Some(q) => out.insert("quantization_config".into(), q.clone()),
        None => out.remove("quantization_config"),
    };
    if out.get("quantization_config") == before.as_ref() {
        return Ok(config.to_vec());
    }
    let mut bytes = serde_json::to_vec_pretty(&Json::Object(out)).expect("serializable");
    bytes.push(b'\n');
    Ok(bytes)
}

/// `config` (config.json bytes) declaring `dtype`, the dtype the weights are written in, in its
/// `dtype` (transformers 5's name) and `torch_dtype` (the older name), each where the config has
/// that field; the bytes as they are when that changes nothing. A config declaring float32 over bf16
/// weights makes `from_pretrained` load them as float32.
///
/// Errors: [`Error::InvalidArgument`] when `config` is not a JSON object.
pub(crate) fn with_dtype(config: &[u8], dtype: DType) -> Result<Vec<u8>> {
    let Ok(Json::Object(mut out)) = serde_json::from_slice::<Json>(config) else {
        return Err(Error::InvalidArgument(
            "config.json is not a JSON object".into(),
        ));
    };
    let name = Json::from(dtype.torch_name());
    // Only the fields the config has: a given config without one is written back as it is.
    let stale: Vec<&str> = ["dtype", "torch_dtype"]
        .into_iter()
        .filter(|k| out.contains_key(*k) && out.get(*k) != Some(&name))
        .collect();
    if stale.is_empty() {
        return Ok(config.to_vec());
    }
    for k in stale {
        out.insert(k.into(), name.clone());
    }
    let mut bytes = serde_json::to_vec_pretty(&Json::Object(out)).expect("serializable");
    bytes.push(b'\n');
    Ok(bytes)
}

/// The RoPE fields transformers 5 keeps in `rope_parameters` (a config from the args holds them
/// at the top level, as the check rows name them).
const ROPE_FIELDS: &[&str] = &["rope_theta", "partial_rotary_factor"];

/// The config.json of a conversion without `--hf-config`: `d.cfg` as [`Dims::from_args`] built it
/// from the stored args, in transformers' names: the expert count under the family's field
/// ([`super::spec::ArchSpec::experts_field`]), products of fields (check rows like
/// `n_shared_experts*moe_intermediate_size`) left out, `num_key_value_heads` always (an MLA
/// config's is its head count), the RoPE base and fraction (unless 1) in `rope_parameters` (`rope_type` `default`: Megatron's `--rope-scaling` variants are not
/// described, see docs/hf.md), `vocab_size` the tokenizer's from the args or else the embedding's
/// `rows`, the MTP field as converted (left out when 0 is its default), `model_type` and
/// `architectures` of the text model, and `dtype`, the weights' dtype as `save_pretrained`
/// writes it. Fields the args do not hold (token ids, `hidden_act`: SwiGLU's `silu` is every
/// family's default) keep transformers' defaults. Keys sorted, as transformers writes them.
///
/// Errors: [`Error::InvalidArgument`] naming every args field (and its config field) that a row
/// needs and the args do not say (absent or None): a config.json would otherwise hold
/// transformers' default for it, another model than the checkpoint's ([`unsaid`]).
pub(crate) fn config_from_args(d: &Dims, rows: Option<u64>, dtype: DType) -> Result<Vec<u8>> {
    let rope_type = d
        .cfg
        .get("rope_parameters")
        .and_then(|r| r.get("rope_type")?.as_str());
    if let Some(t) = rope_type.filter(|t| *t != "default") {
        return Err(Error::InvalidArgument(format!(
            "the checkpoint's args say RoPE scaling {t}, which a config.json built from the args does not describe (only plain RoPE); pass --hf-config (the model's config.json)"
        )));
    }
    let unsaid = unsaid(d);
    if !unsaid.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "the checkpoint's args do not say {}: a config.json built from them would hold transformers' defaults instead; pass --hf-config (the model's config.json)",
            unsaid.join(", ")
        )));
    }
    let spec = d.spec;
    let mut out = Map::new();
    for (k, v) in &d.cfg {
        if k.contains(['*', '+']) || ROPE_FIELDS.contains(&k.as_str()) {
            continue;
        }
        let name = if k == "num_experts" {
            spec.experts_field
        } else {
            k
        };
        out.insert(name.into(), v.clone());
    }
    // MLA has no query groups: its config says as many key/value heads as heads (DeepSeek-V3's).
    out.insert("num_key_value_heads".into(), d.groups.into());
    let mut rope = Map::new();
    for f in ROPE_FIELDS {
        // A rotary fraction of 1 is transformers' default and no field of the MLA configs.
        if let Some(v) = d
            .float(f)
            .filter(|&v| !(*f == "partial_rotary_factor" && v == 1.0))
        {
            rope.insert((*f).into(), v.into());
        }
    }
    if !rope.is_empty() {
        rope.insert("rope_type".into(), "default".into());
        out.insert("rope_parameters".into(), rope.into());
    }
    if let Some(v) = d.vocab_size.or(rows) {
        out.insert("vocab_size".into(), v.into());
    }
    if let Some(m) = spec.mtp {
        out.insert(m.field.into(), d.mtp_layers.into());
        if d.mtp_layers == 0 && m.default == 0 {
            out.remove(m.field);
        }
    }
    let model_type = spec
        .multimodal
        .map_or(spec.model_types[0], |m| m.text_model_type);
    out.insert("model_type".into(), model_type.into());
    out.insert("architectures".into(), vec![spec.architecture].into());
    out.insert("dtype".into(), dtype.torch_name().into());
    let mut bytes = serde_json::to_vec_pretty(&Json::Object(out)).expect("serializable");
    bytes.push(b'\n');
    Ok(bytes)
}

/// The rows of a config built from the args ([`Dims::from_args`]) whose config field the args did
/// not give, as `args field (config field)`: a value row (sizes the mapping uses, numbers, the
/// tie, the router's top-k, scoring, groups and shared experts of a model with experts, the GDN
/// layer pattern, the attention window) absent from `d.cfg`. Not listed: rows whose absence means
/// the same on both sides (Megatron's and transformers' defaults agree: glm4_moe's boolean flags,
/// the layer patterns, the DSA schedule), sizes no required rule of this model uses (an optional
/// tensor's size is checked against the tensor), and the vocabulary
/// (the embedding's rows stand in for it, see [`Rel::Vocab`]).
fn unsaid(d: &Dims) -> Vec<String> {
    let moe = d.num_experts > 0;
    d.spec
        .checks()
        .filter(|c| match c.rel {
            Rel::Eq => d.required_field(c.hf),
            Rel::Not | Rel::AttnLayers | Rel::SlidingWindow => true,
            Rel::Float => moe || !c.args.starts_with("moe_"),
            Rel::TopkNorm | Rel::SharedExperts => moe,
            _ => false,
        })
        .filter(|c| {
            let key = match c.rel {
                Rel::AttnLayers | Rel::SlidingWindow => "layer_types",
                _ => c.hf,
            };
            // A product row (`n_shared_experts*moe_intermediate_size`) is said by its factors'
            // rows (`n_shared_experts` is the SharedExperts one).
            !key.contains('*') && !d.cfg.contains_key(key)
        })
        .map(|c| match c.rel {
            Rel::TopkNorm => format!("{} / moe_router_pre_softmax ({})", c.args, c.hf),
            Rel::AttnLayers => format!("{} (layer_types)", c.args),
            _ => format!("{} ({})", c.args, c.hf),
        })
        .collect()
}

/// The outcome of checking the config against the args.
#[derive(Debug)]
pub(crate) struct ArgsCheck {
    /// `"passed"`, or `"skipped: ..."` when nothing could be checked.
    pub status: String,
    /// Check rows the args could not decide (`"head_dim (args has no kv_channels)"`).
    pub unchecked: Vec<String>,
    /// Facts the user should know about the output (see [`Rel::MlaNormEps`]).
    pub warnings: Vec<String>,
}

/// Checks every row of the architecture's check table; `rows` is the embedding's row count.
/// `allow` (`--allow-config-mismatch`) names rows (by config or args field) whose disagreement is
/// a warning instead: config.json is written as given, so its value is the one the export keeps.
///
/// Errors: [`Error::InvalidArgument`] for an `allow` name of no row ([`check_allowed`]);
/// [`Error::Validation`] naming each other disagreeing field with both values.
pub(crate) fn check_args(
    d: &Dims,
    args: Option<&Args>,
    rows: Option<u64>,
    allow: &[String],
) -> Result<ArgsCheck> {
    check_allowed(d, allow)?;
    let mut diffs = Vec::new();
    let mut unchecked = Vec::new();
    let mut warnings = Vec::new();
    for c in d.spec.checks() {
        match check_row(d, c, args, rows) {
            Some(Finding::Differs(m)) => match allowed(c, allow) {
                Some(name) => warnings.push(format!(
                    "{m} (--allow-config-mismatch {name}: written as config.json says, not as the args say)"
                )),
                None => diffs.push(m),
            },
            Some(Finding::Unchecked(m)) => unchecked.push(m),
            Some(Finding::Warning(m)) => warnings.push(m),
            None => {}
        }
    }
    if !diffs.is_empty() {
        return Err(Error::Validation(format!(
            "config.json disagrees with the checkpoint: {}; pass --allow-config-mismatch FIELD to export config.json's value anyway",
            diffs.join("; ")
        )));
    }
    Ok(ArgsCheck {
        status: if args.is_some() {
            "passed".into()
        } else {
            "skipped: no args stored".into()
        },
        unchecked,
        warnings,
    })
}

/// The name in `allow` of check row `c` (its config field or its args field), if any.
fn allowed<'a>(c: &Check, allow: &'a [String]) -> Option<&'a str> {
    allow
        .iter()
        .find(|a| **a == c.hf || **a == c.args)
        .map(String::as_str)
}

/// Checks that every `--allow-config-mismatch` name is a compared field of the architecture (a
/// misspelt name would otherwise allow nothing, silently).
///
/// Errors: [`Error::InvalidArgument`] naming the unknown name and the architecture's fields.
fn check_allowed(d: &Dims, allow: &[String]) -> Result<()> {
    let Some(bad) = allow
        .iter()
        .find(|a| !d.spec.checks().any(|c| **a == c.hf || **a == c.args))
    else {
        return Ok(());
    };
    let mut names: Vec<&str> = Vec::new();
    for c in d.spec.checks() {
        if !names.contains(&c.hf) {
            names.push(c.hf);
        }
    }
    Err(Error::InvalidArgument(format!(
        "--allow-config-mismatch {bad:?}: {} compares no such field (config fields: {})",
        d.spec.model_types[0],
        names.join(", ")
    )))
}

/// What checking one row of the check table found (nothing: the row agrees, or is no check).
#[derive(Debug, PartialEq)]
enum Finding {
    /// The config disagrees with the args or the checkpoint (naming both values).
    Differs(String),
    /// A row the args cannot decide (`"head_dim (args has no kv_channels)"`).
    Unchecked(String),
    /// A fact the user should know about the output (see [`Rel::MlaNormEps`]).
    Warning(String),
}

/// Where a row's config values come from, in the messages.
const HF_SRC: &str = crate::output::CONFIG;

/// Checks check row `c`: each relation's rule, in one place. Without args only the rows that
/// need none are checked (the MLA norms' epsilon, the vocabulary against the embedding's rows).
fn check_row(d: &Dims, c: &Check, args: Option<&Args>, rows: Option<u64>) -> Option<Finding> {
    match (c.rel, args) {
        (Rel::MlaNormEps, _) => check_mla_norm_eps(d, c, args),
        (Rel::Vocab, _) => check_vocab(d, args, rows).err().map(Finding::Differs),
        (_, None) => None,
        (Rel::Eq, Some(a)) => check_eq(d, c, a),
        (Rel::Not, Some(a)) => check_not(d, c, a),
        (Rel::Same, Some(a)) => check_same(d, c, a),
        (Rel::AttnLayers, Some(a)) => check_attn_layers(d, c, a),
        (Rel::Float, Some(a)) => check_float(d, c, a),
        (Rel::SlidingWindow, Some(a)) => check_sliding_window(d, c, a),
        (Rel::ArgsTrue | Rel::ArgsFalse, Some(a)) => check_implied_flag(d, c, a),
        (Rel::IndexerLayers, Some(a)) => check_indexer_layers(d, c, a),
        (Rel::MoeLayers, Some(a)) => check_moe_layers(d, c, a),
        (Rel::TopkNorm, Some(a)) => check_topk_norm(d, c, a),
        (Rel::SharedExperts, Some(a)) => check_shared_experts(d, c, a),
        (Rel::Router, Some(a)) => check_router(d, c, a),
        (Rel::RopeScaling, Some(a)) => check_rope_scaling(d, c, a),
        (Rel::Activation, Some(a)) => check_activation(d, c, a),
    }
}

/// [`Rel::MlaNormEps`]: a warning when the epsilon (config, else args) is not the 1e-6
/// transformers applies to the MLA norms.
fn check_mla_norm_eps(d: &Dims, c: &Check, args: Option<&Args>) -> Option<Finding> {
    let eps = d.float(c.hf).or(args.and_then(|a| a.float(c.args)));
    let eps = eps.filter(|e| (e - 1e-6).abs() > 1e-12)?;
    Some(Finding::Warning(format!(
        "{} is {eps}, but transformers' deepseek_v3 applies q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever the config says (Megatron used {eps} for them): its outputs differ slightly from Megatron's",
        c.hf
    )))
}

/// `"<hf>: config.json says <h>, args.<args> says <m>"`.
fn says(c: &Check, h: impl std::fmt::Display, m: impl std::fmt::Display) -> Finding {
    Finding::Differs(format!(
        "{}: {HF_SRC} says {h}, args.{} says {m}",
        c.hf, c.args
    ))
}

/// `"<hf> (args has no <args>)"`.
fn args_lack(c: &Check) -> Finding {
    Finding::Unchecked(format!("{} (args has no {})", c.hf, c.args))
}

/// [`Rel::Eq`].
fn check_eq(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    // A field the mapping does not use for this config is not checked (an all-MoE
    // model's args may hold any dense ffn_hidden_size).
    if !d.uses(c.hf) {
        return None;
    }
    match (d.field(c.hf), a.field(c.args)) {
        (Some(h), Some(m)) if h != m => Some(says(c, h, m)),
        (Some(_), Some(_)) => None,
        (None, Some(m)) if m != 0 => Some(Finding::Differs(format!(
            "{}: {HF_SRC} has none, args.{} says {m}",
            c.hf, c.args
        ))),
        (None, _) => None,
        (Some(_), None) => Some(args_lack(c)),
    }
}

/// [`Rel::Not`].
fn check_not(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    match (d.flag(c.hf).or(Some(d.tied)), a.flag(c.args)) {
        (Some(h), Some(m)) if h == m => Some(says(c, h, m)),
        (_, None) => Some(args_lack(c)),
        _ => None,
    }
}

/// [`Rel::Same`].
fn check_same(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    match (d.flag(c.hf).unwrap_or(false), a.flag(c.args)) {
        (h, Some(m)) if h != m => Some(says(c, h, m)),
        (_, None) => Some(args_lack(c)),
        _ => None,
    }
}

/// [`Rel::AttnLayers`].
fn check_attn_layers(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    let ours: Vec<String> = (0..d.num_layers)
        .map(|l| d.layer_type(l).unwrap_or_default())
        .collect();
    match a.attn_layers() {
        Some(p) if p != ours => {
            let show = |v: &[String]| -> String {
                v.iter()
                    .map(|t| if t == "full_attention" { 'F' } else { 'L' })
                    .collect()
            };
            Some(Finding::Differs(format!(
                "layer_types: {HF_SRC} gives {}, args.{} (experimental_attention_variant {}) gives {} (L: linear attention, F: full attention)",
                show(&ours),
                a.pattern_field(c.args),
                a.raw("experimental_attention_variant").map_or("none".into(), |v| v.to_string()),
                show(&p)
            )))
        }
        Some(_) => None,
        None => Some(Finding::Unchecked(format!(
            "layer_types (args has no {})",
            c.args
        ))),
    }
}

/// [`Rel::Float`].
fn check_float(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    if c.args.starts_with("moe_") && d.num_experts == 0 {
        return None;
    }
    match (d.float(c.hf), a.value(c.args)) {
        (Some(h), Some(m)) if (h - m).abs() > 1e-9 * h.abs().max(m.abs()) => Some(says(
            c,
            stated(d, c.hf, h),
            match a.raw(c.args) {
                Some(_) => m.to_string(),
                None => format!("None ({m})"),
            },
        )),
        (Some(_), None) => Some(args_lack(c)),
        _ => None,
    }
}

/// `v`, marked as transformers' default when the config does not state field `k`.
fn stated(d: &Dims, k: &str, v: impl std::fmt::Display) -> String {
    if d.stated(k) {
        v.to_string()
    } else {
        format!("nothing (transformers' default {v})")
    }
}

/// [`Rel::TopkNorm`].
fn check_topk_norm(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    if d.num_experts == 0 {
        return None;
    }
    let (h, m) = (d.flag(c.hf)?, topk_norm_from_args(c, a));
    match m {
        Some(m) if m != h => Some(Finding::Differs(format!(
            "{}: {HF_SRC} says {}, but args.{} {} with moe_router_pre_softmax {} renormalises the top-k: {m}",
            c.hf,
            stated(d, c.hf, h),
            c.args,
            a.raw(c.args).map_or("None".into(), |v| v.to_string()),
            a.flag("moe_router_pre_softmax").unwrap_or(false),
        ))),
        Some(_) => None,
        None => Some(Finding::Unchecked(format!(
            "{} (args has no {} / moe_router_pre_softmax)",
            c.hf, c.args
        ))),
    }
}

/// [`Rel::SharedExperts`].
fn check_shared_experts(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    if d.num_experts == 0 {
        return None;
    }
    if !a.0.contains_key(c.args) {
        return Some(args_lack(c));
    }
    let h = d.field(c.hf).unwrap_or(0);
    let size = a.field(c.args).unwrap_or(0);
    let Some(each) = a.field("moe_ffn_hidden_size").filter(|&f| f > 0) else {
        return Some(Finding::Unchecked(format!(
            "{} (args has no moe_ffn_hidden_size)",
            c.hf
        )));
    };
    let m = (size % each == 0).then_some(size / each);
    (m != Some(h)).then(|| {
        Finding::Differs(format!(
            "{}: {HF_SRC} says {}, args.{} says {size} = {} x moe_ffn_hidden_size {each}",
            c.hf,
            stated(d, c.hf, h),
            c.args,
            m.map_or(format!("{:.2}", size as f64 / each as f64), |m| m
                .to_string())
        ))
    })
}

/// What the family's router computes, in Megatron's terms: whether it scores by sigmoid with the
/// expert bias (its rules require `mlp.router.expert_bias` on every MoE layer: deepseek_v3,
/// glm4_moe, the DSA families, minimax_m2; Qwen's optional bias is no sigmoid router), and whether
/// it renormalises its top-k whatever the config says (a family without a `norm_topk_prob` row:
/// mixtral, gpt_oss, qwen3_5_moe, minimax_m2). The one reading of the family for both directions:
/// from-hf writes these args, to-hf checks them ([`Rel::Router`]).
pub(crate) fn family_router(d: &Dims) -> (bool, bool) {
    let sigmoid = d
        .spec
        .layer_rule("mlp.router.expert_bias")
        .is_some_and(|r| r.when == When::MoeLayer);
    let always_renormalises = !d.spec.checks().any(|c| c.rel == Rel::TopkNorm);
    (sigmoid, always_renormalises)
}

/// [`Rel::Router`].
fn check_router(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    if d.num_experts == 0 {
        return None;
    }
    let Some(score) = a.raw(c.args).and_then(|v| v.as_str()) else {
        return Some(args_lack(c));
    };
    let (sigmoid, renormalises) = family_router(d);
    let model_type = d.spec.model_types[0];
    let want = if sigmoid { "sigmoid" } else { "softmax" };
    let differs = |m: String| Some(Finding::Differs(format!("{}: {m}", c.hf)));
    if score != want {
        return differs(format!(
            "{model_type} routes by {want} scores, args.{} says {score}",
            c.args
        ));
    }
    if sigmoid && a.flag("moe_router_enable_expert_bias") == Some(false) {
        return differs(format!(
            "{model_type} adds the expert bias (e_score_correction_bias) to its sigmoid scores, args.moe_router_enable_expert_bias says false"
        ));
    }
    if renormalises && a.flag("moe_router_pre_softmax") == Some(true) {
        return differs(format!(
            "{model_type} renormalises its top-k (softmax over the top-k), args.moe_router_pre_softmax says true (softmax over all experts)"
        ));
    }
    None
}

/// [`Rel::Activation`].
fn check_activation(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    let act = d.value(c.hf).map_or("silu".into(), |v| match v.as_str() {
        Some(s) => s.to_string(),
        None => v.to_string(),
    });
    let Some(swiglu) = a.flag(c.args) else {
        return Some(args_lack(c));
    };
    let squared = a.flag("squared_relu") == Some(true);
    if act == "silu" && swiglu && !squared {
        return None;
    }
    Some(Finding::Differs(format!(
        "{}: {HF_SRC} says {} (a gated MLP: act(gate) x up), args.{} says {swiglu}{} (Megatron's --swiglu is silu)",
        c.hf,
        stated(d, c.hf, &act),
        c.args,
        if squared { ", squared_relu true" } else { "" }
    )))
}

/// yarn's parameters: the config's name and Megatron-LM's argument (`arguments.py`, core_r0.19.0).
pub(crate) const YARN_ARGS: &[(&str, &str)] = &[
    ("factor", "rotary_scaling_factor"),
    (
        "original_max_position_embeddings",
        "yarn_original_max_position_embeddings",
    ),
    ("beta_fast", "yarn_beta_fast"),
    ("beta_slow", "yarn_beta_slow"),
    ("mscale", "mscale"),
    ("mscale_all_dim", "mscale_all_dim"),
];

/// A RoPE scaling as one side computes it.
#[derive(Debug, PartialEq)]
pub(crate) enum Scaling {
    /// Plain RoPE.
    Plain,
    /// llama3's, with megatron-core's fixed low_freq_factor 1, high_freq_factor 4 and
    /// original_max_position_embeddings 8192: its factor.
    Llama3(Option<f64>),
    /// yarn's: each of [`YARN_ARGS`] the side states.
    Yarn(Vec<(&'static str, f64)>),
    /// One Megatron has no arguments for (the config's description).
    Other(String),
}

impl std::fmt::Display for Scaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scaling::Plain => write!(f, "plain RoPE"),
            Scaling::Llama3(k) => write!(f, "llama3 scaling (factor {})", show_num(*k)),
            Scaling::Yarn(p) => {
                let p: Vec<String> = p.iter().map(|(k, v)| format!("{k} {v}")).collect();
                write!(f, "yarn scaling ({})", p.join(", "))
            }
            Scaling::Other(s) => write!(f, "{s}, which Megatron has no arguments for"),
        }
    }
}

fn show_num(v: Option<f64>) -> String {
    v.map_or("None".into(), |v| v.to_string())
}

/// The config's RoPE scaling (its `rope_parameters` or `rope_scaling`, `rope_type` or `type`;
/// else transformers' default, [`Dims::rope_params`]).
pub(crate) fn config_scaling(d: &Dims) -> Scaling {
    let Some(p) = d.rope_params() else {
        return Scaling::Plain;
    };
    let num = |k: &str| p.get(k).and_then(|v| v.as_f64());
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Scaling::Plain,
        "llama3"
            if num("low_freq_factor") == Some(1.0)
                && num("high_freq_factor") == Some(4.0)
                && num("original_max_position_embeddings") == Some(8192.0) =>
        {
            Scaling::Llama3(num("factor"))
        }
        "llama3" => Scaling::Other(
            "rope_type \"llama3\" with another low_freq_factor, high_freq_factor or original_max_position_embeddings than megatron-core's 1, 4, 8192".into(),
        ),
        "yarn" => Scaling::Yarn(
            YARN_ARGS
                .iter()
                .filter_map(|(k, _)| Some((*k, num(k)?)))
                .collect(),
        ),
        other => Scaling::Other(format!("rope_type {other:?}")),
    }
}

/// The args' RoPE scaling (`--use-rope-scaling` llama3's; `--rope-type yarn` or
/// `--position-embedding-type yarn`; `rope_type` None: yarn for MLA, MC `MLATransformerConfig`);
/// None when the args say none of `rope_type`, `use_rope_scaling`, `position_embedding_type`.
fn args_scaling(a: &Args) -> Option<Scaling> {
    let said = ["rope_type", "use_rope_scaling", "position_embedding_type"];
    if !said.iter().any(|k| a.0.contains_key(*k)) {
        return None;
    }
    let rope_type = a.raw("rope_type").and_then(|v| v.as_str());
    let yarn = rope_type == Some("yarn")
        || a.raw("position_embedding_type").and_then(|v| v.as_str()) == Some("yarn")
        || (rope_type.is_none() && a.flag("multi_latent_attention") == Some(true));
    Some(if a.flag("use_rope_scaling") == Some(true) {
        Scaling::Llama3(a.value("rope_scaling_factor"))
    } else if yarn {
        Scaling::Yarn(
            YARN_ARGS
                .iter()
                .filter_map(|(k, m)| Some((*k, a.value(m)?)))
                .collect(),
        )
    } else {
        Scaling::Plain
    })
}

/// Whether two scalings compute the same: the same kind and factor, and yarn's other parameters
/// equal where both sides state them.
fn same_scaling(h: &Scaling, m: &Scaling) -> bool {
    match (h, m) {
        (Scaling::Yarn(h), Scaling::Yarn(m)) => {
            let get = |p: &[(&str, f64)], k: &str| p.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
            get(h, "factor") == get(m, "factor")
                && h.iter().all(|(k, v)| get(m, k).is_none_or(|w| w == *v))
        }
        _ => h == m,
    }
}

/// [`Rel::RopeScaling`].
fn check_rope_scaling(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    let Some(m) = args_scaling(a) else {
        return Some(Finding::Unchecked(format!(
            "{} (args has no rope_type / use_rope_scaling)",
            c.hf
        )));
    };
    let h = config_scaling(d);
    (!same_scaling(&h, &m)).then(|| {
        Finding::Differs(format!(
            "{}: {HF_SRC} says {h}, args say {m} (args.rope_type {}, use_rope_scaling {})",
            c.hf,
            a.raw("rope_type").map_or("None".into(), |v| v.to_string()),
            a.flag("use_rope_scaling").unwrap_or(false)
        ))
    })
}

/// [`Rel::SlidingWindow`].
fn check_sliding_window(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    match (d.layer_windows(), a.layer_windows(d.num_layers)) {
        (h, Some(m)) if h != m => {
            let show = |v: &[Option<u64>]| -> String {
                let w: Vec<String> = v
                    .iter()
                    .map(|w| w.map_or("full".into(), |w| w.to_string()))
                    .collect();
                format!("[{}]", w.join(", "))
            };
            Some(Finding::Differs(format!(
                "sliding_window: {HF_SRC} gives windows {} (sliding_window, layer_types), args.window_size and window_attn_skip_freq give {}",
                show(&h),
                show(&m)
            )))
        }
        (_, Some(_)) => None,
        (_, None) => Some(args_lack(c)),
    }
}

/// [`Rel::ArgsTrue`] and [`Rel::ArgsFalse`].
fn check_implied_flag(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    match a.flag(c.args) {
        Some(v) if v != (c.rel == Rel::ArgsTrue) => Some(Finding::Differs(format!(
            "{}: {} implies it, args.{} says {v}",
            c.hf,
            d.cfg
                .get("model_type")
                .and_then(|v| v.as_str())
                .unwrap_or("the architecture"),
            c.args
        ))),
        Some(_) => None,
        None => Some(args_lack(c)),
    }
}

/// [`Rel::IndexerLayers`].
fn check_indexer_layers(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    let ours: Vec<bool> = (0..d.num_layers).map(|l| d.indexer(l)).collect();
    let show = |v: &[bool]| -> String { v.iter().map(|&f| if f { 'F' } else { 'S' }).collect() };
    match a.indexer_layers() {
        Some(p) if p != ours => Some(Finding::Differs(format!(
            "{}: {HF_SRC} gives {}, args.{} {} and dsa_indexer_skip_topk_offset {} give {} (F: the layer runs its indexer, S: it shares the previous one's top-k; Megatron counts {} layers)",
            c.hf,
            show(&ours),
            c.args,
            a.field(c.args).unwrap_or(1),
            a.field("dsa_indexer_skip_topk_offset").unwrap_or(0),
            show(&p),
            if a.hybrid_pattern().is_some() { "a HybridModel's" } else { "GPT" }
        ))),
        Some(_) => None,
        None => Some(Finding::Unchecked(format!(
            "{} (args has no num_layers)",
            c.hf
        ))),
    }
}

/// The config fields of a MoE layer pattern, for messages.
fn pattern_fields(p: LayerPattern) -> &'static str {
    match p {
        LayerPattern::QwenSparseStep => "mlp_only_layers, decoder_sparse_step",
        LayerPattern::FirstKDense => "first_k_dense_replace, mlp_layer_types",
        LayerPattern::AllMoe | LayerPattern::Dense => "every layer",
    }
}

/// [`Rel::MoeLayers`].
fn check_moe_layers(d: &Dims, c: &Check, a: &Args) -> Option<Finding> {
    match a.moe_layers() {
        Some(p) if p != d.moe_layers => {
            let show =
                |v: &[bool]| -> String { v.iter().map(|&m| if m { 'E' } else { '-' }).collect() };
            Some(Finding::Differs(format!(
                "MoE layer pattern ({}): {HF_SRC} gives {} ({} experts{}), args.{} gives {} (E: MoE layer)",
                pattern_fields(d.spec.moe_layers),
                show(&d.moe_layers),
                d.num_experts,
                match c.hf {
                    "num_experts" => String::new(),
                    f => format!(", {f} {}", d.field(f).unwrap_or(0)),
                },
                a.pattern_field(c.args),
                show(&p)
            )))
        }
        Some(_) => None,
        None => Some(Finding::Unchecked(format!(
            "MoE layer pattern (args has no {})",
            c.args
        ))),
    }
}

/// The vocabulary: `vocab_size` (config) against the embedding's `rows`. Megatron pads the
/// vocabulary up to a multiple of `make_vocab_size_divisible_by × tensor_model_parallel_size`
/// (args; 128 × 1 when absent); the rows must be exactly `vocab_size` rounded up to that
/// multiple, so the trimmed rows are padding and nothing else. Without args the multiple is taken
/// as the largest power of two dividing the rows (128 × a power-of-two TP). `args.vocab_size`
/// (when stored) is the tokenizer's: the config may not be smaller.
///
/// Errors: a message naming `vocab_size` and both values.
fn check_vocab(
    d: &Dims,
    args: Option<&Args>,
    rows: Option<u64>,
) -> std::result::Result<(), String> {
    let (Some(v), Some(rows)) = (d.vocab_size, rows) else {
        return Ok(());
    };
    if v > rows {
        return Err(format!(
            "vocab_size: config.json says {v}, the checkpoint's embedding has {rows} rows"
        ));
    }
    if let Some(a) = args {
        if let Some(p) = a.field("padded_vocab_size") {
            if p != rows {
                return Err(format!(
                    "vocab_size: args.padded_vocab_size says {p}, the checkpoint's embedding has {rows} rows"
                ));
            }
        }
        if let Some(t) = a.field("vocab_size") {
            if v < t {
                return Err(format!(
                    "vocab_size: config.json says {v}, args.vocab_size says {t} (converting would drop real tokens)"
                ));
            }
        }
    }
    let (m, why) = match args {
        Some(a) => {
            let div = a.field("make_vocab_size_divisible_by").unwrap_or(128);
            let tp = a.field("tensor_model_parallel_size").unwrap_or(1);
            (
                (div * tp).max(1),
                format!("make_vocab_size_divisible_by {div} x tensor_model_parallel_size {tp}"),
            )
        }
        None => (
            1 << rows.trailing_zeros().min(63),
            "the largest power of two dividing the rows; no args stored".to_string(),
        ),
    };
    if v.div_ceil(m) * m != rows {
        return Err(format!(
            "vocab_size: config.json says {v}, the checkpoint's embedding has {rows} rows: {} rows more than Megatron's padding to a multiple of {m} ({why}) explains",
            rows - v
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen3_moe() -> Json {
        json!({"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
            "vocab_size": 250, "tie_word_embeddings": false, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "num_experts_per_tok": 2, "norm_topk_prob": true})
    }

    fn args() -> Args {
        let Json::Object(m) = json!({"num_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "group_query_attention": true, "num_query_groups": 2,
            "kv_channels": 16, "ffn_hidden_size": 128, "moe_ffn_hidden_size": 32,
            "num_experts": 4, "moe_layer_freq": 1, "untie_embeddings_and_output_weights": true,
            "vocab_size": 250, "padded_vocab_size": 256, "make_vocab_size_divisible_by": 128,
            "tensor_model_parallel_size": 2, "moe_shared_expert_intermediate_size": null,
            "norm_epsilon": 1e-6, "max_position_embeddings": 4096, "rotary_base": 10000,
            "moe_router_topk": 2, "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": false, "swiglu": true, "qk_layernorm": true,
            "rope_type": "rope", "use_rope_scaling": false})
        else {
            unreachable!()
        };
        Args(m)
    }

    fn check(cfg: &Json, a: Option<&Args>, rows: u64) -> std::result::Result<ArgsCheck, String> {
        let d = Dims::from_config(cfg, None).map_err(|e| e.to_string())?;
        check_args(&d, a, Some(rows), &[]).map_err(|e| e.to_string())
    }

    #[test]
    fn every_check_row_refuses_a_wrong_field_naming_both_values() {
        let ok = check(&qwen3_moe(), Some(&args()), 256).unwrap();
        assert_eq!((ok.status.as_str(), ok.unchecked.len()), ("passed", 0));
        let cases: &[(&str, Json, &str)] = &[
            ("num_hidden_layers", json!(3), "num_hidden_layers: config.json says 3, args.num_layers says 2"),
            ("hidden_size", json!(32), "hidden_size: config.json says 32, args.hidden_size says 64"),
            ("num_attention_heads", json!(8), "num_attention_heads: config.json says 8, args.num_attention_heads says 4"),
            ("num_key_value_heads", json!(4), "num_key_value_heads: config.json says 4, args.num_query_groups says 2"),
            ("head_dim", json!(8), "head_dim: config.json says 8, args.kv_channels says 16"),
            ("moe_intermediate_size", json!(16), "moe_intermediate_size: config.json says 16, args.moe_ffn_hidden_size says 32"),
            ("num_experts", json!(8), "num_experts: config.json says 8, args.num_experts says 4"),
            ("tie_word_embeddings", json!(true), "tie_word_embeddings: config.json says true, args.untie_embeddings_and_output_weights says true"),
            ("vocab_size", json!(257), "vocab_size: config.json says 257, the checkpoint's embedding has 256 rows"),
            ("vocab_size", json!(249), "vocab_size: config.json says 249, args.vocab_size says 250"),
            ("mlp_only_layers", json!([0]), "MoE layer pattern (mlp_only_layers, decoder_sparse_step): config.json gives -E (4 experts), args.moe_layer_freq gives EE"),
            ("rms_norm_eps", json!(1e-5), "rms_norm_eps: config.json says 0.00001, args.norm_epsilon says 0.000001"),
            ("max_position_embeddings", json!(8192), "max_position_embeddings: config.json says 8192, args.max_position_embeddings says 4096"),
            ("rope_theta", json!(1e6), "rope_theta: config.json says 1000000, args.rotary_base says 10000"),
            ("num_experts_per_tok", json!(3), "num_experts_per_tok: config.json says 3, args.moe_router_topk says 2"),
            ("norm_topk_prob", json!(false), "norm_topk_prob: config.json says false, but args.moe_router_score_function \"softmax\" with moe_router_pre_softmax false renormalises the top-k: true"),
            ("hidden_act", json!("gelu"), "hidden_act: config.json says gelu (a gated MLP: act(gate) x up), args.swiglu says true"),
            ("rope_parameters", json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "rope_parameters: config.json says yarn scaling (factor 4), args say plain RoPE (args.rope_type \"rope\", use_rope_scaling false)"),
        ];
        for (field, value, want) in cases {
            let mut cfg = qwen3_moe();
            cfg[*field] = value.clone();
            let err = check(&cfg, Some(&args()), 256).err().unwrap_or_default();
            assert!(err.contains(want), "{field}: {err}");
        }
        // The dense FFN size is used (and checked) once a layer is dense.
        let mut cfg = qwen3_moe();
        cfg["intermediate_size"] = json!(96);
        let r = check(&cfg, Some(&args()), 256);
        assert!(
            r.is_ok(),
            "all MoE: intermediate_size unused: {:?}",
            r.err()
        );
        cfg["mlp_only_layers"] = json!([1]);
        let mut a = args();
        a.0.insert("moe_layer_freq".into(), json!([1, 0]));
        let err = check(&cfg, Some(&a), 256).err().unwrap();
        assert!(
            err.contains("intermediate_size: config.json says 96, args.ffn_hidden_size says 128"),
            "{err}"
        );
    }

    #[test]
    fn an_allowed_mismatch_is_a_warning_and_an_unknown_name_refused() {
        let mut cfg = qwen3_moe();
        cfg["num_experts_per_tok"] = json!(3);
        let d = Dims::from_config(&cfg, None).unwrap();
        let a = args();
        let allow = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
            check_args(&d, Some(&a), Some(256), &names).map_err(|e| e.to_string())
        };
        let e = allow(&[]).unwrap_err();
        assert!(e.contains("pass --allow-config-mismatch FIELD"), "{e}");
        // By the config field or the args field.
        for name in ["num_experts_per_tok", "moe_router_topk"] {
            let w = allow(&[name]).unwrap().warnings;
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].starts_with("num_experts_per_tok: config.json says 3, args.moe_router_topk says 2 (--allow-config-mismatch"), "{w:?}");
            assert!(
                w[0].contains("written as config.json says, not as the args say"),
                "{w:?}"
            );
        }
        // Another field's allowance does not cover it; a name of no row is refused.
        assert!(allow(&["rope_theta"]).is_err());
        let e = allow(&["num_expert_per_tok"]).unwrap_err();
        assert!(e.contains("--allow-config-mismatch \"num_expert_per_tok\": qwen3_moe compares no such field (config fields: num_hidden_layers,"), "{e}");
    }

    #[test]
    fn the_router_shared_experts_and_rope_scaling_are_compared_as_computed() {
        let mut a = args();
        // A sigmoid router where qwen3_moe's softmax routes.
        a.0.insert("moe_router_score_function".into(), json!("sigmoid"));
        let e = check(&qwen3_moe(), Some(&a), 256).unwrap_err();
        assert!(e.contains("router scoring: qwen3_moe routes by softmax scores, args.moe_router_score_function says sigmoid"), "{e}");
        // Absent from config.json: transformers' default (qwen3_moe's norm_topk_prob is false).
        let mut cfg = qwen3_moe();
        cfg.as_object_mut().unwrap().remove("norm_topk_prob");
        let e = check(&cfg, Some(&args()), 256).unwrap_err();
        assert!(
            e.contains("norm_topk_prob: config.json says nothing (transformers' default false)"),
            "{e}"
        );
        // deepseek_v3: its default n_shared_experts 1 against 64 / 32; None scales by 1.
        let mut ds = args_of(json!({"num_experts": 8, "moe_ffn_hidden_size": 32,
            "moe_shared_expert_intermediate_size": 64, "moe_router_topk_scaling_factor": null}));
        let d = deepseek(json!({"n_routed_experts": 8, "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.0}));
        let found = |a: &Args, hf: &str| {
            let c = d.spec.checks().find(|c| c.hf == hf).unwrap();
            check_row(&d, c, Some(a), None)
        };
        assert!(matches!(found(&ds, "n_shared_experts"),
            Some(Finding::Differs(m)) if m == "n_shared_experts: config.json says nothing (transformers' default 1), args.moe_shared_expert_intermediate_size says 64 = 2 x moe_ffn_hidden_size 32"));
        assert_eq!(found(&ds, "routed_scaling_factor"), None);
        ds.0.insert("moe_shared_expert_intermediate_size".into(), json!(48));
        assert!(
            matches!(found(&ds, "n_shared_experts"), Some(Finding::Differs(m)) if m.contains("says 48 = 1.50 x"))
        );
        // MLA's rope_type None is yarn (MLATransformerConfig's default).
        let mla = args_of(json!({"rope_type": null, "multi_latent_attention": true,
            "rotary_scaling_factor": 40.0}));
        assert!(matches!(found(&mla, "rope_parameters"),
            Some(Finding::Differs(m)) if m.contains("config.json says plain RoPE, args say yarn scaling (factor 40)")));
        let plain = args_of(json!({"rope_type": "rope", "use_rope_scaling": false}));
        assert_eq!(found(&plain, "rope_parameters"), None);
        assert!(matches!(
            found(&args_of(json!({})), "rope_parameters"),
            Some(Finding::Unchecked(_))
        ));
    }

    #[test]
    fn values_megatron_and_serving_cannot_use_are_refused_naming_them() {
        let refused = |field: &str, v: Json| {
            let mut cfg = qwen3_moe();
            cfg[field] = v;
            let d = Dims::from_config(&cfg, None).map_err(|e| e.to_string())?;
            check_values(&d, "config.json").map_err(|e| e.to_string())
        };
        assert!(refused("rms_norm_eps", json!(1e-6)).is_ok());
        for (field, v, want) in [
            (
                "rms_norm_eps",
                json!(-1),
                "config.json: rms_norm_eps = -1: the norms' epsilon must be a positive number",
            ),
            ("rms_norm_eps", json!("1e-6"), "rms_norm_eps = \"1e-6\""),
            (
                "max_position_embeddings",
                json!(-5),
                "max_position_embeddings = -5: the context length must be a positive integer",
            ),
            (
                "num_experts_per_tok",
                json!(0),
                "num_experts_per_tok = 0: a router picks 1 to 4 experts per token",
            ),
            (
                "num_experts_per_tok",
                json!(5),
                "num_experts_per_tok = 5: a router picks 1 to 4",
            ),
            (
                "norm_topk_prob",
                json!(1),
                "norm_topk_prob = 1: must be true or false",
            ),
        ] {
            let e = refused(field, v).unwrap_err();
            assert!(e.contains(want), "{field}: {e}");
        }
        for v in [json!(-1), json!("1"), json!(null), json!(1.5), json!(true)] {
            let e = refused("num_nextn_predict_layers", v.clone()).unwrap_err();
            assert!(e.contains(&format!("num_nextn_predict_layers = {v}: an MTP layer count must be a non-negative integer")), "{e}");
        }
        // A grouped router whose groups do not fit; and transformers' default n_group 8 of 4 experts.
        let grouped =
            |extra: Json| check_values(&deepseek(extra), "config.json").map_err(|e| e.to_string());
        let ok =
            json!({"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2});
        assert!(grouped(ok.clone()).is_ok());
        for (k, v, want) in [
            (
                "n_group",
                json!(3),
                "n_group = 3: the groups must split num_experts 8 evenly",
            ),
            (
                "topk_group",
                json!(5),
                "topk_group = 5: a router keeps 1 to n_group = 4 groups",
            ),
            (
                "topk_group",
                json!(1),
                "num_experts_per_tok = 4: topk_group = 1 groups of 2 experts hold fewer",
            ),
            (
                "num_experts_per_tok",
                json!(2),
                "topk_group = 2: with n_group = 4, transformers scores a group by its top 2",
            ),
        ] {
            let mut c = ok.clone();
            c[k] = v;
            let e = grouped(c).unwrap_err();
            assert!(e.contains(want), "{k}: {e}");
        }
        let e = grouped(json!({"n_routed_experts": 4, "num_experts_per_tok": 2})).unwrap_err();
        assert!(
            e.contains("n_group = 8 (transformers' default: the config has none): the groups"),
            "{e}"
        );
    }

    #[test]
    fn vocab_padding_must_explain_the_trimmed_rows() {
        let mut a = args();
        a.0.remove("vocab_size");
        a.0.remove("padded_vocab_size");
        let with = |v: u64, rows: u64, a: Option<&Args>| {
            let mut cfg = qwen3_moe();
            cfg["vocab_size"] = json!(v);
            check(&cfg, a, rows)
        };
        // 128 x TP 2 = 256: 250 -> 256, 1 -> 256, but 250 never pads to 512.
        assert!(with(250, 256, Some(&a)).is_ok());
        let err = with(250, 512, Some(&a)).err().unwrap();
        assert!(err.contains("vocab_size: config.json says 250, the checkpoint's embedding has 512 rows: 262 rows more than Megatron's padding to a multiple of 256"), "{err}");
        // Qwen's 151936 at TP 8: 152576 rows.
        a.0.insert("tensor_model_parallel_size".into(), json!(8));
        assert!(with(151936, 152576, Some(&a)).is_ok());
        assert!(with(150000, 152576, Some(&a)).is_err());
        // args.padded_vocab_size must be the rows.
        a.0.insert("padded_vocab_size".into(), json!(151936));
        let err = with(151936, 152576, Some(&a)).err().unwrap();
        assert!(err.contains("args.padded_vocab_size says 151936"), "{err}");
        // No args: the largest power of two dividing the rows.
        assert!(with(250, 256, None).is_ok());
        assert!(with(151936, 152576, None).is_ok()); // 152576 = 149 x 1024
        let err = with(150000, 152576, None).err().unwrap();
        assert!(err.contains("no args stored"), "{err}");
        assert_eq!(
            with(250, 256, None).unwrap().status,
            "skipped: no args stored"
        );
    }

    #[test]
    fn a_deepseek_norm_epsilon_transformers_ignores_is_warned_about() {
        let cfg = |eps: f64| {
            json!({"model_type": "deepseek_v3", "num_hidden_layers": 1, "hidden_size": 64,
                "num_attention_heads": 4, "vocab_size": 250, "rms_norm_eps": eps})
        };
        let warn = |eps| {
            let d = Dims::from_config(&cfg(eps), None).unwrap();
            check_args(&d, None, None, &[]).unwrap().warnings
        };
        assert!(warn(1e-6).is_empty());
        let w = warn(1e-5);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("rms_norm_eps is 0.00001, but transformers' deepseek_v3 applies q_a_layernorm and kv_a_layernorm with eps 1e-6"), "{w:?}");
    }

    fn deepseek(extra: Json) -> Dims {
        let mut cfg = json!({"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "vocab_size": 250});
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        Dims::from_config(&cfg, None).unwrap()
    }

    #[test]
    fn mtp_layers_are_checked_against_the_config_and_the_args() {
        let mut a = args();
        let n = |d: &Dims, ck: u64, a: Option<&Args>, drop: bool| {
            mtp_layers(d, ck, a, drop).map_err(|e| e.to_string())
        };
        // Declared (transformers' default 1 for deepseek_v3) and held: converted.
        let d = deepseek(json!({}));
        assert_eq!(n(&d, 1, None, false), Ok((1, vec![])));
        // Held, declared 0: refused naming both, unless dropped.
        let d0 = deepseek(json!({"num_nextn_predict_layers": 0}));
        let e = n(&d0, 1, None, false).unwrap_err();
        assert!(e.contains("the checkpoint holds 1 MTP layer(s) (mtp.layers.*), but config.json's num_nextn_predict_layers says 0; pass --drop-mtp"), "{e}");
        let (k, w) = n(&d0, 1, None, true).unwrap();
        assert_eq!(k, 0);
        assert!(w[0].contains("--drop-mtp: the checkpoint's 1 MTP layer(s) are not converted"));
        // Declared 2, held 1: refused.
        let e = n(
            &deepseek(json!({"num_nextn_predict_layers": 2})),
            1,
            None,
            false,
        )
        .unwrap_err();
        assert!(e.contains("num_nextn_predict_layers says 2"), "{e}");
        // Declared (by default) but none held: a warning, nothing converted.
        let (k, w) = n(&d, 0, None, false).unwrap();
        assert_eq!(k, 0);
        assert!(w[0].contains("num_nextn_predict_layers says 1 (transformers' default), but the checkpoint holds no MTP layers"), "{w:?}");
        // args.mtp_num_layers must match the checkpoint.
        a.0.insert("mtp_num_layers".into(), json!(2));
        let e = n(&d, 1, Some(&a), false).unwrap_err();
        assert!(
            e.contains("args.mtp_num_layers says 2, the checkpoint holds 1 MTP layer(s)"),
            "{e}"
        );
        a.0.insert("mtp_num_layers".into(), json!(null));
        assert_eq!(n(&d, 0, Some(&a), false).map(|x| x.0), Ok(0));
        // A family without an MTP layout, and Qwen's one-module layout with two layers.
        let llama = Dims::from_config(
            &json!({"model_type": "llama", "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4}),
            None,
        )
        .unwrap();
        let e = n(&llama, 1, None, false).unwrap_err();
        assert!(
            e.contains("shardwise knows no HF layout of MTP layers for llama"),
            "{e}"
        );
        let qwen = Dims::from_config(
            &json!({"model_type": "qwen3_next", "num_hidden_layers": 2,
            "hidden_size": 64, "num_attention_heads": 4, "mtp_num_hidden_layers": 2}),
            None,
        )
        .unwrap();
        let e = n(&qwen, 2, None, false).unwrap_err();
        assert!(e.contains("holds one MTP module"), "{e}");
        assert_eq!(n(&qwen, 0, None, false).map(|x| x.0), Ok(0));
        // MiniMax-M2 declares MTP modules but its releases ship none: refused, saying so; the
        // config's own fields (use_mtp, num_mtp_modules) are not shardwise's to convert.
        let minimax = Dims::from_config(
            &json!({"model_type": "minimax_m2", "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "use_mtp": true, "num_mtp_modules": 3}),
            None,
        )
        .unwrap();
        let e = n(&minimax, 1, None, false).unwrap_err();
        assert!(
            e.contains(
                "the checkpoint holds 1 MTP layer(s) (mtp.layers.*), but MiniMax-M2's releases"
            ) && e.contains("ship no MTP weights")
                && e.contains("pass --drop-mtp"),
            "{e}"
        );
        assert_eq!(n(&minimax, 1, None, true).map(|x| x.0), Ok(0));
        assert_eq!(n(&minimax, 0, None, false), Ok((0, Vec::new())));
        // deepseek_v32 and glm_moe_dsa: transformers' configs have no MTP field, so an absent
        // one declares none (the releases say num_nextn_predict_layers 1).
        for t in ["deepseek_v32", "glm_moe_dsa"] {
            let d = Dims::from_config(
                &json!({"model_type": t, "num_hidden_layers": 2, "hidden_size": 64,
                "num_attention_heads": 4}),
                None,
            )
            .unwrap();
            assert_eq!(n(&d, 0, None, false), Ok((0, Vec::new())), "{t}");
            let e = n(&d, 1, None, false).unwrap_err();
            assert!(
                e.contains("num_nextn_predict_layers says 0 (absent)"),
                "{t}: {e}"
            );
        }
    }

    #[test]
    fn the_written_config_says_what_was_converted() {
        // Unchanged: the given bytes, as they are.
        let given = br#"{"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4}"#;
        let mut d = Dims::from_config(&serde_json::from_slice(given).unwrap(), None).unwrap();
        d.mtp_layers = 1;
        assert_eq!(output_config(given, &d, false).unwrap(), given.to_vec());
        // No MTP converted: the field says 0 (absent, transformers would read 1).
        d.mtp_layers = 0;
        let out: Json = serde_json::from_slice(&output_config(given, &d, false).unwrap()).unwrap();
        assert_eq!(out["num_nextn_predict_layers"], json!(0));
        // A multimodal config, text-only: the text model's config, MTP field inside it.
        let mm = json!({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": false, "image_token_id": 5, "vision_config": {"depth": 2},
            "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 2, "hidden_size": 64,
                "num_attention_heads": 4, "mtp_num_hidden_layers": 1}});
        let bytes = serde_json::to_vec(&mm).unwrap();
        let mut d = Dims::from_config(&mm, None).unwrap();
        assert!(d.multimodal);
        d.mtp_layers = 1;
        let text: Json = serde_json::from_slice(&output_config(&bytes, &d, true).unwrap()).unwrap();
        assert_eq!(
            text,
            json!({"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
            "tie_word_embeddings": false, "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "mtp_num_hidden_layers": 1})
        );
        d.mtp_layers = 0;
        let full: Json =
            serde_json::from_slice(&output_config(&bytes, &d, false).unwrap()).unwrap();
        assert_eq!(full["text_config"]["mtp_num_hidden_layers"], json!(0));
        assert_eq!(full["vision_config"], mm["vision_config"]);
        // A multimodal config of a family without a multimodal layout is refused.
        let e = Dims::from_config(&json!({"model_type": "qwen3_moe", "text_config": {}}), None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("a multimodal config (it has a text_config) of qwen3_moe"),
            "{e}"
        );
    }

    #[test]
    fn the_quantization_config_written_is_the_conversions() {
        let given =
            br#"{"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}"#;
        // Unchanged when it already says the same; replaced; removed for unquantized weights.
        let same = json!({"quant_method": "mxfp4"});
        assert_eq!(
            with_quantization(given, Some(&same)).unwrap(),
            given.to_vec()
        );
        let fp8 = json!({"quant_method": "fp8"});
        let out: Json =
            serde_json::from_slice(&with_quantization(given, Some(&fp8)).unwrap()).unwrap();
        assert_eq!(out["quantization_config"], fp8);
        let out: Json = serde_json::from_slice(&with_quantization(given, None).unwrap()).unwrap();
        assert_eq!(out, json!({"model_type": "gpt_oss"}));
        assert!(with_quantization(b"[1]", None).is_err());
    }

    fn args_of(v: Json) -> Args {
        let Json::Object(m) = v else { unreachable!() };
        Args(m)
    }

    #[test]
    fn each_relation_reads_its_args_field_into_the_config() {
        let row = |hf, args, rel| Check { hf, args, rel };
        let qwen = families::arch("qwen3_moe").unwrap();
        let a = args_of(
            json!({"num_layers": 2, "untie_embeddings_and_output_weights": true,
            "rotary_base": 10000, "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": true, "moe_ffn_hidden_size": 16,
            "moe_shared_expert_intermediate_size": 48, "num_experts": 4,
            "moe_layer_freq": [0, 1], "window_size": [127, 0], "window_attn_skip_freq": 2,
            "rope_type": "rope"}),
        );
        let got = |c: Check| row_from_args(qwen, &c, &a);
        assert_eq!(
            got(row("num_hidden_layers", "num_layers", Rel::Eq)),
            vec![("num_hidden_layers", json!(2))]
        );
        assert_eq!(
            got(row(
                "tie_word_embeddings",
                "untie_embeddings_and_output_weights",
                Rel::Not
            )),
            vec![("tie_word_embeddings", json!(false))]
        );
        // As stored: the integer RoPE base stays one; an absent field gives nothing.
        assert_eq!(
            got(row("rope_theta", "rotary_base", Rel::Float)),
            vec![("rope_theta", json!(10000))]
        );
        assert_eq!(got(row("hidden_size", "hidden_size", Rel::Eq)), vec![]);
        assert_eq!(
            got(row(
                "norm_topk_prob",
                "moe_router_score_function",
                Rel::TopkNorm
            )),
            vec![("norm_topk_prob", json!(false))]
        );
        assert_eq!(
            got(row(
                "n_shared_experts",
                "moe_shared_expert_intermediate_size",
                Rel::SharedExperts
            )),
            vec![("n_shared_experts", json!(3))]
        );
        // Qwen's pattern names the dense layers; gpt_oss's windows give two fields.
        assert_eq!(
            got(row("num_experts", "moe_layer_freq", Rel::MoeLayers)),
            vec![("mlp_only_layers", json!([0]))]
        );
        assert_eq!(
            got(row("sliding_window", "window_size", Rel::SlidingWindow)),
            vec![
                ("sliding_window", json!(128)),
                (
                    "layer_types",
                    json!(["sliding_attention", "full_attention"])
                )
            ]
        );
        assert_eq!(got(row("x", "x", Rel::ArgsTrue)), vec![]);
        // Plain RoPE says nothing; yarn and llama3's scaling are named.
        assert_eq!(rope_scaling_from_args(&a), None);
        let y = args_of(json!({"rope_type": "yarn"}));
        assert_eq!(
            rope_scaling_from_args(&y),
            Some(json!({"rope_type": "yarn (args.rope_type)"}))
        );
        let l = args_of(json!({"use_rope_scaling": true}));
        assert_eq!(
            rope_scaling_from_args(&l),
            Some(json!({"rope_type": "llama3 (args.use_rope_scaling)"}))
        );
    }

    #[test]
    fn a_config_from_the_args_needs_the_models_size() {
        let qwen = families::arch("qwen3_moe").unwrap();
        let Json::Object(cfg) =
            json!({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4})
        else {
            unreachable!()
        };
        assert!(check_required_from_args(qwen, &cfg).is_ok());
        let mut partial = cfg.clone();
        partial.remove("hidden_size");
        let e = check_required_from_args(qwen, &partial)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the checkpoint's args have no hidden_size; pass --hf-config"),
            "{e}"
        );
    }

    #[test]
    fn each_row_finds_at_most_one_thing() {
        let d = Dims::from_config(&qwen3_moe(), None).unwrap();
        let row = |hf: &str, rel: Rel| {
            d.spec
                .checks()
                .find(|c| c.hf == hf && c.rel == rel)
                .unwrap()
        };
        let hidden = row("hidden_size", Rel::Eq);
        let mut a = args();
        assert_eq!(check_row(&d, hidden, Some(&a), Some(256)), None);
        a.0.insert("hidden_size".into(), json!(32));
        assert_eq!(
            check_row(&d, hidden, Some(&a), Some(256)),
            Some(Finding::Differs(
                "hidden_size: config.json says 64, args.hidden_size says 32".into()
            ))
        );
        a.0.remove("hidden_size");
        assert_eq!(
            check_row(&d, hidden, Some(&a), Some(256)),
            Some(Finding::Unchecked(
                "hidden_size (args has no hidden_size)".into()
            ))
        );
        a.0.insert("moe_layer_freq".into(), json!([0, 1]));
        assert!(matches!(
            check_row(&d, row("num_experts", Rel::MoeLayers), Some(&a), None),
            Some(Finding::Differs(m)) if m.starts_with("MoE layer pattern (mlp_only_layers, decoder_sparse_step): config.json gives EE")
        ));
        // Without args only the vocabulary is checked, against the embedding's rows.
        assert_eq!(check_row(&d, hidden, None, Some(256)), None);
        assert!(matches!(
            check_row(&d, row("vocab_size", Rel::Vocab), None, Some(100)),
            Some(Finding::Differs(_))
        ));
        // The MLA norms' epsilon warns, args or not.
        let ds = Dims::from_config(
            &json!({"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64,
                "num_attention_heads": 4, "rms_norm_eps": 1e-5}),
            None,
        )
        .unwrap();
        let eps = ds.spec.checks().find(|c| c.rel == Rel::MlaNormEps).unwrap();
        assert!(matches!(
            check_row(&ds, eps, None, None),
            Some(Finding::Warning(m)) if m.starts_with("rms_norm_eps is 0.00001, but")
        ));
    }

    #[test]
    fn args_alone_give_the_dims() {
        let d = Dims::from_args(&args(), Some("qwen3_moe")).unwrap();
        assert_eq!(
            (
                d.num_layers,
                d.hidden,
                d.heads,
                d.groups,
                d.head_dim,
                d.num_experts,
                d.tied
            ),
            (2, 64, 4, 2, 16, 4, false)
        );
        // The tokenizer's vocabulary the args store (the padding beyond it is trimmed); without
        // it the embedding's rows are kept.
        assert_eq!(d.vocab_size, Some(250));
        assert_eq!(d.field("moe_intermediate_size"), Some(32));
        assert_eq!(d.moe_layers, vec![true, true]);
        let mut a = args();
        a.0.remove("vocab_size");
        assert_eq!(
            Dims::from_args(&a, Some("qwen3_moe")).unwrap().vocab_size,
            None
        );
    }

    #[test]
    fn a_config_built_from_the_args_uses_transformers_names() {
        let mut a = args();
        // Args that do not say the router's top-k, its scoring, the RoPE base and the context
        // length: refused, each named, rather than a config with transformers' defaults.
        for k in [
            "max_position_embeddings",
            "rotary_base",
            "moe_router_topk",
            "moe_router_score_function",
            "moe_router_pre_softmax",
        ] {
            a.0.remove(k);
        }
        let d = Dims::from_args(&a, Some("qwen3_moe")).unwrap();
        let e = config_from_args(&d, Some(256), DType::BF16)
            .unwrap_err()
            .to_string();
        for field in [
            "max_position_embeddings (max_position_embeddings)",
            "rotary_base (rope_theta)",
            "moe_router_topk (num_experts_per_tok)",
            "moe_router_score_function / moe_router_pre_softmax (norm_topk_prob)",
        ] {
            assert!(e.contains(field), "{field}: {e}");
        }
        assert!(e.contains("pass --hf-config"), "{e}");
        for (k, v) in [
            ("max_position_embeddings", json!(4096)),
            ("moe_router_topk", json!(2)),
            ("moe_router_score_function", json!("softmax")),
            ("moe_router_pre_softmax", json!(false)),
            ("rotary_base", json!(1000000)),
        ] {
            a.0.insert(k.into(), v);
        }
        let d = Dims::from_args(&a, Some("qwen3_moe")).unwrap();
        let cfg: Json =
            serde_json::from_slice(&config_from_args(&d, Some(256), DType::BF16).unwrap()).unwrap();
        assert_eq!(
            cfg,
            json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "dtype": "bfloat16", "num_hidden_layers": 2, "hidden_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                "mlp_only_layers": [], "tie_word_embeddings": false, "vocab_size": 250,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "num_experts_per_tok": 2,
                "norm_topk_prob": true, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}})
        );
        // deepseek_v3's names: the expert count, the shared experts, an MTP field saying 0.
        let Json::Object(m) = json!({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "num_experts": 8, "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 32,
            "moe_router_score_function": "sigmoid", "moe_layer_freq": [0, 1],
            "ffn_hidden_size": 96, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 16,
            "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "untie_embeddings_and_output_weights": true,
            "norm_epsilon": 1e-6, "rotary_percent": 1.0, "rotary_base": 10000,
            "max_position_embeddings": 64, "moe_router_topk": 4, "moe_router_num_groups": 4,
            "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5})
        else {
            unreachable!()
        };
        let mut a = Args(m);
        let d = Dims::from_args(&a, Some("deepseek_v3")).unwrap();
        let cfg: Json =
            serde_json::from_slice(&config_from_args(&d, Some(256), DType::F32).unwrap()).unwrap();
        assert_eq!(
            (
                &cfg["n_routed_experts"],
                &cfg["n_shared_experts"],
                &cfg["first_k_dense_replace"],
                &cfg["norm_topk_prob"],
                &cfg["num_nextn_predict_layers"],
                &cfg["vocab_size"],
                &cfg["num_key_value_heads"]
            ),
            (
                &json!(8),
                &json!(2),
                &json!(1),
                &json!(true),
                &json!(0),
                &json!(256),
                &json!(4)
            )
        );
        assert!(cfg.get("num_experts").is_none() && cfg.get("head_dim").is_none());
        assert!(!cfg.as_object().unwrap().keys().any(|k| k.contains('*')));
        // RoPE scaling the config built from the args cannot describe: refused.
        let mut y = Args(a.0.clone());
        y.0.insert("rope_type".into(), json!("yarn"));
        let e = config_from_args(
            &Dims::from_args(&y, Some("deepseek_v3")).unwrap(),
            None,
            DType::F32,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("args say RoPE scaling yarn (args.rope_type)"),
            "{e}"
        );
        // None is Megatron's "not set": the grouped router's scaling then is not said either.
        a.0.insert("moe_router_topk_scaling_factor".into(), json!(null));
        a.0.remove("moe_shared_expert_intermediate_size");
        let d = Dims::from_args(&a, Some("deepseek_v3")).unwrap();
        let e = config_from_args(&d, Some(256), DType::F32)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("moe_shared_expert_intermediate_size (n_shared_experts), moe_router_topk_scaling_factor (routed_scaling_factor)"),
            "{e}"
        );
    }

    #[test]
    fn a_hybrid_runs_args_count_its_layers_in_pairs() {
        // glm_moe_dsa as a HybridModel: DSA attentions at Megatron layers 1, 3, 5 (1-based), a
        // dense then two MoE MLPs; the indexer runs on 1 and 3, layer 5 reuses 3's top-k.
        let Json::Object(m) = json!({"num_layers": 6, "hybrid_layer_pattern": "D-DEDE",
            "num_experts": 8, "moe_layer_freq": 1, "dsa_indexer_topk_freq": 4,
            "dsa_indexer_skip_topk_offset": 3})
        else {
            unreachable!()
        };
        let mut a = Args(m);
        assert_eq!(a.hybrid_pattern(), Some(("hybrid_layer_pattern", "D-DEDE")));
        assert_eq!(a.field("num_layers"), Some(3));
        assert_eq!(a.moe_layers(), Some(vec![false, true, true]));
        assert_eq!(a.attn_layers(), Some(vec!["full_attention".to_string(); 3]));
        assert_eq!(a.indexer_layers(), Some(vec![true, true, false]));
        // The same schedule counted in GPT layers (1, 2, 3) is another one.
        a.0.remove("hybrid_layer_pattern");
        a.0.insert("num_layers".into(), json!(3));
        assert_eq!(a.indexer_layers(), Some(vec![true, true, true]));
        a.0.insert("dsa_indexer_topk_freq".into(), json!(2));
        a.0.insert("dsa_indexer_skip_topk_offset".into(), json!(2));
        assert_eq!(a.indexer_layers(), Some(vec![true, true, false]));
        // The deprecated name, and Gated DeltaNet attentions.
        a.0.insert("hybrid_override_pattern".into(), json!("G-*E"));
        assert_eq!(a.field("num_layers"), Some(2));
        assert_eq!(
            a.attn_layers(),
            Some(vec!["linear_attention".into(), "full_attention".into()])
        );
    }
}
