//! The architectures `to-hf` maps, by `model_type`: each an [`ArchSpec`] assembled from the rule
//! slices of [`super::rules`] and [`super::gdn`] (see the header of [`super::rules`] for how to add
//! one).

use super::gdn;
use super::rules::*;
use super::spec::{check, ArchSpec, Check, LayerPattern, Rel, Rule};
use shardwise::error::{Error, Result};

/// The checks of llama and qwen2.
const DENSE_GQA_CHECKS: &[&[Check]] = &[
    BASE_CHECKS,
    HEAD_SPLIT_CHECKS,
    DENSE_CHECKS,
    CONTEXT_CHECKS,
    SWIGLU_CHECKS,
    ROPE_THETA_CHECKS,
];

/// deepseek_v32's and glm_moe_dsa's layer: deepseek_v3's with DeepSeek sparse attention's indexer
/// (the two differ only in the indexer's rope, a check row).
const DSA_LAYER: &[&[Rule]] = &[
    MLA_ATTN,
    DSA_INDEXER,
    NORMS,
    DENSE_MLP,
    DEEPSEEK_MOE,
    ROUTED_EXPERTS,
];

pub(crate) static ARCHS: &[ArchSpec] = &[
    ArchSpec {
        model_types: &["llama"],
        architecture: "LlamaForCausalLM",
        experts_field: "num_experts",
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, NORMS, DENSE_MLP],
        checks: DENSE_GQA_CHECKS,
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                "hidden_act": "silu"}"#,
        moe_layers: LayerPattern::Dense,
        mtp: None,
        multimodal: None,
    },
    ArchSpec {
        model_types: &["qwen2"],
        architecture: "Qwen2ForCausalLM",
        experts_field: "num_experts",
        model: COMMON_MODEL,
        layer: &[QKV_BIAS_REQUIRED, ATTN_QKV, NORMS, DENSE_MLP],
        checks: DENSE_GQA_CHECKS,
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
                "rope_theta": 10000.0, "hidden_act": "silu"}"#,
        moe_layers: LayerPattern::Dense,
        mtp: None,
        multimodal: None,
    },
    ArchSpec {
        model_types: &["qwen3"],
        architecture: "Qwen3ForCausalLM",
        experts_field: "num_experts",
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, QK_NORM, NORMS, DENSE_MLP],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            DENSE_CHECKS,
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            QK_NORM_CHECKS,
            ROPE_THETA_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
                "rope_theta": 10000.0, "hidden_act": "silu"}"#,
        moe_layers: LayerPattern::Dense,
        mtp: None,
        multimodal: None,
    },
    ArchSpec {
        model_types: &["qwen3_moe"],
        architecture: "Qwen3MoeForCausalLM",
        experts_field: "num_experts",
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, QK_NORM, NORMS, DENSE_MLP, QWEN_MOE],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            DENSE_CHECKS,
            QWEN_MOE_CHECKS,
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            QK_NORM_CHECKS,
            ROPE_THETA_CHECKS,
            TOPK_CHECKS,
            TOPK_NORM_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
                "rope_theta": 10000.0, "hidden_act": "silu", "num_experts_per_tok": 8,
                "norm_topk_prob": false}"#,
        moe_layers: LayerPattern::QwenSparseStep,
        mtp: None,
        multimodal: None,
    },
    ArchSpec {
        model_types: &["deepseek_v3"],
        architecture: "DeepseekV3ForCausalLM",
        experts_field: "n_routed_experts",
        model: COMMON_MODEL,
        layer: &[MLA_ATTN, NORMS, DENSE_MLP, DEEPSEEK_MOE, ROUTED_EXPERTS],
        checks: &[
            BASE_CHECKS,
            ROPE_CHECKS,
            MLA_CHECKS,
            DEEPSEEK_MOE_CHECKS,
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            TOPK_CHECKS,
            TOPK_NORM_CHECKS,
            GROUPED_ROUTER_CHECKS,
        ],
        defaults: r#"{"partial_rotary_factor": 1.0, "rms_norm_eps": 1e-06,
                "max_position_embeddings": 4096, "rope_theta": 10000.0,
                "hidden_act": "silu", "num_experts_per_tok": 8, "norm_topk_prob": true,
                "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                "n_shared_experts": 1}"#,
        moe_layers: LayerPattern::FirstKDense,
        mtp: Some(&DEEPSEEK_MTP),
        multimodal: None,
    },
    ArchSpec {
        model_types: &["glm4_moe"],
        architecture: "Glm4MoeForCausalLM",
        experts_field: "n_routed_experts",
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
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            TOPK_CHECKS,
            TOPK_NORM_CHECKS,
            GROUPED_ROUTER_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
                "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "hidden_act": "silu",
                "num_experts_per_tok": 8, "norm_topk_prob": true,
                "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                "n_shared_experts": 1}"#,
        moe_layers: LayerPattern::FirstKDense,
        mtp: Some(&DEEPSEEK_MTP),
        multimodal: None,
    },
    ArchSpec {
        model_types: &["gpt_oss"],
        architecture: "GptOssForCausalLM",
        experts_field: "num_local_experts",
        model: COMMON_MODEL,
        layer: &[QKV_BIAS_REQUIRED, ATTN_QKV, NORMS, GPT_OSS],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            ROPE_CHECKS,
            MIXTRAL_CHECKS,
            &[check("sliding_window", "window_size", Rel::SlidingWindow)],
            CONTEXT_CHECKS,
            GPT_OSS_CHECKS,
            TOPK_CHECKS,
        ],
        defaults: r#"{"partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05,
                "max_position_embeddings": 131072, "rope_theta": 150000.0,
                "num_experts_per_tok": 4, "swiglu_limit": 7.0,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}}"#,
        moe_layers: LayerPattern::AllMoe,
        mtp: None,
        multimodal: None,
    },
    ArchSpec {
        model_types: &["qwen3_next"],
        architecture: "Qwen3NextForCausalLM",
        experts_field: "num_experts",
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
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            QK_NORM_CHECKS,
            TOPK_CHECKS,
            TOPK_NORM_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
                "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "hidden_act": "silu",
                "num_experts_per_tok": 10, "norm_topk_prob": true}"#,
        moe_layers: LayerPattern::QwenSparseStep,
        mtp: Some(&gdn::QWEN_MTP),
        multimodal: None,
    },
    ArchSpec {
        // A Qwen3.5 config.json with a `text_config` (the multimodal one) converts its text model.
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        architecture: gdn::QWEN3_5_MOE_MULTIMODAL.text_architecture,
        experts_field: "num_experts",
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
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            QK_NORM_CHECKS,
            TOPK_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
                "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "hidden_act": "silu",
                "num_experts_per_tok": 8}"#,
        moe_layers: LayerPattern::AllMoe,
        mtp: Some(&gdn::QWEN_MTP),
        multimodal: Some(&gdn::QWEN3_5_MOE_MULTIMODAL),
    },
    ArchSpec {
        model_types: &["qwen3_5", "qwen3_5_text"],
        architecture: gdn::QWEN3_5_MULTIMODAL.text_architecture,
        experts_field: "num_experts",
        model: COMMON_MODEL,
        layer: &[gdn::GDN_QWEN3_5, gdn::GDN_LAYERS, NORMS, DENSE_MLP],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            DENSE_CHECKS,
            gdn::GDN_CHECKS,
            ROPE_CHECKS,
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            QK_NORM_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
                "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "hidden_act": "silu"}"#,
        moe_layers: LayerPattern::Dense,
        mtp: Some(&gdn::QWEN_MTP),
        multimodal: Some(&gdn::QWEN3_5_MULTIMODAL),
    },
    ArchSpec {
        model_types: &["deepseek_v32"],
        architecture: "DeepseekV32ForCausalLM",
        experts_field: "n_routed_experts",
        model: COMMON_MODEL,
        layer: DSA_LAYER,
        checks: &[
            BASE_CHECKS,
            ROPE_CHECKS,
            MLA_CHECKS,
            DEEPSEEK_MOE_CHECKS,
            DSA_CHECKS,
            // TF deepseek_v32's indexer rotates its rope dims in halves, not interleaved.
            &[check(
                "non-interleaved indexer rope",
                "dsa_indexer_rope_interleaved",
                Rel::ArgsFalse,
            )],
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            TOPK_CHECKS,
            TOPK_NORM_CHECKS,
            GROUPED_ROUTER_CHECKS,
        ],
        defaults: r#"{"index_topk": 2048, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-06,
                "max_position_embeddings": 163840, "rope_theta": 10000.0,
                "hidden_act": "silu", "num_experts_per_tok": 8, "norm_topk_prob": true,
                "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                "n_shared_experts": 1}"#,
        moe_layers: LayerPattern::FirstKDense,
        mtp: Some(&DEEPSEEK_V32_MTP),
        multimodal: None,
    },
    ArchSpec {
        model_types: &["glm_moe_dsa"],
        architecture: "GlmMoeDsaForCausalLM",
        experts_field: "n_routed_experts",
        model: COMMON_MODEL,
        layer: DSA_LAYER,
        checks: &[
            BASE_CHECKS,
            ROPE_CHECKS,
            MLA_CHECKS,
            DEEPSEEK_MOE_CHECKS,
            DSA_CHECKS,
            // TF glm_moe_dsa's indexer rotates its rope dims interleaved.
            &[check(
                "interleaved indexer rope",
                "dsa_indexer_rope_interleaved",
                Rel::ArgsTrue,
            )],
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            TOPK_CHECKS,
            TOPK_NORM_CHECKS,
            GROUPED_ROUTER_CHECKS,
        ],
        defaults: r#"{"index_topk": 2048, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05,
                "max_position_embeddings": 202752, "rope_theta": 10000.0,
                "hidden_act": "silu", "num_experts_per_tok": 8, "norm_topk_prob": true,
                "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
                "n_shared_experts": 1}"#,
        moe_layers: LayerPattern::FirstKDense,
        mtp: Some(&GLM_DSA_MTP),
        multimodal: None,
    },
    ArchSpec {
        model_types: &["minimax_m2"],
        architecture: "MiniMaxM2ForCausalLM",
        experts_field: "num_local_experts",
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, FULL_QK_NORM, NORMS, MIXTRAL_MOE, MINIMAX_MOE],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            ROPE_CHECKS,
            MIXTRAL_CHECKS,
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            TOPK_CHECKS,
        ],
        defaults: r#"{"partial_rotary_factor": 1.0, "rms_norm_eps": 1e-06,
                "max_position_embeddings": 196608, "rope_theta": 5000000.0,
                "hidden_act": "silu", "num_experts_per_tok": 8}"#,
        moe_layers: LayerPattern::AllMoe,
        // The releases ship no MTP weights: a checkpoint's MTP layers are refused, saying so
        // (`rules::MTP_NOT_RELEASED`).
        mtp: None,
        multimodal: None,
    },
    ArchSpec {
        model_types: &["mixtral"],
        architecture: "MixtralForCausalLM",
        experts_field: "num_local_experts",
        model: COMMON_MODEL,
        layer: &[ATTN_QKV, NORMS, MIXTRAL_MOE],
        checks: &[
            BASE_CHECKS,
            HEAD_SPLIT_CHECKS,
            MIXTRAL_CHECKS,
            CONTEXT_CHECKS,
            SWIGLU_CHECKS,
            ROPE_THETA_CHECKS,
            TOPK_CHECKS,
        ],
        defaults: r#"{"rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
                "rope_theta": 1000000.0, "hidden_act": "silu", "num_experts_per_tok": 2}"#,
        moe_layers: LayerPattern::AllMoe,
        mtp: None,
        multimodal: None,
    },
];

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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::ARCHS;

    /// docs/hf.md's "Compared pairs" table lists every check row of every family, and no other
    /// (the Python tests flip each of its rows).
    #[test]
    fn the_compared_pairs_table_is_every_check_row() {
        let doc = include_str!("../../../docs/hf.md");
        let start = doc
            .find("#### Compared pairs")
            .expect("the table's heading");
        let table = &doc[start..start + doc[start..].find("\nNot compared").unwrap()];
        let documented: BTreeSet<(String, String)> = table
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cell = |i: usize| l.split('|').nth(i).unwrap().trim().trim_matches('`');
                (cell(1).to_string(), cell(2).to_string())
            })
            .collect();
        let code: BTreeSet<(String, String)> = ARCHS
            .iter()
            .flat_map(|a| a.checks())
            .map(|c| (c.hf.to_string(), c.args.to_string()))
            .collect();
        assert_eq!(documented, code);
    }

    /// Every family's defaults are a JSON object of numbers, strings, booleans and RoPE parameters.
    #[test]
    fn every_familys_defaults_parse() {
        for a in ARCHS {
            let v: serde_json::Value = serde_json::from_str(a.defaults).unwrap();
            let m = v.as_object().unwrap();
            assert!(m.contains_key("rms_norm_eps") && m.contains_key("max_position_embeddings"));
            assert!(m.contains_key("rope_theta"), "{}", a.model_types[0]);
        }
    }
}
