//! How a checkpoint numbers its decoder layers. A GPTModel's `decoder.layers.<i>` (or the layer
//! axis of a stacked key) is HF layer i. A HybridModel (megatron-core 0.19, `models/hybrid/`;
//! GPTModel is deprecated for it) gives each attention and each MLP its own layer and ends in
//! `decoder.final_norm`, so HF layer l is Megatron layers 2l (its attention) and 2l + 1 (its MLP),
//! saved per layer (`hybrid_block.HybridStack.sharded_state_dict`). The rule table is the same for
//! both: only the index of a `decoder.layers.<i>.` key is translated here, as megatron-core's own
//! `dist_checkpointing/gpt_checkpoint_interop.py` pairs the i-th attention with the i-th MLP.
//!
//! The pattern comes from the stored args (`hybrid_layer_pattern`, or the deprecated
//! `hybrid_override_pattern`), else from the keys themselves; nothing is guessed: a pattern that
//! does not pair into HF layers, or keys that fit no pattern, are errors naming the layers.

use std::collections::BTreeMap;

use shardwise::error::{Error, Result};

/// The symbols of megatron-core 0.19.2's hybrid patterns (`hybrid_layer_allocation.Symbols`) that
/// an HF layer's attention can be: attention, MLA, DeepSeek sparse attention, Gated DeltaNet.
const MIXERS: &[u8] = b"*+DG";
/// ... and its MLP: dense, MoE.
const MLPS: &[u8] = b"-E";

/// A HybridModel's main layer pattern (`hybrid_layer_pattern` without its pipeline `|` and its
/// MTP part after `/`), checked to pair into HF layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HybridPattern(Vec<u8>);

impl HybridPattern {
    /// Parses `pattern`; `source` names where it comes from, for errors.
    ///
    /// Errors: [`Error::Validation`] naming the layers (0-based) that are not an attention
    /// followed by an MLP, and Mamba (`M`) or unknown symbols.
    pub(crate) fn parse(pattern: &str, source: &str) -> Result<HybridPattern> {
        let main: Vec<u8> = pattern
            .split('/')
            .next()
            .unwrap_or("")
            .bytes()
            .filter(|&b| b != b'|')
            .collect();
        let mut bad = Vec::new();
        for (g, &s) in main.iter().enumerate() {
            let (want, what) = if g % 2 == 0 {
                (MIXERS, "an attention ('*', '+', 'D', 'G')")
            } else {
                (MLPS, "an MLP ('-', 'E')")
            };
            if !want.contains(&s) {
                bad.push(format!("layer {g} is {:?} where {what} belongs", s as char));
            }
        }
        if main.len() % 2 == 1 {
            bad.push(format!(
                "layer {} has no MLP after it",
                main.len().saturating_sub(1)
            ));
        }
        if main.is_empty() {
            bad.push("it has no layers".into());
        }
        if !bad.is_empty() {
            return Err(Error::Validation(format!(
                "hybrid layer pattern {pattern:?} ({source}) does not pair into Hugging Face layers (each an attention at an even layer, then its MLP; Mamba layers 'M' have no HF counterpart here): {}",
                bad.join("; ")
            )));
        }
        Ok(HybridPattern(main))
    }

    /// HF layers: (attention, MLP) pairs.
    pub(crate) fn hf_layers(&self) -> u64 {
        self.0.len() as u64 / 2
    }

    /// The attention symbol of HF layer `l`.
    pub(crate) fn mixer(&self, l: u64) -> u8 {
        self.0[2 * l as usize]
    }

    /// The MLP symbol of HF layer `l`.
    pub(crate) fn mlp(&self, l: u64) -> u8 {
        self.0[2 * l as usize + 1]
    }
}

/// The MTP depths of hybrid pattern `pattern` (the parts after its first `/`, one per depth,
/// megatron-core 0.19.2 `hybrid_layer_allocation.parse_hybrid_pattern`), each checked to be one
/// HF layer: an HF MTP layer holds one transformer layer (an attention, then its MLP), so a
/// depth of another pattern has no HF layout. `source` names where the pattern comes from.
///
/// Errors: [`Error::Validation`] naming the depth's pattern.
pub(crate) fn mtp_depths(pattern: &str, source: &str) -> Result<u64> {
    let parts: Vec<&str> = pattern.split('/').skip(1).collect();
    if parts.iter().all(|p| p.is_empty()) {
        return Ok(0);
    }
    for p in &parts {
        let depth = HybridPattern::parse(p, &format!("{source}, an MTP depth"))?;
        if depth.hf_layers() != 1 {
            return Err(Error::Validation(format!(
                "{source}: MTP depth pattern {p:?} holds {} (attention, MLP) pairs; a Hugging Face MTP layer holds one transformer layer, one pair",
                depth.hf_layers()
            )));
        }
    }
    Ok(parts.len() as u64)
}

/// The transformer-layer sub-key of MTP layer key `key` = `mtp.layers.{k}.{sub}`, or None for
/// the MTP module's own tensors (`enorm`, `hnorm`, `eh_proj`, `final_layernorm`). megatron-core
/// 0.19.2 (`transformer/multi_token_prediction.py`, `MultiTokenPredictionLayer.sharded_state_dict`)
/// saves a GPTModel's MTP transformer layer as `transformer_layer.{s}` and a HybridModel's as
/// `mtp_model_layer.layers.{j}.{s}`: a HybridStack of the pattern after `/`, which pairs into
/// the one transformer layer of an HF MTP layer, j = 0 its attention and j = 1 its MLP.
///
/// Errors: [`Error::Validation`] for a hybrid MTP layer past j = 1 or a key of the other half
/// (never dropped: the HF layout has no place for it).
pub(crate) fn mtp_layer_sub<'a>(sub: &'a str, key: &str) -> Result<Option<&'a str>> {
    if let Some(s) = sub.strip_prefix("transformer_layer.") {
        return Ok(Some(s));
    }
    let Some(rest) = sub.strip_prefix("mtp_model_layer.") else {
        return Ok(None);
    };
    let parsed = rest
        .strip_prefix("layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(j, s)| Some((j.parse::<u64>().ok()?, s)));
    match parsed {
        Some((j, s)) if j < 2 && role(s).is_none_or(|attention| attention == (j == 0)) => Ok(Some(s)),
        Some((j, _)) if j < 2 => Err(Error::Validation(format!(
            "{key}: hybrid MTP layer {j} is the {} of the MTP layer's transformer layer, but this key belongs to an {}",
            if j == 0 { "attention" } else { "MLP" },
            if j == 0 { "MLP" } else { "attention" }
        ))),
        _ => Err(Error::Validation(format!(
            "{key}: a HybridModel MTP layer beyond one attention and one MLP (mtp_model_layer.layers.0 and .1) has no Hugging Face layout"
        ))),
    }
}

/// Which half of an HF layer a hybrid layer's sub-key belongs to (None: neither, e.g. a key
/// this module does not know; the rule table decides about it).
fn role(sub: &str) -> Option<bool> {
    const MIXER: &[&str] = &["self_attention.", "input_layernorm.", "mixer."];
    const MLP: &[&str] = &["mlp.", "pre_mlp_layernorm."];
    if MIXER.iter().any(|p| sub.starts_with(p)) {
        Some(true)
    } else if MLP.iter().any(|p| sub.starts_with(p)) {
        Some(false)
    } else {
        None
    }
}

/// How the checkpoint's decoder layers map to HF layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    Gpt,
    /// A HybridModel of `layers` Megatron layers (twice the HF layers); `source` says where the
    /// pattern came from.
    Hybrid {
        layers: u64,
        source: String,
    },
}

impl Layout {
    /// The layout of a checkpoint whose tensor keys are `keys`, given the pattern its args store
    /// (`args_pattern`: the args field's name and value). With a pattern, the keys must be a
    /// HybridModel's; without one, `decoder.final_norm.weight` (HybridStack's final norm) or
    /// per-layer keys with attention-only and MLP-only layers and none holding both make the checkpoint
    /// hybrid, and those keys must alternate from an attention.
    ///
    /// Errors: [`Error::Validation`] for a pattern that does not pair, keys that contradict the
    /// pattern or mix both layouts, naming the layers.
    pub(crate) fn detect<'a>(
        keys: impl Iterator<Item = &'a str>,
        args_pattern: Option<(&str, &str)>,
    ) -> Result<Layout> {
        // Per Megatron layer: does it hold attention keys, MLP keys.
        let mut layers: BTreeMap<u64, (bool, bool)> = BTreeMap::new();
        let (mut final_norm, mut gpt_key) = (false, None::<String>);
        for key in keys {
            if key == "decoder.final_norm.weight" {
                final_norm = true;
            }
            if key == "decoder.final_layernorm.weight" {
                gpt_key.get_or_insert_with(|| key.to_string());
            }
            let Some(rest) = key.strip_prefix("decoder.layers.") else {
                continue;
            };
            match rest.split_once('.') {
                Some((i, sub)) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => {
                    let Ok(g) = i.parse::<u64>() else { continue };
                    let e = layers.entry(g).or_default();
                    match role(sub) {
                        Some(true) => e.0 = true,
                        Some(false) => e.1 = true,
                        None => {}
                    }
                }
                // A layer-stacked key: only a GPTModel writes them.
                _ => {
                    gpt_key.get_or_insert_with(|| key.to_string());
                }
            }
        }
        let both: Vec<u64> = layers
            .iter()
            .filter(|(_, &(a, m))| a && m)
            .map(|(&g, _)| g)
            .collect();
        // Attention-only and MLP-only layers and none holding both: only a HybridModel saves
        // that (a layer of keys no role knows, e.g. an unmapped one, proves nothing).
        let single = layers.values().any(|&(a, m)| a && !m)
            && layers.values().any(|&(a, m)| m && !a)
            && both.is_empty()
            && gpt_key.is_none();
        let show = |v: &[u64]| {
            v.iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (layers, source) = match args_pattern {
            Some((field, p)) => {
                let pattern = HybridPattern::parse(p, &format!("args.{field}"))?;
                let source = format!("args.{field} {p:?}");
                if let Some(k) = gpt_key {
                    return Err(Error::Validation(format!(
                        "{source} makes this a HybridModel checkpoint, but it holds {k}, a GPTModel's key"
                    )));
                }
                if !both.is_empty() {
                    return Err(Error::Validation(format!(
                        "{source} makes this a HybridModel checkpoint, but decoder.layers {} each hold an attention and an MLP, as a GPTModel's layers do",
                        show(&both)
                    )));
                }
                if let Some((&g, _)) = layers.iter().find(|(&g, _)| g >= 2 * pattern.hf_layers()) {
                    return Err(Error::Validation(format!(
                        "{source} has {} layers; the checkpoint has decoder.layers.{g}",
                        2 * pattern.hf_layers()
                    )));
                }
                (2 * pattern.hf_layers(), source)
            }
            None if final_norm || single => {
                if let Some(k) = gpt_key.filter(|_| final_norm) {
                    return Err(Error::Validation(format!(
                        "decoder.final_norm.weight marks a HybridModel checkpoint, but it also holds {k}, a GPTModel's key"
                    )));
                }
                if !both.is_empty() {
                    return Err(Error::Validation(format!(
                        "decoder.final_norm.weight marks a HybridModel checkpoint, but decoder.layers {} each hold an attention and an MLP, as a GPTModel's layers do",
                        show(&both)
                    )));
                }
                let n = layers.keys().next_back().map_or(0, |g| g + 1);
                // The first few (a key's number, not the keys held, bounds n).
                let misplaced: Vec<u64> = (0..n)
                    .filter(|g| layers.get(g).map(|&(a, _)| a) != Some(g % 2 == 0))
                    .take(8)
                    .collect();
                if !misplaced.is_empty() || n % 2 == 1 {
                    return Err(Error::Validation(format!(
                        "the checkpoint's keys are a HybridModel's but do not pair into Hugging Face layers (an attention at each even layer, its MLP after it), and its args store no hybrid_layer_pattern: {}",
                        if misplaced.is_empty() {
                            format!("decoder.layers.{} is an attention with no MLP after it", n - 1)
                        } else {
                            format!("decoder.layers {} are missing or hold the other half", show(&misplaced))
                        }
                    )));
                }
                (
                    n,
                    "the checkpoint's keys (no hybrid_layer_pattern in its args)".to_string(),
                )
            }
            None => return Ok(Layout::Gpt),
        };
        Ok(Layout::Hybrid { layers, source })
    }

    /// The HF layer of checkpoint key `key` = `decoder.layers.{g}.{sub}`.
    ///
    /// Errors: [`Error::Validation`] when a hybrid layer's key belongs to the other half of an
    /// HF layer (an MLP key on an attention layer or the reverse).
    pub(crate) fn hf_layer(&self, g: u64, sub: &str, key: &str) -> Result<u64> {
        match self {
            Layout::Gpt => Ok(g),
            Layout::Hybrid { source, .. } => {
                let attention = g % 2 == 0;
                if role(sub).is_some_and(|r| r != attention) {
                    return Err(Error::Validation(format!(
                        "{key}: hybrid layer {g} is the {} of HF layer {} ({source}), but this key belongs to an {}",
                        if attention { "attention" } else { "MLP" },
                        g / 2,
                        if attention { "MLP" } else { "attention" }
                    )));
                }
                Ok(g / 2)
            }
        }
    }

    /// HF layers of a hybrid checkpoint (None for a GPTModel's: the config says).
    pub(crate) fn hf_layers(&self) -> Option<u64> {
        match self {
            Layout::Gpt => None,
            Layout::Hybrid { layers, .. } => Some(layers / 2),
        }
    }
}

/// How many decoder layers or experts a stored tensor of `key` (global shape `shape`, saved in
/// `chunks` chunks) can stand for, for [`crate::spec::Dims::check_held`]: a layer-stacked key
/// (`decoder.layers.<sub-key>`) holds one layer per index of its first axis (and, for experts
/// stacked in it too, one expert per index of its second), whether Megatron saved one chunk per
/// layer or a consolidating tool wrote the stack as one chunk; any other tensor counts its
/// chunks.
pub(crate) fn held_pieces(key: &str, shape: &[u64], chunks: usize) -> u64 {
    let stacked = key
        .strip_prefix("decoder.layers.")
        .is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_digit()));
    let axes = match (stacked, key.contains(".experts.")) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    };
    let along = shape
        .iter()
        .take(axes.min(shape.len().saturating_sub(1)))
        .fold(1u64, |n, &d| n.saturating_mul(d));
    along.max(chunks as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detect(keys: &[&str], args: Option<&str>) -> Result<Layout> {
        Layout::detect(
            keys.iter().copied(),
            args.map(|p| ("hybrid_layer_pattern", p)),
        )
    }

    #[test]
    fn patterns_pair_attention_and_mlp_or_name_the_layers() {
        let p = HybridPattern::parse("*-|*E/*-", "args").unwrap();
        assert_eq!((p.hf_layers(), p.mixer(1), p.mlp(1)), (2, b'*', b'E'));
        for (bad, want) in [
            ("*--*", "layer 2 is '-' where an attention"),
            ("*-*", "layer 2 has no MLP after it"),
            ("M-*-", "layer 0 is 'M'"),
            ("-*", "layer 0 is '-' where an attention"),
            ("", "it has no layers"),
        ] {
            let e = HybridPattern::parse(bad, "args.hybrid_layer_pattern").unwrap_err();
            assert!(e.to_string().contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn the_layout_comes_from_the_args_or_the_keys() {
        let hybrid = [
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.1.mlp.linear_fc1.weight",
            "decoder.layers.2.input_layernorm.weight",
            "decoder.layers.3.mlp.router.weight",
            "decoder.final_norm.weight",
        ];
        let gpt = [
            "decoder.layers.self_attention.linear_qkv.weight",
            "decoder.layers.mlp.linear_fc1.weight",
            "decoder.final_layernorm.weight",
        ];
        assert_eq!(detect(&gpt, None).unwrap(), Layout::Gpt);
        let l = detect(&hybrid, Some("*-*E")).unwrap();
        assert_eq!(l.hf_layers(), Some(2));
        assert_eq!(l.hf_layer(3, "mlp.router.weight", "k").unwrap(), 1);
        let e = l
            .hf_layer(3, "self_attention.linear_qkv.weight", "k")
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("hybrid layer 3 is the MLP of HF layer 1"),
            "{e}"
        );
        // Without args, from the keys.
        assert_eq!(detect(&hybrid, None).unwrap().hf_layers(), Some(2));
        // A GPT checkpoint under a hybrid pattern, a pattern shorter than the keys.
        let e = detect(&gpt, Some("*-")).unwrap_err().to_string();
        assert!(
            e.contains("holds decoder.layers.self_attention.linear_qkv.weight"),
            "{e}"
        );
        let e = detect(&hybrid, Some("*-")).unwrap_err().to_string();
        assert!(
            e.contains("has 2 layers; the checkpoint has decoder.layers.2"),
            "{e}"
        );
        // Keys out of order name the layers.
        let e = detect(&hybrid[1..], None).unwrap_err().to_string();
        assert!(
            e.contains("decoder.layers 0 are missing or hold the other half"),
            "{e}"
        );
        let e = detect(&hybrid[..3], None).unwrap_err().to_string();
        assert!(
            e.contains("decoder.layers.2 is an attention with no MLP after it"),
            "{e}"
        );
        // A per-layer GPT checkpoint (attention and MLP in one layer) with a final_norm: mixed.
        let mixed = [
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.final_norm.weight",
        ];
        let e = detect(&mixed, None).unwrap_err().to_string();
        assert!(
            e.contains("decoder.layers 0 each hold an attention and an MLP"),
            "{e}"
        );
        assert_eq!(detect(&mixed[..2], None).unwrap(), Layout::Gpt);
        // Per-layer keys of no known half, or only attentions: nothing says hybrid.
        let unknown = ["decoder.layers.0.mystery.weight"];
        assert_eq!(detect(&unknown, None).unwrap(), Layout::Gpt);
        assert_eq!(detect(&hybrid[..1], None).unwrap(), Layout::Gpt);
    }

    #[test]
    fn mtp_layers_of_a_hybrid_model_are_one_transformer_layer() {
        assert_eq!(mtp_depths("*-*E", "args").unwrap(), 0);
        assert_eq!(mtp_depths("*-*E/*E/*E", "args").unwrap(), 2);
        let e = mtp_depths("*-/*E*E", "args.hybrid_layer_pattern").unwrap_err();
        assert!(
            e.to_string().contains("MTP depth pattern \"*E*E\" holds 2"),
            "{e}"
        );
        assert!(mtp_depths("*-/M-", "args").is_err());
        fn sub(s: &str) -> Result<Option<&str>> {
            mtp_layer_sub(s, "k")
        }
        assert_eq!(sub("eh_proj.weight").unwrap(), None);
        assert_eq!(
            sub("transformer_layer.mlp.router.weight").unwrap(),
            Some("mlp.router.weight")
        );
        assert_eq!(
            sub("mtp_model_layer.layers.0.self_attention.linear_qkv.weight").unwrap(),
            Some("self_attention.linear_qkv.weight")
        );
        assert_eq!(
            sub("mtp_model_layer.layers.1.mlp.router.weight").unwrap(),
            Some("mlp.router.weight")
        );
        let e = sub("mtp_model_layer.layers.1.self_attention.linear_qkv.weight").unwrap_err();
        assert!(
            e.to_string().contains("hybrid MTP layer 1 is the MLP"),
            "{e}"
        );
        for bad in [
            "mtp_model_layer.layers.2.mlp.router.weight",
            "mtp_model_layer.final_norm.weight",
        ] {
            let e = sub(bad).unwrap_err();
            assert!(
                e.to_string().contains("has no Hugging Face layout"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn held_pieces_counts_stacked_layers_and_experts_even_in_one_chunk() {
        // A consolidated layer-stacked checkpoint: 12 layers in one chunk.
        assert_eq!(
            held_pieces(
                "decoder.layers.self_attention.linear_qkv.weight",
                &[12, 96, 64],
                1
            ),
            12
        );
        // Megatron's own save: one chunk per layer.
        assert_eq!(
            held_pieces("decoder.layers.mlp.linear_fc2.weight", &[12, 64, 128], 12),
            12
        );
        // Layers and experts stacked together.
        assert_eq!(
            held_pieces(
                "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                &[4, 8, 32, 64],
                1
            ),
            32
        );
        // Per-layer keys and the embedding count their chunks only.
        assert_eq!(
            held_pieces("decoder.layers.3.mlp.linear_fc1.weight", &[256, 64], 2),
            2
        );
        assert_eq!(
            held_pieces("embedding.word_embeddings.weight", &[32000, 64], 1),
            1
        );
        // A 1-D stacked norm holds no layer axis apart from its values: chunks only.
        assert_eq!(
            held_pieces("decoder.layers.input_layernorm.weight", &[64], 1),
            1
        );
    }
}
