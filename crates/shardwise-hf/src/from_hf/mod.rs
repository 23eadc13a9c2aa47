//! `shardwise from-hf`: a Hugging Face folder (config.json and safetensors, quantized or not)
//! becomes a Megatron `torch_dist` checkpoint, from the files alone: the to-hf rule table read in
//! reverse ([`plan`]), every HF tensor read with positioned reads and dequantized on the fly
//! ([`source`]), the Megatron tensors written by shardwise's writer and committed with the commit
//! protocol ([`shardwise::save`], [`shardwise::commit`]), `common.pt` as Megatron-LM stores it ([`args`]).
//!
//! Phases: (1) the output folder is checked (absent or empty, unless `overwrite`); (2) the HF
//! folder is opened and planned, every check done (missing, unmapped and misshapen tensors,
//! quantization); nothing is written before all pass. (3) The jobs are cut into groups, each one
//! data file `__<g>_0.distcp` published as part `g` of the save (a pure function of the plan, so
//! the files are byte-identical for any `--workers` and any `--part` split); (4) the process that
//! finds every part published merges them and commits `.metadata`, `metadata.json` and
//! `common.pt`; (5) with `tracker`, `latest_checkpointed_iteration.txt` is written in the parent
//! folder after the commit.

mod args;
mod plan;
mod run;
mod source;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::output::{check_outside, not_empty, Part};
use super::spec::Dims;
use super::WrittenDtype;
use shardwise::commit::part::ObjectShard;
use shardwise::commit::wait::{missing_ranks, Freshness};
use shardwise::error::{first_names, Error, Result, Stopped};
use shardwise::format::dtype::DType;
use shardwise::interrupt::interrupted;
use shardwise::save::{save_rank, ObjectItem, SaveOptions};
use shardwise::storage::Location;
use shardwise::writer::{ByteObject, Payload, TensorChunk};

pub use plan::Impl;
pub(crate) use source::{check_index, parse_untrusted, weight_files};

/// Options of a conversion.
#[derive(Clone, Debug)]
pub struct FromHfOptions {
    /// Overrides config.json's `model_type`.
    pub arch: Option<String>,
    /// Dtype of the written tensors: float32, bfloat16 or float16.
    pub dtype: DType,
    /// Megatron-LM's `--transformer-impl`.
    pub transformer_impl: Impl,
    /// Megatron-LM's `--moe-grouped-gemm` (recorded in args; the keys are the same).
    pub moe_grouped_gemm: bool,
    /// Megatron-LM's `--make-vocab-size-divisible-by` and `--tensor-model-parallel-size`: the
    /// vocabulary is padded to a multiple of their product.
    pub make_vocab_size_divisible_by: u64,
    pub tensor_model_parallel_size: u64,
    /// `iteration` in the common state.
    pub iteration: u64,
    /// Write `latest_checkpointed_iteration.txt` in the parent folder.
    pub tracker: bool,
    /// Worker threads converting tensors.
    pub threads: usize,
    /// The largest data file, in bytes, unless one tensor alone is larger (0, the default: the
    /// largest tensor's size). The tensors of one file are held in memory until it is written,
    /// one file per worker plus one queued and one being written, so peak memory is about
    /// `(threads + 2) x max(max_file_bytes, largest tensor)` plus one HF tensor per worker.
    pub max_file_bytes: u64,
    /// Skip HF tensors no rule reads instead of failing.
    pub allow_unmapped: bool,
    /// Convert without the folder's MTP layers (`args.mtp_num_layers` then None).
    pub drop_mtp: bool,
    /// Replace a checkpoint in a non-empty output folder.
    pub overwrite: bool,
    /// Write only this part's groups.
    pub part: Option<Part>,
}

impl FromHfOptions {
    /// The options `user` asks for, parsed and checked: the dtype, the transformer impl, the
    /// worker count (default: the number of CPUs), the largest file and the part.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad value.
    pub fn from_user(user: FromHfRequest) -> Result<FromHfOptions> {
        Ok(FromHfOptions {
            dtype: user.dtype.parse::<WrittenDtype>()?.into(),
            transformer_impl: user.transformer_impl.parse()?,
            threads: shardwise::workers::count(
                "--workers",
                user.workers,
                shardwise::workers::cpus(),
            )?,
            max_file_bytes: parse_max_file_size(&user.max_file_size)?,
            part: user.part.as_deref().map(Part::parse).transpose()?,
            arch: user.arch,
            moe_grouped_gemm: user.moe_grouped_gemm,
            make_vocab_size_divisible_by: user.make_vocab_size_divisible_by,
            tensor_model_parallel_size: user.tensor_model_parallel_size,
            iteration: user.iteration,
            tracker: user.tracker,
            allow_unmapped: user.allow_unmapped,
            drop_mtp: user.drop_mtp,
            overwrite: user.overwrite,
        })
    }
}

/// `from-hf`'s options as the user gives them, the CLI's flags and Python's keywords alike:
/// [`FromHfOptions::from_user`] parses and checks them, the one place for both. The default is
/// the CLI's and Python's.
#[derive(Clone, Debug)]
pub struct FromHfRequest {
    pub arch: Option<String>,
    /// [`WrittenDtype`]'s names.
    pub dtype: String,
    /// [`Impl`]'s names: `transformer_engine` or `local`.
    pub transformer_impl: String,
    pub moe_grouped_gemm: bool,
    pub make_vocab_size_divisible_by: u64,
    pub tensor_model_parallel_size: u64,
    pub iteration: u64,
    pub tracker: bool,
    /// None: the number of CPUs.
    pub workers: Option<usize>,
    /// A size or `auto` ([`parse_max_file_size`]).
    pub max_file_size: String,
    /// `i/n` ([`Part::parse`]).
    pub part: Option<String>,
    pub overwrite: bool,
    pub allow_unmapped: bool,
    pub drop_mtp: bool,
}

impl Default for FromHfRequest {
    fn default() -> FromHfRequest {
        FromHfRequest {
            arch: None,
            dtype: "bf16".into(),
            transformer_impl: "transformer_engine".into(),
            moe_grouped_gemm: false,
            make_vocab_size_divisible_by: 128,
            tensor_model_parallel_size: 1,
            iteration: 0,
            tracker: false,
            workers: None,
            max_file_size: "auto".into(),
            part: None,
            overwrite: false,
            allow_unmapped: false,
            drop_mtp: false,
        }
    }
}

impl std::str::FromStr for Impl {
    type Err = Error;

    /// Errors: [`Error::InvalidArgument`] for a name other than `transformer_engine` and `local`.
    fn from_str(name: &str) -> Result<Impl> {
        match name {
            "transformer_engine" => Ok(Impl::TransformerEngine),
            "local" => Ok(Impl::Local),
            other => Err(Error::InvalidArgument(format!(
                "transformer_impl {other:?}: use transformer_engine or local"
            ))),
        }
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug, Serialize)]
pub struct FromHfSummary {
    /// Megatron tensor chunks written by this process.
    pub chunks: usize,
    /// Megatron keys of the whole checkpoint.
    pub keys: usize,
    pub bytes: u64,
    /// Data files written by this process.
    pub files: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
    /// HF tensors read (quantized pairs counted once).
    pub hf_tensors: usize,
    pub dequantized: usize,
    /// HF tensors no rule reads, skipped with `allow_unmapped`.
    pub skipped: Vec<String>,
    /// MTP layers converted (`mtp.layers.<k>.*`, `args.mtp_num_layers`).
    pub mtp_layers: u64,
    /// HF tensors of MTP layers left out with `drop_mtp`.
    pub dropped_mtp: usize,
    /// The vision tower's tensors a multimodal folder holds, left out (a Megatron text model has
    /// no vision tower; `to-hf --base-hf` copies it back), and their prefix.
    pub vision_tensors: usize,
    pub vision_prefix: Option<String>,
    /// What was converted otherwise than the folder or config.json suggests.
    pub warnings: Vec<String>,
    /// HF tensors read by this process that hold NaN or infinities, with how many (counted in
    /// the values written, in the output dtype, after dequantization for a quantized release).
    /// Reported, not refused: the checkpoint holds what the folder holds. Empty when every value
    /// is finite.
    pub nonfinite: BTreeMap<String, u64>,
    pub stacked_layers: bool,
    pub padded_vocab_size: u64,
    pub iteration: u64,
    pub part: Option<String>,
    /// Whether the checkpoint is committed (by this process or an earlier part).
    pub committed: bool,
    /// The tracker file written, if any.
    pub tracker: Option<PathBuf>,
}

/// `--max-file-size`: a size ([`crate::parse_size`]) in bytes, or `auto` (0: the largest
/// tensor's size).
///
/// Errors: [`Error::InvalidArgument`] for a bad size.
pub fn parse_max_file_size(s: &str) -> Result<u64> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(0);
    }
    crate::parse_size(s)
}

/// Megatron-LM's padded vocabulary, by Megatron's rule and nothing more: `vocab` rounded up to a
/// multiple of `divisible_by x tp` (megatron-core 0.19.2 `megatron/training/vocab_utils.py`
/// `calculate_padded_vocab_size`, which refuses a multiplier below 1; Megatron-LM
/// `megatron/training/tokenizer/tokenizer.py` `_vocab_size_with_padding`). 250 at TP 4 is 512.
///
/// Errors: [`Error::InvalidArgument`] for `divisible_by` 0 (Megatron's ValueError) or a padded
/// size beyond 64-bit arithmetic.
pub(crate) fn padded_vocab(vocab: u64, divisible_by: u64, tp: u64) -> Result<u64> {
    if divisible_by == 0 {
        return Err(Error::InvalidArgument(
            "--make-vocab-size-divisible-by 0: it must be at least 1".into(),
        ));
    }
    divisible_by
        .checked_mul(tp)
        .filter(|&m| m > 0)
        .and_then(|m| vocab.div_ceil(m).checked_mul(m))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "--make-vocab-size-divisible-by {divisible_by} x --tensor-model-parallel-size {tp}: the padded vocabulary of {vocab} is beyond 64-bit sizes"
            ))
        })
}

/// The padded embedding (and output layer) fits in memory: from-hf builds each Megatron tensor
/// whole before writing it (`run::run_job`), so `padded x hidden` elements of `dtype` must be
/// allocatable; a larger one (a mistyped `--make-vocab-size-divisible-by`) is refused here rather
/// than aborting on the allocation. `memory`: the machine's (None: not known, not checked).
///
/// Errors: [`Error::InvalidArgument`] naming the padded size, its bytes and the memory.
fn check_padded_fits(padded: u64, hidden: u64, dtype: DType, memory: Option<u64>) -> Result<()> {
    let bytes = padded
        .checked_mul(hidden)
        .and_then(|n| n.checked_mul(dtype.itemsize()));
    match (bytes, memory) {
        (Some(b), Some(m)) if b > m => Err(Error::InvalidArgument(format!(
            "the padded vocabulary of {padded} rows makes an embedding of {padded} x {hidden} {} ({b} bytes), more than this machine's {m} bytes of memory: check --make-vocab-size-divisible-by and --tensor-model-parallel-size",
            dtype.torch_name()
        ))),
        (None, _) => Err(Error::InvalidArgument(format!(
            "the padded vocabulary of {padded} rows x hidden_size {hidden} is beyond 64-bit sizes: check --make-vocab-size-divisible-by and --tensor-model-parallel-size"
        ))),
        _ => Ok(()),
    }
}

/// `--tensor-model-parallel-size` as Megatron accepts it: at least 1, and dividing the attention
/// heads (megatron-core `TransformerConfig.__post_init__`: "num_attention_heads must be a
/// multiple of tensor_model_parallel_size"), so never more than the heads.
///
/// Errors: [`Error::InvalidArgument`] naming both numbers.
fn check_tensor_parallel(tp: u64, heads: u64) -> Result<()> {
    if tp == 0 || heads % tp != 0 {
        return Err(Error::InvalidArgument(format!(
            "--tensor-model-parallel-size {tp}: Megatron needs a size of at least 1 that divides num_attention_heads ({heads})"
        )));
    }
    Ok(())
}

/// The entries of `dir` other than the save machinery's own (`.shardwise`) and data files no
/// committed checkpoint holds (an earlier attempt's, or other parts' of this conversion: a new
/// attempt writes the same names). A committed checkpoint shows as its `.metadata`.
fn foreign_entries(dir: &Path) -> Result<Vec<String>> {
    let rd = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("read directory", dir)(e)),
        Ok(rd) => rd,
    };
    let mut v = Vec::new();
    for e in rd {
        let name = e.map_err(Error::io("read directory", dir))?.file_name();
        let name = name.to_string_lossy().into_owned();
        let ours = name == shardwise::commit::part::STATE_DIR
            || shardwise::commit::state::is_data_file_name(&name);
        if !ours {
            v.push(name);
        }
    }
    v.sort();
    Ok(v)
}

/// The tracker's content for `iteration` and the folder name Megatron-LM looks for beside it
/// (`get_checkpoint_name`: `release`, or `iter_` and 7 digits; its `read_metadata` accepts no
/// iteration 0 other than `release`).
fn tracker_entry(iteration: u64) -> (String, String) {
    if iteration == 0 {
        ("release".into(), "release".into())
    } else {
        (iteration.to_string(), format!("iter_{iteration:07}"))
    }
}

/// The HF tensors among `names` that belong to multi-token prediction layers: under the family's
/// MTP layout ([`super::spec::MtpSpec`]: its layers' prefix and its module's own names, for each
/// layer the config declares, at least one), under `mtp.` (Qwen's layout, and vLLM's), or, when
/// the config declares MTP layers under any family's field, on the layers after the last decoder
/// layer (where DeepSeek-V3's, GLM's and the DSA families' releases put them).
fn mtp_tensors(d: &Dims, names: &[String]) -> Vec<String> {
    let declared = super::spec::MTP_FIELDS
        .iter()
        .filter_map(|f| d.field(f))
        .fold(d.declared_mtp(), u64::max);
    let n = declared.max(1);
    let mut prefixes = vec!["mtp.".to_string()];
    prefixes
        .extend((0..declared).map(|k| format!("{}layers.{}.", d.text_prefix, d.num_layers + k)));
    if let Some(m) = d.spec.mtp {
        for k in 0..n {
            prefixes.push(d.mtp_name(m.layer, k));
            let own = m.rules.iter().flat_map(|r| r.outs);
            prefixes.extend(own.map(|o| d.mtp_name(o.name, k)));
        }
    }
    names
        .iter()
        .filter(|x| prefixes.iter().any(|p| x.starts_with(p.as_str())))
        .cloned()
        .collect()
}

/// The MTP layers to convert from a folder whose tensors are `names`, and what to warn about:
/// the count config.json declares when the folder holds MTP tensors ([`mtp_tensors`]); none, with a
/// warning, when it declares some and the folder holds none (transformers' `save_pretrained` leaves
/// them out: its models ignore them on load) or when `drop` (`--drop-mtp`).
///
/// Errors: [`Error::Validation`] when the folder holds MTP tensors that cannot all be converted:
/// the family has no MTP layout, config.json declares none, or the family's layout holds one MTP
/// module and config.json declares more.
fn mtp_layers(d: &Dims, names: &[String], drop: bool) -> Result<(u64, Vec<String>)> {
    let found = mtp_tensors(d, names);
    let declared = d.declared_mtp();
    let field = d.spec.mtp.map_or("num_nextn_predict_layers", |m| m.field);
    let model_type = d.spec.model_types[0];
    if found.is_empty() {
        let w = (declared > 0).then(|| format!(
            "config.json's {field} says {declared}, but the folder holds no MTP tensors (transformers' save_pretrained leaves them out): the checkpoint has no MTP layers (args.mtp_num_layers None)"
        ));
        return Ok((0, w.into_iter().collect()));
    }
    let held = format!(
        "the folder holds {} tensors of MTP layers ({})",
        found.len(),
        first_names(&found, 5)
    );
    if drop {
        return Ok((
            0,
            vec![format!(
                "--drop-mtp: {held}, not converted (args.mtp_num_layers None)"
            )],
        ));
    }
    let why = match d.spec.mtp {
        None => format!(", but shardwise knows no HF layout of MTP layers for {model_type}"),
        Some(_) if declared == 0 => format!(", but config.json's {field} says 0"),
        Some(m) if declared > 1 && !m.per_layer_names() => format!(
            ", config.json's {field} says {declared}, but {model_type}'s HF layout holds one MTP module"
        ),
        Some(_) => return Ok((declared, Vec::new())),
    };
    Err(Error::Validation(format!(
        "{held}{why}; pass --drop-mtp to convert without them (--allow-unmapped does not skip them)"
    )))
}

/// The HF tensors no job reads, sorted by why: a multimodal folder's vision tower (left out: a
/// Megatron text model has none), MTP tensors `--drop-mtp` leaves out, and the rest (`skipped`
/// with `--allow-unmapped`).
struct LeftOut {
    vision: usize,
    dropped_mtp: usize,
    skipped: Vec<String>,
}

/// Sorts `unmapped` into [`LeftOut`].
///
/// Errors: [`Error::Validation`] for MTP tensors left unread without `--drop-mtp` (more MTP
/// layers than config.json declares), and for other tensors no rule reads without
/// `--allow-unmapped`.
fn left_out(
    d: &Dims,
    multimodal: Option<&super::spec::Multimodal>,
    unmapped: &[String],
    opts: &FromHfOptions,
) -> Result<LeftOut> {
    let (vision, rest): (Vec<String>, Vec<String>) = unmapped
        .iter()
        .cloned()
        .partition(|n| multimodal.is_some_and(|m| n.starts_with(m.vision_prefix)));
    let mtp = mtp_tensors(d, &rest);
    if !mtp.is_empty() && !opts.drop_mtp {
        return Err(Error::Validation(format!(
            "the folder holds {} tensors of MTP layers that no rule reads ({}): more MTP layers than config.json declares, or names of no MTP layout shardwise knows; fix config.json or pass --drop-mtp (--allow-unmapped does not skip them)",
            mtp.len(),
            first_names(&mtp, 5)
        )));
    }
    let skipped: Vec<String> = rest.into_iter().filter(|n| !mtp.contains(n)).collect();
    if !skipped.is_empty() && !opts.allow_unmapped {
        return Err(Error::Validation(format!(
            "no rule reads these HF tensors (pass --allow-unmapped to skip them): {}",
            first_names(&skipped, 20)
        )));
    }
    Ok(LeftOut {
        vision: vision.len(),
        dropped_mtp: mtp.len(),
        skipped,
    })
}

/// Bound of each wait of a conversion's save and commit (its parts are written by this process or
/// by the other `--part` processes, which may start minutes apart).
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(600);

/// Converts the HF folder `hf_dir` into a torch_dist checkpoint in the local folder `ckpt_dir`;
/// `progress(bytes)` is called as chunks are converted. The phases of the module doc, each a step
/// below.
///
/// Errors: [`Error::InvalidArgument`] for bad options, a non-empty output folder without
/// `overwrite`, an output folder inside the HF folder, a `tracker` with a folder Megatron-LM would
/// not find; [`Error::Validation`] for HF tensors the config requires and the folder lacks, tensors
/// no rule reads (unless `allow_unmapped`), shapes that contradict the config, inconsistent
/// quantization; [`Error::Corrupt`] for damaged safetensors; [`Error::Interrupted`] (nothing is
/// committed); the save's and commit's errors.
pub fn from_hf(
    hf_dir: &Path,
    ckpt_dir: &Path,
    opts: &FromHfOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<FromHfSummary> {
    let t0 = Instant::now();
    let tracker_path = check_output(hf_dir, ckpt_dir, opts)?;
    let conversion = Conversion::plan(hf_dir, ckpt_dir, opts)?;
    let loc = Location::local(ckpt_dir);
    let written = conversion.write(&loc, opts, progress)?;
    let committed = commit_if_complete(&loc, &conversion.save_id, conversion.world)?;
    let tracker = match (tracker_path, committed) {
        (Some(path), true) => {
            let (content, _) = tracker_entry(opts.iteration);
            shardwise::storage::atomic_write(&path, content.as_bytes())?;
            Some(path)
        }
        _ => None,
    };
    Ok(conversion.summary(opts, written, committed, tracker, t0.elapsed()))
}

/// Phase 1: the output folder is local, outside the HF folder, and empty (unless `overwrite`);
/// returns where the tracker goes with `tracker` (the parent of a folder named as Megatron-LM
/// names iteration folders).
///
/// Errors: [`Error::InvalidArgument`], as [`from_hf`] says.
fn check_output(hf_dir: &Path, ckpt_dir: &Path, opts: &FromHfOptions) -> Result<Option<PathBuf>> {
    Location::local_output(ckpt_dir, "from-hf")?;
    if opts.part.is_some() && opts.overwrite {
        return Err(Error::InvalidArgument(
            "--overwrite cannot be combined with --part: empty the folder first".into(),
        ));
    }
    check_outside(ckpt_dir, hf_dir, "HF folder")?;
    let found = foreign_entries(ckpt_dir)?;
    if !found.is_empty() && !opts.overwrite {
        return Err(not_empty(
            ckpt_dir,
            &found,
            "pass --overwrite to replace a checkpoint there, or choose an empty folder",
        ));
    }
    if !opts.tracker {
        return Ok(None);
    }
    let abs = std::path::absolute(ckpt_dir).map_err(Error::io("resolve", ckpt_dir))?;
    let (_, want) = tracker_entry(opts.iteration);
    let name = abs.file_name().map(|n| n.to_string_lossy().into_owned());
    match abs
        .parent()
        .filter(|_| name.as_deref() == Some(want.as_str()))
    {
        Some(p) => Ok(Some(p.join(shardwise::hints::TRACKER_FILE))),
        None => Err(Error::InvalidArgument(format!(
            "--tracker: Megatron-LM loads iteration {} from a folder named {want} beside the tracker; {} is named {}",
            opts.iteration,
            ckpt_dir.display(),
            name.unwrap_or_default()
        ))),
    }
}

/// A planned conversion: everything phase 2 checked and decided, before any write.
struct Conversion {
    src: source::HfSource,
    d: Dims,
    /// The vision tower's prefix of a multimodal folder (left out of the checkpoint).
    vision_prefix: Option<&'static str>,
    padded_vocab: u64,
    plan: plan::Plan,
    left: LeftOut,
    warnings: Vec<String>,
    /// `common.pt`'s bytes (the args and the iteration).
    common: Vec<u8>,
    /// The linears' `_extra_state` objects: (key, global shape, global offset).
    extra: Vec<plan::ObjectPos>,
    /// The jobs of each group (one data file, one part of the save each).
    groups: Vec<std::ops::Range<usize>>,
    world: u32,
    save_id: String,
}

/// What phase 3 wrote: tensor chunks, their bytes, data files, and the HF tensors read that hold
/// NaN or infinities, with how many.
#[derive(Default)]
struct Written {
    chunks: usize,
    bytes: u64,
    files: usize,
    nonfinite: BTreeMap<String, u64>,
}

impl Conversion {
    /// Phase 2: opens the HF folder, reads its config and plans every tensor; every check runs
    /// here (missing, unmapped, misshapen and unsupported tensors, MTP copies, the vocabulary and
    /// tensor-parallel sizes), so nothing is written unless all pass.
    ///
    /// Errors: as [`from_hf`] says.
    fn plan(hf_dir: &Path, ckpt_dir: &Path, opts: &FromHfOptions) -> Result<Conversion> {
        let src = source::HfSource::open(hf_dir)?;
        // A weight file may be a symlink out of the folder (the HF cache's snapshots point into
        // its blobs folder): the output must not hold any of them either.
        for f in src
            .files
            .iter()
            .chain(std::iter::once(&crate::output::CONFIG.to_string()))
        {
            check_outside(ckpt_dir, &hf_dir.join(f), "HF file")?;
        }
        let mut d = Dims::from_config(&src.config, opts.arch.as_deref())?;
        super::config::check_values(&d, crate::output::CONFIG)?;
        // A multimodal folder: the text model under its own prefix, beside the vision tower.
        let multimodal = d.spec.multimodal.filter(|_| d.multimodal);
        if let Some(mm) = multimodal {
            d.text_prefix = mm.text_prefix;
        }
        let vocab = d.vocab_size.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}/config.json has no vocab_size",
                hf_dir.display()
            ))
        })?;
        d.check_held(src.tensors.len() as u64, "the HF folder")?;
        check_tensor_parallel(opts.tensor_model_parallel_size, d.heads)?;
        let padded_vocab = padded_vocab(
            vocab,
            opts.make_vocab_size_divisible_by,
            opts.tensor_model_parallel_size,
        )?;
        check_padded_fits(
            padded_vocab,
            d.hidden,
            opts.dtype,
            shardwise::staging::host_memory(),
        )?;
        let shapes: plan::HfShapes = src
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.shape.clone()))
            .collect();
        let names: Vec<String> = shapes.keys().cloned().collect();
        let (mtp, warnings) = mtp_layers(&d, &names, opts.drop_mtp)?;
        d.mtp_layers = mtp;
        let plan = plan::plan(&d, &shapes, opts.transformer_impl, padded_vocab)?;
        let left = left_out(&d, multimodal, &plan.unmapped, opts)?;
        check_inputs(&src, &plan)?;
        let common = args::common_pt(
            &args::megatron_args(&d, &layout(&src, opts, padded_vocab))?,
            opts.iteration,
        );
        let extra = plan::extra_states(&plan.jobs);
        let item = opts.dtype.itemsize();
        let largest = plan
            .jobs
            .iter()
            .map(|j| j.numel() * item)
            .max()
            .unwrap_or(0);
        let groups = run::groups(&plan.jobs, item, opts.max_file_bytes.max(largest));
        let world = groups.len().max(1) as u32;
        let save_id = save_id(&src, opts, &d)?;
        Ok(Conversion {
            src,
            d,
            vision_prefix: multimodal.map(|m| m.vision_prefix),
            padded_vocab,
            plan,
            left,
            warnings,
            common,
            extra,
            groups,
            world,
            save_id,
        })
    }

    /// Phase 3: converts this part's groups and saves each as one part of the save (rank `g` of
    /// `world`); group 0 also writes `common.pt` and the `_extra_state` objects.
    ///
    /// Errors: conversion errors, the save's errors, [`Error::Interrupted`].
    fn write(
        &self,
        loc: &Location,
        opts: &FromHfOptions,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<Written> {
        let mine: Vec<usize> = match opts.part {
            None => (0..self.groups.len()).collect(),
            Some(part) => part.shards(self.groups.len()),
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads.max(1))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("thread pool: {e}")))?;
        let none_pt = none_list_archive();
        let objects = extra_state_objects(&self.extra, &none_pt);
        let jobs = |g: usize| &self.plan.jobs[self.groups.get(g).cloned().unwrap_or(0..0)];
        let nonfinite = std::sync::Mutex::new(BTreeMap::new());
        let convert = |g: usize, stop: &AtomicBool| -> Result<Vec<Vec<u8>>> {
            jobs(g)
                .iter()
                .map(|j| {
                    let (b, found) = run::run_job(&self.src, j, opts.dtype, stop)?;
                    let mut m = nonfinite.lock().unwrap_or_else(|e| e.into_inner());
                    m.extend(found.into_iter().map(|(name, n)| (name, n.total())));
                    progress(b.len() as u64);
                    Ok(b)
                })
                .collect()
        };
        let save = |g: usize, bufs: &Vec<Vec<u8>>| -> Result<Written> {
            let tensors: Vec<TensorChunk> = jobs(g)
                .iter()
                .zip(bufs)
                .flat_map(|(j, b)| {
                    j.chunks.iter().map(move |c| TensorChunk {
                        fqn: c.key.clone(),
                        dtype: opts.dtype,
                        global_shape: c.global_shape.clone(),
                        offsets: c.offsets.clone(),
                        sizes: c.sizes.clone(),
                        data: Payload::Host(run::chunk_bytes(b, c, opts.dtype)),
                    })
                })
                .collect();
            let save_opts = SaveOptions {
                location: loc.clone(),
                rank: g as u32,
                world_size: self.world,
                save_id: self.save_id.clone(),
                megatron: true,
                merge_rank: None,
                timeout: RENDEZVOUS_TIMEOUT,
                wait_for_commit: false,
                overwrite: opts.overwrite,
                derived_save_id: false,
                integrity: false,
            };
            let report = save_rank(
                &save_opts,
                &tensors,
                if g == 0 { &objects } else { &[] },
                (g == 0).then_some(self.common.as_slice()),
                None,
            )?;
            Ok(Written {
                chunks: tensors.len(),
                bytes: tensors.iter().map(|t| t.data.len()).sum(),
                files: report.data_file.is_some() as usize,
                nonfinite: BTreeMap::new(),
            })
        };
        let written = convert_then_save(&pool, &mine, convert, save)?;
        if interrupted() {
            return Err(Error::Interrupted(Stopped::Commit));
        }
        Ok(written.into_iter().fold(
            Written {
                nonfinite: nonfinite.into_inner().unwrap_or_else(|e| e.into_inner()),
                ..Written::default()
            },
            |a, w| Written {
                chunks: a.chunks + w.chunks,
                bytes: a.bytes + w.bytes,
                files: a.files + w.files,
                nonfinite: a.nonfinite,
            },
        ))
    }

    /// The summary of a conversion that wrote `written` in `took`.
    fn summary(
        self,
        opts: &FromHfOptions,
        written: Written,
        committed: bool,
        tracker: Option<PathBuf>,
        took: Duration,
    ) -> FromHfSummary {
        let p = &self.plan;
        let keys: std::collections::BTreeSet<&str> = p
            .jobs
            .iter()
            .flat_map(|j| j.chunks.iter().map(|c| c.key.as_str()))
            .collect();
        let seconds = took.as_secs_f64();
        FromHfSummary {
            chunks: written.chunks,
            keys: keys.len(),
            bytes: written.bytes,
            files: written.files,
            seconds,
            gb_per_s: written.bytes as f64 / seconds.max(1e-9) / 1e9,
            hf_tensors: self.src.tensors.len() - p.unmapped.len() + p.copies.len(),
            dequantized: p
                .jobs
                .iter()
                .flat_map(|j| &j.inputs)
                .filter(|i| self.src.tensors[&i.name].quantized())
                .count(),
            skipped: self.left.skipped,
            mtp_layers: self.d.mtp_layers,
            dropped_mtp: self.left.dropped_mtp,
            vision_tensors: self.left.vision,
            vision_prefix: self.vision_prefix.map(str::to_string),
            warnings: self.warnings,
            nonfinite: written.nonfinite,
            stacked_layers: p.stacked,
            padded_vocab_size: self.padded_vocab,
            iteration: opts.iteration,
            part: opts.part.map(|p| format!("{}/{}", p.index, p.count)),
            committed,
            tracker,
        }
    }
}

/// Checks what the plan reads: each MTP copy equals the model's tensor Megatron shares, and every
/// input is a float type from-hf converts (or quantized, dequantized on the fly).
///
/// Errors: [`Error::Validation`] naming a differing copy; [`Error::UnsupportedDtype`].
fn check_inputs(src: &source::HfSource, p: &plan::Plan) -> Result<()> {
    for (copy, shared) in &p.copies {
        if !src.same_values(copy, shared)? {
            return Err(Error::Validation(format!(
                "{copy} differs from {shared}: Megatron's MTP layers share the model's tensor, so a different copy cannot be converted (pass --drop-mtp to convert without the MTP layers)"
            )));
        }
    }
    for i in p.jobs.iter().flat_map(|j| &j.inputs) {
        let t = &src.tensors[&i.name];
        if !t.quantized() && !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDtype(format!(
                "{}: {} (from-hf converts float32, bfloat16 and float16 tensors)",
                i.name,
                t.dtype.torch_name()
            )));
        }
    }
    Ok(())
}

/// What the args record of the Megatron layout written: the options, and what the folder's
/// tensors show (biases, q/k norms, MLA).
fn layout(src: &source::HfSource, opts: &FromHfOptions, padded_vocab: u64) -> args::Layout {
    let has = |suffix: &str| src.tensors.keys().any(|k| k.ends_with(suffix));
    args::Layout {
        te: opts.transformer_impl == Impl::TransformerEngine,
        moe_grouped_gemm: opts.moe_grouped_gemm,
        tensor_model_parallel_size: opts.tensor_model_parallel_size,
        make_vocab_size_divisible_by: opts.make_vocab_size_divisible_by,
        padded_vocab_size: padded_vocab,
        has_qkv_bias: has("self_attn.q_proj.bias"),
        has_qk_norm: has("self_attn.q_norm.weight"),
        mla: has("self_attn.kv_a_proj_with_mqa.weight"),
        add_bias_linear: has("self_attn.o_proj.bias"),
    }
}

/// `torch.save([None])`'s archive: what megatron-core's torch_dist save stores for a local
/// linear's `_extra_state` (`get_extra_state()` is None; every ShardedObject is saved as the list
/// of its shards' data, `strategies/torch.py` `_mcore_to_torch_sharded_object`, and loaded back as
/// that list).
fn none_list_archive() -> Vec<u8> {
    let mut p = shardwise::format::pickle::Pickler::new(false);
    p.empty_list();
    p.put();
    p.mark();
    p.none();
    p.appends();
    shardwise::format::zip::object_archive(&p.finish(), "0000000000000000000000000000000000000000")
}

/// The `_extra_state` ShardedObjects at `extra`, each holding `bytes`, under the fqn
/// megatron-core gives a shard (`<key>/shard_<offset>_<shape>`, dims joined by dots).
fn extra_state_objects<'a>(extra: &[plan::ObjectPos], bytes: &'a [u8]) -> Vec<ObjectItem<'a>> {
    let dims = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
    extra
        .iter()
        .map(|(key, shape, offset)| ObjectItem {
            object: ByteObject {
                fqn: format!("{key}/shard_{}_{}", dims(offset), dims(shape)),
                bytes,
            },
            shard: Some(ObjectShard {
                key: key.clone(),
                global_shape: shape.clone(),
                global_offset: offset.clone(),
            }),
        })
        .collect()
}

/// Runs `convert(g)` for each group `g` of `mine` on `pool`'s workers and hands each result to
/// one writer thread that runs `save(g, result)`; returns the writer's results.
///
/// The workers convert one group at a time each (its jobs in turn), so reading, converting and
/// writing overlap, and memory holds at most a group per worker plus the one queued and the one
/// being written (a queue of one: with a rendezvous instead, 4 workers on 16 cores reached 74 % of
/// the disk's ceiling, not 89 %; BENCHMARKS.md "from-hf"). The writer runs outside the pool: a
/// save's own rayon work waited for inside the pool could steal another group's task, whose save
/// would then wait for the save ticket this thread holds (deadlock).
///
/// Errors: the first of `convert`'s and `save`'s; [`Error::Interrupted`] on Ctrl-C.
fn convert_then_save<T: Send>(
    pool: &rayon::ThreadPool,
    mine: &[usize],
    convert: impl Fn(usize, &AtomicBool) -> Result<T> + Sync,
    save: impl Fn(usize, &T) -> Result<Written> + Sync,
) -> Result<Vec<Written>> {
    let (written, stopped) = shardwise::interrupt::watching(|stop| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, T)>(1);
        std::thread::scope(|s| {
            let writer = s.spawn(|| -> Result<Vec<Written>> {
                let mut out = Vec::new();
                for (g, converted) in rx {
                    if stop.load(Ordering::Relaxed) {
                        return Err(Error::Interrupted(Stopped::Commit));
                    }
                    out.push(save(g, &converted)?);
                }
                Ok(out)
            });
            let converted = pool.install(|| {
                mine.par_iter().with_max_len(1).try_for_each(|&g| {
                    let c = convert(g, stop)?;
                    // A closed queue: the writer failed, and says why below.
                    tx.send((g, c))
                        .map_err(|_| Error::Interrupted(Stopped::Commit))
                })
            });
            drop(tx);
            let written = writer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            match (written, converted) {
                (Err(e), _) | (Ok(_), Err(e)) => Err(e),
                (Ok(w), Ok(())) => Ok(w),
            }
        })
    });
    if stopped {
        return Err(Error::Interrupted(Stopped::Commit));
    }
    written
}

/// Phase 4: the process that finds every part of the save published merges them and commits;
/// returns whether it did (false: another part is still to be written).
///
/// Errors: the commit's; [`Error::Interrupted`] (nothing committed).
fn commit_if_complete(loc: &Location, save_id: &str, world: u32) -> Result<bool> {
    if !missing_ranks(loc, save_id, world)?.is_empty() {
        return Ok(false);
    }
    if interrupted() {
        return Err(Error::Interrupted(Stopped::Commit));
    }
    shardwise::commit::merge(
        loc,
        save_id,
        world,
        RENDEZVOUS_TIMEOUT,
        &Freshness::any_part(),
    )?;
    Ok(true)
}

/// The save id of a conversion: a digest of its input (config.json and every weight file's name,
/// size and mtime) and of every option that changes the output, so that every part of one
/// conversion agrees and two conversions never share parts.
fn save_id(src: &source::HfSource, opts: &FromHfOptions, d: &Dims) -> Result<String> {
    let mut h = Sha256::new();
    h.update(src.identity()?);
    h.update(
        format!(
            "\0{:?}\0{:?}\0{}\0{}\0{}\0{}\0{}\0{}\0{}",
            opts.dtype,
            opts.transformer_impl,
            opts.moe_grouped_gemm,
            opts.make_vocab_size_divisible_by,
            opts.tensor_model_parallel_size,
            opts.iteration,
            d.spec.model_types[0],
            // The data files' grouping: parts split with different sizes must not mix.
            opts.max_file_bytes,
            opts.drop_mtp,
        )
        .as_bytes(),
    );
    let digest: [u8; 32] = h.finalize().into();
    let id = format!(
        "from-hf-{}",
        &shardwise::commit::manifest::hex(&digest)[..24]
    );
    // A folder committed by this very conversion is replaced under another id (a save never
    // overwrites its own commit); there is no part to agree with (--overwrite excludes --part).
    Ok(if opts.overwrite {
        format!("{id}-{}", shardwise::commit::liveness::now_ns())
    } else {
        id
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_from_user_parse_every_name_once() {
        let d = FromHfOptions::from_user(FromHfRequest::default()).unwrap();
        assert_eq!(
            (d.dtype, d.transformer_impl),
            (DType::BF16, Impl::TransformerEngine)
        );
        assert_eq!(
            (d.make_vocab_size_divisible_by, d.tensor_model_parallel_size),
            (128, 1)
        );
        assert_eq!((d.iteration, d.max_file_bytes, d.part), (0, 0, None));
        assert_eq!("local".parse::<Impl>().unwrap(), Impl::Local);
        let refused = |r: FromHfRequest| FromHfOptions::from_user(r).unwrap_err().to_string();
        let e = refused(FromHfRequest {
            transformer_impl: "megatron".into(),
            ..Default::default()
        });
        assert!(
            e.ends_with("transformer_impl \"megatron\": use transformer_engine or local"),
            "{e}"
        );
        let e = refused(FromHfRequest {
            dtype: "int8".into(),
            ..Default::default()
        });
        assert!(e.ends_with("dtype \"int8\": use bf16, fp16 or fp32"), "{e}");
        let e = refused(FromHfRequest {
            max_file_size: "big".into(),
            ..Default::default()
        });
        assert!(e.contains("big"), "{e}");
        let e = refused(FromHfRequest {
            part: Some("2/2".into()),
            ..Default::default()
        });
        assert!(e.contains("--part \"2/2\""), "{e}");
    }

    #[test]
    fn vocab_padding_and_tracker_names() {
        assert_eq!(padded_vocab(250, 128, 1).unwrap(), 256);
        assert_eq!(padded_vocab(250, 128, 2).unwrap(), 256);
        assert_eq!(padded_vocab(257, 128, 2).unwrap(), 512);
        assert_eq!(padded_vocab(151936, 128, 8).unwrap(), 152576);
        // Megatron's rule alone: 250 at TP 4 pads to 512, more rows than the vocabulary.
        assert_eq!(padded_vocab(250, 128, 4).unwrap(), 512);
        assert_eq!(padded_vocab(250, 1 << 40, 1).unwrap(), 1 << 40);
        // Zero and overflow are refused.
        for (d, tp) in [(0, 1), (128, 0), (1 << 40, 1 << 30)] {
            assert!(padded_vocab(250, d, tp).is_err(), "{d} x {tp}");
        }
        // The padded embedding must fit in memory (or in 64 bits).
        let gib = Some(1 << 30);
        assert!(check_padded_fits(512, 64, DType::BF16, gib).is_ok());
        assert!(check_padded_fits(1 << 40, 64, DType::BF16, None).is_ok());
        let e = check_padded_fits(1 << 40, 64, DType::BF16, gib)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("more than this machine's 1073741824 bytes"),
            "{e}"
        );
        assert!(check_padded_fits(1 << 60, 64, DType::BF16, gib).is_err());
        assert_eq!(tracker_entry(0), ("release".into(), "release".into()));
        assert_eq!(tracker_entry(42), ("42".into(), "iter_0000042".into()));
    }
}
