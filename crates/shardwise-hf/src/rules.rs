//! The Megatron → Hugging Face mapping as data: the rule slices that architectures share, their
//! split functions and the check rows. One [`super::spec::ArchSpec`] per architecture assembles them in
//! [`super::families`]; the vocabulary is [`super::spec`]; the code that applies the table to a
//! checkpoint is [`super::plan`], shared by every architecture.
//!
//! HOW TO ADD AN ARCHITECTURE
//! 1. Add an `ArchSpec` to [`super::families::ARCHS`] with the `model_type` names its config.json uses.
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
//! 4. `moe_layers`: which layers are MoE according to the config ([`super::spec::LayerPattern`]).
//! 5. Tests: a real megatron-core model of that family, converted and loaded by transformers.
//!
//! The set of HF tensors a config requires is derived from the same rows (`When`), so a config
//! that demands a tensor no checkpoint key produces is refused, not written incomplete.

use super::spec::{
    check, out, rule, Check, Dims, Experts, MtpSpec, Out, Post, Rel, Rule, Split, When,
};
use shardwise::error::{Error, Result};

// ---- splits -----------------------------------------------------------------------------------

pub(crate) fn whole(_: &Dims, _: &str, shape: &[u64]) -> Result<Vec<Vec<(u64, u64)>>> {
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
/// rows (slime `megatron_to_hf/qwen2.py`, Megatron-Bridge `qwen3_moe_bridge.py`).
fn qkv_per_group(d: &Dims, key: &str, shape: &[u64]) -> Result<Vec<Vec<(u64, u64)>>> {
    let (g, h) = (d.groups, d.head_dim);
    let n = d.heads / g.max(1);
    // Checked: the group count sizes the ranges below only once the tensor's rows confirm it.
    let rows = g.checked_mul(n + 2).and_then(|x| x.checked_mul(h));
    if g == 0 || d.heads % g != 0 || rows != Some(shape[0]) {
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

const fn experts(src: &'static [&'static str], outs: &'static [Out], split: Split) -> Rule {
    Rule {
        src,
        outs,
        split,
        experts: Experts::PerExpert,
        post: Post::None,
        when: When::MoeLayer,
        parts: None,
    }
}

// ---- rule slices --------------------------------------------------------------------------------

/// Embedding, final norm and output layer (slime `megatron_to_hf/llama.py`, `qwen2.py`).
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
        // A GPTModel's TransformerBlock final norm; a HybridModel's HybridStack names it
        // `final_norm` (MC `hybrid_block.py`; `gpt_checkpoint_interop.py` maps one to the other).
        &[
            "decoder.final_layernorm.weight",
            "decoder.final_norm.weight",
        ],
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
        parts: None,
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

// ---- MTP ------------------------------------------------------------------------------------------

/// The MTP module's own tensors in DeepSeek-V3's layout (deepseek-ai/DeepSeek-V3
/// `README_WEIGHTS.md`: layer `num_hidden_layers + k` with `enorm`, `hnorm`, `eh_proj`,
/// `shared_head.norm` beside its attention and MoE), which GLM-4.5, DeepSeek-V3.2 and GLM-5 keep
/// (see the specs below). Megatron's `eh_proj` input is `[enorm(embedding); hnorm(hidden)]`, as
/// HF's; `final_layernorm` is `shared_head.norm`.
const DEEPSEEK_MTP_RULES: &[Rule] = &[
    rule(
        &["enorm.weight"],
        &[out("model.layers.{L}.enorm.weight", &[H])],
        whole,
        When::Always,
    ),
    rule(
        &["hnorm.weight"],
        &[out("model.layers.{L}.hnorm.weight", &[H])],
        whole,
        When::Always,
    ),
    rule(
        &["eh_proj.weight"],
        &[out(
            "model.layers.{L}.eh_proj.weight",
            &[H, &["2", "hidden_size"]],
        )],
        whole,
        When::Always,
    ),
    rule(
        &["final_layernorm.weight"],
        &[out("model.layers.{L}.shared_head.norm.weight", &[H])],
        whole,
        When::Always,
    ),
];

/// DeepSeek-V3's per-MTP-layer copies of the model's embedding and output layer (`embed_tokens`,
/// `shared_head.head`): Megatron's MTP layer shares them, the HF layout repeats them.
const DEEPSEEK_MTP_COPIES: &[Rule] = &[
    rule(
        &["embedding.word_embeddings.weight"],
        &[out("model.layers.{L}.embed_tokens.weight", &[V, H])],
        vocab_rows,
        When::Always,
    ),
    rule(
        &["output_layer.weight", "embedding.word_embeddings.weight"],
        &[out("model.layers.{L}.shared_head.head.weight", &[V, H])],
        vocab_rows,
        When::Always,
    ),
];

/// DeepSeek-V3's MTP module as its official checkpoint holds it (deepseek-ai/DeepSeek-V3
/// `README_WEIGHTS.md`: layer `num_hidden_layers + k` with `embed_tokens`, `enorm`, `hnorm`,
/// `eh_proj`, `shared_head.norm`, `shared_head.head` beside its attention and MoE), and
/// GLM-4.5's (zai-org/GLM-4.5, layer 92 of 92: the same names; vLLM `deepseek_mtp.py`,
/// `glm4_moe_mtp.py` read them so). transformers' deepseek_v3 and glm4_moe configs default the
/// field to 1.
pub(crate) static DEEPSEEK_MTP: MtpSpec = MtpSpec {
    field: "num_nextn_predict_layers",
    default: 1,
    layer: "model.layers.{L}.",
    rules: DEEPSEEK_MTP_RULES,
    copies: DEEPSEEK_MTP_COPIES,
};

/// DeepSeek-V3.2's MTP module (deepseek-ai/DeepSeek-V3.2-Exp and DeepSeek-V3.2, config
/// `num_nextn_predict_layers: 1`): DeepSeek-V3's layout, layer 61 of 61 with its copies of the
/// embedding and head, its attention DSA with its own indexer (`model.layers.61.self_attn.indexer.*`;
/// transformers 5.25 `DeepseekV32ForCausalLM` ignores `model\.layers\.61.*` on load). The
/// release's tensor count, 92,425 (FP8, each quantized weight with its `weight_scale_inv`), is
/// that of 61 decoder layers with 7 indexer tensors each, the embedding, norm and head, and such a
/// layer 61 (an MoE layer, its 7 indexer tensors and the 6 MTP tensors), copies included.
/// transformers' deepseek_v32 config has no MTP field: absent is none.
pub(crate) static DEEPSEEK_V32_MTP: MtpSpec = MtpSpec {
    field: "num_nextn_predict_layers",
    default: 0,
    layer: "model.layers.{L}.",
    rules: DEEPSEEK_MTP_RULES,
    copies: DEEPSEEK_MTP_COPIES,
};

/// GLM-5's MTP module (zai-org/GLM-5, GLM-5.1, config `num_nextn_predict_layers: 1`): layer 78 of
/// 78 in DeepSeek-V3's names (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, a DSA attention
/// with its indexer, an MoE), but without copies of the embedding and head: the model's
/// `model.embed_tokens` and `lm_head` serve it (vLLM-Ascend's GLM-5 guide has users add
/// `model.layers.78.embed_tokens.weight` and `.shared_head.head.weight` to the bf16 release
/// before serving its MTP; Megatron-Bridge `glm5_bridge.py` maps the four tensors and the layer,
/// no copies; transformers 5.25 `GlmMoeDsaForCausalLM` ignores `model\.layers\.78.*`).
/// transformers' glm_moe_dsa config has no MTP field: absent is none.
pub(crate) static GLM_DSA_MTP: MtpSpec = MtpSpec {
    field: "num_nextn_predict_layers",
    default: 0,
    layer: "model.layers.{L}.",
    rules: DEEPSEEK_MTP_RULES,
    copies: &[],
};

/// Families whose official releases declare MTP layers in config.json but ship no MTP weights:
/// `model_type` -> why a checkpoint's MTP layers have no HF layout (see `config::mtp_layers`).
pub(crate) const MTP_NOT_RELEASED: &[(&str, &str)] = &[(
    "minimax_m2",
    "MiniMax-M2's releases (MiniMaxAI/MiniMax-M2, -M2.1, -M2.5, -M2.7) declare MTP modules in \
     config.json (use_mtp, num_mtp_modules 3) but ship no MTP weights (MiniMax-AI/MiniMax-M2 \
     issue 47, MiniMax-AI/MiniMax-M2.5 issue 8, MiniMax-AI/MiniMax-M2.7 issue 16: none of the \
     release's tensors is an MTP one), so there is no layout to write them in",
)];

// ---- deepseek_v32, glm_moe_dsa, minimax_m2 ------------------------------------------------------

const INDEX_Q: &[&str] = &["index_n_heads", "index_head_dim"];
const INDEX_HD: &[&str] = &["index_head_dim"];

const fn indexer(src: &'static [&'static str], outs: &'static [Out]) -> Rule {
    rule(src, outs, whole, When::IndexerLayer)
}

/// DeepSeek sparse attention's lightning indexer (deepseek_v32, glm_moe_dsa; MLA_ATTN is the rest
/// of the attention): its own query projection from the q latent, key projection with a LayerNorm
/// (weight and bias), and per-head score weights; every row layout is already transformers'
/// (MC `dsa.py` `DSAIndexer`; TF deepseek_v32 `DeepseekV32Indexer`; MB `glm5_bridge.py`). Megatron
/// and transformers both put the rope dims first in each head; which rope (interleaved or not)
/// is a check row. Layers that share the previous layer's top-k have no indexer on either side.
pub(crate) const DSA_INDEXER: &[Rule] = &[
    indexer(
        &["self_attention.core_attention.indexer.linear_wq_b.weight"],
        &[out("self_attn.indexer.wq_b.weight", &[INDEX_Q, QLR])],
    ),
    indexer(
        &["self_attention.core_attention.indexer.linear_wk.weight"],
        &[out("self_attn.indexer.wk.weight", &[INDEX_HD, H])],
    ),
    indexer(
        &["self_attention.core_attention.indexer.k_norm.weight"],
        &[out("self_attn.indexer.k_norm.weight", &[INDEX_HD])],
    ),
    indexer(
        &["self_attention.core_attention.indexer.k_norm.bias"],
        &[out("self_attn.indexer.k_norm.bias", &[INDEX_HD])],
    ),
    indexer(
        &["self_attention.core_attention.indexer.linear_weights_proj.weight"],
        &[out(
            "self_attn.indexer.weights_proj.weight",
            &[&["index_n_heads"], H],
        )],
    ),
];

/// MiniMax-M2's q/k norms: one RMSNorm over all heads of the projection, `[heads x head_dim]`
/// (TF minimax_m2 `MiniMaxM2Attention` from FlexOlmo's; Megatron-Bridge's `FullDimQNorm` /
/// `FullDimKNorm` store it as `q_layernorm` / `k_layernorm`, sharded by head over TP).
pub(crate) const FULL_QK_NORM: &[Rule] = &[
    rule(
        &["self_attention.q_layernorm.weight"],
        &[out("self_attn.q_norm.weight", &[Q])],
        whole,
        When::Always,
    ),
    rule(
        &["self_attention.k_layernorm.weight"],
        &[out("self_attn.k_norm.weight", &[KV])],
        whole,
        When::Always,
    ),
];

/// MiniMax-M2's MoE beyond mixtral's: the sigmoid router's expert bias, which `save_pretrained`
/// writes as `block_sparse_moe.e_score_correction_bias` (TF `conversion_mapping.py` minimax_m2).
pub(crate) const MINIMAX_MOE: &[Rule] = &[rule(
    &["mlp.router.expert_bias"],
    &[out("block_sparse_moe.e_score_correction_bias", &[E])],
    whole,
    When::MoeLayer,
)];

// ---- checks -------------------------------------------------------------------------------------

/// Fields every architecture's mapping uses.
pub(crate) const BASE_CHECKS: &[Check] = &[
    check("num_hidden_layers", "num_layers", Rel::Eq),
    check("hidden_size", "hidden_size", Rel::Eq),
    check("num_attention_heads", "num_attention_heads", Rel::Eq),
    check("vocab_size", "vocab_size", Rel::Vocab),
    check(
        "tie_word_embeddings",
        "untie_embeddings_and_output_weights",
        Rel::Not,
    ),
    // Megatron-LM `--norm-epsilon` (TransformerConfig `layernorm_epsilon`) for every norm.
    check("rms_norm_eps", "norm_epsilon", Rel::Float),
];

/// What every family computes with beyond its sizes: the context length (Megatron's
/// `--max-position-embeddings`, its training length; a release may declare another for the same
/// weights: `--allow-config-mismatch max_position_embeddings`) and the RoPE scaling.
pub(crate) const CONTEXT_CHECKS: &[Check] = &[
    check(
        "max_position_embeddings",
        "max_position_embeddings",
        Rel::Float,
    ),
    check("rope_parameters", "rope_type", Rel::RopeScaling),
];

/// The SwiGLU MLP of every family but gpt_oss (whose clamped GLU is [`GPT_OSS_CHECKS`]').
pub(crate) const SWIGLU_CHECKS: &[Check] = &[check("hidden_act", "swiglu", Rel::Activation)];

/// The RoPE base of the families without [`ROPE_CHECKS`].
pub(crate) const ROPE_THETA_CHECKS: &[Check] = &[check("rope_theta", "rotary_base", Rel::Float)];

/// The router of every MoE family: its top-k (`--moe-router-topk`) and its scoring.
pub(crate) const TOPK_CHECKS: &[Check] = &[
    check("num_experts_per_tok", "moe_router_topk", Rel::Float),
    check("router scoring", "moe_router_score_function", Rel::Router),
];

/// Whether the router renormalises its top-k (the families whose config has `norm_topk_prob`).
pub(crate) const TOPK_NORM_CHECKS: &[Check] = &[check(
    "norm_topk_prob",
    "moe_router_score_function",
    Rel::TopkNorm,
)];

/// deepseek_v3's grouped router (`--moe-router-topk-scaling-factor`, `--moe-router-num-groups`,
/// `--moe-router-group-topk`; None: no scaling, one group).
pub(crate) const GROUPED_ROUTER_CHECKS: &[Check] = &[
    check(
        "routed_scaling_factor",
        "moe_router_topk_scaling_factor",
        Rel::Float,
    ),
    check("n_group", "moe_router_num_groups", Rel::Float),
    check("topk_group", "moe_router_group_topk", Rel::Float),
];

/// The q/k norms transformers' Qwen3 families always apply (Megatron `--qk-layernorm`).
pub(crate) const QK_NORM_CHECKS: &[Check] =
    &[check("q_norm and k_norm", "qk_layernorm", Rel::ArgsTrue)];

/// gpt_oss's clamped GLU: transformers clamps at `swiglu_limit` (MC `activation_func_clamp_value`).
pub(crate) const GPT_OSS_CHECKS: &[Check] = &[check(
    "swiglu_limit",
    "activation_func_clamp_value",
    Rel::Float,
)];

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
    check("rms_norm_eps", "norm_epsilon", Rel::MlaNormEps),
];

/// glm4_moe's optional q/k norm and QKV bias ([`GLM_ATTN_OPTIONS`]).
pub(crate) const GLM_ATTN_CHECKS: &[Check] = &[
    check("use_qk_norm", "qk_layernorm", Rel::Same),
    check("attention_bias", "add_qkv_bias", Rel::Same),
];

/// deepseek_v3 / glm4_moe: dense and expert FFN sizes, shared experts (their count; their
/// tensors' shape is `n_shared_experts × moe_intermediate_size`), the first dense layers.
pub(crate) const DEEPSEEK_MOE_CHECKS: &[Check] = &[
    check("intermediate_size", "ffn_hidden_size", Rel::Eq),
    check("num_experts", "num_experts", Rel::Eq),
    check("moe_intermediate_size", "moe_ffn_hidden_size", Rel::Eq),
    check(
        "n_shared_experts",
        "moe_shared_expert_intermediate_size",
        Rel::SharedExperts,
    ),
    check("first_k_dense_replace", "moe_layer_freq", Rel::MoeLayers),
];

/// DeepSeek sparse attention: the indexer's heads, head size and top-k (no tensor depends on
/// `index_topk`, but another top-k is another model), which layers run it, and the ReLU on its
/// scores that transformers applies (MC `dsa_indexer_scoring_relu`).
pub(crate) const DSA_CHECKS: &[Check] = &[
    check("index_n_heads", "dsa_indexer_n_heads", Rel::Eq),
    check("index_head_dim", "dsa_indexer_head_dim", Rel::Eq),
    check("index_topk", "dsa_indexer_topk", Rel::Float),
    check("indexer_types", "dsa_indexer_topk_freq", Rel::IndexerLayers),
    check(
        "ReLU on the indexer scores",
        "dsa_indexer_scoring_relu",
        Rel::ArgsTrue,
    ),
];
