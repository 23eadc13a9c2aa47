//! The rule table read in reverse: which Megatron tensors an HF folder makes, with Megatron's keys,
//! global shapes and chunks, each built from HF tensors by inverting the rule's [`Post`] and
//! scattering its rows back where the rule's [`Split`](super::super::spec::Split) took them from.
//! Pure: no I/O (the HF tensors are given by name, dtype and shape).
//!
//! Keys follow megatron-core's `sharded_state_dict` (0.13 to 0.19): layers stacked on a leading
//! axis of `num_layers` (`decoder.layers.<sub>`, chunk offset = the layer) when every layer has the
//! same keys, else one key per layer (`decoder.layers.<i>.<sub>`: what `TransformerBlock` does when
//! `moe_layer_freq` is a pattern or `linear_attention_freq` is set, `transformer_block.py`
//! `non_homogeneous_layers`); experts with an expert axis of `num_experts` on
//! `mlp.experts.experts.` (`SequentialMLP` and `TEGroupedMLP` write the same keys,
//! `experts.py`). Norms follow `--transformer-impl`: with `transformer_engine` a norm is fused
//! into the linear after it when the layer has that linear (`X.layer_norm_weight` when the layer
//! has `X.weight`: `linear_qkv`, a dense layer's `linear_fc1`, MLA's `linear_q_up_proj` /
//! `linear_kv_up_proj`, GDN's `in_proj`), else it is its own module (`input_layernorm.weight`,
//! `pre_mlp_layernorm.weight`). `local` keeps each norm its own module, but the local GPT layer
//! spec of a `linear_qkv` attention saves its two norms under the fused names on every layer, MoE
//! layers included (`get_gpt_layer_local_submodules`' `sharded_state_dict_keys_map`
//! `input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`, `pre_mlp_layernorm.` ->
//! `mlp.linear_fc1.layer_norm_`, megatron-core 0.13.1 to 0.19.2); its MLA spec has no such map. The vocabulary rows are padded to
//! `padded_vocab` by repeating the last row, as Megatron-LM's own checkpoint converter does
//! (`tools/checkpoint/saver_mcore.py`: "Expanding embedding to larger size by replicating final
//! entry").

use std::collections::{BTreeMap, BTreeSet};

use super::super::plan::implied_shape;
use super::super::spec::{Dims, Experts, Post, Rule, When};
use shardwise::error::{Error, Result};

/// How Megatron's model is built, as far as its checkpoint keys depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Impl {
    TransformerEngine,
    Local,
}

/// One HF tensor a job reads: its name, shape (as transformers holds it) and the source row ranges
/// its gathered rows fill, in order.
#[derive(Clone, Debug)]
pub(crate) struct JobIn {
    pub name: String,
    pub shape: Vec<u64>,
    pub ranges: Vec<(u64, u64)>,
}

/// A Megatron chunk a job writes: `key`, the key's global shape, the chunk's offsets and sizes
/// (elements), and its bytes' position in the job's buffer (in elements).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Chunk {
    pub key: String,
    pub global_shape: Vec<u64>,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub start: u64,
}

/// One unit of conversion: HF tensors in, one Megatron source tensor (`experts x rows x rest`)
/// rebuilt, cut into chunks out.
#[derive(Clone, Debug)]
pub(crate) struct Job {
    pub post: Post,
    pub inputs: Vec<JobIn>,
    /// Experts held in the job's buffer (1 unless the HF tensor is fused over experts).
    pub experts: u64,
    pub rows: u64,
    pub rest: Vec<u64>,
    /// Rows `[pad_from, rows)` repeat row `pad_from - 1` (vocabulary padding).
    pub pad_from: Option<u64>,
    pub chunks: Vec<Chunk>,
}

impl Job {
    /// Elements of the job's buffer.
    pub(crate) fn numel(&self) -> u64 {
        self.experts * self.rows * self.rest.iter().product::<u64>()
    }
}

/// The reverse plan: jobs in a deterministic order, and what the HF folder holds that no rule
/// reads.
pub(crate) struct Plan {
    pub jobs: Vec<Job>,
    pub unmapped: Vec<String>,
    /// Whether layers are stacked on a leading axis.
    pub stacked: bool,
    /// The whole-model tensors MTP layers repeat, each with the model's tensor it must equal
    /// (HF names; see [`plan`]).
    pub copies: Vec<(String, String)>,
}

/// The HF tensors a plan reads: name -> shape.
pub(crate) type HfShapes = BTreeMap<String, Vec<u64>>;

/// `X.layer_norm_weight` as `X`.
fn fused_module(alias: &str) -> Option<&str> {
    alias.strip_suffix(".layer_norm_weight")
}

/// Whether the local GPT spec saves norm `alias` under this fused name on a layer whose rules'
/// sources are `srcs`: the two norms of a layer with a `linear_qkv` attention (see the module
/// doc).
fn local_fused(alias: &str, srcs: &[&str]) -> bool {
    matches!(
        alias,
        "self_attention.linear_qkv.layer_norm_weight" | "mlp.linear_fc1.layer_norm_weight"
    ) && srcs.contains(&"self_attention.linear_qkv.weight")
}

/// The Megatron sub-key rule `r` has on a layer whose rules' sources are `srcs`: under
/// Transformer Engine a fused `X.layer_norm_weight` when the layer has a source `X.weight...`;
/// under the local spec a fused name [`local_fused`] gives; else the first alias that is no fused
/// norm (None when the rule has only fused aliases and the layer lacks the linear they belong to).
fn choose_alias(r: &Rule, imp: Impl, srcs: &[&str]) -> Option<&'static str> {
    if imp == Impl::Local {
        if let Some(a) = r.src.iter().find(|a| local_fused(a, srcs)) {
            return Some(a);
        }
    }
    if imp == Impl::TransformerEngine {
        let fused = r.src.iter().find(|a| {
            fused_module(a).is_some_and(|m| {
                let w = format!("{m}.weight");
                srcs.iter().any(|s| s.starts_with(&w))
            })
        });
        if let Some(a) = fused {
            return Some(a);
        }
    }
    r.src.iter().copied().find(|a| fused_module(a).is_none())
}

/// `prefix.{a|b}` as (`prefix.`, [a, b]).
fn joined(src: &str) -> Option<(&str, Vec<&str>)> {
    let (prefix, rest) = src.split_once('{')?;
    Some((prefix, rest.strip_suffix('}')?.split('|').collect()))
}

/// The rules of layer `l` with the Megatron sub-key each takes (see [`choose_alias`]); of two
/// rules writing one HF tensor (a norm both a fused and a plain rule name), the fused one under
/// Transformer Engine, the plain one under the local spec.
fn layer_rules(d: &Dims, l: u64, imp: Impl) -> Vec<(&'static Rule, &'static str)> {
    let rules: Vec<&'static Rule> = d
        .spec
        .layer_rules()
        .filter(|r| d.may_produce(r, l))
        .collect();
    let srcs: Vec<&str> = rules
        .iter()
        .flat_map(|r| r.src.iter().copied())
        .filter(|a| fused_module(a).is_none())
        .collect();
    let mut chosen: Vec<(&'static Rule, &'static str)> = rules
        .iter()
        .filter_map(|r| choose_alias(r, imp, &srcs).map(|a| (*r, a)))
        .collect();
    // One rule per HF tensor.
    let mut keep = vec![true; chosen.len()];
    for i in 0..chosen.len() {
        for j in 0..i {
            let shares = chosen[i]
                .0
                .outs
                .iter()
                .any(|o| chosen[j].0.outs.iter().any(|p| p.name == o.name));
            if keep[i] && keep[j] && shares {
                let prefer_i = match imp {
                    Impl::TransformerEngine => fused_module(chosen[i].1).is_some(),
                    // The local spec's fused name, else the plain one.
                    Impl::Local => {
                        let rank = |a: &str| {
                            if local_fused(a, &srcs) {
                                2
                            } else {
                                u8::from(fused_module(a).is_none())
                            }
                        };
                        rank(chosen[i].1) >= rank(chosen[j].1)
                    }
                };
                if prefer_i {
                    keep[j] = false;
                } else {
                    keep[i] = false;
                }
            }
        }
    }
    let mut k = keep.into_iter();
    chosen.retain(|_| k.next().unwrap());
    chosen
}

/// Where a rule's outputs are named in the HF folder: a whole-model tensor (under the text
/// model's prefix, [`Dims::text_name`]), layer `l`'s (a decoder layer, or for `l >= num_layers`
/// MTP layer `l - num_layers`'s transformer layer: [`Dims::layer_prefix`]), or MTP layer `k`'s own
/// module ([`Dims::mtp_name`]): the names to-hf writes, from the same Dims.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Site {
    Model,
    Layer(u64),
    MtpModule(u64),
}

/// The HF name of rule output `name` at `site` for expert `e`.
fn hf_name(d: &Dims, site: Site, name: &str, e: Option<u64>) -> String {
    let n = match e {
        Some(e) => name.replace("{e}", &e.to_string()),
        None => name.to_string(),
    };
    match site {
        Site::Model => d.text_name(&n),
        Site::Layer(l) => format!("{}{n}", d.layer_prefix(l)),
        Site::MtpModule(k) => d.mtp_name(&n, k),
    }
}

/// Where a rule's source sits: the Megatron key prefix and the axes before the source's own.
struct Place {
    /// `decoder.layers.` (stacked), `decoder.layers.<l>.`, `mtp.layers.<k>.transformer_layer.`,
    /// `mtp.layers.<k>.`, or empty (model rules).
    prefix: String,
    /// (global size, offset) of each leading axis: the layer when stacked.
    lead: Vec<(u64, u64)>,
    site: Site,
}

/// What planning gathers: the jobs, the HF tensors they read, the required ones absent.
#[derive(Default)]
struct Acc {
    jobs: Vec<Job>,
    read: BTreeSet<String>,
    missing: Vec<String>,
}

/// Whether any output of `r` at `site` is in the folder.
fn present(d: &Dims, hf: &HfShapes, r: &Rule, site: Site) -> bool {
    r.outs.iter().any(|o| {
        let e = (r.experts == Experts::PerExpert).then_some(0);
        hf.contains_key(&hf_name(d, site, o.name, e))
    })
}

/// An optional rule (a QKV bias the config does not require) is present on every decoder layer
/// it applies to or on none: Megatron holds it on all or none.
///
/// Errors: [`Error::Validation`] naming the layers that lack it.
fn check_optional(d: &Dims, used: &[Vec<(&'static Rule, &'static str)>]) -> Result<()> {
    for r in d.spec.layer_rules().filter(|r| r.when == When::Optional) {
        let on: Vec<u64> = (0..used.len() as u64)
            .filter(|&l| used[l as usize].iter().any(|(x, _)| std::ptr::eq(*x, r)))
            .collect();
        let applies: Vec<u64> = (0..used.len() as u64)
            .filter(|&l| d.may_produce(r, l))
            .collect();
        if !on.is_empty() && on != applies {
            let off: Vec<String> = applies
                .iter()
                .filter(|l| !on.contains(l))
                .map(|l| hf_name(d, Site::Layer(*l), r.outs[0].name, Some(0)))
                .collect();
            return Err(Error::Validation(format!(
                "{} is present on some layers only: missing {} (Megatron holds it on every layer or none)",
                r.outs[0].name,
                off.join(", ")
            )));
        }
    }
    Ok(())
}

/// Builds the reverse plan of `d` over the HF tensors `hf`: the whole-model rules, the
/// `num_layers` decoder layers, then the `d.mtp_layers` MTP layers (their transformer layer by the
/// layer rules, as layer `num_layers + k`, under megatron-core's GPTModel keys
/// `mtp.layers.<k>.transformer_layer.<sub>`, and their own module by the family's
/// [`super::super::spec::MtpSpec`] under `mtp.layers.<k>.<sub>`: megatron-core 0.19.2
/// `multi_token_prediction.py` `MultiTokenPredictionLayer`). The whole-model tensors an MTP layer
/// repeats (`MtpSpec::copies`) are read by no job: they are returned as [`Plan::copies`], each
/// beside the tensor Megatron shares for it.
///
/// `padded_vocab`: Megatron's vocabulary rows (`make_vocab_size_divisible_by x
/// tensor_model_parallel_size` padding of `vocab_size`). Rules for tied embeddings' `lm_head` are
/// not applied.
///
/// Errors: [`Error::Validation`] naming the HF tensors the config requires that the folder lacks
/// (a config with more layers than the weights), shapes that contradict the config, outputs of
/// one rule present in part, and an optional tensor present on some layers only.
pub(crate) fn plan(d: &Dims, hf: &HfShapes, imp: Impl, padded_vocab: u64) -> Result<Plan> {
    let used: Vec<Vec<(&'static Rule, &'static str)>> = (0..d.num_layers + d.mtp_layers)
        .map(|l| {
            layer_rules(d, l, imp)
                .into_iter()
                .filter(|(r, _)| d.requires(r, Some(l)) || present(d, hf, r, Site::Layer(l)))
                .collect()
        })
        .collect();
    let decoder = &used[..d.num_layers as usize];
    check_optional(d, decoder)?;
    let key_sets: BTreeSet<Vec<&str>> = decoder
        .iter()
        .map(|u| u.iter().map(|(_, a)| *a).collect())
        .collect();
    let stacked = key_sets.len() <= 1;

    let mut acc = Acc::default();
    let model = Place {
        prefix: String::new(),
        lead: Vec::new(),
        site: Site::Model,
    };
    for r in d.spec.model.iter() {
        let untied = r.when == When::Untied && d.tied;
        if !untied && (d.requires(r, None) || present(d, hf, r, Site::Model)) {
            rule_jobs(d, r, r.src[0], &model, hf, padded_vocab, &mut acc)?;
        }
    }
    for (l, rules) in used.iter().enumerate() {
        let l = l as u64;
        let (prefix, lead) = match l.checked_sub(d.num_layers) {
            Some(k) => (format!("mtp.layers.{k}.transformer_layer."), Vec::new()),
            None if stacked => ("decoder.layers.".into(), vec![(d.num_layers, l)]),
            None => (format!("decoder.layers.{l}."), Vec::new()),
        };
        let place = Place {
            prefix,
            lead,
            site: Site::Layer(l),
        };
        for &(r, a) in rules {
            rule_jobs(d, r, a, &place, hf, padded_vocab, &mut acc)?;
        }
    }
    let copies = mtp_modules(d, hf, padded_vocab, &mut acc)?;
    if !acc.missing.is_empty() {
        return Err(Error::Validation(format!(
            "{} HF tensors the config requires are not in the folder: {}",
            acc.missing.len(),
            shardwise::error::first_names(&acc.missing, 20)
        )));
    }
    let unmapped = hf
        .keys()
        .filter(|k| !acc.read.contains(*k))
        .cloned()
        .collect();
    Ok(Plan {
        jobs: acc.jobs,
        unmapped,
        stacked,
        copies,
    })
}

/// The jobs of each MTP layer's own module (`mtp.layers.<k>.<sub>`), and the whole-model tensors
/// the HF layout repeats in it, each paired with the model's tensor whose bytes it must equal: the
/// first of the copy rule's sources that a whole-model rule writes and the folder holds (DeepSeek-
/// V3's `model.layers.61.embed_tokens.weight` with `model.embed_tokens.weight`, its
/// `shared_head.head.weight` with `lm_head.weight`). A copy the folder lacks is no error: Megatron
/// shares the model's tensor anyway.
fn mtp_modules(
    d: &Dims,
    hf: &HfShapes,
    padded_vocab: u64,
    acc: &mut Acc,
) -> Result<Vec<(String, String)>> {
    let mut copies = Vec::new();
    let Some(m) = d.spec.mtp else {
        return Ok(copies);
    };
    for k in 0..d.mtp_layers {
        let place = Place {
            prefix: format!("mtp.layers.{k}."),
            lead: Vec::new(),
            site: Site::MtpModule(k),
        };
        for r in m.rules {
            rule_jobs(d, r, r.src[0], &place, hf, padded_vocab, acc)?;
        }
        for r in m.copies {
            let name = hf_name(d, Site::MtpModule(k), r.outs[0].name, None);
            let shared = r.src.iter().find_map(|s| {
                let model = d.spec.model_rule(s)?;
                let n = hf_name(d, Site::Model, model.outs[0].name, None);
                hf.contains_key(&n).then_some(n)
            });
            if let (true, Some(shared)) = (hf.contains_key(&name), shared) {
                acc.read.insert(name.clone());
                copies.push((name, shared));
            }
        }
    }
    Ok(copies)
}

/// The jobs of rule `r` (Megatron sub-key `key`) at `place`.
fn rule_jobs(
    d: &Dims,
    r: &'static Rule,
    key: &str,
    place: &Place,
    hf: &HfShapes,
    padded_vocab: u64,
    acc: &mut Acc,
) -> Result<()> {
    let units: Vec<Option<u64>> = match r.experts {
        Experts::PerExpert => (0..d.num_experts).map(Some).collect(),
        _ => vec![None],
    };
    for e in units {
        let names: Vec<String> = r
            .outs
            .iter()
            .map(|o| hf_name(d, place.site, o.name, e))
            .collect();
        let absent: Vec<&String> = names.iter().filter(|n| !hf.contains_key(*n)).collect();
        if !absent.is_empty() {
            acc.missing.extend(absent.into_iter().cloned());
            continue;
        }
        acc.read.extend(names.iter().cloned());
        acc.jobs
            .push(job(d, r, key, e, place, &names, hf, padded_vocab)?);
    }
    Ok(())
}

/// One job: rule `r`'s outputs `names` (present in `hf`) back into Megatron key `key`.
#[allow(clippy::too_many_arguments)]
fn job(
    d: &Dims,
    r: &Rule,
    key: &str,
    expert: Option<u64>,
    place: &Place,
    names: &[String],
    hf: &HfShapes,
    padded_vocab: u64,
) -> Result<Job> {
    let full_key = format!("{}{key}", place.prefix);
    let g = gather(d, r, names, hf, &full_key)?;
    let (rows, pad_from) = padded_rows(r, &g, &names[0], padded_vocab)?;
    let src_shape: Vec<u64> = if g.has_rows {
        std::iter::once(rows)
            .chain(g.rest.iter().copied())
            .collect()
    } else {
        Vec::new()
    };
    let ranges = (r.split)(d, &full_key, &src_shape)?;
    let inputs = job_inputs(names, hf, ranges, &g, &full_key)?;
    let parts = parts(d, r, key, place, &full_key, rows)?;
    let chunks = chunks(d, r, expert, place, &parts, &g, rows);
    Ok(Job {
        post: r.post,
        inputs,
        experts: g.experts,
        rows,
        rest: g.rest,
        pad_from,
        chunks,
    })
}

/// A job's HF tensors as its Megatron source sees them: each gathered as `[experts?, rows,
/// rest...]` (transposed back where the rule's [`Post`] transposes).
#[derive(Debug, PartialEq)]
struct Gathered {
    /// Experts held in the job's buffer (1 unless the HF tensor is fused over experts).
    experts: u64,
    /// The rows each HF tensor gives the source, in order.
    out_rows: Vec<u64>,
    /// The source's dimensions after its rows.
    rest: Vec<u64>,
    /// Whether the source has rows at all (false for a tensor of no dimension beyond the experts').
    has_rows: bool,
}

/// Gathers rule `r`'s outputs `names` for Megatron's `full_key`: each shape checked against
/// the config, the experts' count against `num_experts`, and every output's dimensions after
/// its rows against the first's (they are stacked row-wise into one source).
///
/// Errors: [`Error::Validation`] naming the HF tensor and its shape.
fn gather(d: &Dims, r: &Rule, names: &[String], hf: &HfShapes, full_key: &str) -> Result<Gathered> {
    let stacked_experts = r.experts == Experts::Stacked;
    // Each HF tensor's gathered shape: [experts?, rows, rest...].
    let mut gathered: Vec<Vec<u64>> = Vec::new();
    for (o, name) in r.outs.iter().zip(names) {
        let shape = &hf[name];
        if let Some(implied) = implied_shape(d, shape, o.shape) {
            return Err(Error::Validation(format!(
                "{name}: shape {shape:?}; the config implies {implied} (for Megatron's {full_key})"
            )));
        }
        let mut g = shape.clone();
        if r.post.transposes() {
            let n = g.len();
            if n < 2 {
                return Err(Error::Validation(format!(
                    "{name}: shape {shape:?} has no two dimensions to transpose"
                )));
            }
            g.swap(n - 2, n - 1);
        }
        gathered.push(g);
    }
    let lead = stacked_experts as usize;
    let experts = if stacked_experts {
        gathered[0].first().copied().unwrap_or(0)
    } else {
        1
    };
    if stacked_experts && experts != d.num_experts {
        return Err(Error::Validation(format!(
            "num_experts: config.json says {}, {} holds {experts} experts",
            d.num_experts, names[0]
        )));
    }
    let split_rest = |g: &Vec<u64>| -> (u64, Vec<u64>) {
        match g.get(lead) {
            Some(&rows) => (rows, g[lead + 1..].to_vec()),
            None => (1, Vec::new()),
        }
    };
    let (_, rest) = split_rest(&gathered[0]);
    let mut out_rows = Vec::new();
    for (g, name) in gathered.iter().zip(names) {
        let (rows, rest_k) = split_rest(g);
        if rest_k != rest || (stacked_experts && g.first() != Some(&experts)) {
            return Err(Error::Validation(format!(
                "{name} has shape {:?}, which does not fit {} beside it into {full_key}",
                hf[name], names[0]
            )));
        }
        out_rows.push(rows);
    }
    Ok(Gathered {
        experts,
        out_rows,
        rest,
        has_rows: gathered[0].len() > lead,
    })
}

/// The source's rows, and the row the vocabulary padding starts at (see [`Job::pad_from`]): the
/// outputs' rows, padded to `padded_vocab` for the vocabulary (a rule whose one output's rows
/// are `vocab_size`). `first` names the first output, for the error.
///
/// Errors: [`Error::Validation`] for more rows than the padded vocabulary.
fn padded_rows(
    r: &Rule,
    g: &Gathered,
    first: &str,
    padded_vocab: u64,
) -> Result<(u64, Option<u64>)> {
    let sum: u64 = g.out_rows.iter().sum();
    // The vocabulary's rows are padded (a rule whose one output's rows are `vocab_size`).
    let vocab = r.outs.len() == 1
        && r.outs[0]
            .shape
            .first()
            .is_some_and(|f| *f == ["vocab_size"]);
    if !(vocab && g.has_rows) {
        return Ok((sum, None));
    }
    if padded_vocab < sum {
        return Err(Error::Validation(format!(
            "{first}: {sum} rows, more than the padded vocabulary of {padded_vocab}"
        )));
    }
    Ok((padded_vocab, (padded_vocab > sum).then_some(sum)))
}

/// The job's inputs: each HF tensor with the source row ranges ([`Rule::split`]'s `ranges`) its
/// rows fill.
///
/// Errors: [`Error::Validation`] when the layout takes another number of rows than a tensor has.
fn job_inputs(
    names: &[String],
    hf: &HfShapes,
    ranges: Vec<Vec<(u64, u64)>>,
    g: &Gathered,
    full_key: &str,
) -> Result<Vec<JobIn>> {
    let mut inputs = Vec::new();
    for ((name, rg), &n) in names.iter().zip(ranges).zip(&g.out_rows) {
        let got: u64 = rg.iter().map(|x| x.1).sum();
        if got != n && g.has_rows {
            return Err(Error::Validation(format!(
                "{name}: {n} rows, but the layout of {full_key} takes {got} rows for it"
            )));
        }
        inputs.push(JobIn {
            name: name.clone(),
            shape: hf[name].clone(),
            ranges: rg,
        });
    }
    Ok(inputs)
}

/// The Megatron keys of the source and the rows of each: one, or the parts of a joined source
/// ([`joined`], sized by the rule's [`Rule::parts`]).
///
/// Errors: [`Error::Validation`] for a joined source without part sizes, or parts that do not
/// make its `rows`.
fn parts(
    d: &Dims,
    r: &Rule,
    key: &str,
    place: &Place,
    full_key: &str,
    rows: u64,
) -> Result<Vec<(String, u64)>> {
    let Some((prefix, subs)) = joined(key) else {
        return Ok(vec![(full_key.to_string(), rows)]);
    };
    let Some(part_rows) = r.parts else {
        return Err(Error::Validation(format!(
            "{key}: a joined source with no part sizes in the rule table"
        )));
    };
    let sizes = part_rows(d, full_key)?;
    if sizes.len() != subs.len() || sizes.iter().sum::<u64>() != rows {
        return Err(Error::Validation(format!(
            "{full_key}: parts of {sizes:?} rows do not make its {rows} rows"
        )));
    }
    Ok(subs
        .iter()
        .zip(sizes)
        .map(|(s, n)| (format!("{}{prefix}{s}", place.prefix), n))
        .collect())
}

/// The chunks the job writes: per expert held, each part's rows at `place` (its leading axes),
/// the expert axis (at `expert`, or each held expert's), then the part's rows and the rest
/// whole; positioned in the job's buffer of `rows` rows per expert.
fn chunks(
    d: &Dims,
    r: &Rule,
    expert: Option<u64>,
    place: &Place,
    parts: &[(String, u64)],
    g: &Gathered,
    rows: u64,
) -> Vec<Chunk> {
    let rest_n: u64 = g.rest.iter().product();
    let mut chunks = Vec::new();
    for e in 0..g.experts {
        let mut row0 = 0;
        for (k, n) in parts {
            let mut global: Vec<u64> = place.lead.iter().map(|x| x.0).collect();
            let mut offsets: Vec<u64> = place.lead.iter().map(|x| x.1).collect();
            let mut sizes = vec![1; place.lead.len()];
            if r.experts != Experts::No {
                global.push(d.num_experts);
                offsets.push(expert.unwrap_or(e));
                sizes.push(1);
            }
            if g.has_rows {
                global.push(*n);
                offsets.push(0);
                sizes.push(*n);
                global.extend_from_slice(&g.rest);
                offsets.extend(std::iter::repeat_n(0, g.rest.len()));
                sizes.extend_from_slice(&g.rest);
            }
            chunks.push(Chunk {
                key: k.clone(),
                global_shape: global,
                offsets,
                sizes,
                start: (e * rows + row0) * rest_n,
            });
            row0 += n;
        }
    }
    chunks
}

/// A Megatron ShardedObject position: `key`, `global_shape`, `global_offset`.
pub(crate) type ObjectPos = (String, Vec<u64>, Vec<u64>);

/// The `_extra_state` ShardedObjects megatron-core asks for beside the linears the plan writes:
/// every linear of a decoder or MTP layer (`linear_*`, GDN's `in_proj` / `out_proj`, MTP's
/// `eh_proj`; the local
/// `ColumnParallelLinear` / `RowParallelLinear` as well as Transformer Engine's) has an
/// `_extra_state` entry in its state dict, which `sharded_state_dict` turns into a ShardedObject
/// whose shape and offset are the layer and expert axes of its weight, `(1,)` / `(0,)` without
/// them (megatron-core 0.19 `utils._get_extra_state_offsets`). Sorted, each once.
pub(crate) fn extra_states(jobs: &[Job]) -> Vec<ObjectPos> {
    let mut out: BTreeSet<ObjectPos> = BTreeSet::new();
    for c in jobs.iter().flat_map(|j| &j.chunks) {
        // GDN's `in_proj` weight is saved in parts (`in_proj.weight.query`, ...; megatron-core
        // 0.19 `gated_delta_net.py` `sharded_state_dict`), one `_extra_state` for the module.
        let module = c
            .key
            .strip_suffix(".weight")
            .or_else(|| c.key.rsplit_once(".weight.").map(|(m, _)| m));
        let Some(module) = module else {
            continue;
        };
        let last = module.rsplit('.').next().unwrap_or(module);
        let linear =
            last.starts_with("linear_") || ["in_proj", "out_proj", "eh_proj"].contains(&last);
        let layer = c.key.starts_with("decoder.layers.") || c.key.starts_with("mtp.layers.");
        if !layer || !linear || c.global_shape.len() < 2 {
            continue;
        }
        let lead = c.global_shape.len() - 2;
        let (shape, offset) = if lead == 0 {
            (vec![1], vec![0])
        } else {
            (c.global_shape[..lead].to_vec(), c.offsets[..lead].to_vec())
        };
        out.insert((format!("{module}._extra_state"), shape, offset));
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_linear_saved_in_parts_has_one_extra_state() {
        let chunk = |key: &str| Chunk {
            key: key.into(),
            global_shape: vec![4, 8],
            offsets: vec![0, 0],
            sizes: vec![4, 8],
            start: 0,
        };
        let job = Job {
            post: Post::None,
            inputs: vec![],
            experts: 1,
            rows: 4,
            rest: vec![8],
            pad_from: None,
            chunks: vec![
                chunk("decoder.layers.0.self_attention.in_proj.weight.query"),
                chunk("decoder.layers.0.self_attention.in_proj.weight.key"),
                chunk("decoder.layers.0.self_attention.conv1d.weight.key"),
            ],
        };
        let want: Vec<ObjectPos> = vec![(
            "decoder.layers.0.self_attention.in_proj._extra_state".into(),
            vec![1],
            vec![0],
        )];
        assert_eq!(extra_states(&[job]), want);
    }

    fn dims(cfg: serde_json::Value) -> Dims {
        Dims::from_config(&cfg, None).unwrap()
    }

    /// The tensors transformers' save_pretrained writes for a small llama (2 layers).
    fn llama_hf() -> (Dims, HfShapes) {
        let d = dims(
            json!({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
            "intermediate_size": 6, "vocab_size": 10}),
        );
        let mut hf = HfShapes::new();
        hf.insert("model.embed_tokens.weight".into(), vec![10, 8]);
        hf.insert("lm_head.weight".into(), vec![10, 8]);
        hf.insert("model.norm.weight".into(), vec![8]);
        for l in 0..2 {
            let p = format!("model.layers.{l}.");
            for (n, s) in [
                ("self_attn.q_proj.weight", vec![8, 8]),
                ("self_attn.k_proj.weight", vec![4, 8]),
                ("self_attn.v_proj.weight", vec![4, 8]),
                ("self_attn.o_proj.weight", vec![8, 8]),
                ("input_layernorm.weight", vec![8]),
                ("post_attention_layernorm.weight", vec![8]),
                ("mlp.gate_proj.weight", vec![6, 8]),
                ("mlp.up_proj.weight", vec![6, 8]),
                ("mlp.down_proj.weight", vec![8, 6]),
            ] {
                hf.insert(format!("{p}{n}"), s);
            }
        }
        (d, hf)
    }

    #[test]
    fn llama_keys_are_stacked_and_qkv_regrouped() {
        let (d, hf) = llama_hf();
        let p = plan(&d, &hf, Impl::Local, 16).unwrap();
        assert!(p.stacked && p.unmapped.is_empty());
        let keys: BTreeSet<&str> = p
            .jobs
            .iter()
            .flat_map(|j| j.chunks.iter().map(|c| c.key.as_str()))
            .collect();
        // The local GPT spec's keys map (megatron-core 0.19.2 gpt_layer_specs.py).
        assert!(keys.contains("decoder.layers.self_attention.linear_qkv.layer_norm_weight"));
        assert!(keys.contains("decoder.layers.mlp.linear_fc1.layer_norm_weight"));
        assert!(!keys.contains("decoder.layers.input_layernorm.weight"));
        let te = plan(&d, &hf, Impl::TransformerEngine, 16).unwrap();
        let te_keys: BTreeSet<&str> = te
            .jobs
            .iter()
            .flat_map(|j| j.chunks.iter().map(|c| c.key.as_str()))
            .collect();
        assert!(te_keys.contains("decoder.layers.self_attention.linear_qkv.layer_norm_weight"));
        assert!(te_keys.contains("decoder.layers.mlp.linear_fc1.layer_norm_weight"));
        assert!(!te_keys.contains("decoder.layers.input_layernorm.weight"));
        // QKV of layer 1: global [2, 16, 8], chunk at layer 1; q rows per group [0,4) and [8,12).
        let qkv = p
            .jobs
            .iter()
            .find(|j| {
                j.chunks[0].key == "decoder.layers.self_attention.linear_qkv.weight"
                    && j.chunks[0].offsets[0] == 1
            })
            .unwrap();
        assert_eq!(qkv.chunks[0].global_shape, vec![2, 16, 8]);
        assert_eq!(qkv.chunks[0].sizes, vec![1, 16, 8]);
        assert_eq!(qkv.inputs[0].ranges, vec![(0, 4), (8, 4)]);
        assert_eq!(qkv.inputs[1].ranges, vec![(4, 2), (12, 2)]);
        // The embedding is padded to 16 rows from row 10.
        let emb = p
            .jobs
            .iter()
            .find(|j| j.chunks[0].key == "embedding.word_embeddings.weight")
            .unwrap();
        assert_eq!((emb.rows, emb.pad_from), (16, Some(10)));
        assert_eq!(emb.chunks[0].global_shape, vec![16, 8]);
    }

    #[test]
    fn a_jobs_tensors_are_gathered_and_the_vocabulary_padded() {
        let (d, hf) = llama_hf();
        let emb = d
            .spec
            .model_rule("embedding.word_embeddings.weight")
            .unwrap();
        let names = vec!["model.embed_tokens.weight".to_string()];
        let g = gather(&d, emb, &names, &hf, "embedding.word_embeddings.weight").unwrap();
        assert_eq!(
            g,
            Gathered {
                experts: 1,
                out_rows: vec![10],
                rest: vec![8],
                has_rows: true
            }
        );
        assert_eq!(padded_rows(emb, &g, &names[0], 16).unwrap(), (16, Some(10)));
        assert_eq!(padded_rows(emb, &g, &names[0], 10).unwrap(), (10, None));
        let e = padded_rows(emb, &g, &names[0], 8).unwrap_err().to_string();
        assert!(
            e.contains("model.embed_tokens.weight: 10 rows, more than the padded vocabulary of 8"),
            "{e}"
        );
        // Q, K and V stack row-wise into one source; a misshapen one is named.
        let qkv = d
            .spec
            .layer_rule("self_attention.linear_qkv.weight")
            .unwrap();
        let names: Vec<String> = ["q", "k", "v"]
            .iter()
            .map(|x| format!("model.layers.0.self_attn.{x}_proj.weight"))
            .collect();
        let g = gather(&d, qkv, &names, &hf, "k").unwrap();
        assert_eq!((g.out_rows, g.rest), (vec![8, 4, 4], vec![8]));
        let mut bad = hf.clone();
        bad.insert(names[1].clone(), vec![4, 7]);
        let e = gather(&d, qkv, &names, &bad, "k").unwrap_err().to_string();
        assert!(
            e.contains("model.layers.0.self_attn.k_proj.weight: shape [4, 7]; the config implies"),
            "{e}"
        );
    }

    #[test]
    fn inputs_take_the_rows_the_layout_gives_them() {
        let (_, hf) = llama_hf();
        let names = vec!["model.embed_tokens.weight".to_string()];
        let g = Gathered {
            experts: 1,
            out_rows: vec![10],
            rest: vec![8],
            has_rows: true,
        };
        let inputs = job_inputs(&names, &hf, vec![vec![(0, 10)]], &g, "k").unwrap();
        assert_eq!(
            (inputs[0].shape.clone(), inputs[0].ranges.clone()),
            (vec![10, 8], vec![(0, 10)])
        );
        let e = job_inputs(&names, &hf, vec![vec![(0, 4)]], &g, "k")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "model.embed_tokens.weight: 10 rows, but the layout of k takes 4 rows for it"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_sources_keys_and_chunks() {
        let (d, _) = llama_hf();
        let qkv = d
            .spec
            .layer_rule("self_attention.linear_qkv.weight")
            .unwrap();
        let place = Place {
            prefix: "decoder.layers.".into(),
            lead: vec![(2, 1)],
            site: Site::Layer(1),
        };
        let key = "decoder.layers.self_attention.linear_qkv.weight";
        let one = parts(&d, qkv, "self_attention.linear_qkv.weight", &place, key, 16).unwrap();
        assert_eq!(one, vec![(key.to_string(), 16)]);
        // A joined source needs the rule's part sizes.
        let e = parts(&d, qkv, "x.{a|b}", &place, "decoder.layers.x.{a|b}", 16)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.{a|b}: a joined source with no part sizes"),
            "{e}"
        );
        // Two parts of one layer: each at the layer's offset, the second after the first's rows.
        let g = Gathered {
            experts: 1,
            out_rows: vec![16],
            rest: vec![8],
            has_rows: true,
        };
        let two = vec![("a".to_string(), 10), ("b".to_string(), 6)];
        let c = chunks(&d, qkv, None, &place, &two, &g, 16);
        assert_eq!(
            c[1],
            Chunk {
                key: "b".into(),
                global_shape: vec![2, 6, 8],
                offsets: vec![1, 0, 0],
                sizes: vec![1, 6, 8],
                start: 80,
            }
        );
        assert_eq!(
            (c.len(), c[0].start, c[0].sizes.clone()),
            (2, 0, vec![1, 10, 8])
        );
    }

    #[test]
    fn each_stacked_linear_has_an_extra_state_object_per_layer() {
        // What megatron-core 0.19's sharded_state_dict of a llama GPTModel (local spec) asks for.
        let (d, hf) = llama_hf();
        let p = plan(&d, &hf, Impl::Local, 16).unwrap();
        let want: Vec<ObjectPos> = [
            "mlp.linear_fc1",
            "mlp.linear_fc2",
            "self_attention.linear_proj",
            "self_attention.linear_qkv",
        ]
        .iter()
        .flat_map(|m| {
            (0..2).map(move |l| (format!("decoder.layers.{m}._extra_state"), vec![2], vec![l]))
        })
        .collect();
        assert_eq!(extra_states(&p.jobs), want);
    }

    #[test]
    fn missing_extra_and_misshapen_tensors_are_named() {
        let (d, mut hf) = llama_hf();
        hf.remove("model.layers.1.mlp.up_proj.weight");
        let e = plan(&d, &hf, Impl::Local, 16).err().unwrap().to_string();
        assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
        let (d, mut hf) = llama_hf();
        hf.insert("model.layers.2.self_attn.q_proj.weight".into(), vec![8, 8]);
        assert_eq!(
            plan(&d, &hf, Impl::Local, 16).unwrap().unmapped,
            vec!["model.layers.2.self_attn.q_proj.weight"]
        );
        let (d, mut hf) = llama_hf();
        hf.insert("model.layers.0.mlp.down_proj.weight".into(), vec![8, 7]);
        let e = plan(&d, &hf, Impl::Local, 16).err().unwrap().to_string();
        assert!(
            e.contains("model.layers.0.mlp.down_proj.weight") && e.contains("intermediate_size"),
            "{e}"
        );
    }

    #[test]
    fn gdn_layers_are_per_layer_and_joined_keys_are_cut_into_parts() {
        let d = dims(
            json!({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "hidden_size": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2, "vocab_size": 10,
            "intermediate_size": 6, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 3, "linear_value_head_dim": 2, "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention", "full_attention"]}),
        );
        let mut hf = HfShapes::new();
        for (n, s) in [
            ("model.embed_tokens.weight", vec![10, 8]),
            ("lm_head.weight", vec![10, 8]),
            ("model.norm.weight", vec![8]),
            ("model.layers.0.input_layernorm.weight", vec![8]),
            ("model.layers.0.linear_attn.in_proj_qkv.weight", vec![20, 8]),
            ("model.layers.0.linear_attn.in_proj_z.weight", vec![8, 8]),
            ("model.layers.0.linear_attn.in_proj_b.weight", vec![4, 8]),
            ("model.layers.0.linear_attn.in_proj_a.weight", vec![4, 8]),
            ("model.layers.0.linear_attn.conv1d.weight", vec![20, 1, 4]),
            ("model.layers.0.linear_attn.A_log", vec![4]),
            ("model.layers.0.linear_attn.dt_bias", vec![4]),
            ("model.layers.0.linear_attn.norm.weight", vec![2]),
            ("model.layers.0.linear_attn.out_proj.weight", vec![8, 8]),
            ("model.layers.1.input_layernorm.weight", vec![8]),
            ("model.layers.1.self_attn.q_proj.weight", vec![16, 8]),
            ("model.layers.1.self_attn.k_proj.weight", vec![4, 8]),
            ("model.layers.1.self_attn.v_proj.weight", vec![4, 8]),
            ("model.layers.1.self_attn.o_proj.weight", vec![8, 8]),
            ("model.layers.1.self_attn.q_norm.weight", vec![2]),
            ("model.layers.1.self_attn.k_norm.weight", vec![2]),
        ] {
            hf.insert(n.into(), s);
        }
        for l in 0..2 {
            for (n, s) in [
                ("post_attention_layernorm.weight", vec![8]),
                ("mlp.gate_proj.weight", vec![6, 8]),
                ("mlp.up_proj.weight", vec![6, 8]),
                ("mlp.down_proj.weight", vec![8, 6]),
            ] {
                hf.insert(format!("model.layers.{l}.{n}"), s);
            }
        }
        let p = plan(&d, &hf, Impl::TransformerEngine, 10).unwrap();
        assert!(!p.stacked && p.unmapped.is_empty(), "{:?}", p.unmapped);
        let keys: BTreeMap<&str, &Chunk> = p
            .jobs
            .iter()
            .flat_map(|j| j.chunks.iter().map(|c| (c.key.as_str(), c)))
            .collect();
        // The GDN layer's input norm is fused into in_proj, the attention layer's into linear_qkv.
        assert!(keys.contains_key("decoder.layers.0.self_attention.in_proj.layer_norm_weight"));
        assert!(keys.contains_key("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"));
        assert!(!keys.keys().any(|k| k.ends_with("input_layernorm.weight")));
        // in_proj's six parts: q 6, k 6, v 8, z 8, beta 4, alpha 4 rows, back to back.
        let parts: Vec<(u64, u64)> = ["query", "key", "value", "z", "beta", "alpha"]
            .iter()
            .map(|s| {
                let c =
                    keys[format!("decoder.layers.0.self_attention.in_proj.weight.{s}").as_str()];
                (c.global_shape[0], c.start / 8)
            })
            .collect();
        assert_eq!(
            parts,
            vec![(6, 0), (6, 6), (8, 12), (8, 20), (4, 28), (4, 32)]
        );
        assert_eq!(
            keys["decoder.layers.0.self_attention.conv1d.weight.value"].global_shape,
            vec![8, 1, 4]
        );
    }
}
