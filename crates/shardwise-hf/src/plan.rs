//! Applies the rule table ([`super::rules`] (through [`super::spec`])) to a checkpoint's keys: the HF tensors to write, each
//! as boxes of checkpoint tensors, plus the checks that the config's required tensors are all
//! produced with the shapes the config implies.
//!
//! Checkpoint keys (megatron-core 0.16.1 `transformer/transformer_block.py` `sharded_state_dict`,
//! `moe/experts.py`): layer-stacked `decoder.layers.<sub>` with a
//! leading layer axis, or `decoder.layers.{i}.<sub>`; experts with an expert axis on
//! `.experts.experts.`.

use std::collections::BTreeSet;

use super::layout::Layout;
use super::spec::{Dims, Experts, Post, Rule, When};
use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;
use shardwise::format::metadata::Entry;
use shardwise::reader::Checkpoint;

/// A box of a checkpoint tensor (global offsets and sizes, in elements).
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub key: String,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// One HF tensor: the concatenation of its pieces (C order), reshaped to `shape`, then `post`;
/// or, with `from_file`, bytes copied as they are from an HF safetensors file.
#[derive(Clone, Debug)]
pub(crate) struct HfTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub src_dtype: DType,
    pub pieces: Vec<Piece>,
    pub post: Post,
    /// The file and byte offset of a tensor copied byte for byte (the vision tower of
    /// `--base-hf`): written in its stored dtype whatever the output dtype.
    pub from_file: Option<(std::path::PathBuf, u64)>,
    /// Written quantized (`--quantize`): the stored tensors of [`super::quant::stored`] in place
    /// of this one. Set by the caller of [`plan`], never for a tensor copied from a file.
    pub quant: Option<super::quant::Scheme>,
    /// Quantized together with the tensor before it (an NVFP4 scale group, see
    /// [`super::quant::scale_group`]): one write job and one shard file hold both.
    pub with_previous: bool,
}

impl HfTensor {
    /// The dtype written: `requested` (the output dtype) or the source's.
    pub(crate) fn out_dtype(&self, requested: Option<DType>) -> DType {
        match (&self.from_file, requested) {
            (None, Some(d)) => d,
            _ => self.src_dtype,
        }
    }
}

/// The HF tensors a checkpoint converts to, in output order, and how many checkpoint keys the
/// mapping skips (optimizer state, extra state, objects, and unmapped keys when allowed).
pub(crate) struct Plan {
    pub tensors: Vec<HfTensor>,
    pub skipped: usize,
}

enum Mapped {
    Tensors(Vec<HfTensor>),
    /// A part of a joined source, mapped with its first part.
    Joined,
    Skip,
    Unmapped,
}

/// A checkpoint tensor's global shape and dtype, by key (None: no such tensor).
type Lookup<'a> = &'a dyn Fn(&str) -> Option<(Vec<u64>, DType)>;

/// Keys that hold no weights.
fn skip_key(key: &str) -> bool {
    key.contains("_extra_state")
        || key.starts_with("optimizer.")
        || key.starts_with("rng_state")
        || key.starts_with("rerun_state_machine_state")
        || key.starts_with("common_state")
        || key.starts_with("content_metadata")
}

/// The HF tensors rule `r` makes of checkpoint tensor `key` (shape `shape`); `lead`: the layer
/// index when the key stacks layers on its first axis; `name_of`: the HF name of an output name
/// of the rule (its `{e}` already the expert index). `joined`: for a rule whose source joins
/// several keys, each part's key and row count (`shape` is then the joined shape, `key` the first
/// part); the split's row ranges are over the parts' rows in order.
#[allow(clippy::too_many_arguments)]
fn apply(
    d: &Dims,
    r: &Rule,
    key: &str,
    shape: &[u64],
    dtype: DType,
    lead: &[u64],
    name_of: &dyn Fn(&str) -> String,
    joined: Option<&[(String, u64)]>,
) -> Result<Vec<HfTensor>> {
    let inner = &shape[lead.len()..];
    // `groups`: the expert indices of each HF tensor's pieces (one tensor per expert, or one
    // tensor over all experts in order, or no expert axis).
    let (groups, inner): (Vec<Vec<Option<u64>>>, &[u64]) = match r.experts {
        Experts::No => (vec![vec![None]], inner),
        Experts::PerExpert | Experts::Stacked => {
            let Some((&e, rest)) = inner.split_first().filter(|(_, rest)| !rest.is_empty()) else {
                return Err(Error::Validation(format!(
                    "{key} has shape {shape:?}: no expert axis"
                )));
            };
            if e != d.num_experts {
                return Err(Error::Validation(format!(
                    "num_experts: config.json says {}, {key} has {e} experts",
                    d.num_experts
                )));
            }
            let all = (0..e).map(Some);
            if r.experts == Experts::PerExpert {
                (all.map(|e| vec![e]).collect(), rest)
            } else {
                (vec![all.collect()], rest)
            }
        }
    };
    let rows = (r.split)(d, key, inner)?;
    debug_assert_eq!(rows.len(), r.outs.len());
    let rest = &inner[1.min(inner.len())..];
    let mut out = Vec::new();
    for experts in groups {
        for (o, ranges) in r.outs.iter().zip(&rows) {
            let mut pieces = Vec::new();
            for &e in &experts {
                let pre: Vec<u64> = lead.iter().copied().chain(e).collect();
                for &(r0, n) in ranges {
                    for (part, p0, pn) in part_rows(key, joined, r0, n) {
                        let mut offsets = pre.clone();
                        let mut sizes = vec![1; pre.len()];
                        if !inner.is_empty() {
                            offsets.push(p0);
                            sizes.push(pn);
                        }
                        offsets.extend(std::iter::repeat_n(0, rest.len()));
                        sizes.extend_from_slice(rest);
                        pieces.push(Piece {
                            key: part.to_string(),
                            offsets,
                            sizes,
                        });
                    }
                }
            }
            // The gathered shape: [experts when stacked, rows, rest...].
            let mut hf_shape: Vec<u64> = Vec::new();
            if r.experts == Experts::Stacked {
                hf_shape.push(experts.len() as u64);
            }
            if !inner.is_empty() {
                hf_shape.push(ranges.iter().map(|x| x.1).sum());
            }
            hf_shape.extend_from_slice(rest);
            if r.post.transposes() {
                if hf_shape.len() < 2 {
                    return Err(Error::Validation(format!(
                        "{key}: shape {shape:?} has no two dimensions to transpose"
                    )));
                }
                let n = hf_shape.len();
                hf_shape.swap(n - 2, n - 1);
            }
            let name = name_of(&match experts.as_slice() {
                [Some(e)] if r.experts == Experts::PerExpert => {
                    o.name.replace("{e}", &e.to_string())
                }
                _ => o.name.to_string(),
            });
            check_shape(d, &name, key, &hf_shape, o.shape)?;
            out.push(HfTensor {
                name,
                shape: hf_shape,
                src_dtype: dtype,
                pieces,
                post: r.post,
                from_file: None,
                quant: None,
                with_previous: false,
            });
        }
    }
    Ok(out)
}

/// The parts of a joined source whose first part is `key` (sub-key `first`, shape `shape`, rows on
/// dimension `axis`: 1 when layers are stacked on dimension 0): each part's key and row count, and
/// the joined shape (rows summed).
///
/// Errors: [`Error::Validation`] for a missing part, or parts that differ in dtype or in any
/// dimension but the rows.
fn joined_source(
    key: &str,
    first: &str,
    shape: &[u64],
    dtype: DType,
    parts: &[String],
    axis: usize,
    lookup: Lookup,
) -> Result<(Vec<(String, u64)>, Vec<u64>)> {
    let base = &key[..key.len() - first.len()];
    let mut out = Vec::new();
    let mut joined = shape.to_vec();
    for p in parts {
        let k = format!("{base}{p}");
        let Some((s, t)) = lookup(&k) else {
            return Err(Error::Validation(format!(
                "{key} is one part of {}; the checkpoint has no {k}",
                parts.join(" + ")
            )));
        };
        let others = |v: &[u64]| [&v[..axis], &v[axis + 1..]].concat();
        if t != dtype || s.len() != shape.len() || s.len() <= axis || others(&s) != others(shape) {
            return Err(Error::Validation(format!(
                "{k} ({} {s:?}) does not join {key} ({} {shape:?}) along its rows",
                t.torch_name(),
                dtype.torch_name()
            )));
        }
        out.push((k, s[axis]));
    }
    joined[axis] = out.iter().map(|x| x.1).sum();
    Ok((out, joined))
}

/// Rows `[r0, r0 + n)` of a source as (key, first row, rows) per key: the source itself, or the
/// parts of a joined source that the range overlaps.
fn part_rows<'a>(
    key: &'a str,
    joined: Option<&'a [(String, u64)]>,
    r0: u64,
    n: u64,
) -> Vec<(&'a str, u64, u64)> {
    let Some(parts) = joined else {
        return vec![(key, r0, n)];
    };
    let mut out = Vec::new();
    let mut start = 0;
    for (k, rows) in parts {
        let (lo, hi) = (r0.max(start), (r0 + n).min(start + rows));
        if lo < hi {
            out.push((k.as_str(), lo - start, hi - lo));
        }
        start += rows;
    }
    out
}

/// The produced shape against the one the config implies.
///
/// Errors: [`Error::Validation`] naming the HF tensor, the source key, both shapes and the
/// config fields of each differing dimension.
fn check_shape(d: &Dims, name: &str, key: &str, got: &[u64], want: &[&[&str]]) -> Result<()> {
    match implied_shape(d, got, want) {
        None => Ok(()),
        Some(implied) => Err(Error::Validation(format!(
            "{name}: the checkpoint's {key} gives shape {got:?}; the config implies {implied}"
        ))),
    }
}

/// None when shape `got` fits an [`Out::shape`](super::spec::Out) `want` (a dimension whose
/// fields the config lacks fits anything), else what the config implies, each dimension with its
/// fields (`[hidden_size = 64, intermediate_size = 128]`).
pub(crate) fn implied_shape(d: &Dims, got: &[u64], want: &[&[&str]]) -> Option<String> {
    let fits = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(&g, f)| d.product(f).is_none_or(|w| w == g));
    if fits {
        return None;
    }
    let implied: Vec<String> = want
        .iter()
        .map(|f| match (f.is_empty(), d.product(f)) {
            (true, _) => "1".into(),
            (false, Some(w)) => format!("{} = {w}", f.join(" x ")),
            (false, None) => format!("{} (not in config)", f.join(" x ")),
        })
        .collect();
    Some(format!("[{}]", implied.join(", ")))
}

/// Maps one checkpoint tensor key; `lookup` finds the other parts of a joined source.
fn map_key(d: &Dims, key: &str, shape: &[u64], dtype: DType, lookup: Lookup) -> Result<Mapped> {
    if skip_key(key) {
        return Ok(Mapped::Skip);
    }
    // A tensor of no layer axis, named by `name_of`.
    let unstacked = |r: &Rule, name_of: &dyn Fn(&str) -> String| -> Result<Mapped> {
        Ok(Mapped::Tensors(apply(
            d,
            r,
            key,
            shape,
            dtype,
            &[],
            name_of,
            None,
        )?))
    };
    if let Some(r) = d.spec.model_rule(key) {
        return unstacked(r, &|n| d.text_name(n));
    }
    // `decoder.layers.{i}.sub` (one layer), `decoder.layers.sub` (layer axis first), or MTP
    // layer k's transformer layer (layer num_layers + k; `layout::mtp_layer_sub` names its
    // keys); an MTP module's own tensors `mtp.layers.{k}.sub`.
    let (layers, sub, stacked) = if let Some(rest) = key.strip_prefix("mtp.layers.") {
        let Some((k, sub)) = rest
            .split_once('.')
            .and_then(|(k, sub)| Some((k.parse::<u64>().ok()?, sub)))
        else {
            return Ok(Mapped::Unmapped);
        };
        if k >= d.mtp_layers {
            // Not converted (--drop-mtp): refused earlier otherwise, see `config::mtp_layers`.
            return Ok(Mapped::Skip);
        }
        match (super::layout::mtp_layer_sub(sub, key)?, d.spec.mtp) {
            (Some(sub), _) => (d.num_layers + k..d.num_layers + k + 1, sub, false),
            (None, Some(m)) => {
                let Some(r) = m.rules.iter().find(|r| r.src.contains(&sub)) else {
                    return Ok(Mapped::Unmapped);
                };
                return unstacked(r, &|n| d.mtp_name(n, k));
            }
            (None, None) => return Ok(Mapped::Unmapped),
        }
    } else {
        let Some(rest) = key.strip_prefix("decoder.layers.") else {
            return Ok(Mapped::Unmapped);
        };
        match rest.split_once('.') {
            Some((i, sub)) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => {
                let g: u64 = i
                    .parse()
                    .map_err(|_| Error::Validation(format!("{key}: bad layer index")))?;
                // A HybridModel numbers attention and MLP layers apart (`layout`).
                let l = d.layout.hf_layer(g, sub, key)?;
                (l..l + 1, sub, false)
            }
            _ if shape.is_empty() => return Ok(Mapped::Unmapped),
            _ => (0..shape[0], rest, true),
        }
    };
    let (r, joined, shape) = match (d.spec.layer_rule(sub), d.spec.joined_rule(sub)) {
        (Some(r), _) => (r, None, shape.to_vec()),
        (None, None) => return Ok(Mapped::Unmapped),
        (None, Some((_, i, _))) if i > 0 => return Ok(Mapped::Joined),
        (None, Some((r, _, parts))) => {
            let (parts, shape) =
                joined_source(key, sub, shape, dtype, &parts, stacked as usize, lookup)?;
            (r, Some(parts), shape)
        }
    };
    let shape = shape.as_slice();
    let mut out = Vec::new();
    for l in layers {
        if let (false, When::LayerType(t)) = (d.may_produce(r, l), r.when) {
            return Err(Error::Validation(format!(
                "{key}: layer {l} is {} in the config (layer_types), but this key belongs to {t} layers",
                d.layer_type(l).as_deref().unwrap_or("of no type")
            )));
        }
        if let (false, When::IndexerLayer) = (d.may_produce(r, l), r.when) {
            return Err(Error::Validation(format!(
                "{key}: layer {l} shares the previous layer's DSA top-k in the config (indexer_types), so it has no indexer; the checkpoint has one"
            )));
        }
        if let (false, When::Flag(f)) = (d.may_produce(r, l), r.when) {
            return Err(Error::Validation(format!(
                "{f}: config.json says {}, but the checkpoint has {key}",
                d.flag(f).unwrap_or(false)
            )));
        }
        if !d.may_produce(r, l) {
            return Err(Error::Validation(format!(
                "{key}: layer {l} is {} in the config ({}), but this key belongs to {} layers",
                if d.is_moe(l) { "MoE" } else { "dense" },
                d.moe_pattern_source(),
                if r.when == When::MoeLayer {
                    "MoE"
                } else {
                    "dense"
                }
            )));
        }
        let prefix = d.layer_prefix(l);
        let name_of = |n: &str| format!("{prefix}{n}");
        let lead = if stacked { vec![l] } else { vec![] };
        out.extend(apply(
            d,
            r,
            key,
            shape,
            dtype,
            &lead,
            &name_of,
            joined.as_deref(),
        )?);
    }
    Ok(Mapped::Tensors(out))
}

/// The whole-model tensors that each converted MTP layer repeats in the HF layout
/// ([`super::spec::MtpSpec::copies`]), from the first source key `lookup` finds.
fn mtp_copies(d: &Dims, lookup: Lookup) -> Result<Vec<HfTensor>> {
    let mut out = Vec::new();
    let Some(m) = d.spec.mtp else {
        return Ok(out);
    };
    for k in 0..d.mtp_layers {
        for r in m.copies {
            let Some((key, (shape, dtype))) = r.src.iter().find_map(|s| Some((*s, lookup(s)?)))
            else {
                continue; // reported as missing by `plan`
            };
            let name_of = |n: &str| d.mtp_name(n, k);
            out.extend(apply(d, r, key, &shape, dtype, &[], &name_of, None)?);
        }
    }
    Ok(out)
}

impl Dims {
    fn moe_pattern_source(&self) -> String {
        format!(
            "{} experts, layer pattern {:?}",
            self.num_experts, self.spec.moe_layers
        )
    }

    /// Whether rule `r` may produce tensors on layer `l` (None: a model rule).
    pub(crate) fn may_produce(&self, r: &Rule, l: u64) -> bool {
        match r.when {
            When::MoeLayer => self.is_moe(l),
            When::DenseLayer => !self.is_moe(l),
            When::LayerType(t) => self.layer_type(l).as_deref() == Some(t),
            When::Flag(f) => self.flag(f) == Some(true),
            When::IndexerLayer => self.indexer(l),
            When::Always | When::Optional | When::Untied => true,
        }
    }

    /// Whether the config requires rule `r`'s outputs on layer `l` (None: a model rule).
    pub(crate) fn requires(&self, r: &Rule, l: Option<u64>) -> bool {
        match r.when {
            When::Always => true,
            When::Optional => false,
            When::Untied => !self.tied,
            When::LayerType(_) => l.is_some_and(|l| self.may_produce(r, l)),
            When::MoeLayer | When::DenseLayer | When::Flag(_) | When::IndexerLayer => {
                l.is_some_and(|l| self.may_produce(r, l))
            }
        }
    }

    /// Every HF tensor name the config requires, from the same rules that map.
    fn required(&self) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        let mut add = |name_of: &dyn Fn(&str) -> String, r: &Rule| {
            for o in r.outs {
                match r.experts {
                    Experts::No | Experts::Stacked => {
                        names.insert(name_of(o.name));
                    }
                    Experts::PerExpert => {
                        for e in 0..self.num_experts {
                            names.insert(name_of(&o.name.replace("{e}", &e.to_string())));
                        }
                    }
                }
            }
        };
        for r in self.spec.model.iter().filter(|r| self.requires(r, None)) {
            add(&|n| self.text_name(n), r);
        }
        for l in 0..self.num_layers + self.mtp_layers {
            let p = self.layer_prefix(l);
            for r in self
                .spec
                .layer_rules()
                .filter(|r| self.requires(r, Some(l)))
            {
                add(&|n| format!("{p}{n}"), r);
            }
        }
        if let Some(m) = self.spec.mtp {
            for k in 0..self.mtp_layers {
                for r in m.rules.iter().chain(m.copies) {
                    add(&|n| self.mtp_name(n, k), r);
                }
            }
        }
        names
    }
}

/// Maps every tensor of `ckpt` to HF tensors.
///
/// Errors: [`Error::Validation`] for unmapped checkpoint keys (unless `allow_unmapped`), HF
/// tensors the config requires that the checkpoint does not produce, shapes that contradict the
/// config, a layer count that contradicts it, and two keys mapping to one HF tensor.
pub(crate) fn plan(ckpt: &Checkpoint, d: &Dims, allow_unmapped: bool) -> Result<Plan> {
    let mut tensors: Vec<HfTensor> = Vec::new();
    let (mut unmapped, mut skipped) = (Vec::new(), 0usize);
    let mut stacked_layers: BTreeSet<u64> = BTreeSet::new();
    let lookup = |k: &str| match ckpt.metadata.entries.get(k) {
        Some(Entry::Tensor {
            dtype,
            global_shape,
            ..
        }) => Some((global_shape.clone(), *dtype)),
        _ => None,
    };
    for (key, e) in &ckpt.metadata.entries {
        let Entry::Tensor {
            dtype,
            global_shape,
            ..
        } = e
        else {
            skipped += 1;
            continue;
        };
        match map_key(d, key, global_shape, *dtype, &lookup)? {
            Mapped::Tensors(v) => {
                if key.starts_with("decoder.layers.")
                    && !key["decoder.layers.".len()..].starts_with(|c: char| c.is_ascii_digit())
                {
                    stacked_layers.insert(global_shape[0]);
                }
                tensors.extend(v)
            }
            Mapped::Joined => {}
            Mapped::Skip => skipped += 1,
            Mapped::Unmapped => unmapped.push(key.clone()),
        }
    }
    tensors.extend(mtp_copies(d, &lookup)?);
    if !unmapped.is_empty() && !allow_unmapped {
        return Err(Error::Validation(format!(
            "no rule maps these checkpoint keys (pass --allow-unmapped to skip them): {}",
            unmapped.join(", ")
        )));
    }
    skipped += unmapped.len();
    if let (Some(n), Layout::Hybrid { source, .. }) = (d.layout.hf_layers(), &d.layout) {
        if n != d.num_layers {
            return Err(Error::Validation(format!(
                "num_hidden_layers: config.json says {}, the checkpoint's HybridModel has {n} (attention, MLP) pairs ({source})",
                d.num_layers
            )));
        }
    }
    if let Some(l) = stacked_layers.iter().find(|&&l| l != d.num_layers) {
        return Err(Error::Validation(format!(
            "num_hidden_layers: config.json says {}, the checkpoint stacks {l} layers",
            d.num_layers
        )));
    }
    let produced: BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    if produced.len() != tensors.len() {
        return Err(Error::Validation(
            "two checkpoint keys map to the same HF tensor".into(),
        ));
    }
    let missing: Vec<String> = d
        .required()
        .into_iter()
        .filter(|n| !produced.contains(n.as_str()))
        .collect();
    if !missing.is_empty() {
        return Err(Error::Validation(format!(
            "{} HF tensors the config requires were not produced: {}",
            missing.len(),
            shardwise::error::first_names(&missing, 20)
        )));
    }
    // Deterministic order: the `mtp.*` module last, by layer, then name.
    let order = |n: &str| {
        let layer = n
            .split_once("layers.")
            .and_then(|(_, r)| r.split('.').next())
            .and_then(|i| i.parse::<u64>().ok());
        (n.starts_with("mtp."), layer)
    };
    tensors.sort_by(|a, b| (order(&a.name), &a.name).cmp(&(order(&b.name), &b.name)));
    Ok(Plan { tensors, skipped })
}

/// Reads HF tensor `t` (its pieces, in order) into `buf` (`prod(shape) * itemsize` bytes of
/// `t.src_dtype`), then applies its value transform.
///
/// Errors: reader errors; [`Error::UnsupportedDtype`] for `+1` on a non-float tensor.
pub(crate) fn read_hf_tensor(ckpt: &Checkpoint, t: &HfTensor, buf: &mut [u8]) -> Result<()> {
    if let Some((path, at)) = &t.from_file {
        use std::os::unix::fs::FileExt;
        let f = shardwise::storage::open_regular(path).map_err(Error::io("open", path))?;
        return f.read_exact_at(buf, *at).map_err(Error::io("read", path));
    }
    let item = t.src_dtype.itemsize();
    let mut at = 0usize;
    for pc in &t.pieces {
        let n = (pc.sizes.iter().product::<u64>() * item) as usize;
        shardwise::load::read_region(ckpt, &pc.key, &pc.offsets, &pc.sizes, &mut buf[at..at + n])?;
        at += n;
    }
    apply_post(t.post, t.src_dtype, &t.shape, buf)
}

/// Applies a value transform in place to `buf`, the gathered tensor in `dtype` whose shape after
/// the transform is `shape`.
///
/// Errors: [`Error::UnsupportedDtype`] for `+1` on a non-float dtype.
pub(crate) fn apply_post(post: Post, dtype: DType, shape: &[u64], buf: &mut [u8]) -> Result<()> {
    match post {
        Post::None => Ok(()),
        Post::AddOne => {
            use half::{bf16, f16};
            match dtype {
                DType::F32 => buf.chunks_exact_mut(4).for_each(|c| {
                    let v = f32::from_le_bytes(c.try_into().unwrap()) + 1.0;
                    c.copy_from_slice(&v.to_le_bytes())
                }),
                DType::BF16 => buf.chunks_exact_mut(2).for_each(|c| {
                    let v = bf16::from_f32(bf16::from_le_bytes([c[0], c[1]]).to_f32() + 1.0);
                    c.copy_from_slice(&v.to_le_bytes())
                }),
                DType::F16 => buf.chunks_exact_mut(2).for_each(|c| {
                    let v = f16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32() + 1.0);
                    c.copy_from_slice(&v.to_le_bytes())
                }),
                other => {
                    return Err(Error::UnsupportedDtype(format!(
                        "+1 norm offset on {}",
                        other.torch_name()
                    )))
                }
            }
            Ok(())
        }
        Post::InterleaveLast | Post::InterleaveTransposeLast2 => {
            // Gathered as [..., 2I] or [..., 2I, c] ([gate; up] rows); `shape` ends 2I. Source
            // position s goes to 2s (gate) or 2(s - I) + 1 (up), transposed for the latter.
            let n = shape.len();
            let two = shape[n - 1] as usize;
            let c = if post == Post::InterleaveLast {
                1
            } else {
                shape[n - 2] as usize
            };
            if two % 2 != 0 {
                return Err(Error::Validation(format!(
                    "gate/up dimension {two} of {shape:?} is odd"
                )));
            }
            let item = dtype.itemsize() as usize;
            let mat = two * c * item;
            let mut tmp = vec![0u8; mat];
            for m in buf.chunks_exact_mut(mat.max(1)) {
                for s in 0..two {
                    let d = if s < two / 2 {
                        2 * s
                    } else {
                        2 * (s - two / 2) + 1
                    };
                    for j in 0..c {
                        let (src, dst) = ((s * c + j) * item, (j * two + d) * item);
                        tmp[dst..dst + item].copy_from_slice(&m[src..src + item]);
                    }
                }
                m.copy_from_slice(&tmp);
            }
            Ok(())
        }
        Post::TransposeLast2 => {
            // Gathered as [..., c, r]; `shape` ends [r, c].
            let n = shape.len();
            let (r, c) = (shape[n - 2] as usize, shape[n - 1] as usize);
            let item = dtype.itemsize() as usize;
            let mat = r * c * item;
            let mut tmp = vec![0u8; mat];
            for m in buf.chunks_exact_mut(mat.max(1)) {
                for i in 0..c {
                    for j in 0..r {
                        let (src, dst) = ((i * r + j) * item, (j * c + i) * item);
                        tmp[dst..dst + item].copy_from_slice(&m[src..src + item]);
                    }
                }
                m.copy_from_slice(&tmp);
            }
            Ok(())
        }
    }
}

/// The inverse of [`apply_post`] (from-hf): `buf` holds the HF tensor of shape `hf_shape` in
/// `dtype`; afterwards it holds the gathered rows the transform was applied to. `w + 1` becomes
/// `w - 1` computed in float32 and rounded once, exact for HF values in [0.5, 2] (Sterbenz), so
/// that a round trip gives the HF value back there.
///
/// Errors: as [`apply_post`].
pub(crate) fn invert_post(
    post: Post,
    dtype: DType,
    hf_shape: &[u64],
    buf: &mut [u8],
) -> Result<()> {
    let item = dtype.itemsize() as usize;
    let n = hf_shape.len();
    match post {
        Post::None => Ok(()),
        Post::AddOne => {
            use half::{bf16, f16};
            match dtype {
                DType::F32 => buf.chunks_exact_mut(4).for_each(|c| {
                    let v = f32::from_le_bytes(c.try_into().unwrap()) - 1.0;
                    c.copy_from_slice(&v.to_le_bytes())
                }),
                DType::BF16 => buf.chunks_exact_mut(2).for_each(|c| {
                    let v = bf16::from_f32(bf16::from_le_bytes([c[0], c[1]]).to_f32() - 1.0);
                    c.copy_from_slice(&v.to_le_bytes())
                }),
                DType::F16 => buf.chunks_exact_mut(2).for_each(|c| {
                    let v = f16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32() - 1.0);
                    c.copy_from_slice(&v.to_le_bytes())
                }),
                other => {
                    return Err(Error::UnsupportedDtype(format!(
                        "-1 norm offset on {}",
                        other.torch_name()
                    )))
                }
            }
            Ok(())
        }
        Post::TransposeLast2 | Post::InterleaveLast | Post::InterleaveTransposeLast2 => {
            if n < 2 && post != Post::InterleaveLast {
                return Err(Error::Validation(format!(
                    "shape {hf_shape:?} has no two dimensions to transpose"
                )));
            }
            if post != Post::TransposeLast2 {
                // [..., 2I] with gate at even and up at odd positions to [..., gate | up].
                let two = hf_shape[n - 1] as usize;
                if two % 2 != 0 {
                    return Err(Error::Validation(format!(
                        "gate/up dimension {two} of {hf_shape:?} is odd"
                    )));
                }
                let row = two * item;
                let mut tmp = vec![0u8; row];
                for r in buf.chunks_exact_mut(row.max(1)) {
                    for p in 0..two {
                        let s = if p % 2 == 0 { p / 2 } else { two / 2 + p / 2 };
                        tmp[s * item..(s + 1) * item].copy_from_slice(&r[p * item..(p + 1) * item]);
                    }
                    r.copy_from_slice(&tmp);
                }
            }
            if post != Post::InterleaveLast {
                let (r, c) = (hf_shape[n - 2] as usize, hf_shape[n - 1] as usize);
                let mat = r * c * item;
                let mut tmp = vec![0u8; mat];
                for m in buf.chunks_exact_mut(mat.max(1)) {
                    for i in 0..r {
                        for j in 0..c {
                            let (src, dst) = ((i * c + j) * item, (j * r + i) * item);
                            tmp[dst..dst + item].copy_from_slice(&m[src..src + item]);
                        }
                    }
                    m.copy_from_slice(&tmp);
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invert_post_undoes_apply_post() {
        // Gathered [2 experts, 4 rows ([gate; up], I = 2), 3 columns], f32 values 0..24.
        let gathered: Vec<u8> = (0..24)
            .flat_map(|v| (v as f32 * 0.25 + 0.5).to_le_bytes())
            .collect();
        for (post, hf_shape) in [
            (Post::None, vec![2u64, 4, 3]),
            (Post::AddOne, vec![2, 4, 3]),
            (Post::TransposeLast2, vec![2, 3, 4]),
            (Post::InterleaveLast, vec![2, 3, 4]),
            (Post::InterleaveTransposeLast2, vec![2, 3, 4]),
        ] {
            let mut buf = gathered.clone();
            apply_post(post, DType::F32, &hf_shape, &mut buf).unwrap();
            assert!(
                post == Post::None || buf != gathered,
                "{post:?} changed nothing"
            );
            invert_post(post, DType::F32, &hf_shape, &mut buf).unwrap();
            assert_eq!(buf, gathered, "{post:?}");
        }
    }

    #[test]
    fn post_adds_one_and_transposes() {
        let mut b: Vec<u8> = [0.5f32, -1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        apply_post(Post::AddOne, DType::F32, &[2], &mut b).unwrap();
        let v: Vec<f32> = b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v, vec![1.5, 0.0]);
        // Two experts of [2, 3] gathered, written as [3, 2] each.
        let mut b: Vec<u8> = (0u8..12).collect();
        apply_post(Post::TransposeLast2, DType::U8, &[2, 3, 2], &mut b).unwrap();
        assert_eq!(b, vec![0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]);
        assert!(apply_post(Post::AddOne, DType::I64, &[1], &mut [0u8; 8]).is_err());
        // gpt_oss: one expert's [gate; up] rows [[0, 1], [2, 3] | [4, 5], [6, 7]] (I = 2, H = 2)
        // become [H, 2I] with gate in even columns: [[0, 4, 2, 6], [1, 5, 3, 7]].
        let mut b: Vec<u8> = (0u8..8).collect();
        apply_post(
            Post::InterleaveTransposeLast2,
            DType::U8,
            &[1, 2, 4],
            &mut b,
        )
        .unwrap();
        assert_eq!(b, vec![0, 4, 2, 6, 1, 5, 3, 7]);
        // Its bias [g0, g1, u0, u1] per expert, two experts.
        let mut b: Vec<u8> = (0u8..8).collect();
        apply_post(Post::InterleaveLast, DType::U8, &[2, 4], &mut b).unwrap();
        assert_eq!(b, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }

    #[test]
    fn joined_in_proj_of_stacked_layers() {
        // Qwen3.5 GDN: q, k 2 x 3 rows, v, z 4 x 2, beta, alpha 4; two layers stacked on dim 0.
        let d = dims(
            serde_json::json!({"model_type": "qwen3_5_text", "num_hidden_layers": 2,
            "hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
            "vocab_size": 10, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 3, "linear_value_head_dim": 2, "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention", "linear_attention"]}),
        );
        let base = "decoder.layers.self_attention.in_proj.weight.";
        let rows = |part: &str| match part {
            "query" | "key" => 6,
            "value" | "z" => 8,
            _ => 4,
        };
        let lookup = |k: &str| Some((vec![2, rows(k.strip_prefix(base)?), 8], DType::F32));
        let shape = [2, 6, 8];
        let Mapped::Tensors(v) =
            map_key(&d, &format!("{base}query"), &shape, DType::F32, &lookup).unwrap()
        else {
            panic!()
        };
        let qkv = v
            .iter()
            .find(|t| t.name == "model.layers.1.linear_attn.in_proj_qkv.weight")
            .unwrap();
        assert_eq!(qkv.shape, vec![20, 8]);
        let got: Vec<(&str, Vec<u64>, Vec<u64>)> = qkv
            .pieces
            .iter()
            .map(|p| (&p.key[base.len()..], p.offsets.clone(), p.sizes.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("query", vec![1, 0, 0], vec![1, 6, 8]),
                ("key", vec![1, 0, 0], vec![1, 6, 8]),
                ("value", vec![1, 0, 0], vec![1, 8, 8]),
            ]
        );
        assert!(matches!(
            map_key(&d, &format!("{base}z"), &[2, 8, 8], DType::F32, &lookup),
            Ok(Mapped::Joined)
        ));
        // A missing part is named.
        let e = map_key(
            &d,
            &format!("{base}query"),
            &shape,
            DType::F32,
            &|k: &str| (!k.ends_with("alpha")).then(|| lookup(k)).flatten(),
        );
        assert!(e.is_err_and(|e| e
            .to_string()
            .contains("no decoder.layers.self_attention.in_proj.weight.alpha")));
    }

    fn dims(cfg: serde_json::Value) -> Dims {
        Dims::from_config(&cfg, None).unwrap()
    }

    fn names(m: Mapped) -> Vec<String> {
        let Mapped::Tensors(v) = m else { panic!() };
        v.into_iter().map(|t| t.name).collect()
    }

    #[test]
    fn the_mtp_layer_of_the_dsa_families_holds_an_indexer() {
        // deepseek_v32 (DeepSeek-V3's names, copies included) and glm_moe_dsa (no copies): the
        // MTP layer runs its own indexer even where the config's lists (indexer_types,
        // mlp_layer_types) cover the decoder layers only and its last layer shares a top-k.
        let cfg = |t: &str| {
            serde_json::json!({"model_type": t, "num_hidden_layers": 2, "hidden_size": 8,
            "num_attention_heads": 2, "vocab_size": 10, "n_routed_experts": 2,
            "first_k_dense_replace": 1, "moe_intermediate_size": 4, "q_lora_rank": 4,
            "index_n_heads": 2, "index_head_dim": 4, "indexer_types": ["full", "shared"],
            "mlp_layer_types": ["dense", "sparse"], "num_nextn_predict_layers": 1})
        };
        for (t, copies) in [("deepseek_v32", true), ("glm_moe_dsa", false)] {
            let mut d = dims(cfg(t));
            d.mtp_layers = 1;
            let map = |k: &str, shape: &[u64]| map_key(&d, k, shape, DType::F32, &|_| None);
            assert_eq!(
                names(
                    map(
                        "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wk.weight",
                        &[4, 8]
                    )
                    .unwrap()
                ),
                vec!["model.layers.2.self_attn.indexer.wk.weight"],
                "{t}"
            );
            // The decoder's last layer shares layer 0's top-k: no indexer there.
            assert!(map(
                "decoder.layers.1.self_attention.core_attention.indexer.linear_wk.weight",
                &[4, 8]
            )
            .is_err());
            let req = d.required();
            for n in [
                "model.layers.2.self_attn.indexer.wq_b.weight",
                "model.layers.2.self_attn.indexer.k_norm.bias",
                "model.layers.2.mlp.experts.1.down_proj.weight",
                "model.layers.2.mlp.gate.e_score_correction_bias",
                "model.layers.2.eh_proj.weight",
                "model.layers.2.shared_head.norm.weight",
            ] {
                assert!(req.contains(n), "{t}: {n}");
            }
            assert!(
                !req.contains("model.layers.1.self_attn.indexer.wk.weight"),
                "{t}"
            );
            assert!(!req.contains("model.layers.2.mlp.down_proj.weight"), "{t}");
            for n in [
                "model.layers.2.embed_tokens.weight",
                "model.layers.2.shared_head.head.weight",
            ] {
                assert_eq!(req.contains(n), copies, "{t}: {n}");
            }
        }
    }

    #[test]
    fn mtp_layers_take_the_family_names() {
        // deepseek_v3: MTP layer 0 of a 2-layer model is layer 2, an MoE layer (past
        // first_k_dense_replace 1); its module's own tensors under the same prefix.
        let mut d = dims(
            serde_json::json!({"model_type": "deepseek_v3", "num_hidden_layers": 2,
            "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10, "n_routed_experts": 2,
            "first_k_dense_replace": 1, "moe_intermediate_size": 4}),
        );
        d.mtp_layers = 1;
        let map = |k: &str, shape: &[u64]| map_key(&d, k, shape, DType::F32, &|_| None).unwrap();
        assert_eq!(
            names(map("mtp.layers.0.eh_proj.weight", &[8, 16])),
            vec!["model.layers.2.eh_proj.weight"]
        );
        assert_eq!(
            names(map("mtp.layers.0.final_layernorm.weight", &[8])),
            vec!["model.layers.2.shared_head.norm.weight"]
        );
        assert_eq!(
            names(map(
                "mtp.layers.0.transformer_layer.mlp.router.weight",
                &[2, 8]
            )),
            vec!["model.layers.2.mlp.gate.weight"]
        );
        // A HybridModel's MTP layer: its HybridStack's attention (0) and MLP (1), one HF layer.
        assert_eq!(
            names(map(
                "mtp.layers.0.mtp_model_layer.layers.1.mlp.router.weight",
                &[2, 8]
            )),
            vec!["model.layers.2.mlp.gate.weight"]
        );
        let req = d.required();
        for n in [
            "model.layers.2.embed_tokens.weight",
            "model.layers.2.shared_head.head.weight",
            "model.layers.2.enorm.weight",
            "model.layers.2.mlp.experts.1.down_proj.weight",
        ] {
            assert!(req.contains(n), "{n}");
        }
        // Not converted (--drop-mtp): skipped.
        d.mtp_layers = 0;
        assert!(matches!(
            map_key(
                &d,
                "mtp.layers.0.eh_proj.weight",
                &[8, 16],
                DType::F32,
                &|_| None
            ),
            Ok(Mapped::Skip)
        ));
        // qwen3_5 multimodal: the text model under model.language_model., MTP top-level.
        let mut d = dims(serde_json::json!({"model_type": "qwen3_5", "text_config": {
            "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10,
            "intermediate_size": 4, "layer_types": ["linear_attention", "full_attention"]}}));
        d.text_prefix = "model.language_model.";
        d.mtp_layers = 1;
        let map = |k: &str, shape: &[u64]| map_key(&d, k, shape, DType::F32, &|_| None).unwrap();
        assert_eq!(
            names(map("mtp.layers.0.hnorm.weight", &[8])),
            vec!["mtp.pre_fc_norm_hidden.weight"]
        );
        assert_eq!(
            names(map(
                "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight",
                &[8, 4]
            )),
            vec!["mtp.layers.0.mlp.down_proj.weight"]
        );
        assert_eq!(
            names(map("decoder.layers.1.mlp.linear_fc2.weight", &[8, 4])),
            vec!["model.language_model.layers.1.mlp.down_proj.weight"]
        );
        assert_eq!(
            names(map("embedding.word_embeddings.weight", &[16, 8])),
            vec!["model.language_model.embed_tokens.weight"]
        );
        assert_eq!(
            names(map("output_layer.weight", &[16, 8])),
            vec!["lm_head.weight"]
        );
    }

    #[test]
    fn qkv_splits_per_query_group() {
        let d = dims(
            serde_json::json!({"model_type": "llama", "num_hidden_layers": 2,
            "hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
            "vocab_size": 10}),
        );
        let Mapped::Tensors(v) = map_key(
            &d,
            "decoder.layers.self_attention.linear_qkv.weight",
            &[2, 16, 8],
            DType::F32,
            &|_| None,
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(v.len(), 6);
        let k1 = v
            .iter()
            .find(|t| t.name == "model.layers.1.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k1.shape, vec![4, 8]);
        // group 0: rows [0,4) q, [4,6) k, [6,8) v; group 1 starts at 8.
        let starts: Vec<(u64, u64)> = k1
            .pieces
            .iter()
            .map(|p| (p.offsets[0], p.offsets[1]))
            .collect();
        assert_eq!(starts, vec![(1, 4), (1, 12)]);
    }
}
