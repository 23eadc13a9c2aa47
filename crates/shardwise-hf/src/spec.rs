//! The vocabulary of the Megatron → Hugging Face mapping: what an architecture is ([`ArchSpec`]), a
//! rule ([`Rule`], [`Out`], [`Split`], [`Experts`], [`Post`], [`When`]), a check of the config
//! against Megatron's stored args ([`Check`], [`Rel`]), which layers are MoE ([`LayerPattern`]), and
//! [`Dims`], the hyperparameters a rule is evaluated against. The rules themselves are data in
//! [`super::rules`] and [`super::gdn`], assembled per architecture in [`super::families`]; how a
//! config or the stored args become [`Dims`] is [`super::config`].

use serde_json::{Map, Value as Json};

use super::layout::Layout;
use shardwise::error::{Error, Result};

/// One architecture.
pub(crate) struct ArchSpec {
    /// `model_type` values of config.json (and `--arch`) that select it.
    pub model_types: &'static [&'static str],
    /// The transformers class of the text model (`architectures` of a config.json built from the
    /// stored args, whose `model_type` is `model_types[0]`, or the multimodal layout's
    /// `text_model_type`).
    pub architecture: &'static str,
    /// The config.json field of the routed expert count (`num_experts`, mixtral's and gpt_oss's
    /// `num_local_experts`, deepseek_v3's `n_routed_experts`; see [`Dims::field`]).
    pub experts_field: &'static str,
    /// Rules for whole-model keys (full checkpoint key).
    pub model: &'static [Rule],
    /// Rules for per-layer keys (sub-key after `decoder.layers.{i}.`, or after `decoder.layers.`
    /// when layers are stacked on a leading axis).
    pub layer: &'static [&'static [Rule]],
    /// Config fields tied to Megatron's stored args: each checked against them, and the source of
    /// a config.json built from them.
    pub checks: &'static [&'static [Check]],
    /// transformers' defaults (5.25, the family's config class) of the fields the checks and
    /// [`super::config::check_values`] read, as a JSON object: what transformers and the serving
    /// engines that load its config classes use when config.json lacks the field. RoPE fields may
    /// also sit in a `rope_parameters` object (a family whose default is a RoPE scaling).
    pub defaults: &'static str,
    /// Which layers are MoE.
    pub moe_layers: LayerPattern,
    /// The HF layout of Megatron's multi-token prediction layers (`mtp.layers.{k}.*`); None: the
    /// family has none, and a checkpoint with MTP layers converts only with `--drop-mtp`.
    pub mtp: Option<&'static MtpSpec>,
    /// The layout of the family's multimodal config (one with a `text_config`); None: such a
    /// config is refused.
    pub multimodal: Option<&'static Multimodal>,
}

/// Where an architecture's official HF checkpoint keeps Megatron's MTP layers. Megatron stores
/// MTP layer k as `mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}.weight` and its
/// transformer layer as `mtp.layers.{k}.transformer_layer.<decoder layer sub-key>` (MC 0.19
/// `multi_token_prediction.py`, `MultiTokenPredictionLayer.sharded_state_dict`); the transformer
/// layer maps with the family's layer rules as layer `num_hidden_layers + k`, a full-attention
/// layer, MoE as the family's pattern makes that layer.
pub(crate) struct MtpSpec {
    /// The config.json field that declares the MTP layer count.
    pub field: &'static str,
    /// Its value when config.json lacks it (transformers' default).
    pub default: u64,
    /// The HF name prefix of MTP layer k's transformer layer: `{L}` stands for
    /// `num_hidden_layers + k`, `{k}` for k.
    pub layer: &'static str,
    /// The MTP module's own tensors: Megatron sub-keys after `mtp.layers.{k}.`, full HF names
    /// (`{L}`, `{k}` as in `layer`; a name without either exists once, so one MTP layer at most).
    pub rules: &'static [Rule],
    /// Whole-model tensors that the HF layout repeats in every MTP layer (DeepSeek-V3's
    /// `embed_tokens` and `shared_head.head`): rules over whole-model keys, the first source the
    /// checkpoint holds taken.
    pub copies: &'static [Rule],
}

impl MtpSpec {
    /// Whether every HF name of the module's own tensors names its layer (`{L}` or `{k}`).
    pub(crate) fn per_layer_names(&self) -> bool {
        self.rules
            .iter()
            .flat_map(|r| r.outs)
            .all(|o| o.name.contains("{L}") || o.name.contains("{k}"))
    }
}

/// The layout of a family's multimodal model (Qwen3.5's `...ForConditionalGeneration`): the text
/// model under its own prefix, beside a vision tower a Megatron text checkpoint does not hold.
pub(crate) struct Multimodal {
    /// The text model's prefix in place of `model.` (`model.language_model.`: what
    /// `save_pretrained` of the multimodal model writes; `lm_head` and `mtp.*` stay top-level).
    pub text_prefix: &'static str,
    /// The vision tower's prefix (`model.visual.`), whose tensors come from `--base-hf`.
    pub vision_prefix: &'static str,
    /// The vision tensors `vision_config` implies: names after `vision_prefix` (`{b}` a block
    /// index below `depth`) and shapes as products of `vision_config` fields.
    pub vision: &'static [Out],
    /// `--text-only`: the text model's `model_type` and architecture.
    pub text_model_type: &'static str,
    pub text_architecture: &'static str,
}

/// A rule: Megatron tensor → HF tensors.
pub(crate) struct Rule {
    /// Megatron (sub-)keys this rule maps; several are aliases of one tensor.
    pub src: &'static [&'static str],
    /// HF tensors, in the order [`Split`] returns their rows; names after `model.layers.{l}.` for
    /// layer rules, `{e}` standing for the expert index.
    pub outs: &'static [Out],
    pub split: Split,
    pub experts: Experts,
    pub post: Post,
    pub when: When,
    /// For a source that joins several keys (`prefix.{a|b|..}`): each part's rows. to-hf reads
    /// them from the checkpoint's keys; from-hf cuts the joined rows it rebuilt into the parts.
    pub parts: Option<PartRows>,
}

/// An HF tensor of a rule.
pub(crate) struct Out {
    pub name: &'static str,
    /// The shape the config implies, each dimension a product of config fields (resolved by
    /// [`Dims::field`], with transformers' defaults); a dimension whose field the config lacks is
    /// not checked. Per expert for [`Experts::PerExpert`].
    pub shape: &'static [&'static [&'static str]],
}

/// Row ranges `(start, len)` of the source's first dimension (after the layer and expert axes)
/// that make each [`Rule::outs`] entry, concatenated in order. Arguments: the dims, the Megatron
/// key (for errors) and the source's shape after the layer and expert axes.
pub(crate) type Split = fn(&Dims, &str, &[u64]) -> Result<Vec<Vec<(u64, u64)>>>;

/// Rows of each part of a joined source, in order (the dims and the Megatron key, for errors).
pub(crate) type PartRows = fn(&Dims, &str) -> Result<Vec<u64>>;

/// Whether the source has a leading expert axis (after the layer axis, when stacked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Experts {
    No,
    /// One HF tensor per expert (`{e}` in the names): what `save_pretrained` writes for qwen3_moe,
    /// mixtral, qwen3_5_moe, qwen3_next, deepseek_v3 and glm4_moe.
    PerExpert,
    /// One HF tensor over all experts, the expert axis first (gpt_oss's fused 3-D experts; with
    /// [`Post::TransposeLast2`] for its `[H, 2I]` / `[I, H]` layout). `Out::shape` includes the
    /// expert dimension.
    Stacked,
}

/// A value transform applied after the rows are gathered (`plan::apply_post`; the writer and
/// every reader of a plan go through `read_hf_tensor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(dead_code)] // AddOne and TransposeLast2 are first used by the issue-16 families
pub(crate) enum Post {
    None,
    /// `w + 1`: Megatron's zero-centred gated norm (Gated DeltaNet `out_norm`) to HF's plain one.
    AddOne,
    /// Swap the last two dimensions (per expert): gpt_oss writes experts as `x @ W`.
    TransposeLast2,
    /// SwiGLU `[gate; up]` halves of the last dimension interleaved (gate in even, up in odd
    /// positions): gpt_oss's `gate_up_proj_bias` (TF gpt_oss `gate_up[..., ::2]`).
    InterleaveLast,
    /// [`Post::TransposeLast2`] of rows `[gate; up]`, then [`Post::InterleaveLast`]: gpt_oss's
    /// `gate_up_proj[e]` = interleave(gate, up).T, `[H, 2I]` (MB `gpt_oss_bridge.py`).
    InterleaveTransposeLast2,
}

impl Post {
    /// Whether the HF tensor's last two dimensions are the gathered ones swapped.
    pub(crate) fn transposes(self) -> bool {
        matches!(self, Post::TransposeLast2 | Post::InterleaveTransposeLast2)
    }
}

/// When the config requires a rule's outputs (and on which layers the rule may produce them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum When {
    /// Every layer (the model, for model rules).
    Always,
    /// Mapped when the checkpoint has it, never required.
    Optional,
    /// Required unless the config ties the embeddings (`lm_head`).
    Untied,
    /// Layers the config makes MoE; a source on another layer is an error.
    MoeLayer,
    /// Layers the config makes dense.
    DenseLayer,
    /// Layers whose config `layer_types` entry is this (`linear_attention`, `full_attention`;
    /// from `full_attention_interval` when the config has no list, see `Dims::layer_type`); a
    /// source on another layer is an error.
    LayerType(&'static str),
    /// Every layer when the config's boolean field is true (transformers' default false); a
    /// source when it is not is an error (transformers would drop it): glm4_moe's
    /// `attention_bias`, `use_qk_norm`.
    Flag(&'static str),
    /// Layers that run their own DSA indexer: config `indexer_types` `full` (glm_moe_dsa's
    /// `shared` layers reuse the previous layer's top-k and have none); every layer when the
    /// config has no list (deepseek_v32). A source on another layer is an error.
    IndexerLayer,
}

/// Which layers are MoE, from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerPattern {
    /// None.
    Dense,
    /// All.
    AllMoe,
    /// qwen2_moe/qwen3_moe: layer l is MoE iff l is not in `mlp_only_layers`, there are experts,
    /// and (l + 1) % `decoder_sparse_step` == 0.
    QwenSparseStep,
    /// deepseek_v3/glm4_moe: layer l is MoE iff there are experts and l >= `first_k_dense_replace`
    /// (TF `DeepseekV3DecoderLayer`, `Glm4MoeDecoderLayer`); deepseek_v32/glm_moe_dsa: the
    /// config's `mlp_layer_types[l]` is `sparse` (transformers derives that list from
    /// `first_k_dense_replace` when absent, `DeepseekV32Config.__post_init__`).
    FirstKDense,
}

/// A config field that must agree with Megatron's stored args.
pub(crate) struct Check {
    /// config.json field (resolved with transformers' defaults by [`Dims::field`]).
    pub hf: &'static str,
    /// Megatron args field (resolved with Megatron's defaults by [`super::config::Args::field`]).
    pub args: &'static str,
    pub rel: Rel,
}

/// How a config field relates to its args field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rel {
    /// Equal integers.
    Eq,
    /// Booleans, one the negation of the other (`tie_word_embeddings` vs
    /// `untie_embeddings_and_output_weights`).
    Not,
    /// Equal booleans, absent in config.json being false (transformers' default for the fields
    /// used: glm4_moe's `use_qk_norm`, `attention_bias`).
    Same,
    /// The vocabulary: see [`super::config::check_vocab`].
    Vocab,
    /// The MoE layer pattern (config via [`LayerPattern`], args `moe_layer_freq`).
    MoeLayers,
    /// The attention layer pattern: config `layer_types` against args `linear_attention_freq`
    /// (an int N: layer i is full attention iff (i + 1) % N == 0; a list: 1 linear, 0 full) and
    /// `experimental_attention_variant` `gated_delta_net`.
    AttnLayers,
    /// Equal numbers, integer or not, as each side computes with them: the config's (also looked
    /// up in `rope_parameters`, where transformers 5 keeps the RoPE fields), else transformers'
    /// default ([`ArchSpec::defaults`]); the args', Megatron's None read as what Megatron then
    /// computes ([`super::config::Args::value`]). A row of a router field (args `moe_*`) applies
    /// to a model with experts only.
    Float,
    /// The architecture implies that this args flag is true (the `hf` name says what in the
    /// message); false in args is an error, absent is unchecked.
    ArgsTrue,
    /// ... that this args flag is false; true in args is an error, absent is unchecked.
    ArgsFalse,
    /// The DSA layers that run their own indexer: config `indexer_types` (absent: all `full`)
    /// against args `dsa_indexer_topk_freq` and `dsa_indexer_skip_topk_offset`, counted in
    /// Megatron's layer numbers (a HybridModel's attention of HF layer l is layer 2l + 1; MC
    /// `dsa.is_dsa_skip_topk_layer`).
    IndexerLayers,
    /// gpt_oss's attention window per layer: config `sliding_window` on the layers `layer_types`
    /// says `sliding_attention` (default: even layers), against args `window_size` (left
    /// `sliding_window - 1`, right 0) on the layers `window_attn_skip_freq` leaves windowed
    /// (MC `is_layer_window_attention`).
    SlidingWindow,
    /// transformers' deepseek_v3 builds `q_a_layernorm` and `kv_a_layernorm` without an eps, so
    /// they use `DeepseekV3RMSNorm`'s default 1e-6 whatever `rms_norm_eps` says (TF 5.24
    /// `modeling_deepseek_v3.py`); Megatron applies `layernorm_epsilon` to every norm. Another
    /// epsilon (config, else args) is converted with a warning: those two norms then differ.
    MlaNormEps,
    /// `norm_topk_prob` (default: transformers') against the router's scoring (MC 0.19
    /// `moe_utils.py` `topk_routing_with_score_function`): a sigmoid router always renormalises its
    /// top-k; a softmax one does unless `moe_router_pre_softmax` (softmax over all experts, then
    /// top-k). A model with experts only.
    TopkNorm,
    /// deepseek_v3's `n_shared_experts` (default: transformers') against Megatron's
    /// `moe_shared_expert_intermediate_size / moe_ffn_hidden_size` (None: 0 shared experts). A
    /// model with experts only.
    SharedExperts,
    /// The router's scoring the family computes (sigmoid with the expert bias where the family's
    /// rules require `e_score_correction_bias`, else softmax; a family without `norm_topk_prob`
    /// renormalises its top-k) against `moe_router_score_function` and, for those,
    /// `moe_router_pre_softmax` (see [`super::config::family_router`]). A model with experts only.
    Router,
    /// The RoPE scaling (`rope_parameters` / `rope_scaling`: none, llama3's, yarn's, with its
    /// factors; default: transformers') against Megatron's (`--use-rope-scaling`,
    /// `--rope-scaling-factor`; `--rope-type yarn` and its `--rotary-scaling-factor`, `--yarn-*`,
    /// `--mscale*`; `rope_type` None is yarn for MLA, MC `MLATransformerConfig`).
    RopeScaling,
    /// The MLP's activation: config `hidden_act` (default `silu`) is SwiGLU's `silu`, and args
    /// say `swiglu` (Megatron's gated silu MLP), not `squared_relu`.
    Activation,
}

// ---- constructors ------------------------------------------------------------------------------

pub(crate) const fn out(name: &'static str, shape: &'static [&'static [&'static str]]) -> Out {
    Out { name, shape }
}

/// A rule without an expert axis or a value transform.
pub(crate) const fn rule(
    src: &'static [&'static str],
    outs: &'static [Out],
    split: Split,
    when: When,
) -> Rule {
    Rule {
        src,
        outs,
        split,
        experts: Experts::No,
        post: Post::None,
        when,
        parts: None,
    }
}

pub(crate) const fn check(hf: &'static str, args: &'static str, rel: Rel) -> Check {
    Check { hf, args, rel }
}

impl Rule {
    /// The rule with value transform `post`.
    pub(crate) const fn with_post(mut self, post: Post) -> Rule {
        self.post = post;
        self
    }

    /// The rule of a joined source, with its parts' rows.
    pub(crate) const fn with_parts(mut self, parts: PartRows) -> Rule {
        self.parts = Some(parts);
        self
    }
}

/// `prefix.{a|b}` as (`prefix.`, [a, b]); None for a plain key.
fn joined_parts(src: &str) -> Option<(&str, Vec<&str>)> {
    let (prefix, rest) = src.split_once('{')?;
    Some((prefix, rest.strip_suffix('}')?.split('|').collect()))
}

impl ArchSpec {
    /// The layer rule of Megatron sub-key `sub` (the first in table order: a more specific slice
    /// listed first wins, e.g. qwen2's required QKV bias over the optional one).
    pub(crate) fn layer_rule(&self, sub: &str) -> Option<&'static Rule> {
        self.layer
            .iter()
            .flat_map(|s| s.iter())
            .find(|r| r.src.contains(&sub))
    }

    /// The layer rule whose source joins several keys (`prefix.{a|b|c}`: the rows of
    /// `prefix.a`, `prefix.b`, `prefix.c` concatenated, as Megatron holds them fused in memory)
    /// and of which `sub` is one: the rule, `sub`'s index among the parts, and every part's
    /// sub-key in order.
    pub(crate) fn joined_rule(&self, sub: &str) -> Option<(&'static Rule, usize, Vec<String>)> {
        self.layer_rules().find_map(|r| {
            let (prefix, parts) = r.src.iter().find_map(|s| joined_parts(s))?;
            let part = sub.strip_prefix(prefix)?;
            let i = parts.iter().position(|p| *p == part)?;
            Some((r, i, parts.iter().map(|p| format!("{prefix}{p}")).collect()))
        })
    }

    /// The model rule of checkpoint key `key`.
    pub(crate) fn model_rule(&self, key: &str) -> Option<&'static Rule> {
        self.model.iter().find(|r| r.src.contains(&key))
    }

    /// The rules that apply to layers: each Megatron source once (the first rule of each).
    pub(crate) fn layer_rules(&self) -> impl Iterator<Item = &'static Rule> + '_ {
        let all: Vec<&'static Rule> = self.layer.iter().flat_map(|s| s.iter()).collect();
        all.clone()
            .into_iter()
            .enumerate()
            .filter(move |(i, r)| !all[..*i].iter().any(|p| p.src == r.src))
            .map(|(_, r)| r)
    }

    pub(crate) fn checks(&self) -> impl Iterator<Item = &'static Check> + '_ {
        self.checks.iter().flat_map(|s| s.iter())
    }
}

/// The largest layer or expert count a config may declare (no model has a million layers or
/// experts): checked before any per-layer table is built, so an absurd count is an error, not an
/// allocation of its size. [`Dims::check_held`] then holds counts to what the input stores.
pub(crate) const MAX_COUNT: u64 = 1 << 20;

/// The config fields that hold an MTP layer count, in any family ([`MtpSpec::field`]; from-hf
/// looks for MTP tensors under either).
pub(crate) const MTP_FIELDS: &[&str] = &["num_nextn_predict_layers", "mtp_num_hidden_layers"];

/// Config fields that are counts or sizes: a negative or fractional value is named as such
/// (rather than reported as missing).
const COUNTS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
];

/// The model's hyperparameters, as the mapping uses them.
pub(crate) struct Dims {
    pub spec: &'static ArchSpec,
    /// The config (config.json, or the one derived from args), transformers' field names.
    pub cfg: Map<String, Json>,
    /// transformers' defaults of the family ([`ArchSpec::defaults`]).
    pub defaults: Map<String, Json>,
    pub num_layers: u64,
    pub hidden: u64,
    pub heads: u64,
    /// Query groups (`num_key_value_heads`).
    pub groups: u64,
    pub head_dim: u64,
    /// None: no config says it (args only): the embedding's rows are kept.
    pub vocab_size: Option<u64>,
    pub tied: bool,
    pub num_experts: u64,
    /// Per layer: MoE (true) or dense.
    pub moe_layers: Vec<bool>,
    /// The config is a multimodal one (its text model's fields in `text_config`).
    pub multimodal: bool,
    /// The names to write: the text model's of the multimodal model (`Multimodal::text_prefix`)
    /// or a text model's (`model.`).
    pub text_prefix: &'static str,
    /// MTP layers converted, after the `num_layers` decoder layers (see [`MtpSpec`]).
    pub mtp_layers: u64,
    /// How the checkpoint numbers its layers (set from the checkpoint by `setup`).
    pub layout: Layout,
}

impl Dims {
    /// Dims of architecture `spec` from config `cfg` (transformers' field names).
    ///
    /// Errors: [`Error::InvalidArgument`] for a missing required field.
    pub(crate) fn new(spec: &'static ArchSpec, cfg: Map<String, Json>) -> Result<Dims> {
        let defaults = match serde_json::from_str(spec.defaults) {
            Ok(Json::Object(m)) => m,
            _ => unreachable!("ArchSpec::defaults is a JSON object (tested)"),
        };
        let mut d = Dims {
            spec,
            cfg,
            defaults,
            num_layers: 0,
            hidden: 0,
            heads: 0,
            groups: 0,
            head_dim: 0,
            vocab_size: None,
            tied: false,
            num_experts: 0,
            moe_layers: Vec::new(),
            multimodal: false,
            text_prefix: "model.",
            mtp_layers: 0,
            layout: Layout::Gpt,
        };
        for (k, v) in &d.cfg {
            if v.is_number() && v.as_u64().is_none() && COUNTS.contains(&k.as_str()) {
                return Err(Error::InvalidArgument(format!(
                    "config.json: {k} is {v}, not a non-negative integer"
                )));
            }
        }
        let need = |d: &Dims, k: &str| {
            d.field(k).ok_or_else(|| {
                Error::InvalidArgument(format!("config.json has no {k:?} (a non-negative integer)"))
            })
        };
        d.num_layers = need(&d, "num_hidden_layers")?;
        d.hidden = need(&d, "hidden_size")?;
        d.heads = need(&d, "num_attention_heads")?;
        d.groups = need(&d, "num_key_value_heads")?;
        d.head_dim = need(&d, "head_dim")?;
        d.vocab_size = d.field("vocab_size");
        d.tied = d.flag("tie_word_embeddings").unwrap_or(false);
        d.num_experts = d.field("num_experts").unwrap_or(0);
        // Checked before any per-layer or per-expert table is built from them.
        for (k, n) in [
            ("num_hidden_layers", d.num_layers),
            ("num_experts", d.num_experts),
        ] {
            if n > MAX_COUNT {
                return Err(Error::InvalidArgument(format!(
                    "config.json: {k} = {n} is more than any model holds (at most {MAX_COUNT})"
                )));
            }
        }
        d.moe_layers = (0..d.num_layers).map(|l| d.is_moe_layer(l)).collect();
        Ok(d)
    }

    /// Refuses counts the input cannot hold: every decoder layer, MTP layer and expert is at
    /// least one stored piece of its own (an HF tensor, or a DCP chunk: Megatron shards stacked
    /// layers and experts into one chunk each), so a config declaring more than the `pieces` the
    /// input stores describes other files. Called before planning, so a config with 10^9 layers
    /// fails at once instead of building 10^9 layers' rules.
    ///
    /// Errors: [`Error::InvalidArgument`] naming the field, its value and `pieces`.
    pub(crate) fn check_held(&self, pieces: u64, what: &str) -> Result<()> {
        let mtp = MTP_FIELDS.iter().map(|&k| (k, self.field(k).unwrap_or(0)));
        let counts = [
            ("num_hidden_layers", self.num_layers),
            ("num_experts", self.num_experts),
            ("MTP layers", self.declared_mtp()),
        ];
        for (k, n) in counts.into_iter().chain(mtp) {
            if n > pieces {
                return Err(Error::InvalidArgument(format!(
                    "config.json: {k} = {n}, but {what} holds only {pieces} tensors; it is not this model's config"
                )));
            }
        }
        Ok(())
    }

    /// An integer config field, with transformers' defaults and aliases: `num_key_value_heads`
    /// defaults to `num_attention_heads`, `head_dim` to `hidden_size / num_attention_heads`,
    /// `num_experts` is mixtral's and gpt_oss's `num_local_experts`, deepseek_v3's and glm4_moe's
    /// `n_routed_experts`; a product's factor that is a number ([`Out::shape`]) is itself;
    /// `a+b` and `a*b` (MLA's head sizes, shared experts' FFN) are the sum and product of the
    /// fields, unless the config holds that name (a config derived from args does); else the
    /// family's default ([`ArchSpec::defaults`]). None when absent.
    pub fn field(&self, k: &str) -> Option<u64> {
        if let Ok(n) = k.parse::<u64>() {
            return Some(n);
        }
        let raw = |k: &str| self.cfg.get(k).and_then(|v| v.as_u64());
        if let Some(v) = raw(k) {
            return Some(v);
        }
        // Checked: a sum or product of absurd fields is no size (None, so the shape check that
        // asked refuses it), never a wrapped one that could match a stored shape.
        if let Some((a, b)) = k.split_once('+') {
            return self.field(a)?.checked_add(self.field(b)?);
        }
        if let Some((a, b)) = k.split_once('*') {
            return self.field(a)?.checked_mul(self.field(b)?);
        }
        let v = match k {
            "num_key_value_heads" => raw(k).or_else(|| raw("num_attention_heads")),
            "head_dim" => raw(k).or_else(|| {
                Some(raw("hidden_size")? / raw("num_attention_heads").filter(|&h| h > 0)?)
            }),
            "num_experts" => raw("num_local_experts").or_else(|| raw("n_routed_experts")),
            _ => raw(k),
        };
        v.or_else(|| self.default(k)?.as_u64())
    }

    /// transformers' default of config field `k` for this family (top level, else in its default
    /// `rope_parameters`), None when it has none listed.
    fn default(&self, k: &str) -> Option<&Json> {
        let rope = self.defaults.get("rope_parameters").and_then(|r| r.get(k));
        self.defaults.get(k).or(rope)
    }

    /// Config field `k` as transformers reads it: the config's (top level, else in
    /// `rope_parameters`), else the family's default; None when neither says it (or says null).
    pub fn value(&self, k: &str) -> Option<&Json> {
        let rope = self.cfg.get("rope_parameters").and_then(|r| r.get(k));
        self.cfg
            .get(k)
            .or(rope)
            .or_else(|| self.default(k))
            .filter(|v| !v.is_null())
    }

    /// Whether the config itself states field `k` (top level or in `rope_parameters`), rather than
    /// leaving it to transformers' default.
    pub fn stated(&self, k: &str) -> bool {
        let rope = self.cfg.get("rope_parameters").and_then(|r| r.get(k));
        self.cfg.get(k).or(rope).is_some()
    }

    /// The RoPE parameters transformers reads: the config's `rope_parameters` (transformers 5) or
    /// `rope_scaling` (4.x) object, else the family's default ones; None for plain RoPE.
    pub fn rope_params(&self) -> Option<&Map<String, Json>> {
        ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|k| self.cfg.get(*k)?.as_object())
            .or_else(|| self.defaults.get("rope_parameters")?.as_object())
    }

    /// A boolean config field (else the family's default).
    pub fn flag(&self, k: &str) -> Option<bool> {
        match self.cfg.get(k) {
            Some(v) => v.as_bool(),
            None => self.default(k)?.as_bool(),
        }
    }

    /// A number of the config, at the top level or in `rope_parameters` (else the family's
    /// default, see [`Dims::value`]).
    pub fn float(&self, k: &str) -> Option<f64> {
        self.value(k)?.as_f64()
    }

    /// Layer `l`'s attention type: the config's `layer_types[l]`, or from `full_attention_interval`
    /// (default 4, transformers' for qwen3_next and qwen3_5) when it has no list: layer l is
    /// `full_attention` iff (l + 1) % interval == 0, else `linear_attention`. An MTP layer
    /// (`l >= num_layers`) is `full_attention` (the MTP layer of qwen3_next and qwen3_5: TF
    /// `Qwen3NextMTP`-style `mtp.layers.0.self_attn`, vLLM `qwen3_5_mtp.py` builds it so).
    pub fn layer_type(&self, l: u64) -> Option<String> {
        if l >= self.num_layers {
            return Some("full_attention".into());
        }
        match self.cfg.get("layer_types") {
            Some(Json::Array(a)) => a.get(l as usize)?.as_str().map(str::to_string),
            _ => {
                let k = self.field("full_attention_interval").unwrap_or(4).max(1);
                Some(
                    if (l + 1) % k == 0 {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                    .into(),
                )
            }
        }
    }

    /// Whether layer `l` is MoE: the config's pattern, evaluated at `l` for an MTP layer
    /// (deepseek_v3's and glm4_moe's MTP layer, past `first_k_dense_replace`, is MoE).
    pub fn is_moe(&self, l: u64) -> bool {
        match self.moe_layers.get(l as usize) {
            Some(&m) => m,
            None => self.is_moe_layer(l),
        }
    }

    /// The HF name of a whole-model tensor (`model.embed_tokens.weight`, `lm_head.weight`) under
    /// the text model's prefix.
    pub fn text_name(&self, name: &str) -> String {
        match name.strip_prefix("model.") {
            Some(rest) => format!("{}{rest}", self.text_prefix),
            None => name.to_string(),
        }
    }

    /// The HF name prefix of layer `l`: a decoder layer's under the text prefix, an MTP layer's
    /// (`l >= num_layers`) as the family's [`MtpSpec::layer`] says.
    pub fn layer_prefix(&self, l: u64) -> String {
        match (l.checked_sub(self.num_layers), self.spec.mtp) {
            (Some(k), Some(m)) => self.mtp_name(m.layer, k),
            _ => format!("{}layers.{l}.", self.text_prefix),
        }
    }

    /// `name` of MTP layer `k`: `{L}` is `num_hidden_layers + k`, `{k}` is k.
    pub fn mtp_name(&self, name: &str, k: u64) -> String {
        name.replace("{L}", &(self.num_layers + k).to_string())
            .replace("{k}", &k.to_string())
    }

    /// Whether layer `l` runs its own DSA indexer (see [`When::IndexerLayer`]). An MTP layer
    /// (`l >= num_layers`) always does: megatron-core 0.19.2 numbers the MTP block's inner layer 1
    /// (`multi_token_prediction.py`, `MultiTokenPredictionLayer`: "MTP inner layers use their own
    /// layer numbering"), and layer 1 never shares a top-k (`dsa.is_dsa_skip_topk_layer`); the
    /// releases hold it (`model.layers.61.self_attn.indexer.*` in deepseek-ai/DeepSeek-V3.2,
    /// `model.layers.78.self_attn.indexer.*` in zai-org/GLM-5, whose `indexer_types` lists the 78
    /// decoder layers only).
    pub fn indexer(&self, l: u64) -> bool {
        if l >= self.num_layers {
            return true;
        }
        match self.cfg.get("indexer_types") {
            Some(Json::Array(a)) => a.get(l as usize).and_then(|v| v.as_str()) == Some("full"),
            _ => true,
        }
    }

    fn is_moe_layer(&self, l: u64) -> bool {
        match self.spec.moe_layers {
            LayerPattern::Dense => false,
            LayerPattern::AllMoe => true,
            LayerPattern::QwenSparseStep => {
                let step = self.field("decoder_sparse_step").unwrap_or(1).max(1);
                let dense_only = self
                    .cfg
                    .get("mlp_only_layers")
                    .and_then(|v| v.as_array())
                    .is_some_and(|a| a.iter().any(|x| x.as_u64() == Some(l)));
                self.num_experts > 0 && !dense_only && (l + 1) % step == 0
            }
            // `mlp_layer_types` lists the decoder layers only (zai-org/GLM-5's 78): an MTP layer
            // past it is MoE by `first_k_dense_replace`, as the releases' MTP layers are.
            LayerPattern::FirstKDense => match self.cfg.get("mlp_layer_types") {
                Some(Json::Array(a)) if (l as usize) < a.len() => {
                    a[l as usize].as_str() == Some("sparse")
                }
                _ => self.num_experts > 0 && l >= self.field("first_k_dense_replace").unwrap_or(0),
            },
        }
    }

    /// Whether the mapping uses config field `k` for this config: the layer count, or a field of
    /// an output shape of a rule that applies (MoE rules when some layer is MoE, dense MLP rules
    /// when some layer is dense). A check row of an unused field is not checked (a MoE model's
    /// args may hold any dense `ffn_hidden_size`).
    pub fn uses(&self, k: &str) -> bool {
        self.used_by(k, true)
    }

    /// Whether a rule that the config requires ([`When::Optional`] ones left out) uses field `k`
    /// (see [`Dims::uses`]): a field whose absence would leave transformers' default shaping a
    /// tensor the model has (Qwen MoE's optional shared expert's size is not one).
    pub fn required_field(&self, k: &str) -> bool {
        self.used_by(k, false)
    }

    fn used_by(&self, k: &str, optional: bool) -> bool {
        let (moe, dense) = (
            self.moe_layers.iter().any(|&m| m),
            self.moe_layers.iter().any(|&m| !m),
        );
        let applies = |r: &Rule| match r.when {
            When::MoeLayer => moe,
            When::DenseLayer => dense,
            When::Optional => optional,
            _ => true,
        };
        k == "num_hidden_layers"
            || self
                .spec
                .model
                .iter()
                .chain(self.spec.layer.iter().flat_map(|s| s.iter()))
                .filter(|r| applies(r))
                .any(|r| {
                    r.outs.iter().any(|o| {
                        o.shape
                            .iter()
                            .flat_map(|f| f.iter())
                            .any(|f| *f == k || f.split(['+', '*']).any(|p| p == k))
                    })
                })
    }

    /// A dimension of [`Out::shape`]: the product of its fields, None when one is absent.
    pub fn product(&self, fields: &[&str]) -> Option<u64> {
        fields.iter().map(|f| self.field(f)).product()
    }
}
