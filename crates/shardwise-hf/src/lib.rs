//! The HF layer of shardwise, on the core crate (`shardwise`): `from-hf` ([`from_hf`]), [`diff`]
//! and, in this module, `shardwise to-hf`: streaming conversion of a torch_dist / DCP checkpoint
//! to Hugging Face safetensors, from the files alone. Each HF tensor is read from only the chunk
//! byte ranges it needs, converted, and written at its precomputed offset by one of `threads`
//! workers, so peak memory is about `threads x largest HF tensor` whatever the model size.
//!
//! Modules, each importing only those before it: [`quant`] (the block-FP8 and MXFP4 formats of
//! quantized releases, pure functions), [`layout`] (how the checkpoint numbers its layers:
//! a GPTModel's or a HybridModel's), [`spec`] (the rule vocabulary and [`spec::Dims`]),
//! [`rules`] and [`gdn`] (the rule slices), [`families`] (the architectures), [`config`]
//! (hyperparameters from config.json and the stored args, and their checks), [`plan`] (the table
//! applied to the checkpoint's keys), [`write`] (shard plan, safetensors headers, index),
//! [`output`] (the folder and the commit). Name mapping: megatron-core 0.16.1's key names
//! (`transformer/transformer_block.py`, `moe/experts.py`), slime's `megatron_to_hf/*.py`,
//! Megatron-Bridge's bridges and transformers 5.24's `conversion_mapping.py`; the families in
//! docs/hf.md. Output files:
//! safetensors sharded as `model-0000k-of-0000n.safetensors` with
//! `model.safetensors.index.json`, as `transformers` writes them.

mod config;
pub mod diff;
mod families;
mod finite;
mod from_hf;
pub mod fuzzing;
mod gdn;
mod layout;
mod output;
mod plan;
pub(crate) mod quant;
mod rules;
mod spec;
mod tokenizer;
mod vision;
mod write;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;
use shardwise::format::METADATA_FILE;
use shardwise::reader::Checkpoint;
use shardwise::storage::{create_dir_all, Location};

pub(crate) use from_hf::{check_index, weight_files};
pub use from_hf::{
    from_hf, parse_max_file_size, FromHfOptions, FromHfRequest, FromHfSummary, Impl,
};
pub use output::Part;
pub(crate) use plan::{read_hf_tensor, HfTensor, Plan};
pub use quant::{Quantize, QuantizeFormat};
pub(crate) use spec::Post;
pub(crate) use write::dtype_of_st;
pub(crate) use write::INDEX;

/// The HF-side parsers of untrusted bytes, as [`shardwise::fuzzing`] drives them: each must return,
/// never panic, hang or allocate by a number it has not checked.
pub(crate) mod untrusted {
    /// A safetensors file's header (from-hf's reader; the bytes are the whole file).
    pub fn safetensors_header(data: &[u8]) {
        super::from_hf::parse_untrusted(Some(data), None);
    }

    /// `model.safetensors.index.json`.
    pub fn index(data: &[u8]) {
        super::from_hf::parse_untrusted(None, Some(data));
    }

    /// config.json's dimensions, and their check against a folder of 64 tensors.
    pub fn config(data: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
            return;
        };
        if let Ok(d) = super::spec::Dims::from_config(&v, None) {
            let _ = d.check_held(64, "the fuzzed folder");
        }
    }
}

/// `to-hf`'s options as the user gives them, the CLI's flags and Python's keywords alike:
/// [`HfOptions::from_user`] parses and checks them, the one place for both. The default is
/// the CLI's and Python's.
#[derive(Clone, Debug)]
pub struct ToHfRequest {
    pub hf_config: Option<PathBuf>,
    pub arch: Option<String>,
    /// [`WrittenDtype`]'s names; None: as stored.
    pub dtype: Option<String>,
    /// A size like `5GB` ([`parse_size`]).
    pub max_shard_size: String,
    /// None: the number of CPUs.
    pub workers: Option<usize>,
    pub allow_unmapped: bool,
    pub overwrite: bool,
    /// `i/n` ([`Part::parse`]).
    pub part: Option<String>,
    pub base_hf: Option<PathBuf>,
    pub text_only: bool,
    pub drop_mtp: bool,
    pub tokenizer: Option<PathBuf>,
    /// [`Quantize`]'s names.
    pub quantize: Option<String>,
    /// [`QuantizeFormat`]'s names.
    pub quantize_format: Option<String>,
    /// `--allow-config-mismatch`: config fields (or their args fields) whose disagreement with the
    /// stored args is a warning, not a refusal ([`HfOptions::allow_config_mismatch`]).
    pub allow_config_mismatch: Vec<String>,
    /// Quantize tensors that hold NaN or infinities anyway (a warning each), instead of refusing.
    pub allow_nonfinite: bool,
}

impl Default for ToHfRequest {
    fn default() -> ToHfRequest {
        ToHfRequest {
            hf_config: None,
            arch: None,
            dtype: None,
            max_shard_size: "5GB".into(),
            workers: None,
            allow_unmapped: false,
            overwrite: false,
            part: None,
            base_hf: None,
            text_only: false,
            drop_mtp: false,
            tokenizer: None,
            quantize: None,
            quantize_format: None,
            allow_config_mismatch: Vec::new(),
            allow_nonfinite: false,
        }
    }
}

/// A dtype the conversions write, as the user names it: `bf16`, `fp16` or `fp32` (or
/// `bfloat16`, `float16`, `float32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrittenDtype {
    Bf16,
    Fp16,
    Fp32,
}

impl std::str::FromStr for WrittenDtype {
    type Err = Error;

    /// Errors: [`Error::InvalidArgument`] for another name.
    fn from_str(name: &str) -> Result<WrittenDtype> {
        match name {
            "bf16" | "bfloat16" => Ok(WrittenDtype::Bf16),
            "fp16" | "float16" => Ok(WrittenDtype::Fp16),
            "fp32" | "float32" => Ok(WrittenDtype::Fp32),
            other => Err(Error::InvalidArgument(format!(
                "dtype {other:?}: use bf16, fp16 or fp32"
            ))),
        }
    }
}

impl From<WrittenDtype> for DType {
    fn from(d: WrittenDtype) -> DType {
        match d {
            WrittenDtype::Bf16 => DType::BF16,
            WrittenDtype::Fp16 => DType::F16,
            WrittenDtype::Fp32 => DType::F32,
        }
    }
}

/// Options of a conversion.
#[derive(Clone, Debug)]
pub struct HfOptions {
    /// An HF `config.json`: the source of hyperparameters (checked against `common.pt` `args` when
    /// both exist) and copied to the output.
    pub config: Option<PathBuf>,
    /// Overrides the config's `model_type`.
    pub arch: Option<String>,
    /// Output dtype (float32, bfloat16 or float16); default: the checkpoint's.
    pub dtype: Option<DType>,
    /// Largest shard file, in bytes.
    pub max_shard_bytes: u64,
    /// Worker threads (each holds at most one HF tensor in memory).
    pub threads: usize,
    /// Skip checkpoint keys that no rule maps instead of failing.
    pub allow_unmapped: bool,
    /// Replace an earlier conversion in the output folder (its index, weight files and
    /// config.json; other files are kept). Without it a non-empty folder is refused.
    pub overwrite: bool,
    /// Write only this part's shards (a conversion split over processes or machines).
    pub part: Option<Part>,
    /// The original HF release of a multimodal model: its vision tower (`model.visual.*`) is
    /// copied byte for byte beside the converted text model.
    pub base_hf: Option<PathBuf>,
    /// For a multimodal config: write the text model alone, with its own config.
    pub text_only: bool,
    /// Convert without the checkpoint's MTP layers (the config written then declares none).
    pub drop_mtp: bool,
    /// The tokenizer folder to copy (`--tokenizer DIR`); None: `<checkpoint>/tokenizer/` when
    /// the checkpoint is a local folder that has one.
    pub tokenizer: Option<PathBuf>,
    /// `--quantize`: block-scaled FP8 (see [`quant`]), gpt_oss's MXFP4 experts, weight-only
    /// NVFP4 or MXFP8; None writes every tensor in the output dtype.
    pub quantize: Option<Quantize>,
    /// `--quantize-format`: compressed-tensors (the default) or modelopt (`nvfp4` only).
    pub quantize_format: Option<QuantizeFormat>,
    /// `--allow-config-mismatch FIELD`: check rows (named by config or args field) whose
    /// disagreement with the stored args converts with a warning; config.json is written as
    /// given, so the export keeps its value. A name of no row of the architecture is refused.
    pub allow_config_mismatch: Vec<String>,
    /// `--allow-nonfinite`: quantize a tensor that holds NaN or infinities anyway (its summary
    /// warns), instead of refusing the conversion before it commits anything.
    pub allow_nonfinite: bool,
}

impl HfOptions {
    /// The options `user` asks for, parsed and checked: the dtype, the sizes, the worker count
    /// (default: the number of CPUs), the part and the quantization's names.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad value, in the order of the fields.
    pub fn from_user(user: ToHfRequest) -> Result<HfOptions> {
        Ok(HfOptions {
            config: user.hf_config,
            arch: user.arch,
            dtype: user
                .dtype
                .map(|d| d.parse::<WrittenDtype>().map(DType::from))
                .transpose()?,
            max_shard_bytes: parse_size(&user.max_shard_size)?,
            threads: shardwise::workers::count(
                "--workers",
                user.workers,
                shardwise::workers::cpus(),
            )?,
            allow_unmapped: user.allow_unmapped,
            overwrite: user.overwrite,
            part: user.part.as_deref().map(Part::parse).transpose()?,
            base_hf: user.base_hf,
            text_only: user.text_only,
            drop_mtp: user.drop_mtp,
            tokenizer: user.tokenizer,
            quantize: user.quantize.as_deref().map(str::parse).transpose()?,
            quantize_format: user
                .quantize_format
                .as_deref()
                .map(str::parse)
                .transpose()?,
            allow_config_mismatch: user.allow_config_mismatch,
            allow_nonfinite: user.allow_nonfinite,
        })
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug, Serialize)]
pub struct HfSummary {
    /// HF tensors written by this process (all of them, or this part's).
    pub tensors: usize,
    pub bytes: u64,
    /// Shard files written by this process.
    pub files: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
    pub skipped_keys: usize,
    /// The config against the checkpoint's stored args: `"passed"`, or `"skipped: no args
    /// stored"` (the checkpoint has no common state with `args`).
    pub args_check: String,
    /// Check rows the stored args could not decide (an older Megatron without the field).
    pub args_unchecked: Vec<String>,
    /// What the user should know about the output (e.g. a norm epsilon transformers ignores, a
    /// disagreement `--allow-config-mismatch` let through).
    pub warnings: Vec<String>,
    /// Embedding and output rows beyond `vocab_size` left out (Megatron's vocabulary padding,
    /// checked to be no more than its padding explains).
    pub padding_rows_dropped: u64,
    /// Whether config.json was written (the `--hf-config` one, else one built from the stored
    /// args).
    pub config_written: bool,
    /// MTP layers converted.
    pub mtp_layers: u64,
    /// Vision tensors copied from `--base-hf`.
    pub vision_tensors: usize,
    /// HF tensors of the conversion (all parts) written quantized (`--quantize`), each as its
    /// stored tensors (FP8 weight and `weight_scale_inv`, or MXFP4 blocks and scales).
    pub quantized: usize,
    /// Tokenizer files copied (from `--tokenizer` or `<checkpoint>/tokenizer/`).
    pub tokenizer_files: usize,
    /// HF tensors written by this process that hold NaN or infinities, with how many: counted in
    /// the values written (as the output dtype: a float32 value beyond float16's range becomes an
    /// infinity), for a quantized tensor in the values it was quantized from (only with
    /// `allow_nonfinite`; otherwise the conversion is refused). Empty when every value is finite.
    pub nonfinite: BTreeMap<String, u64>,
    /// `"i/n"` for one part of a split conversion.
    pub part: Option<String>,
    /// Whether the index is committed (always for one process; for a part, when every part has
    /// published its shards).
    pub committed: bool,
}

/// The dtype most of `tensors`' elements are written in (`requested` or each one's stored dtype):
/// what config.json declares. None for no tensor.
fn written_dtype(tensors: &[plan::HfTensor], requested: Option<DType>) -> Option<DType> {
    let mut by_dtype: Vec<(DType, u128)> = Vec::new();
    for t in tensors {
        let d = t.out_dtype(requested);
        let n: u128 = t.shape.iter().map(|&x| x as u128).product();
        match by_dtype.iter_mut().find(|(k, _)| *k == d) {
            Some((_, total)) => *total += n,
            None => by_dtype.push((d, n)),
        }
    }
    by_dtype.into_iter().max_by_key(|&(_, n)| n).map(|(d, _)| d)
}

/// Converts the checkpoint at `ckpt` (a directory or an object-store prefix, read by ranged GETs)
/// into HF safetensors in the local directory `out_dir`; `progress(bytes)` is called as tensors
/// are written. See [`output`] for the folder rules and the commit.
///
/// Errors: [`Error::InvalidArgument`] for missing or unusable hyperparameters or a non-empty
/// output folder without `overwrite`; [`Error::Validation`] for unmapped checkpoint keys (unless
/// `allow_unmapped`), HF tensors the config requires that the checkpoint does not produce,
/// shapes that contradict the config, and config/args disagreements; reader errors for damaged
/// checkpoints; [`Error::Io`].
pub fn to_hf(
    ckpt: &Location,
    out_dir: &Path,
    opts: &HfOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<HfSummary> {
    let t0 = Instant::now();
    let scheme = quant_scheme(opts)?;
    check_output(ckpt, out_dir, opts)?;
    let ckpt = Checkpoint::open(ckpt)?;
    let c = Conversion::plan(&ckpt, opts, scheme)?;
    let shards = shard_plan(&c.tensors, opts)?;
    let (which, written, committed) =
        write_and_commit(&ckpt, &c, &shards, out_dir, opts, progress)?;
    let seconds = t0.elapsed().as_secs_f64();
    let bytes: u64 = which.iter().map(|&k| shards.shards[k].data_len).sum();
    let mut warnings = c.check.warnings;
    warnings.extend(nonfinite_warnings(&c.tensors, &written));
    Ok(HfSummary {
        tensors: which.iter().map(|&k| shards.shards[k].tensors.len()).sum(),
        bytes,
        files: which.len(),
        seconds,
        gb_per_s: bytes as f64 / seconds.max(1e-9) / 1e9,
        skipped_keys: c.skipped,
        args_check: c.check.status,
        args_unchecked: c.check.unchecked,
        warnings,
        padding_rows_dropped: match (c.rows, c.d.vocab_size) {
            (Some(r), Some(v)) => r.saturating_sub(v),
            _ => 0,
        },
        config_written: committed && c.config_written,
        mtp_layers: c.d.mtp_layers,
        vision_tensors: c.vision_tensors,
        quantized: c.quantized,
        tokenizer_files: if committed { c.tokenizer_files } else { 0 },
        nonfinite: written
            .into_iter()
            .map(|(name, found)| (name, found.total()))
            .collect(),
        part: opts.part.map(|p| format!("{}/{}", p.index, p.count)),
        committed,
    })
}

/// The quantization `opts` ask for, checked before anything is read.
///
/// Errors: [`Error::InvalidArgument`] for a layout the scheme is not written in, or a layout
/// without a scheme.
fn quant_scheme(opts: &HfOptions) -> Result<Option<quant::Scheme>> {
    match (opts.quantize, opts.quantize_format) {
        (Some(q), f) => Ok(Some(quant::Scheme::from_user(q, f)?)),
        (None, Some(f)) => Err(Error::InvalidArgument(format!(
            "--quantize-format {:?} without --quantize: it names the layout of a quantized output",
            f.to_string()
        ))),
        (None, None) => Ok(None),
    }
}

/// Phase 1: the output folder, checked before anything is read (nothing changes there yet): it
/// holds none of the inputs, and, unless a part of a split conversion, is absent, empty or (with
/// `overwrite`) an earlier conversion.
///
/// Errors: [`Error::InvalidArgument`].
fn check_output(ckpt: &Location, out_dir: &Path, opts: &HfOptions) -> Result<()> {
    if opts.part.is_some() && opts.overwrite {
        return Err(Error::InvalidArgument(
            "--overwrite cannot be combined with --part: empty the folder first".into(),
        ));
    }
    if let Location::Local(dir) = ckpt {
        output::check_outside(out_dir, dir, "checkpoint directory")?;
    }
    if let Some(dir) = &opts.base_hf {
        output::check_outside(out_dir, dir, "--base-hf folder")?;
    }
    if let Some(file) = &opts.config {
        output::check_outside(out_dir, file, "--hf-config file")?;
    }
    if let Some(dir) = &opts.tokenizer {
        output::check_outside(out_dir, dir, "--tokenizer folder")?;
    }
    if opts.part.is_none() {
        output::check_folder(out_dir, opts.overwrite)?;
    }
    Ok(())
}

/// A planned conversion (phase 2): the HF tensors to write, quantization marked, and the files
/// written beside them.
struct Conversion {
    d: spec::Dims,
    check: config::ArgsCheck,
    /// The embedding's rows.
    rows: Option<u64>,
    tensors: Vec<HfTensor>,
    skipped: usize,
    vision_tensors: usize,
    quantized: usize,
    /// config.json, the quantization's own files, then the tokenizer's: (name, bytes).
    files: Vec<(String, Vec<u8>)>,
    config_written: bool,
    tokenizer_files: usize,
}

impl Conversion {
    /// Phase 2: hyperparameters, checks and the mapping; nothing is written before all pass.
    ///
    /// Errors: as [`to_hf`] says.
    fn plan(ckpt: &Checkpoint, opts: &HfOptions, scheme: Option<quant::Scheme>) -> Result<Self> {
        let Setup {
            d,
            check,
            rows,
            config,
            from_args,
            vision,
        } = setup(ckpt, opts, false)?;
        let Plan {
            mut tensors,
            skipped,
        } = plan::plan(ckpt, &d, opts.allow_unmapped)?;
        let vision_tensors = vision.len();
        // Without --hf-config, the config.json built from the stored args; either way its `dtype`
        // is the one most of the weights are written in.
        let written = written_dtype(&tensors, opts.dtype);
        let config = match (config, from_args) {
            (Some(c), _) => Some(c),
            (None, true) => written
                .map(|t| config::config_from_args(&d, rows, t))
                .transpose()?,
            (None, false) => None,
        };
        let config = match (config, written) {
            (Some(c), Some(t)) => Some(config::with_dtype(&c, t)?),
            (c, _) => c,
        };
        tensors.extend(vision);
        let quantization = match scheme {
            Some(s) => Some(quantize_plan(&mut tensors, s, &d, opts.dtype)?),
            None => None,
        };
        let quantized = tensors.iter().filter(|t| t.quant.is_some()).count();
        // The config declares the weights as written: the quantization applied, or none (a given
        // release config's own quantization_config would describe weights this folder lacks).
        let config = config
            .map(|c| config::with_quantization(&c, quantization.as_ref().map(|q| &q.config)))
            .transpose()?;
        // The files written beside the weights: config.json, then the tokenizer's.
        let tokenizer = match &opts.tokenizer {
            Some(dir) => tokenizer::given_tokenizer(dir)?,
            None => tokenizer::tokenizer_files(ckpt.location(), "tokenizer")?,
        };
        let tokenizer_files = tokenizer.len();
        let config_written = config.is_some();
        let files: Vec<(String, Vec<u8>)> = config
            .into_iter()
            .map(|c| (output::CONFIG.to_string(), c))
            .chain(quantization.into_iter().flat_map(|q| q.files))
            .chain(tokenizer)
            .collect();
        Ok(Conversion {
            d,
            check,
            rows,
            tensors,
            skipped,
            vision_tensors,
            quantized,
            files,
            config_written,
            tokenizer_files,
        })
    }
}

/// Phase 3: the shard plan (files, headers, offsets, index), a pure function of the tensors, so
/// every part of a split conversion computes the same.
///
/// Errors: [`Error::InvalidArgument`] for more `--part`s than shard files; the plan's errors.
fn shard_plan(tensors: &[HfTensor], opts: &HfOptions) -> Result<write::ShardPlan> {
    let shards = write::shard_plan(
        tensors,
        opts.dtype,
        opts.max_shard_bytes,
        write::HEADER_BUDGET,
    )?;
    if let Some(p) = opts.part {
        if p.count > shards.shards.len() {
            return Err(Error::InvalidArgument(format!(
                "--part {}/{}: this conversion has {} shard file(s), so at most {} parts can share it (a smaller --max-shard-size gives more files)",
                p.index,
                p.count,
                shards.shards.len(),
                shards.shards.len()
            )));
        }
    }
    Ok(shards)
}

/// Phases 4 and 5: writes this conversion's shard files (all, or this part's), then commits (the
/// index last); returns the shard files written, the non-finite values of the HF tensors written
/// ([`write::write_shards`]), and whether the folder is committed. When a write fails, what this run wrote goes: the staged shards (or this part's),
/// and the output folder when this run made it.
///
/// Errors: storage errors, the read and conversion errors of [`write::write_shards`] (a tensor to
/// quantize holding NaN or infinities among them), [`Error::Interrupted`] (nothing committed).
fn write_and_commit(
    ckpt: &Checkpoint,
    c: &Conversion,
    shards: &write::ShardPlan,
    out_dir: &Path,
    opts: &HfOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(Vec<usize>, BTreeMap<String, finite::NonFinite>, bool)> {
    let index = write::index_bytes(shards);
    let made_dir = !out_dir.exists();
    create_dir_all(out_dir)?;
    let write = |which: &[usize], path: &dyn Fn(usize) -> PathBuf| {
        let values = write::Values {
            dtype: opts.dtype,
            allow_nonfinite: opts.allow_nonfinite,
        };
        let written = write::write_shards(
            ckpt,
            &c.tensors,
            shards,
            which,
            values,
            opts.threads,
            path,
            progress,
        );
        if written.is_err() {
            // Nothing was committed; what was written is of no use (best effort: a later run
            // removes a leftover staging folder or part file too).
            for &k in which {
                shardwise::failpoint::hit(shardwise::failpoint::Op::Unlink, &path(k));
                let _ = std::fs::remove_file(path(k));
            }
        }
        written
    };
    let result = (|| {
        let Some(part) = opts.part else {
            let staging = output::stage(out_dir)?;
            let which: Vec<usize> = (0..shards.shards.len()).collect();
            let written = write(&which, &|k| staging.join(shards.file_name(k)));
            if written.is_err() {
                shardwise::failpoint::hit(shardwise::failpoint::Op::RemoveTree, &staging);
                let _ = std::fs::remove_dir_all(&staging);
            }
            let written = written?;
            output::commit(out_dir, &staging, shards, &index, &c.files)?;
            return Ok((which, written, true));
        };
        if output::prepare_part(out_dir, shards, &index)? {
            return Ok((Vec::new(), BTreeMap::new(), true));
        }
        let which = part.shards(shards.shards.len());
        let written = write(&which, &|k| {
            output::part_temp(out_dir, &shards.file_name(k), part)
        })?;
        let committed = output::commit_part(
            out_dir,
            &source_identity(ckpt, &c.tensors)?,
            shards,
            part,
            &index,
            &c.files,
        )?;
        Ok((which, written, committed))
    })();
    if result.is_err() && made_dir {
        // `remove_dir` only removes an empty folder: another part's files stay.
        shardwise::failpoint::hit(shardwise::failpoint::Op::RemoveTree, out_dir);
        let _ = std::fs::remove_dir(out_dir.join(output::PARTS));
        let _ = std::fs::remove_dir(out_dir);
    }
    result
}

/// One warning per quantized tensor of `tensors` that `nonfinite` lists (written with
/// `allow_nonfinite`): what its quantized form holds instead.
fn nonfinite_warnings(
    tensors: &[HfTensor],
    nonfinite: &BTreeMap<String, finite::NonFinite>,
) -> Vec<String> {
    tensors
        .iter()
        .filter_map(|t| {
            let (scheme, found) = (t.quant?, nonfinite.get(&t.name)?);
            Some(format!(
                "{} holds {}, quantized anyway (--allow-nonfinite, {}): a NaN may have become a finite code, an infinity an infinite or zero scale, which turns its block or scale group into NaN when dequantized",
                t.name,
                found.describe(),
                scheme.quantize_name()
            ))
        })
        .collect()
}

/// What a quantized conversion declares: config.json's `quantization_config`, and the files
/// written beside it (ModelOpt's `hf_quant_config.json`).
struct Quantization {
    config: serde_json::Value,
    files: Vec<(String, Vec<u8>)>,
}

/// ModelOpt's quantization file beside config.json (TensorRT-LLM reads it).
const HF_QUANT_CONFIG: &str = "hf_quant_config.json";

/// Marks the tensors of a conversion that `scheme` quantizes ([`quant::quantizes`]; tensors copied
/// from `--base-hf` never are, nor MTP layers under [`quant::Scheme::keeps_mtp`]), gathers each
/// NVFP4 scale group ([`quant::scale_group`]) into consecutive tensors, and returns what describes
/// the folder: [`quant::fp8_block_config`] with [`quant::fp8_modules_to_not_convert`] of the kept
/// tensors (none for the DeepSeek families, as DeepSeek-V3's config.json has none),
/// [`quant::mxfp4_config`] with [`quant::GPT_OSS_NOT_CONVERTED`], or for NVFP4 and MXFP8
/// [`quant::compressed_tensors_config`] / ModelOpt's two configs with [`quant::ignored_modules`].
/// `out`: the output dtype (None: as stored).
///
/// Errors: [`Error::InvalidArgument`] for MXFP4 of a family without an MXFP4 release, NVFP4 or
/// MXFP8 of gpt_oss (its experts are 3-D fused parameters; its release is MXFP4), a tensor to
/// quantize that is not float32/bfloat16/float16, or one whose input dimension is not a multiple of
/// the scheme's scale group (naming the tensor).
fn quantize_plan(
    tensors: &mut Vec<HfTensor>,
    scheme: quant::Scheme,
    d: &spec::Dims,
    out: Option<DType>,
) -> Result<Quantization> {
    use quant::Scheme;
    let model_type = d.spec.model_types[0];
    if scheme == Scheme::Mxfp4 && !quant::MXFP4_MODEL_TYPES.contains(&model_type) {
        return Err(Error::InvalidArgument(format!(
            "--quantize mxfp4: {model_type} has no MXFP4 release whose layout shardwise could follow (it writes gpt_oss's MXFP4 experts); use --quantize fp8-block"
        )));
    }
    if matches!(scheme, Scheme::Nvfp4(_) | Scheme::Mxfp8) && model_type == "gpt_oss" {
        return Err(Error::InvalidArgument(
            "--quantize nvfp4/mxfp8: gpt_oss's experts are 3-D fused parameters that the compressed-tensors and ModelOpt linear layouts do not describe; use --quantize mxfp4 (its release's format)".into(),
        ));
    }
    let mtp: Vec<String> = (0..d.mtp_layers)
        .map(|k| d.layer_prefix(d.num_layers + k))
        .collect();
    for t in tensors.iter_mut().filter(|t| t.from_file.is_none()) {
        let in_mtp = mtp.iter().any(|p| t.name.starts_with(p.as_str()));
        if !quant::quantizes(scheme, &t.name, &t.shape) || (in_mtp && scheme.keeps_mtp()) {
            continue;
        }
        let dtype = t.out_dtype(out);
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::InvalidArgument(format!(
                "--quantize: {} is {}; float32, bfloat16 or float16 values are quantized",
                t.name,
                dtype.torch_name()
            )));
        }
        if let Some(g) = scheme.group() {
            // MXFP4's parameter is transposed: its input dimension is the second last.
            let n = t.shape.len();
            let input = if scheme == Scheme::Mxfp4 {
                t.shape[n - 2]
            } else {
                t.shape[n - 1]
            };
            if input % g != 0 {
                return Err(Error::InvalidArgument(format!(
                    "--quantize {}: {} {:?}: its input dimension {input} is not a multiple of the {g}-element scale group",
                    scheme.quantize_name(),
                    t.name,
                    t.shape,
                )));
            }
        }
        t.quant = Some(scheme);
    }
    if matches!(scheme, Scheme::Nvfp4(_)) {
        gather_scale_groups(tensors);
    }
    let kept = || {
        tensors
            .iter()
            .filter(|t| t.quant.is_none())
            .map(|t| t.name.as_str())
    };
    let config = match scheme {
        Scheme::Fp8Block(_) if model_type.starts_with("deepseek") => quant::fp8_block_config(&[]),
        Scheme::Fp8Block(_) => quant::fp8_block_config(&quant::fp8_modules_to_not_convert(kept())),
        Scheme::Mxfp4 => quant::mxfp4_config(quant::GPT_OSS_NOT_CONVERTED),
        Scheme::Nvfp4(quant::Nvfp4Layout::ModelOpt) => {
            let exclude = quant::ignored_modules(kept());
            let file = serde_json::to_vec_pretty(&quant::modelopt_hf_quant_config(&exclude))
                .expect("serializable");
            return Ok(Quantization {
                config: quant::modelopt_config(&exclude),
                files: vec![(HF_QUANT_CONFIG.to_string(), file)],
            });
        }
        Scheme::Nvfp4(_) | Scheme::Mxfp8 => {
            quant::compressed_tensors_config(scheme, &quant::ignored_modules(kept()))
                .expect("a compressed-tensors scheme")
        }
    };
    Ok(Quantization {
        config,
        files: Vec::new(),
    })
}

/// Moves the quantized members of each scale group ([`quant::scale_group`]) right after the
/// group's first member, in their order, and marks them [`HfTensor::with_previous`]: a group is
/// then one run of tensors, written by one job from one shared statistic and never split across
/// files (the shard plan keeps a run together), so every `--workers` and `--part` gives the same
/// bytes and each member is read once. The order is a pure function of the plan.
fn gather_scale_groups(tensors: &mut Vec<HfTensor>) {
    let keys: Vec<Option<String>> = tensors
        .iter()
        .map(|t| t.quant.and_then(|_| quant::scale_group(&t.name)))
        .collect();
    let mut members: std::collections::HashMap<&str, Vec<usize>> = Default::default();
    for (i, k) in keys.iter().enumerate() {
        if let Some(k) = k {
            members.entry(k.as_str()).or_default().push(i);
        }
    }
    let mut order = Vec::with_capacity(tensors.len());
    let mut placed = vec![false; tensors.len()];
    for i in 0..tensors.len() {
        if placed[i] {
            continue;
        }
        match keys[i].as_deref().and_then(|k| members.get(k)) {
            Some(group) => {
                for &j in group {
                    placed[j] = true;
                    order.push((j, j != i));
                }
            }
            None => {
                placed[i] = true;
                order.push((i, false));
            }
        }
    }
    let mut slots: Vec<Option<HfTensor>> = std::mem::take(tensors).into_iter().map(Some).collect();
    *tensors = order
        .into_iter()
        .map(|(j, with_previous)| {
            let mut t = slots[j].take().expect("each tensor placed once");
            t.with_previous = with_previous;
            t
        })
        .collect();
}

/// The identity of the checkpoint a part converts, for [`output::fingerprint`]: the storage
/// stamps (size and mtime, or ETag) of `.metadata`, `common.pt` and every data file it names, and
/// of the `--base-hf` files that `tensors` copies. Parts of one conversion on several machines
/// read the same files, so they agree; two iterations of one model, whose `.metadata` can be
/// byte-identical, do not.
pub(crate) fn source_identity(ckpt: &Checkpoint, tensors: &[HfTensor]) -> Result<Vec<u8>> {
    let mut files = std::collections::BTreeSet::new();
    for entry in ckpt.metadata.entries.values() {
        match entry {
            shardwise::format::metadata::Entry::Tensor { chunks, .. } => {
                files.extend(chunks.iter().map(|c| c.storage.relative_path.as_str()))
            }
            shardwise::format::metadata::Entry::Bytes { storage } => {
                files.insert(storage.relative_path.as_str());
            }
        }
    }
    let mut id = Vec::new();
    for rel in [METADATA_FILE, shardwise::format::COMMON_FILE]
        .into_iter()
        .chain(files)
    {
        let stamp = ckpt.location().stamp(rel)?.unwrap_or_default();
        id.extend_from_slice(format!("{rel}\0{stamp}\0").as_bytes());
    }
    let copied: std::collections::BTreeSet<&PathBuf> = tensors
        .iter()
        .filter_map(|t| Some(&t.from_file.as_ref()?.0))
        .collect();
    for path in copied {
        let m = std::fs::metadata(path).map_err(Error::io("stat", path))?;
        let mtime = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |t| t.as_nanos());
        id.extend_from_slice(format!("{}\0{}:{mtime}\0", path.display(), m.len()).as_bytes());
    }
    Ok(id)
}

/// What a conversion decides before it reads a tensor.
struct Setup {
    d: spec::Dims,
    check: config::ArgsCheck,
    /// The embedding's rows.
    rows: Option<u64>,
    /// The config.json to write: `--hf-config`'s.
    config: Option<Vec<u8>>,
    /// No `--hf-config`: the dims come from the stored args, and so does the config.json written.
    from_args: bool,
    /// The vision tower's tensors (copies from `--base-hf`).
    vision: Vec<HfTensor>,
}

/// The MTP layers `ckpt` holds: `mtp.layers.{k}.*` for k in 0..n.
///
/// Errors: [`Error::Validation`] when some k below the largest is missing.
fn mtp_in_checkpoint(ckpt: &Checkpoint) -> Result<u64> {
    let ks: std::collections::BTreeSet<u64> = ckpt
        .metadata
        .entries
        .keys()
        .filter_map(|k| {
            k.strip_prefix("mtp.layers.")?
                .split('.')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    let n = ks.last().map_or(0, |k| k + 1);
    if ks.len() as u64 != n {
        return Err(Error::Validation(format!(
            "the checkpoint holds MTP layers {ks:?} (mtp.layers.*), not 0..{n}"
        )));
    }
    Ok(n)
}

/// The hyperparameters of `ckpt` (config.json, else the stored args), checked against the args;
/// the names (a multimodal config's, see [`spec::Multimodal`]) and the MTP layers to convert.
/// `compare`: for `diff` against an existing folder, where a multimodal config names the text
/// model as the folder holds it and no vision tower is read (nothing is written).
fn setup(ckpt: &Checkpoint, opts: &HfOptions, compare: bool) -> Result<Setup> {
    let args = config::megatron_args(ckpt)?;
    let given = match &opts.config {
        Some(p) => Some(shardwise::storage::read_regular(p).map_err(Error::io("read", p))?),
        None => None,
    };
    let json: Option<serde_json::Value> = match (&given, &opts.config) {
        (Some(b), Some(p)) => Some(
            serde_json::from_slice(b)
                .map_err(|e| Error::InvalidArgument(format!("{}: not JSON: {e}", p.display())))?,
        ),
        _ => None,
    };
    let layout = layout::Layout::detect(
        ckpt.metadata.entries.keys().map(String::as_str),
        args.as_ref().and_then(|a| a.hybrid_pattern()),
    )?;
    let mut d = match (&json, &args) {
        (Some(c), _) => spec::Dims::from_config(c, opts.arch.as_deref())?,
        (None, Some(a)) => spec::Dims::from_args(a, opts.arch.as_deref())?,
        (None, None) => {
            return Err(Error::InvalidArgument(
                "no --hf-config and no Megatron args in common.pt: pass --hf-config".into(),
            ))
        }
    };
    d.layout = layout;
    let source = match &json {
        Some(_) => output::CONFIG,
        None => "the config built from the args",
    };
    config::check_values(&d, source)?;
    let pieces = ckpt.metadata.entries.iter().map(|(k, e)| match e {
        shardwise::format::metadata::Entry::Tensor {
            global_shape,
            chunks,
            ..
        } => layout::held_pieces(k, global_shape, chunks.len()),
        shardwise::format::metadata::Entry::Bytes { .. } => 1,
    });
    d.check_held(pieces.fold(0, u64::saturating_add), "the checkpoint")?;
    // A multimodal config declares a model whose vision tower the text checkpoint lacks: it comes
    // from --base-hf, or the config written is the text model's (--text-only); never a config
    // that loads with weights missing.
    match (d.multimodal, d.spec.multimodal) {
        (true, Some(mm)) if !opts.text_only => {
            if opts.base_hf.is_none() && !compare {
                let declared = json
                    .as_ref()
                    .and_then(|j| j.get("architectures")?.get(0)?.as_str().map(String::from))
                    .unwrap_or_else(|| format!("model_type {}", d.spec.model_types[0]));
                return Err(Error::InvalidArgument(format!(
                    "config.json declares {declared}, a multimodal model whose vision tower ({}*) a Megatron text checkpoint does not hold: pass --base-hf DIR (the original release, whose vision tower is copied) or --text-only (a text-only config, {})",
                    mm.vision_prefix, mm.text_architecture
                )));
            }
            d.text_prefix = mm.text_prefix;
        }
        (false, _) if opts.text_only || opts.base_hf.is_some() => {
            return Err(Error::InvalidArgument(
                "--text-only and --base-hf apply to a multimodal config.json (one with a text_config)".into(),
            ))
        }
        _ => {}
    }
    let in_ckpt = mtp_in_checkpoint(ckpt)?;
    if let (None, Some(m)) = (&json, d.spec.mtp) {
        // A config built from the args declares what the checkpoint holds.
        d.cfg.insert(m.field.into(), in_ckpt.into());
    }
    let (mtp, mtp_warnings) = config::mtp_layers(&d, in_ckpt, args.as_ref(), opts.drop_mtp)?;
    d.mtp_layers = mtp;
    let rows = ["embedding.word_embeddings.weight", "output_layer.weight"]
        .iter()
        .find_map(|k| match ckpt.metadata.entries.get(*k) {
            Some(shardwise::format::metadata::Entry::Tensor { global_shape, .. }) => {
                global_shape.first().copied()
            }
            _ => None,
        });
    let mut check = config::check_args(&d, args.as_ref(), rows, &opts.allow_config_mismatch)?;
    check.warnings.extend(mtp_warnings);
    let config = match &given {
        Some(b) => Some(config::output_config(b, &d, opts.text_only)?),
        None => None,
    };
    let vision = match (&opts.base_hf, d.spec.multimodal, &json) {
        (Some(base), Some(mm), Some(j)) if d.multimodal && !opts.text_only && !compare => {
            vision::vision_tensors(base, j, mm, d.hidden)?
        }
        _ => Vec::new(),
    };
    Ok(Setup {
        from_args: json.is_none(),
        d,
        check,
        rows,
        config,
        vision,
    })
}

/// Maps every tensor of `ckpt` to HF tensors, for `diff` against a converted folder (see
/// [`to_hf`] for the checks and errors; a multimodal config's vision tower is not the
/// checkpoint's, so it is not among them).
pub(crate) fn plan(ckpt: &Checkpoint, opts: &HfOptions) -> Result<Plan> {
    let d = setup(ckpt, opts, true)?.d;
    plan::plan(ckpt, &d, opts.allow_unmapped)
}

/// Parses a size like `5GB`, `500MB`, `4GiB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("bad size {s:?}")))?;
    let mult: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(Error::InvalidArgument(format!(
                "bad size unit {other:?} in {s:?}"
            )))
        }
    };
    let v = num * mult;
    if !(v >= 1.0 && v.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "size {s:?} must be at least 1 byte"
        )));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The user's names and sizes become typed options; every bad value is refused with its
    /// message.
    #[test]
    fn options_from_user_parse_every_name_once() {
        let d = HfOptions::from_user(ToHfRequest::default()).unwrap();
        assert_eq!(
            (d.dtype, d.max_shard_bytes, d.part),
            (None, 5_000_000_000, None)
        );
        assert_eq!((d.quantize, d.quantize_format), (None, None));
        for (name, dtype) in [
            ("bf16", DType::BF16),
            ("bfloat16", DType::BF16),
            ("fp16", DType::F16),
            ("float16", DType::F16),
            ("fp32", DType::F32),
            ("float32", DType::F32),
        ] {
            assert_eq!(
                name.parse::<WrittenDtype>().map(DType::from).unwrap(),
                dtype
            );
        }
        let o = HfOptions::from_user(ToHfRequest {
            dtype: Some("fp16".into()),
            part: Some("1/3".into()),
            quantize: Some("mxfp8".into()),
            quantize_format: Some("compressed-tensors".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(o.dtype, Some(DType::F16));
        assert_eq!(o.part.map(|p| (p.index, p.count)), Some((1, 3)));
        assert_eq!(o.quantize, Some(Quantize::Mxfp8));
        assert_eq!(o.quantize_format, Some(QuantizeFormat::CompressedTensors));
        let refused = |r: ToHfRequest| HfOptions::from_user(r).unwrap_err().to_string();
        let e = refused(ToHfRequest {
            dtype: Some("fp64".into()),
            ..Default::default()
        });
        assert!(e.ends_with("dtype \"fp64\": use bf16, fp16 or fp32"), "{e}");
        let e = refused(ToHfRequest {
            quantize: Some("int4".into()),
            ..Default::default()
        });
        assert!(
            e.ends_with("--quantize \"int4\": use fp8-block, mxfp4, nvfp4 or mxfp8"),
            "{e}"
        );
        let e = refused(ToHfRequest {
            quantize: Some("w4a4".into()),
            ..Default::default()
        });
        assert!(
            e.contains("--quantize \"w4a4\" needs calibration data"),
            "{e}"
        );
        let e = refused(ToHfRequest {
            quantize_format: Some("gguf".into()),
            ..Default::default()
        });
        assert!(
            e.ends_with("--quantize-format \"gguf\": use compressed-tensors or modelopt"),
            "{e}"
        );
        let e = refused(ToHfRequest {
            workers: Some(0),
            ..Default::default()
        });
        assert!(e.contains("--workers 0"), "{e}");
    }

    /// A layout goes with a scheme written in it, and never without a scheme.
    #[test]
    fn quantize_format_goes_with_its_scheme() {
        let scheme = |q: Option<Quantize>, f: Option<QuantizeFormat>| {
            let mut o = HfOptions::from_user(ToHfRequest::default()).unwrap();
            (o.quantize, o.quantize_format) = (q, f);
            quant_scheme(&o).map_err(|e| e.to_string())
        };
        let modelopt = Some(QuantizeFormat::ModelOpt);
        assert_eq!(scheme(None, None), Ok(None));
        assert_eq!(
            scheme(Some(Quantize::Nvfp4), modelopt),
            Ok(Some(quant::Scheme::Nvfp4(quant::Nvfp4Layout::ModelOpt)))
        );
        assert_eq!(
            scheme(
                Some(Quantize::Mxfp8),
                Some(QuantizeFormat::CompressedTensors)
            ),
            Ok(Some(quant::Scheme::Mxfp8))
        );
        let e = scheme(Some(Quantize::Mxfp8), modelopt).unwrap_err();
        assert!(
            e.contains("--quantize-format \"modelopt\" with --quantize mxfp8: nvfp4"),
            "{e}"
        );
        let e = scheme(None, modelopt).unwrap_err();
        assert!(e.ends_with("--quantize-format \"modelopt\" without --quantize: it names the layout of a quantized output"), "{e}");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert!(parse_size("5 parsecs").is_err() && parse_size("0").is_err());
    }
}
