//! The Megatron → Hugging Face mapping as a table: one [`ArchSpec`] per architecture, built from
//! shared rule slices. What differs between architectures is data here; the code that applies the
//! table (`map.rs`-style logic in [`super::mapping`]) is shared.
//!
//! HOW TO ADD AN ARCHITECTURE
//! 1. Add an `ArchSpec` to [`ARCHS`] with the `model_type` names its config.json uses.
//! 2. `layer`: list the rule slices its layers use, reusing the shared ones below ([`ATTN_QKV`],
//!    [`QK_NORM`], [`NORMS`], [`DENSE_MLP`], ...) and adding a slice for what is its own. A
//!    [`Rule`] names the Megatron sub-key(s) (aliases: TE's fused norms, the local spec's), the HF
//!    tensors it writes ([`Out`]: name and the shape the config implies, as products of config
//!    fields), how the source rows are split among them ([`Split`], a small function of the dims:
//!    `whole`, `gate_up`, `qkv_per_group`, ...; a new layout such as a per-key-head in_proj gather or
//!    a per-head q/gate interleave is one more such function), whether an expert axis leads
//!    ([`Experts`]), a value transform ([`Post`]: `+1` for zero-centred norms, transposed fused
//!    experts), and on which layers the config requires it ([`When`]).
//! 3. `checks`: the (config.json field, Megatron args field, [`Rel`]) rows that must agree for
//!    this architecture, normally `BASE_CHECKS` and `HEAD_SPLIT_CHECKS` plus its own fields
//!    (e.g. `q_lora_rank`, `linear_num_key_heads`). Every config field a rule's `Out::shape` or `Split` uses must be
//!    in a check row, so that a wrong config is refused wherever args are stored.
//! 4. `moe_layers`: which layers are MoE according to the config ([`LayerPattern`]).
//! 5. Tests: a real megatron-core model of that family, converted and loaded by transformers.
//!
//! The set of HF tensors a config requires is derived from the same rows (`When`), so a config
//! that demands a tensor no checkpoint key produces is refused, not written incomplete.

use super::dims::Dims;
use super::gdn;
use crate::error::{Error, Result};

/// One architecture.
pub(crate) struct ArchSpec {
    /// `model_type` values of config.json (and `--arch`) that select it.
    pub model_types: &'static [&'static str],
    /// Rules for whole-model keys (full checkpoint key).
    pub model: &'static [Rule],
    /// Rules for per-layer keys (sub-key after `decoder.layers.{i}.`, or after `decoder.layers.`
    /// when layers are stacked on a leading axis).
    pub layer: &'static [&'static [Rule]],
    /// Config fields checked against Megatron's stored args.
    pub checks: &'static [&'static [Check]],
    /// Which layers are MoE.
    pub moe_layers: LayerPattern,
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
    /// (TF `DeepseekV3DecoderLayer`, `Glm4MoeDecoderLayer`).
    FirstKDense,
}

/// A config field that must agree with Megatron's stored args.
pub(crate) struct Check {
    /// config.json field (resolved with transformers' defaults by [`Dims::field`]).
    pub hf: &'static str,
    /// Megatron args field (resolved with Megatron's defaults by [`super::dims::Args::field`]).
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
    /// The vocabulary: see [`super::dims::check_vocab`].
    Vocab,
    /// The MoE layer pattern (config via [`LayerPattern`], args `moe_layer_freq`).
    MoeLayers,
    /// The attention layer pattern: config `layer_types` against args `linear_attention_freq`
    /// (an int N: layer i is full attention iff (i + 1) % N == 0; a list: 1 linear, 0 full) and
    /// `experimental_attention_variant` `gated_delta_net`.
    AttnLayers,
    /// Equal numbers, integer or not (the rotary fraction); the config field is also looked up
    /// in `rope_parameters` (transformers 5 keeps it there).
    Float,
    /// The architecture implies that this args flag is true (the `hf` name says what in the
    /// message); false in args is an error, absent is unchecked.
    ArgsTrue,
    /// gpt_oss's attention window per layer: config `sliding_window` on the layers `layer_types`
    /// says `sliding_attention` (default: even layers), against args `window_size` (left
    /// `sliding_window - 1`, right 0) on the layers `window_attn_skip_freq` leaves windowed
    /// (MC `is_layer_window_attention`).
    SlidingWindow,
}

// ---- splits -----------------------------------------------------------------------------------

fn whole(_: &Dims, _: &str, shape: &[u64]) -> Result<Vec<Vec<(u64, u64)>>> {
    Ok(vec![vec![(0, shape.first().copied().unwrap_or(1))]])
}

/// Rows `[0, vocab_size)`: Megatron pads the vocabulary (checked in `check_vocab`).
fn vocab_rows(d: &Dims, key: &str, shape: &[u64]) -> Result<Vec<Vec<(u64, u64)>>> {
    let rows = shape[0];
    let v = d.vocab_size.unwrap_or(rows);
    if v > rows {
        return Err(Error::Validation(format!(
            "{key} has {rows} rows, fewer than vocab_size {v}"
        )));
    }
    Ok(vec![vec![(0, v)]])
}

/// SwiGLU fc1 rows `[gate; up]`.
pub(crate) fn gate_up(_: &Dims, key: &str, shape: &[u64]) -> Result<Vec<Vec<(u64, u64)>>> {
    let r = shape[0];
    if r % 2 != 0 {
        return Err(Error::Validation(format!(
            "{key}: SwiGLU fc1 has an odd row count {r}"
        )));
    }
    Ok(vec![vec![(0, r / 2)], vec![(r / 2, r / 2)]])
}

/// `linear_qkv` rows per query group: `[q (heads/groups heads), k, v]`, each head `head_dim`
/// rows (megatron-torch-dist.md §4.3).
fn qkv_per_group(d: &Dims, key: &str, shape: &[u64]) -> Result<Vec<Vec<(u64, u64)>>> {
    let (g, h) = (d.groups, d.head_dim);
    let n = d.heads / g.max(1);
    if g == 0 || d.heads % g != 0 || shape[0] != g * (n + 2) * h {
        return Err(Error::Validation(format!(
            "{key}: {} rows do not fit num_attention_heads = {} in num_key_value_heads = {} groups of head_dim = {h}",
            shape[0], d.heads, g
        )));
    }
    let block = |off: u64, len: u64| (0..g).map(|gi| (gi * (n + 2) * h + off, len)).collect();
    Ok(vec![
        block(0, n * h),
        block(n * h, h),
        block((n + 1) * h, h),
    ])
}

// ---- shapes -----------------------------------------------------------------------------------

pub(crate) const H: &[&str] = &["hidden_size"];
const V: &[&str] = &["vocab_size"];
const Q: &[&str] = &["num_attention_heads", "head_dim"];
const KV: &[&str] = &["num_key_value_heads", "head_dim"];
pub(crate) const HD: &[&str] = &["head_dim"];
const FFN: &[&str] = &["intermediate_size"];
const MOE_FFN: &[&str] = &["moe_intermediate_size"];
const SHARED_FFN: &[&str] = &["shared_expert_intermediate_size"];
const E: &[&str] = &["num_experts"];
pub(crate) const ONE: &[&str] = &[];

const fn out(name: &'static str, shape: &'static [&'static [&'static str]]) -> Out {
    Out { name, shape }
}

const fn rule(
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
    }
}

const fn experts(src: &'static [&'static str], outs: &'static [Out], split: Split) -> Rule {
    Rule {
        src,
        outs,
        split,
        experts: Experts::PerExpert,
        post: Post::None,
        when: When::MoeLayer,
    }
}

// ---- rule slices --------------------------------------------------------------------------------

/// Embedding, final norm and output layer (megatron-torch-dist.md §4.3).
pub(crate) const COMMON_MODEL: &[Rule] = &[
    rule(
        &["embedding.word_embeddings.weight"],
        &[out("model.embed_tokens.weight", &[V, H])],
        vocab_rows,
        When::Always,
    ),
    rule(
        &["output_layer.weight"],
        &[out("lm_head.weight", &[V, H])],
        vocab_rows,
        When::Untied,
    ),
    rule(
        &["decoder.final_layernorm.weight"],
        &[out("model.norm.weight", &[H])],
        whole,
        When::Always,
    ),
];

const QKV_OUTS: &[Out] = &[
    out("self_attn.q_proj.weight", &[Q, H]),
    out("self_attn.k_proj.weight", &[KV, H]),
    out("self_attn.v_proj.weight", &[KV, H]),
];
const QKV_BIAS_OUTS: &[Out] = &[
    out("self_attn.q_proj.bias", &[Q]),
    out("self_attn.k_proj.bias", &[KV]),
    out("self_attn.v_proj.bias", &[KV]),
];

/// Standard attention: fused QKV per query group, output projection; QKV bias when stored.
pub(crate) const ATTN_QKV: &[Rule] = &[
    rule(
        &["self_attention.linear_qkv.weight"],
        QKV_OUTS,
        qkv_per_group,
        When::Always,
    ),
    rule(
        &["self_attention.linear_qkv.bias"],
        QKV_BIAS_OUTS,
        qkv_per_group,
        When::Optional,
    ),
    rule(
        &["self_attention.linear_proj.weight"],
        &[out("self_attn.o_proj.weight", &[H, Q])],
        whole,
        When::Always,
    ),
];

/// QKV bias the config requires (qwen2).
pub(crate) const QKV_BIAS_REQUIRED: &[Rule] = &[rule(
    &["self_attention.linear_qkv.bias"],
    QKV_BIAS_OUTS,
    qkv_per_group,
    When::Always,
)];

/// Per-head q/k RMSNorm (qwen3).
pub(crate) const QK_NORM: &[Rule] = &[
    rule(
        &["self_attention.q_layernorm.weight"],
        &[out("self_attn.q_norm.weight", &[HD])],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.k_layernorm.weight"],
        &[out("self_attn.k_norm.weight", &[HD])],
        whole,
        When::Always,
    ),
];

/// Pre-attention and pre-MLP norms: TE's fused names and the local spec's.
pub(crate) const NORMS: &[Rule] = &[
    rule(
        &[
            "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.weight",
        ],
        &[out("input_layernorm.weight", &[H])],
        whole,
        When::Always,
    ),
    rule(
        &[
            "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.weight",
        ],
        &[out("post_attention_layernorm.weight", &[H])],
        whole,
        When::Always,
    ),
];

/// Dense SwiGLU MLP on dense layers.
pub(crate) const DENSE_MLP: &[Rule] = &[
    rule(
        &["mlp.linear_fc1.weight"],
        &[
            out("mlp.gate_proj.weight", &[FFN, H]),
            out("mlp.up_proj.weight", &[FFN, H]),
        ],
        gate_up,
        When::DenseLayer,
    ),
    rule(
        &["mlp.linear_fc2.weight"],
        &[out("mlp.down_proj.weight", &[H, FFN])],
        whole,
        When::DenseLayer,
    ),
];

/// Qwen MoE: router, per-expert SwiGLU, optional shared expert with its gate.
pub(crate) const QWEN_MOE: &[Rule] = &[
    rule(
        &["mlp.router.weight"],
        &[out("mlp.gate.weight", &[E, H])],
        whole,
        When::MoeLayer,
    ),
    rule(
        &["mlp.router.expert_bias"],
        &[out("mlp.gate.e_score_correction_bias", &[E])],
        whole,
        When::Optional,
    ),
    experts(
        &["mlp.experts.experts.linear_fc1.weight"],
        &[
            out("mlp.experts.{e}.gate_proj.weight", &[MOE_FFN, H]),
            out("mlp.experts.{e}.up_proj.weight", &[MOE_FFN, H]),
        ],
        gate_up,
    ),
    experts(
        &["mlp.experts.experts.linear_fc2.weight"],
        &[out("mlp.experts.{e}.down_proj.weight", &[H, MOE_FFN])],
        whole,
    ),
    rule(
        &["mlp.shared_experts.linear_fc1.weight"],
        &[
            out("mlp.shared_expert.gate_proj.weight", &[SHARED_FFN, H]),
            out("mlp.shared_expert.up_proj.weight", &[SHARED_FFN, H]),
        ],
        gate_up,
        When::Optional,
    ),
    rule(
        &["mlp.shared_experts.linear_fc2.weight"],
        &[out("mlp.shared_expert.down_proj.weight", &[H, SHARED_FFN])],
        whole,
        When::Optional,
    ),
    rule(
        &["mlp.shared_experts.gate_weight"],
        &[out("mlp.shared_expert_gate.weight", &[ONE, H])],
        whole,
        When::Optional,
    ),
];

/// Mixtral MoE: `block_sparse_moe`, experts w1 (gate), w3 (up), w2 (down); expert FFN size is the
/// config's `intermediate_size`.
pub(crate) const MIXTRAL_MOE: &[Rule] = &[
    rule(
        &["mlp.router.weight"],
        &[out("block_sparse_moe.gate.weight", &[E, H])],
        whole,
        When::MoeLayer,
    ),
    experts(
        &["mlp.experts.experts.linear_fc1.weight"],
        &[
            out("block_sparse_moe.experts.{e}.w1.weight", &[FFN, H]),
            out("block_sparse_moe.experts.{e}.w3.weight", &[FFN, H]),
        ],
        gate_up,
    ),
    experts(
        &["mlp.experts.experts.linear_fc2.weight"],
        &[out("block_sparse_moe.experts.{e}.w2.weight", &[H, FFN])],
        whole,
    ),
];

// ---- deepseek_v3, glm4_moe, gpt_oss ---------------------------------------------------------------
// Sums of config fields ("a+b") and products are resolved by `Dims::field` / `Dims::product`.

const QLR: &[&str] = &["q_lora_rank"];
const KVLR: &[&str] = &["kv_lora_rank"];
const SHARED_EXPERTS_FFN: &[&str] = &["n_shared_experts*moe_intermediate_size"];
const GATE_UP: &[&str] = &["2", "intermediate_size"];

/// Multi-latent attention (deepseek_v3): low-rank q and kv projections with their norms (TE's
/// fused `layer_norm_weight` and the local spec's `q_layernorm`/`kv_layernorm`). Every row layout
/// is already transformers': `q_b_proj` per head [qk_nope; qk_rope], `kv_a_proj_with_mqa`
/// [kv_lora_rank; qk_rope], `kv_b_proj` per head [qk_nope; v] (MC `multi_latent_attention.py`;
/// MB `deepseek/common.py`). Megatron's MLA de-interleaves the rope dims itself, as transformers
/// does with `rope_interleave` (its default).
pub(crate) const MLA_ATTN: &[Rule] = &[
    rule(
        &["self_attention.linear_q_down_proj.weight"],
        &[out("self_attn.q_a_proj.weight", &[QLR, H])],
        whole,
        When::Always,
    ),
    rule(
        &[
            "self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.q_layernorm.weight",
        ],
        &[out("self_attn.q_a_layernorm.weight", &[QLR])],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.linear_q_up_proj.weight"],
        &[out(
            "self_attn.q_b_proj.weight",
            &[
                &["num_attention_heads", "qk_nope_head_dim+qk_rope_head_dim"],
                QLR,
            ],
        )],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.linear_kv_down_proj.weight"],
        &[out(
            "self_attn.kv_a_proj_with_mqa.weight",
            &[&["kv_lora_rank+qk_rope_head_dim"], H],
        )],
        whole,
        When::Always,
    ),
    rule(
        &[
            "self_attention.linear_kv_up_proj.layer_norm_weight",
            "self_attention.kv_layernorm.weight",
        ],
        &[out("self_attn.kv_a_layernorm.weight", &[KVLR])],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.linear_kv_up_proj.weight"],
        &[out(
            "self_attn.kv_b_proj.weight",
            &[
                &["num_attention_heads", "qk_nope_head_dim+v_head_dim"],
                KVLR,
            ],
        )],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.linear_proj.weight"],
        &[out(
            "self_attn.o_proj.weight",
            &[H, &["num_attention_heads", "v_head_dim"]],
        )],
        whole,
        When::Always,
    ),
];

/// glm4_moe's QKV bias and q/k norm, present as its config says.
pub(crate) const GLM_ATTN_OPTIONS: &[Rule] = &[
    rule(
        &["self_attention.linear_qkv.bias"],
        QKV_BIAS_OUTS,
        qkv_per_group,
        When::Flag("attention_bias"),
    ),
    rule(
        &["self_attention.q_layernorm.weight"],
        &[out("self_attn.q_norm.weight", &[HD])],
        whole,
        When::Flag("use_qk_norm"),
    ),
    rule(
        &["self_attention.k_layernorm.weight"],
        &[out("self_attn.k_norm.weight", &[HD])],
        whole,
        When::Flag("use_qk_norm"),
    ),
];

/// deepseek_v3 / glm4_moe MoE layers: sigmoid router with its expert bias
/// (`e_score_correction_bias`, which `save_pretrained` always writes), shared experts of
/// `n_shared_experts x moe_intermediate_size` (MB `deepseek/common.py`, `glm45_bridge.py`).
pub(crate) const DEEPSEEK_MOE: &[Rule] = &[
    rule(
        &["mlp.router.weight"],
        &[out("mlp.gate.weight", &[E, H])],
        whole,
        When::MoeLayer,
    ),
    rule(
        &["mlp.router.expert_bias"],
        &[out("mlp.gate.e_score_correction_bias", &[E])],
        whole,
        When::MoeLayer,
    ),
    rule(
        &["mlp.shared_experts.linear_fc1.weight"],
        &[
            out(
                "mlp.shared_experts.gate_proj.weight",
                &[SHARED_EXPERTS_FFN, H],
            ),
            out(
                "mlp.shared_experts.up_proj.weight",
                &[SHARED_EXPERTS_FFN, H],
            ),
        ],
        gate_up,
        When::MoeLayer,
    ),
    rule(
        &["mlp.shared_experts.linear_fc2.weight"],
        &[out(
            "mlp.shared_experts.down_proj.weight",
            &[H, SHARED_EXPERTS_FFN],
        )],
        whole,
        When::MoeLayer,
    ),
];

/// Per-expert SwiGLU experts of `moe_intermediate_size` (the same rows as in [`QWEN_MOE`]).
pub(crate) const ROUTED_EXPERTS: &[Rule] = &[
    experts(
        &["mlp.experts.experts.linear_fc1.weight"],
        &[
            out("mlp.experts.{e}.gate_proj.weight", &[MOE_FFN, H]),
            out("mlp.experts.{e}.up_proj.weight", &[MOE_FFN, H]),
        ],
        gate_up,
    ),
    experts(
        &["mlp.experts.experts.linear_fc2.weight"],
        &[out("mlp.experts.{e}.down_proj.weight", &[H, MOE_FFN])],
        whole,
    ),
];

const fn stacked(src: &'static [&'static str], outs: &'static [Out], post: Post) -> Rule {
    Rule {
        src,
        outs,
        split: whole,
        experts: Experts::Stacked,
        post,
        when: When::MoeLayer,
    }
}

/// gpt_oss: QKV and output biases, attention sinks (`softmax_offset`, one per head), a router with
/// a bias, and experts written fused over all experts and transposed (`x @ W`), `gate_up` columns
/// interleaved (MB `gpt_oss_bridge.py`; TF gpt_oss modeling).
pub(crate) const GPT_OSS: &[Rule] = &[
    rule(
        &["self_attention.linear_proj.bias"],
        &[out("self_attn.o_proj.bias", &[H])],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.core_attention.softmax_offset"],
        &[out("self_attn.sinks", &[&["num_attention_heads"]])],
        whole,
        When::Always,
    ),
    rule(
        &["mlp.router.weight"],
        &[out("mlp.router.weight", &[E, H])],
        whole,
        When::MoeLayer,
    ),
    rule(
        &["mlp.router.bias"],
        &[out("mlp.router.bias", &[E])],
        whole,
        When::MoeLayer,
    ),
    stacked(
        &["mlp.experts.experts.linear_fc1.weight"],
        &[out("mlp.experts.gate_up_proj", &[E, H, GATE_UP])],
        Post::InterleaveTransposeLast2,
    ),
    stacked(
        &["mlp.experts.experts.linear_fc1.bias"],
        &[out("mlp.experts.gate_up_proj_bias", &[E, GATE_UP])],
        Post::InterleaveLast,
    ),
    stacked(
        &["mlp.experts.experts.linear_fc2.weight"],
        &[out("mlp.experts.down_proj", &[E, FFN, H])],
        Post::TransposeLast2,
    ),
    stacked(
        &["mlp.experts.experts.linear_fc2.bias"],
        &[out("mlp.experts.down_proj_bias", &[E, H])],
        Post::None,
    ),
];

// ---- checks -------------------------------------------------------------------------------------

pub(crate) const fn check(hf: &'static str, args: &'static str, rel: Rel) -> Check {
    Check { hf, args, rel }
}

/// Fields every architecture's mapping uses.
pub(crate) const BASE_CHECKS: &[Check] = &[
    check("num_hidden_layers", "num_layers", Rel::Eq),
    check("hidden_size", "hidden_size", Rel::Eq),
    check("num_attention_heads", "num_attention_heads", Rel::Eq),
    check("vocab_size", "padded_vocab_size", Rel::Vocab),
    check(
        "tie_word_embeddings",
        "untie_embeddings_and_output_weights",
        Rel::Not,
    ),
];

/// The head split of standard attention (every architecture but MLA's: transformers' deepseek_v3
/// `head_dim` is `qk_rope_head_dim`, and Megatron's `kv_channels` is unused by MLA).
pub(crate) const HEAD_SPLIT_CHECKS: &[Check] = &[
    check("num_key_value_heads", "num_query_groups", Rel::Eq),
    check("head_dim", "kv_channels", Rel::Eq),
];

/// Dense MLP size.
pub(crate) const DENSE_CHECKS: &[Check] = &[check("intermediate_size", "ffn_hidden_size", Rel::Eq)];

/// Qwen MoE sizes and layer pattern.
pub(crate) const QWEN_MOE_CHECKS: &[Check] = &[
    check("num_experts", "num_experts", Rel::Eq),
    check("moe_intermediate_size", "moe_ffn_hidden_size", Rel::Eq),
    check(
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        Rel::Eq,
    ),
    check("num_experts", "moe_layer_freq", Rel::MoeLayers),
];

/// Mixtral and gpt_oss: experts' FFN size is `intermediate_size`.
pub(crate) const MIXTRAL_CHECKS: &[Check] = &[
    check("num_experts", "num_experts", Rel::Eq),
    check("intermediate_size", "moe_ffn_hidden_size", Rel::Eq),
    check("num_experts", "moe_layer_freq", Rel::MoeLayers),
];

/// RoPE: no tensor depends on it, but a wrong fraction or base gives a wrong model (the config
/// field at the top level or in `rope_parameters`).
pub(crate) const ROPE_CHECKS: &[Check] = &[
    check("partial_rotary_factor", "rotary_percent", Rel::Float),
    check("rope_theta", "rotary_base", Rel::Float),
];

/// MLA's ranks and head sizes (Megatron `--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim` (the
/// no-rope part), `--qk-pos-emb-head-dim`, `--v-head-dim`).
pub(crate) const MLA_CHECKS: &[Check] = &[
    check("q_lora_rank", "q_lora_rank", Rel::Eq),
    check("kv_lora_rank", "kv_lora_rank", Rel::Eq),
    check("qk_nope_head_dim", "qk_head_dim", Rel::Eq),
    check("qk_rope_head_dim", "qk_pos_emb_head_dim", Rel::Eq),
    check("v_head_dim", "v_head_dim", Rel::Eq),
];

/// glm4_moe's optional q/k norm and QKV bias ([`GLM_ATTN_OPTIONS`]).
pub(crate) const GLM_ATTN_CHECKS: &[Check] = &[
    check("use_qk_norm", "qk_layernorm", Rel::Same),
    check("attention_bias", "add_qkv_bias", Rel::Same),
];

/// deepseek_v3 / glm4_moe: dense and expert FFN sizes, shared experts, the first dense layers.
pub(crate) const DEEPSEEK_MOE_CHECKS: &[Check] = &[
    check("intermediate_size", "ffn_hidden_size", Rel::Eq),
    check("num_experts", "num_experts", Rel::Eq),
    check("moe_intermediate_size", "moe_ffn_hidden_size", Rel::Eq),
    check(
        "n_shared_experts*moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        Rel::Eq,
    ),
    check("first_k_dense_replace", "moe_layer_freq", Rel::MoeLayers),
];

// ---- architectures ------------------------------------------------------------------------------

pub(crate) static ARCHS: &[ArchSpec] = &[
    ArchSpec {
        model_types: &["llama"],
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, NORMS, DENSE_MLP],
        checks: &[BASE_CHECKS, HEAD_SPLIT_CHECKS, DENSE_CHECKS],
        moe_layers: LayerPattern::Dense,
    },
    ArchSpec {
        model_types: &["qwen2"],
        model: COMMON_MODEL,
        layer: &[QKV_BIAS_REQUIRED, ATTN_QKV, NORMS, DENSE_MLP],
        checks: &[BASE_CHECKS, HEAD_SPLIT_CHECKS, DENSE_CHECKS],
        moe_layers: LayerPattern::Dense,
    },
    ArchSpec {
        model_types: &["qwen3"],
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, QK_NORM, NORMS, DENSE_MLP],
        checks: &[BASE_CHECKS, HEAD_SPLIT_CHECKS, DENSE_CHECKS],
        moe_layers: LayerPattern::Dense,
    },
    ArchSpec {
        model_types: &["qwen3_moe"],
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, QK_NORM, NORMS, DENSE_MLP, QWEN_MOE],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            DENSE_CHECKS,
            QWEN_MOE_CHECKS,
        ],
        moe_layers: LayerPattern::QwenSparseStep,
    },
    ArchSpec {
        model_types: &["deepseek_v3"],
        model: COMMON_MODEL,
        layer: &[MLA_ATTN, NORMS, DENSE_MLP, DEEPSEEK_MOE, ROUTED_EXPERTS],
        checks: &[BASE_CHECKS, ROPE_CHECKS, MLA_CHECKS, DEEPSEEK_MOE_CHECKS],
        moe_layers: LayerPattern::FirstKDense,
    },
    ArchSpec {
        model_types: &["glm4_moe"],
        model: COMMON_MODEL,
        layer: &[
            GLM_ATTN_OPTIONS,
            ATTN_QKV,
            NORMS,
            DENSE_MLP,
            DEEPSEEK_MOE,
            ROUTED_EXPERTS,
        ],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            ROPE_CHECKS,
            GLM_ATTN_CHECKS,
            DEEPSEEK_MOE_CHECKS,
        ],
        moe_layers: LayerPattern::FirstKDense,
    },
    ArchSpec {
        model_types: &["gpt_oss"],
        model: COMMON_MODEL,
        layer: &[QKV_BIAS_REQUIRED, ATTN_QKV, NORMS, GPT_OSS],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            ROPE_CHECKS,
            MIXTRAL_CHECKS,
            &[check("sliding_window", "window_size", Rel::SlidingWindow)],
        ],
        moe_layers: LayerPattern::AllMoe,
    },
    ArchSpec {
        model_types: &["qwen3_next"],
        model: COMMON_MODEL,
        layer: &[
            gdn::GDN_QWEN3_NEXT,
            gdn::GDN_LAYERS,
            NORMS,
            DENSE_MLP,
            gdn::GATED_SHARED_EXPERT,
            QWEN_MOE,
        ],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            DENSE_CHECKS,
            QWEN_MOE_CHECKS,
            gdn::GDN_CHECKS,
            ROPE_CHECKS,
            gdn::GDN_MOE_CHECKS,
        ],
        moe_layers: LayerPattern::QwenSparseStep,
    },
    ArchSpec {
        // A Qwen3.5 config.json with a `text_config` (the multimodal one) converts its text model.
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        model: COMMON_MODEL,
        layer: &[
            gdn::GDN_QWEN3_5,
            gdn::GDN_LAYERS,
            NORMS,
            gdn::GATED_SHARED_EXPERT,
            QWEN_MOE,
        ],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            QWEN_MOE_CHECKS,
            gdn::GDN_CHECKS,
            ROPE_CHECKS,
            gdn::GDN_MOE_CHECKS,
        ],
        moe_layers: LayerPattern::AllMoe,
    },
    ArchSpec {
        model_types: &["qwen3_5", "qwen3_5_text"],
        model: COMMON_MODEL,
        layer: &[gdn::GDN_QWEN3_5, gdn::GDN_LAYERS, NORMS, DENSE_MLP],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            DENSE_CHECKS,
            gdn::GDN_CHECKS,
            ROPE_CHECKS,
        ],
        moe_layers: LayerPattern::Dense,
    },
    ArchSpec {
        model_types: &["mixtral"],
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, NORMS, MIXTRAL_MOE],
        checks: &[BASE_CHECKS, HEAD_SPLIT_CHECKS, MIXTRAL_CHECKS],
        moe_layers: LayerPattern::AllMoe,
    },
];

/// `prefix.{a|b}` as (`prefix.`, [a, b]); None for a plain key.
fn joined_parts(src: &str) -> Option<(&str, Vec<&str>)> {
    let (prefix, rest) = src.split_once('{')?;
    Some((prefix, rest.strip_suffix('}')?.split('|').collect()))
}

/// The architecture of a `model_type`.
///
/// Errors: [`Error::InvalidArgument`] naming the supported ones.
pub(crate) fn arch(name: &str) -> Result<&'static ArchSpec> {
    ARCHS
        .iter()
        .find(|a| a.model_types.contains(&name))
        .ok_or_else(|| {
            let known: Vec<&str> = ARCHS
                .iter()
                .flat_map(|a| a.model_types.iter().copied())
                .collect();
            Error::InvalidArgument(format!(
                "unsupported architecture {name:?}: shardwise maps {}",
                known.join(", ")
            ))
        })
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
