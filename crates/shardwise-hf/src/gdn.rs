//! The hybrid Gated-DeltaNet families: `qwen3_next`, `qwen3_5_moe` (`qwen3_5_moe_text`) and
//! `qwen3_5` (`qwen3_5_text`). Layers alternate Gated DeltaNet linear attention and gated full
//! attention per the config's `layer_types` (Megatron: layer i is full attention iff
//! (i + 1) % `linear_attention_freq` == 0, MC `experimental_attention_variant_module_specs.py`).
//!
//! How megatron-core (0.16 to 0.19, `ssm/gated_delta_net`) stores a GDN layer: its fused
//! `in_proj` [q | k | v | z | beta | alpha] (each flat over heads: q, k `linear_num_key_heads x
//! linear_key_head_dim` rows, v, z `linear_num_value_heads x linear_value_head_dim`, beta, alpha
//! one row per value head) is saved as six keys `in_proj.weight.{query,key,value,z,beta,alpha}`,
//! and `conv1d.weight` [q | k | v] as three, `conv1d.weight.{query,key,value}` (its
//! `sharded_state_dict` splits them with `_split_tensor_factory`, so each is TP-sharded on its
//! own). The rules below name them joined (`{a|b|..}`): the split functions see Megatron's
//! in-memory fused rows. TE's fused pre-norm is `in_proj.layer_norm_weight`.
//!
//! Norms are zero-centred on both sides ((1 + w) x / rms), and copy as they are, except the GDN
//! output norm: transformers' `RMSNormGated` scales by w, so it is `out_norm.weight + 1`.
//! Full-attention layers are gated: `linear_qkv` rows per query group are [q (n heads), gate (n
//! heads), k, v] (MC `attention.py` `get_query_key_value_tensors`), transformers' `q_proj` rows per
//! head [q_h; gate_h] (its `view(..., head_dim * 2)` then `chunk(2)`).

use super::rules::{gate_up, whole, H, HD, ONE};
use super::spec::{check, out, rule, Check, Dims, MtpSpec, Multimodal, Out, Post, Rel, Rule, When};
use shardwise::error::{Error, Result};

type Rows = Result<Vec<Vec<(u64, u64)>>>;

/// A row count for a message ("overflow" for none).
fn show_rows(rows: Option<u64>) -> String {
    rows.map_or("more than 64-bit".into(), |r| r.to_string())
}

/// The GDN sizes, from the config.
struct Gdn {
    /// Key heads, value heads per key head, key and value head dims.
    nk: u64,
    r: u64,
    dk: u64,
    dv: u64,
}

impl Gdn {
    fn of(d: &Dims, key: &str) -> Result<Gdn> {
        let f = |k: &str| {
            d.field(k)
                .filter(|&v| v > 0)
                .ok_or_else(|| Error::InvalidArgument(format!("config.json has no integer {k:?}")))
        };
        let (nk, nv) = (f("linear_num_key_heads")?, f("linear_num_value_heads")?);
        if nv % nk != 0 {
            return Err(Error::Validation(format!(
                "{key}: linear_num_value_heads = {nv} is not a multiple of linear_num_key_heads = {nk}"
            )));
        }
        let g = Gdn {
            nk,
            r: nv / nk,
            dk: f("linear_key_head_dim")?,
            dv: f("linear_value_head_dim")?,
        };
        // Every size below is a part of the fused in_proj's rows: checked once, so none wraps
        // into a row count that could match a stored tensor.
        let rows = (|| {
            let qk = nk.checked_mul(g.dk)?;
            let v = nv.checked_mul(g.dv)?;
            qk.checked_add(v)?.checked_add(nv)?.checked_mul(2)
        })();
        if rows.is_none() {
            return Err(Error::Validation(format!(
                "{key}: linear_num_key_heads = {nk}, linear_num_value_heads = {nv} and their head dims give more than 64-bit rows"
            )));
        }
        Ok(g)
    }
    fn qk(&self) -> u64 {
        self.nk * self.dk
    }
    fn nv(&self) -> u64 {
        self.nk * self.r
    }
    fn v(&self) -> u64 {
        self.nv() * self.dv
    }
    /// Rows of the fused in_proj, checked against the source's.
    fn check_in_proj(&self, key: &str, shape: &[u64]) -> Result<()> {
        let want = 2 * self.qk() + 2 * self.v() + 2 * self.nv();
        if shape.first() != Some(&want) {
            return Err(Error::Validation(format!(
                "{key}: {:?} rows do not fit linear_num_key_heads = {} x linear_key_head_dim = {} (q, k) and linear_num_value_heads = {} x linear_value_head_dim = {} (v, z) plus beta and alpha ({want} rows)",
                shape.first(), self.nk, self.dk, self.nv(), self.dv
            )));
        }
        Ok(())
    }
}

/// Qwen3.5: `in_proj_qkv` = [q; k; v], `in_proj_z`, `in_proj_b` (beta), `in_proj_a` (alpha).
fn in_proj_flat(d: &Dims, key: &str, shape: &[u64]) -> Rows {
    let g = Gdn::of(d, key)?;
    g.check_in_proj(key, shape)?;
    let (qkv, v, nv) = (2 * g.qk() + g.v(), g.v(), g.nv());
    Ok(vec![
        vec![(0, qkv)],
        vec![(qkv, v)],
        vec![(qkv + v, nv)],
        vec![(qkv + v + nv, nv)],
    ])
}

/// Qwen3-Next: per key head g, `in_proj_qkvz` = [q_g; k_g; v_g (r value heads); z_g (r)] and
/// `in_proj_ba` = [beta_g (r); alpha_g (r)] (TF qwen3_next `fix_query_key_value_ordering`).
fn in_proj_per_key_head(d: &Dims, key: &str, shape: &[u64]) -> Rows {
    let g = Gdn::of(d, key)?;
    g.check_in_proj(key, shape)?;
    let (qk, v, nv, rv) = (g.qk(), g.v(), g.nv(), g.r * g.dv);
    let (z0, b0) = (2 * qk + v, 2 * qk + 2 * v);
    let qkvz = (0..g.nk)
        .flat_map(|h| {
            [
                (h * g.dk, g.dk),
                (qk + h * g.dk, g.dk),
                (2 * qk + h * rv, rv),
                (z0 + h * rv, rv),
            ]
        })
        .collect();
    let ba = (0..g.nk)
        .flat_map(|h| [(b0 + h * g.r, g.r), (b0 + nv + h * g.r, g.r)])
        .collect();
    Ok(vec![qkvz, ba])
}

/// The parts of the fused in_proj: q, k, v, z, beta, alpha.
fn in_proj_parts(d: &Dims, key: &str) -> Result<Vec<u64>> {
    let g = Gdn::of(d, key)?;
    Ok(vec![g.qk(), g.qk(), g.v(), g.v(), g.nv(), g.nv()])
}

/// The parts of conv1d: q, k, v channels.
fn conv_parts(d: &Dims, key: &str) -> Result<Vec<u64>> {
    let g = Gdn::of(d, key)?;
    Ok(vec![g.qk(), g.qk(), g.v()])
}

/// `conv1d.weight` [q; k; v] as it is (one channel per row).
fn conv_qkv(d: &Dims, key: &str, shape: &[u64]) -> Rows {
    let g = Gdn::of(d, key)?;
    let want = 2 * g.qk() + g.v();
    if shape.first() != Some(&want) {
        return Err(Error::Validation(format!(
            "{key}: {:?} channels; the config implies 2 x {} (q, k) + {} (v) = {want}",
            shape.first(),
            g.qk(),
            g.v()
        )));
    }
    Ok(vec![vec![(0, want)]])
}

/// Gated attention: `linear_qkv` rows per query group [q (n heads); gate (n); k; v] to `q_proj`
/// rows per head [q_h; gate_h], `k_proj`, `v_proj`.
fn qkv_gated(d: &Dims, key: &str, shape: &[u64]) -> Rows {
    let (g, h) = (d.groups, d.head_dim);
    let n = d.heads / g.max(1);
    // Checked: the group count sizes the ranges below only once the tensor's rows confirm it.
    let per = (2 * n + 2).saturating_mul(h);
    let rows = g.checked_mul(per);
    if g == 0 || d.heads % g != 0 || rows.is_none() || shape.first() != rows.as_ref() {
        return Err(Error::Validation(format!(
            "{key}: {:?} rows do not fit gated attention: num_attention_heads = {} in num_key_value_heads = {g} groups of head_dim = {h}, rows per group [q; gate; k; v] ({} rows)",
            shape.first(), d.heads, show_rows(rows)
        )));
    }
    let q = (0..g)
        .flat_map(|gi| {
            (0..n).flat_map(move |j| [(gi * per + j * h, h), (gi * per + (n + j) * h, h)])
        })
        .collect();
    let k = (0..g).map(|gi| (gi * per + 2 * n * h, h)).collect();
    let v = (0..g).map(|gi| (gi * per + (2 * n + 1) * h, h)).collect();
    Ok(vec![q, k, v])
}

// ---- shapes (products of config fields; `a+b` sums, see `Dims::field`) ---------------------------

const NV: &[&str] = &["linear_num_value_heads"];
const V_DIM: &[&str] = &["linear_num_value_heads", "linear_value_head_dim"];
const CONV: &[&str] =
    &["linear_num_key_heads*linear_key_head_dim*2+linear_num_value_heads*linear_value_head_dim"];
const QKVZ: &[&str] =
    &["linear_num_key_heads*linear_key_head_dim*2+linear_num_value_heads*linear_value_head_dim*2"];
const Q_GATED: &[&str] = &["num_attention_heads", "head_dim", "2"];
const KV: &[&str] = &["num_key_value_heads", "head_dim"];
const Q: &[&str] = &["num_attention_heads", "head_dim"];

const LINEAR: When = When::LayerType("linear_attention");
const FULL: When = When::LayerType("full_attention");

const IN_PROJ: &str = "self_attention.in_proj.weight.{query|key|value|z|beta|alpha}";

/// The parts of a GDN layer both layouts share.
pub(crate) const GDN_LAYERS: &[Rule] = &[
    rule(
        &["self_attention.in_proj.layer_norm_weight"],
        &[out("input_layernorm.weight", &[H])],
        whole,
        LINEAR,
    ),
    rule(
        &["self_attention.conv1d.weight.{query|key|value}"],
        &[out(
            "linear_attn.conv1d.weight",
            &[CONV, ONE, &["linear_conv_kernel_dim"]],
        )],
        conv_qkv,
        LINEAR,
    )
    .with_parts(conv_parts),
    rule(
        &["self_attention.A_log"],
        &[out("linear_attn.A_log", &[NV])],
        whole,
        LINEAR,
    ),
    rule(
        &["self_attention.dt_bias"],
        &[out("linear_attn.dt_bias", &[NV])],
        whole,
        LINEAR,
    ),
    rule(
        &["self_attention.out_norm.weight"],
        &[out(
            "linear_attn.norm.weight",
            &[&["linear_value_head_dim"]],
        )],
        whole,
        LINEAR,
    )
    .with_post(Post::AddOne),
    rule(
        &["self_attention.out_proj.weight"],
        &[out("linear_attn.out_proj.weight", &[H, V_DIM])],
        whole,
        LINEAR,
    ),
    // Gated full attention.
    rule(
        &["self_attention.linear_qkv.weight"],
        &[
            out("self_attn.q_proj.weight", &[Q_GATED, H]),
            out("self_attn.k_proj.weight", &[KV, H]),
            out("self_attn.v_proj.weight", &[KV, H]),
        ],
        qkv_gated,
        FULL,
    ),
    rule(
        &["self_attention.linear_proj.weight"],
        &[out("self_attn.o_proj.weight", &[H, Q])],
        whole,
        FULL,
    ),
    rule(
        &["self_attention.q_layernorm.weight"],
        &[out("self_attn.q_norm.weight", &[HD])],
        whole,
        FULL,
    ),
    rule(
        &["self_attention.k_layernorm.weight"],
        &[out("self_attn.k_norm.weight", &[HD])],
        whole,
        FULL,
    ),
];

/// Qwen3.5's GDN input projections.
pub(crate) const GDN_QWEN3_5: &[Rule] = &[rule(
    &[IN_PROJ],
    &[
        out("linear_attn.in_proj_qkv.weight", &[CONV, H]),
        out("linear_attn.in_proj_z.weight", &[V_DIM, H]),
        out("linear_attn.in_proj_b.weight", &[NV, H]),
        out("linear_attn.in_proj_a.weight", &[NV, H]),
    ],
    in_proj_flat,
    LINEAR,
)
.with_parts(in_proj_parts)];

/// Qwen3-Next's GDN input projections.
pub(crate) const GDN_QWEN3_NEXT: &[Rule] = &[rule(
    &[IN_PROJ],
    &[
        out("linear_attn.in_proj_qkvz.weight", &[QKVZ, H]),
        out(
            "linear_attn.in_proj_ba.weight",
            &[&["linear_num_value_heads", "2"], H],
        ),
    ],
    in_proj_per_key_head,
    LINEAR,
)
.with_parts(in_proj_parts)];

/// The shared expert and its sigmoid gate, which these families always have (listed before
/// [`super::rules::QWEN_MOE`], whose optional rows they override).
pub(crate) const GATED_SHARED_EXPERT: &[Rule] = &[
    rule(
        &["mlp.shared_experts.linear_fc1.weight"],
        &[
            out(
                "mlp.shared_expert.gate_proj.weight",
                &[&["shared_expert_intermediate_size"], H],
            ),
            out(
                "mlp.shared_expert.up_proj.weight",
                &[&["shared_expert_intermediate_size"], H],
            ),
        ],
        gate_up,
        When::MoeLayer,
    ),
    rule(
        &["mlp.shared_experts.linear_fc2.weight"],
        &[out(
            "mlp.shared_expert.down_proj.weight",
            &[H, &["shared_expert_intermediate_size"]],
        )],
        whole,
        When::MoeLayer,
    ),
    rule(
        &["mlp.shared_experts.gate_weight"],
        &[out("mlp.shared_expert_gate.weight", &[ONE, H])],
        whole,
        When::MoeLayer,
    ),
];

/// The MTP module of Qwen3-Next and Qwen3.5, as their official checkpoints hold it
/// (Qwen/Qwen3-Next-80B-A3B-Instruct, Qwen/Qwen3.5-*: `mtp.fc`, `mtp.pre_fc_norm_embedding`,
/// `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`, top-level beside `model.*`, also in the
/// multimodal layout; config field `mtp_num_hidden_layers`; vLLM `qwen3_next_mtp.py`,
/// `qwen3_5_mtp.py` build `fc` over `[pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(hidden)]`,
/// Megatron's `eh_proj` over `[enorm(embedding); hnorm(hidden)]`). The module's own tensors exist
/// once, so one MTP layer converts; the embedding and head are the model's.
pub(crate) static QWEN_MTP: MtpSpec = MtpSpec {
    field: "mtp_num_hidden_layers",
    default: 0,
    layer: "mtp.layers.{k}.",
    rules: &[
        rule(
            &["enorm.weight"],
            &[out("mtp.pre_fc_norm_embedding.weight", &[H])],
            whole,
            When::Always,
        ),
        rule(
            &["hnorm.weight"],
            &[out("mtp.pre_fc_norm_hidden.weight", &[H])],
            whole,
            When::Always,
        ),
        rule(
            &["eh_proj.weight"],
            &[out("mtp.fc.weight", &[H, &["2", "hidden_size"]])],
            whole,
            When::Always,
        ),
        rule(
            &["final_layernorm.weight"],
            &[out("mtp.norm.weight", &[H])],
            whole,
            When::Always,
        ),
    ],
    copies: &[],
};

/// The vision tower of Qwen3.5's multimodal model, as `save_pretrained` of
/// `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` writes it (TF 5.24
/// `Qwen3_5VisionModel`): names after `model.visual.`, shapes from `vision_config`.
const VISION: &[Out] = &[
    out(
        "patch_embed.proj.weight",
        &[
            VH,
            &["in_channels"],
            &["temporal_patch_size"],
            &["patch_size"],
            &["patch_size"],
        ],
    ),
    out("patch_embed.proj.bias", &[VH]),
    out("pos_embed.weight", &[&["num_position_embeddings"], VH]),
    out("blocks.{b}.norm1.weight", &[VH]),
    out("blocks.{b}.norm1.bias", &[VH]),
    out("blocks.{b}.norm2.weight", &[VH]),
    out("blocks.{b}.norm2.bias", &[VH]),
    out("blocks.{b}.attn.qkv.weight", &[&["3", "hidden_size"], VH]),
    out("blocks.{b}.attn.qkv.bias", &[&["3", "hidden_size"]]),
    out("blocks.{b}.attn.proj.weight", &[VH, VH]),
    out("blocks.{b}.attn.proj.bias", &[VH]),
    out("blocks.{b}.mlp.linear_fc1.weight", &[VI, VH]),
    out("blocks.{b}.mlp.linear_fc1.bias", &[VI]),
    out("blocks.{b}.mlp.linear_fc2.weight", &[VH, VI]),
    out("blocks.{b}.mlp.linear_fc2.bias", &[VH]),
    out("merger.norm.weight", &[VH]),
    out("merger.norm.bias", &[VH]),
    out("merger.linear_fc1.weight", &[MERGED, MERGED]),
    out("merger.linear_fc1.bias", &[MERGED]),
    out("merger.linear_fc2.weight", &[&["out_hidden_size"], MERGED]),
    out("merger.linear_fc2.bias", &[&["out_hidden_size"]]),
];
const VH: &[&str] = &["hidden_size"];
const VI: &[&str] = &["intermediate_size"];
/// The merger's width: `hidden_size x spatial_merge_size^2`.
const MERGED: &[&str] = &["hidden_size", "spatial_merge_size", "spatial_merge_size"];

pub(crate) static QWEN3_5_MOE_MULTIMODAL: Multimodal = Multimodal {
    text_prefix: "model.language_model.",
    vision_prefix: "model.visual.",
    vision: VISION,
    text_model_type: "qwen3_5_moe_text",
    text_architecture: "Qwen3_5MoeForCausalLM",
};

pub(crate) static QWEN3_5_MULTIMODAL: Multimodal = Multimodal {
    text_prefix: "model.language_model.",
    vision_prefix: "model.visual.",
    vision: VISION,
    text_model_type: "qwen3_5_text",
    text_architecture: "Qwen3_5ForCausalLM",
};

/// The GDN fields (Megatron-LM's `--linear-*` arguments carry the TransformerConfig names), the
/// layer pattern, and what the architecture implies of the args: gated attention, zero-centred
/// norms (`--apply-layernorm-1p`).
pub(crate) const GDN_CHECKS: &[Check] = &[
    check("linear_num_key_heads", "linear_num_key_heads", Rel::Eq),
    check("linear_num_value_heads", "linear_num_value_heads", Rel::Eq),
    check("linear_key_head_dim", "linear_key_head_dim", Rel::Eq),
    check("linear_value_head_dim", "linear_value_head_dim", Rel::Eq),
    check("linear_conv_kernel_dim", "linear_conv_kernel_dim", Rel::Eq),
    check("layer_types", "linear_attention_freq", Rel::AttnLayers),
    check(
        "attention_output_gate",
        "attention_output_gate",
        Rel::ArgsTrue,
    ),
    check(
        "layernorm_zero_centered_gamma",
        "apply_layernorm_1p",
        Rel::ArgsTrue,
    ),
];

/// MoE GDN families: the shared expert's sigmoid gate (`--moe-shared-expert-gate`).
pub(crate) const GDN_MOE_CHECKS: &[Check] = &[check(
    "shared_expert_gate",
    "moe_shared_expert_gate",
    Rel::ArgsTrue,
)];

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(model_type: &str) -> Dims {
        Dims::from_config(
            &serde_json::json!({"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 8,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2, "vocab_size": 10,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 3,
                "linear_value_head_dim": 2, "linear_conv_kernel_dim": 4,
                "layer_types": ["linear_attention", "full_attention"]}),
            None,
        )
        .unwrap()
    }

    #[test]
    fn in_proj_layouts() {
        // q 6, k 6, v 8, z 8, beta 4, alpha 4 rows.
        let d = dims("qwen3_next");
        let rows = in_proj_per_key_head(&d, "k", &[36, 8]).unwrap();
        // key head 0: q [0,3), k [6,9), v [12,16), z [20,24); head 1 follows.
        assert_eq!(
            rows[0],
            vec![
                (0, 3),
                (6, 3),
                (12, 4),
                (20, 4),
                (3, 3),
                (9, 3),
                (16, 4),
                (24, 4)
            ]
        );
        assert_eq!(rows[1], vec![(28, 2), (32, 2), (30, 2), (34, 2)]);
        let rows = in_proj_flat(&dims("qwen3_5_text"), "k", &[36, 8]).unwrap();
        assert_eq!(
            rows,
            vec![vec![(0, 20)], vec![(20, 8)], vec![(28, 4)], vec![(32, 4)]]
        );
        assert!(in_proj_flat(&d, "k", &[35, 8]).is_err());
    }

    #[test]
    fn gated_q_interleaves_per_head() {
        // 2 groups of 2 heads, head_dim 2: per group [q0 q1 | g0 g1 | k | v] = 12 rows.
        let rows = qkv_gated(&dims("qwen3_next"), "k", &[24, 8]).unwrap();
        assert_eq!(
            rows[0],
            vec![
                (0, 2),
                (4, 2),
                (2, 2),
                (6, 2),
                (12, 2),
                (16, 2),
                (14, 2),
                (18, 2)
            ]
        );
        assert_eq!(rows[1], vec![(8, 2), (20, 2)]);
        assert_eq!(rows[2], vec![(10, 2), (22, 2)]);
        assert!(qkv_gated(&dims("qwen3_next"), "k", &[16, 8]).is_err());
    }
}
