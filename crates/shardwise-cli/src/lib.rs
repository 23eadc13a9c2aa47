//! The `shardwise` command line: inspect, verify, status and merge checkpoints; the status model
//! it prints is [`shardwise::status`]'s.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};
use indicatif::HumanBytes;
use serde::Serialize;

use shardwise::commit::part::{Marker, STATE_DIR};
use shardwise::commit::state::{checkpoint_state, CheckpointState};
use shardwise::commit::wait::{timeout_from_secs, Freshness};
use shardwise::error::{fmt_ranks, Error, Result};
use shardwise::format::metadata::Entry;
use shardwise::format::METADATA_FILE;
use shardwise::reader::Checkpoint;
use shardwise::status::{format_name, read_parts, save_ids, status_report, StatusReport};
use shardwise::storage::Location;
use shardwise_hf::{FromHfOptions, FromHfRequest, HfOptions, ToHfRequest};

const EXIT_CODES: &str = "Exit codes:\n  0  success (verify: no problem found; status: committed, the data not read)\n  1  the operation failed, verify found problems, or status found the checkpoint damaged or not committed\n  2  bad command line\n  130  interrupted (Ctrl-C) during a wait; nothing committed\n  141  stdout was closed early (e.g. `| head`); nothing more is printed";
/// Help of every `--json` flag (docs/cli.md lists each command's fields).
const JSON_HELP: &str =
    "Print one JSON object on stdout instead of text: sizes in plain bytes, durations in seconds";

#[derive(Parser, Debug)]
#[command(name = "shardwise", version, about = "Collective-free Megatron torch_dist / PyTorch DCP checkpoints", after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Table of the tensors and byte objects of a committed checkpoint (key, dtype, global shape, chunks, bytes).
    #[command(after_help = EXIT_CODES)]
    Inspect {
        /// Checkpoint directory or URL (s3://, gs://, az://); torch DCP or Megatron torch_dist, written by anyone.
        dir: PathBuf,
        #[arg(long, help = JSON_HELP)]
        json: bool,
    },
    /// Check that a checkpoint is whole: layout, item bounds, decoding, zip CRCs and shardwise's per-item CRCs.
    #[command(after_help = EXIT_CODES)]
    Verify {
        /// Checkpoint directory or URL.
        dir: PathBuf,
        #[arg(long, help = JSON_HELP)]
        json: bool,
        /// Read no item data: check the layout, that every item lies inside its file (real file
        /// sizes), the checksum sidecar's placements, metadata.json and that the common state exists.
        #[arg(long)]
        quick: bool,
        /// Also check that this torch release (2.3 to 2.15) reads the checkpoint's .metadata, and
        /// say why not (a problem on .metadata; `rewrite-metadata` fixes what it can).
        #[arg(long, value_name = "2.X")]
        torch_compat: Option<String>,
        /// Bound in seconds on each object-store request, its retries included (default: 30 s
        /// per attempt, retried for SHARDWISE_RETRY_TIMEOUT_S, 60 s).
        #[arg(long, value_name = "S", allow_negative_numbers = true)]
        timeout: Option<f64>,
    },
    /// Saves in a directory: save id, rank parts and their age, missing ranks, commit state, layout.
    #[command(after_help = EXIT_CODES)]
    Status {
        /// Checkpoint directory or URL.
        dir: PathBuf,
        /// Also list every key with its dtype, global shape, chunk count and the ranks that saved it
        /// (reads every rank's part; without it a committed save costs a read of its record only).
        #[arg(long)]
        keys: bool,
        #[arg(long, help = JSON_HELP)]
        json: bool,
        /// First rebuild a damaged checkpoint (.metadata removed, replaced or truncated) from the
        /// parts of the save that committed it, as `merge --repair` does.
        #[arg(long)]
        repair: bool,
    },
    /// Convert a checkpoint to Hugging Face safetensors, streaming: only the byte ranges each HF tensor
    /// needs are read, and memory stays at about threads x the largest HF tensor.
    #[command(name = "to-hf", after_help = EXIT_CODES)]
    ToHf(ToHfFlags),
    /// Convert a Hugging Face folder (config.json and safetensors, also block-FP8 or MXFP4) into a
    /// Megatron torch_dist checkpoint, by the to-hf mapping read in reverse: no GPU, no process
    /// group, no model code. MTP layers are converted (mtp.layers.*), a multimodal folder's text
    /// model too (its vision tower is left out; to-hf --base-hf puts it back). Memory stays at
    /// about a group of tensors (1 GiB, or the largest tensor) plus one HF tensor per worker.
    #[command(name = "from-hf", after_help = EXIT_CODES)]
    FromHf(FromHfFlags),
    /// Compare two checkpoints key by key, across layouts (TP/PP/EP) and storage, or a checkpoint with
    /// an HF safetensors folder through the to-hf mapping.
    #[command(after_help = DIFF_EXIT_CODES)]
    Diff(DiffArgs),
    /// Rewrite .metadata into the form an older torch release reads (TensorProperties as 5-tuples,
    /// no StorageMeta before 2.4), atomically; data files untouched, shardwise's commit record and
    /// integrity.json updated to the new .metadata.
    #[command(name = "rewrite-metadata", after_help = EXIT_CODES)]
    RewriteMetadata {
        /// Checkpoint directory or URL.
        dir: PathBuf,
        /// The torch release that must read the checkpoint, e.g. 2.3 or 2.14.
        #[arg(long, value_name = "2.X")]
        torch_compat: String,
        #[arg(long, help = JSON_HELP)]
        json: bool,
    },
    /// Merge the per-rank parts of a save and commit `.metadata` (finishes a save whose merging rank died).
    /// Idempotent; when two mergers race, one commits and both succeed. On a torch DCP checkpoint
    /// saved with use_collectives=False (rank-local __{rank}.metadata files, no .metadata): validates
    /// the rank-local files together and creates the global .metadata, so that DCP loads it at any
    /// world size.
    #[command(after_help = EXIT_CODES)]
    Merge {
        /// Checkpoint directory or URL.
        dir: PathBuf,
        /// Save id to merge (default: the only uncommitted save under `.shardwise/`).
        #[arg(long)]
        save_id: Option<String>,
        /// Number of ranks (default: the world_size recorded in the parts).
        #[arg(long, allow_negative_numbers = true)]
        world_size: Option<u32>,
        /// Seconds to wait for missing parts; also the bound of each object-store request, its
        /// retries included (0: the default bound, 30 s per attempt retried for 60 s).
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        timeout: f64,
        #[arg(long, help = JSON_HELP)]
        json: bool,
        /// Rebuild a damaged checkpoint (its .metadata removed, replaced or truncated, or
        /// common.pt changed) from the parts of the save that committed it; its data files must
        /// be unchanged.
        #[arg(long)]
        repair: bool,
    },
}

/// `to-hf`'s command line; [`ToHfFlags::options`] hands it to the library.
#[derive(clap::Args, Debug)]
struct ToHfFlags {
    /// Checkpoint directory or URL (torch_dist / DCP).
    dir: PathBuf,
    /// Output directory for model-0000k-of-0000n.safetensors and model.safetensors.index.json.
    out: PathBuf,
    /// HF config.json: hyperparameters (checked against the checkpoint's stored args) and
    /// copied to the output. Without it the args give the hyperparameters, --arch is
    /// required, and the config.json written is built from the args.
    #[arg(long)]
    hf_config: Option<PathBuf>,
    /// Architecture (llama, qwen2, qwen3, qwen3_moe, mixtral, ...); default: the config's model_type.
    #[arg(long)]
    arch: Option<String>,
    /// Output dtype: bf16, fp16 or fp32 (default: as stored).
    #[arg(long)]
    dtype: Option<String>,
    /// Largest output file, e.g. 5GB (files are also split so that no safetensors header
    /// passes 90 MB; safetensors opens at most 100 MB).
    #[arg(long, default_value_t = ToHfRequest::default().max_shard_size)]
    max_shard_size: String,
    /// Worker threads reading, converting and writing tensors in parallel (default: the
    /// number of CPUs); memory is about workers x the largest HF tensor.
    #[arg(
        long,
        allow_negative_numbers = true,
        visible_alias = "threads",
        value_name = "N"
    )]
    workers: Option<usize>,
    /// Write only part i of n (0-based) of the conversion, for a conversion split over
    /// processes or machines sharing the output folder: every part computes the same shard
    /// plan and writes shards k with k % n == i; the part that finds every part done writes
    /// config.json and commits the index (create-if-absent). Run all n parts with the same
    /// arguments.
    #[arg(long, allow_hyphen_values = true, value_name = "I/N")]
    part: Option<String>,
    /// Replace an earlier conversion in a non-empty output folder: its index, weight files
    /// and config.json go, other files stay. The new shards are staged first; the old index
    /// is removed only after they are all written, the new index written last.
    #[arg(long)]
    overwrite: bool,
    /// The original HF release of a multimodal model (a config.json with a text_config, e.g.
    /// Qwen3.5's): its vision tower (model.visual.*) is copied byte for byte, after its
    /// names and shapes are checked against the config's vision_config; the text model is
    /// written under model.language_model.*, as save_pretrained writes it.
    #[arg(long, value_name = "DIR")]
    base_hf: Option<PathBuf>,
    /// For a multimodal config: write the text model alone (model.*) with the text model's
    /// own config.json (e.g. Qwen3_5MoeForCausalLM).
    #[arg(long)]
    text_only: bool,
    /// Convert without the checkpoint's MTP layers (mtp.layers.*); the config.json written
    /// then declares none.
    #[arg(long)]
    drop_mtp: bool,
    /// The tokenizer folder whose files (tokenizer.json, tokenizer_config.json, ...,
    /// generation_config.json) are copied beside the weights; default the checkpoint's
    /// tokenizer/ (Megatron-LM after 0.19 saves one there), when it has one.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Write the weights quantized as the official releases store them: fp8-block (e4m3
    /// weights with float32 weight_scale_inv per 128x128 block; embeddings, lm_head, norms,
    /// routers, gates, biases and small projections stay in the output dtype), mxfp4
    /// (gpt_oss's experts as *_blocks / *_scales), nvfp4 (weight-only NVFP4, as
    /// llm-compressor's NVFP4A16) or mxfp8 (compressed-tensors' mxfp8-quantized). config.json
    /// gets the matching quantization_config. NVFP4 W4A4 (nvfp4-w4a4) is refused: its
    /// activation scales need calibration data.
    #[arg(long, value_name = "FORMAT")]
    quantize: Option<String>,
    /// The layout of --quantize nvfp4: compressed-tensors (default; vLLM, SGLang,
    /// transformers) or modelopt (W4A16_NVFP4 with hf_quant_config.json, for TensorRT-LLM).
    #[arg(long, value_name = "LAYOUT")]
    quantize_format: Option<String>,
    /// With --quantize: quantize a weight that holds NaN or infinities anyway, with a warning
    /// each, instead of refusing the conversion (a NaN can become a finite code, an infinity
    /// an infinite or zero scale that turns its block or scale group into NaN).
    #[arg(long)]
    allow_nonfinite: bool,
    /// Skip checkpoint keys that no rule maps instead of failing.
    #[arg(long)]
    allow_unmapped: bool,
    /// Convert although config.json's FIELD (or the args field it is compared with)
    /// disagrees with the checkpoint's stored args (repeatable): the disagreement becomes a
    /// warning, and config.json is written as given, so the export keeps the config's value.
    /// A FIELD the architecture does not compare is refused.
    #[arg(long, value_name = "FIELD")]
    allow_config_mismatch: Vec<String>,
    #[arg(long, help = JSON_HELP)]
    json: bool,
    /// Bound in seconds on each object-store request, its retries included (default: 30 s
    /// per attempt, retried for SHARDWISE_RETRY_TIMEOUT_S, 60 s).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    timeout: Option<f64>,
}

/// `from-hf`'s command line; [`FromHfFlags::options`] hands it to the library.
#[derive(clap::Args, Debug)]
struct FromHfFlags {
    /// HF folder: config.json and model.safetensors or model.safetensors.index.json with its files.
    hf_dir: PathBuf,
    /// Output checkpoint directory (absent or empty; a local directory).
    ckpt_dir: PathBuf,
    /// Architecture (llama, qwen2, qwen3, qwen3_moe, mixtral, ...); default: config.json's model_type.
    #[arg(long)]
    arch: Option<String>,
    /// Dtype of the written tensors: bf16, fp16 or fp32 (quantized weights are dequantized into it).
    #[arg(long, default_value_t = FromHfRequest::default().dtype)]
    dtype: String,
    /// Megatron-LM's --transformer-impl of the model that will load the checkpoint (stored in
    /// the args): transformer_engine fuses each norm into the linear after it
    /// (self_attention.linear_qkv.layer_norm_weight, ...); local keeps them separate modules,
    /// but megatron-core's local GPT spec saves a linear_qkv attention's two norms under the
    /// fused names on every layer, so a dense model's keys are the same; they differ for MoE
    /// layers' pre-MLP norm and MLA's q/kv norms.
    #[arg(long, default_value_t = FromHfRequest::default().transformer_impl, value_parser = ["transformer_engine", "local"])]
    transformer_impl: String,
    /// Megatron-LM's --moe-grouped-gemm (recorded in the stored args; the keys are the same).
    #[arg(long)]
    moe_grouped_gemm: bool,
    /// Megatron-LM's --make-vocab-size-divisible-by: with --tensor-model-parallel-size, the
    /// vocabulary is padded to a multiple of their product (the padding rows repeat the last row).
    #[arg(long, default_value_t = FromHfRequest::default().make_vocab_size_divisible_by)]
    make_vocab_size_divisible_by: u64,
    #[arg(long, default_value_t = FromHfRequest::default().tensor_model_parallel_size)]
    tensor_model_parallel_size: u64,
    /// The iteration stored in the common state.
    #[arg(long, allow_negative_numbers = true, default_value_t = FromHfRequest::default().iteration)]
    iteration: u64,
    /// Also write latest_checkpointed_iteration.txt in CKPT_DIR's parent (CKPT_DIR must be
    /// named release for iteration 0, iter_0000123 for --iteration 123), after the commit.
    #[arg(long)]
    tracker: bool,
    /// Worker threads converting tensors in parallel (default: the number of CPUs).
    #[arg(
        long,
        allow_negative_numbers = true,
        visible_alias = "threads",
        value_name = "N"
    )]
    workers: Option<usize>,
    /// The largest data file, e.g. 1GB (a larger tensor gets a file of its own), or auto:
    /// the largest tensor's size. Each worker holds one file's tensors in memory until it is
    /// written, so peak memory is about (workers + 2) x max(this, the largest tensor).
    #[arg(long, default_value_t = FromHfRequest::default().max_file_size)]
    max_file_size: String,
    /// Write only part i of n (0-based), for a conversion split over processes or machines
    /// sharing CKPT_DIR: every part computes the same data files and writes those k with
    /// k % n == i; the part that finds every part published commits. Run all n parts with
    /// the same arguments; the files are byte-identical to a one-process conversion.
    #[arg(long, allow_hyphen_values = true, value_name = "I/N")]
    part: Option<String>,
    /// Replace a checkpoint in CKPT_DIR (it stays loadable until the new commit).
    #[arg(long)]
    overwrite: bool,
    /// Skip HF tensors that no rule reads instead of failing.
    #[arg(long)]
    allow_unmapped: bool,
    /// Convert without the folder's MTP layers (the checkpoint's args then say
    /// mtp_num_layers None). Without it, a folder holding MTP layers converts them all or
    /// fails.
    #[arg(long)]
    drop_mtp: bool,
    #[arg(long, help = JSON_HELP)]
    json: bool,
}

impl ToHfFlags {
    /// The conversion's options, parsed and checked by the library.
    fn options(&self) -> Result<HfOptions> {
        HfOptions::from_user(ToHfRequest {
            hf_config: self.hf_config.clone(),
            arch: self.arch.clone(),
            dtype: self.dtype.clone(),
            max_shard_size: self.max_shard_size.clone(),
            workers: self.workers,
            allow_unmapped: self.allow_unmapped,
            overwrite: self.overwrite,
            part: self.part.clone(),
            base_hf: self.base_hf.clone(),
            text_only: self.text_only,
            drop_mtp: self.drop_mtp,
            tokenizer: self.tokenizer.clone(),
            quantize: self.quantize.clone(),
            quantize_format: self.quantize_format.clone(),
            allow_config_mismatch: self.allow_config_mismatch.clone(),
            allow_nonfinite: self.allow_nonfinite,
        })
    }
}

impl FromHfFlags {
    /// The conversion's options, parsed and checked by the library.
    fn options(&self) -> Result<FromHfOptions> {
        FromHfOptions::from_user(FromHfRequest {
            arch: self.arch.clone(),
            dtype: self.dtype.clone(),
            transformer_impl: self.transformer_impl.clone(),
            moe_grouped_gemm: self.moe_grouped_gemm,
            make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
            tensor_model_parallel_size: self.tensor_model_parallel_size,
            iteration: self.iteration,
            tracker: self.tracker,
            workers: self.workers,
            max_file_size: self.max_file_size.clone(),
            part: self.part.clone(),
            overwrite: self.overwrite,
            allow_unmapped: self.allow_unmapped,
            drop_mtp: self.drop_mtp,
        })
    }
}

/// How a command stops short of success.
enum Stop {
    /// stdout was closed (`shardwise inspect --json DIR | head`): end quietly, as a Unix tool does.
    Pipe,
    Fail(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Stop {
        Stop::Fail(e)
    }
}

impl From<std::io::Error> for Stop {
    /// A failed write to stdout.
    fn from(e: std::io::Error) -> Stop {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Stop::Pipe
        } else {
            Stop::Fail(Error::Io {
                op: "write",
                path: PathBuf::from("<stdout>"),
                source: e,
            })
        }
    }
}

/// A command's exit code.
type Outcome = std::result::Result<i32, Stop>;

/// `println!` that returns a closed stdout as [`Stop::Pipe`] instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*)?
    };
}

/// `key` (or an error message naming keys) as the text output prints it: control characters
/// escaped (`\n`, `\u{1b}`), so a hostile checkpoint's or HF folder's names cannot move the
/// cursor, clear the screen or forge lines in a terminal or a log, and an error stays one line.
/// Text without control characters prints as it is (`--json` output is JSON-escaped).
fn shown(key: &str) -> Cow<'_, str> {
    if !key.chars().any(char::is_control) {
        return Cow::Borrowed(key);
    }
    key.chars()
        .map(|c| match c.is_control() {
            true => c.escape_default().to_string(),
            false => c.to_string(),
        })
        .collect::<String>()
        .into()
}

/// Exit code of a failed command, and of a checkpoint found not whole: `verify`'s problems,
/// `status`'s damaged or not committed.
const EXIT_FAILED: i32 = 1;

/// Exit code after Ctrl-C (SIGINT) stopped a wait: 128 + 2, as shells report it.
pub const EXIT_INTERRUPTED: i32 = 130;

/// Exit code of a command whose stdout was closed: what a C tool killed by SIGPIPE reports.
pub const EXIT_PIPE: i32 = 141;

/// The location a command-line argument names: a URL (UTF-8) or a local path (any bytes).
fn location(dir: &Path) -> Result<Location> {
    Location::from_os(dir.as_os_str())
}

/// [`location`] with its object-store requests bounded by `--timeout` seconds
/// ([`Location::with_timeout`]).
fn bounded(dir: &Path, timeout: Option<f64>) -> Result<Location> {
    let timeout = timeout
        .map(|t| timeout_from_secs("--timeout", t))
        .transpose()?;
    location(dir)?.with_timeout(timeout)
}

/// Runs the CLI on `args` (including the program name); returns the process exit code. Arguments
/// need not be UTF-8 (local paths are bytes on Unix).
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match parse(args) {
        Ok(cli) => exit_code(dispatch(cli.command)),
        Err(code) => code,
    }
}

/// The command line `args` holds, or the exit code once `--help` / `--version` is printed (0) or
/// a bad command line is reported (2).
fn parse<I, T>(args: I) -> std::result::Result<Cli, i32>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    Cli::try_parse_from(args).map_err(|e| {
        if !e.use_stderr() {
            let _ = e.print(); // --help, --version
            return 0;
        }
        if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
            // Bare `shardwise`: the help (clap renders it as this "error"), on stderr, exit 2.
            let _ = e.print();
            return 2;
        }
        let _ = writeln!(
            std::io::stderr(),
            "shardwise: error: {} (see --help)",
            shown(&one_line(&e.render().to_string()))
        );
        2
    })
}

/// A clap error as one line, as every other error: its first line with the lines indented under
/// it (what it names: the missing `<DIR>`, the subcommands), its usage and tip lines dropped.
fn one_line(rendered: &str) -> String {
    let mut lines = rendered.lines();
    let first = lines.next().unwrap_or_default();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let named: Vec<&str> = lines
        .take_while(|l| l.starts_with(' '))
        .map(str::trim)
        .collect();
    match named.as_slice() {
        [] => first.to_string(),
        named => format!("{first} {}", named.join(", ")),
    }
}

/// Runs `command`: its arguments turned into the library's values, then its function.
fn dispatch(command: Command) -> Outcome {
    match command {
        Command::Inspect { dir, json } => inspect(&location(&dir)?, json),
        Command::Verify {
            dir,
            json,
            quick,
            torch_compat,
            timeout,
        } => {
            let torch = torch_compat
                .as_deref()
                .map(shardwise::torch_compat::Torch::parse)
                .transpose()?;
            verify(&bounded(&dir, timeout)?, json, quick, torch)
        }
        Command::RewriteMetadata {
            dir,
            torch_compat,
            json,
        } => rewrite_metadata(
            &location(&dir)?,
            shardwise::torch_compat::Torch::parse(&torch_compat)?,
            json,
        ),
        Command::Status {
            dir,
            keys,
            json,
            repair,
        } => status(&location(&dir)?, keys, json, repair),
        Command::Merge {
            dir,
            save_id,
            world_size,
            timeout,
            json,
            repair,
        } => merge(
            &bounded(&dir, Some(timeout))?,
            save_id,
            world_size,
            timeout,
            json,
            repair,
        ),
        Command::Diff(args) => diff(args),
        Command::FromHf(f) => from_hf(&f.hf_dir, &f.ckpt_dir, &f.options()?, f.json),
        Command::ToHf(f) => {
            let opts = f.options()?;
            to_hf(&bounded(&f.dir, f.timeout)?, &f.out, &opts, f.json)
        }
    }
}

/// The exit code of a command's outcome, its error told on stderr as one line.
fn exit_code(outcome: Outcome) -> i32 {
    match outcome {
        Ok(code) => code,
        Err(Stop::Pipe) => EXIT_PIPE,
        Err(Stop::Fail(e @ Error::Interrupted(_))) => {
            let _ = writeln!(std::io::stderr(), "shardwise: {e}");
            EXIT_INTERRUPTED
        }
        Err(Stop::Fail(e)) => {
            // stderr may be closed too; nothing is left to tell then.
            let _ = writeln!(
                std::io::stderr(),
                "shardwise: error: {}",
                shown(&e.to_string())
            );
            EXIT_FAILED
        }
    }
}

fn print_json<T: Serialize>(value: &T) -> std::result::Result<(), Stop> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value).map_err(std::io::Error::from)?;
    writeln!(out)?;
    Ok(())
}

/// `n` and `noun`, plural unless `n` is 1: `1 chunk`, `2 chunks`.
fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// A size for people: `2.55 KiB`, `1.00 GiB` (JSON outputs keep plain bytes).
fn size(bytes: u64) -> String {
    HumanBytes(bytes).to_string()
}

/// A progress bar on stderr with `template`, drawn only when stderr is a terminal (indicatif's
/// stderr target hides itself otherwise) and never with `--json`.
fn progress(bar: indicatif::ProgressBar, template: &str, json: bool) -> indicatif::ProgressBar {
    bar.set_style(indicatif::ProgressStyle::with_template(template).expect("template"));
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar
}

/// A [`progress`] spinner that turns on its own while a long step runs (merge, to-hf, from-hf).
fn spinner(template: &str, json: bool) -> indicatif::ProgressBar {
    let bar = progress(indicatif::ProgressBar::new_spinner(), template, json);
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

#[derive(Serialize)]
struct KeyRow {
    key: String,
    kind: &'static str,
    dtype: Option<&'static str>,
    global_shape: Option<Vec<u64>>,
    chunks: usize,
    bytes: u64,
}

fn inspect(dir: &Location, json: bool) -> Outcome {
    let ckpt = Checkpoint::open(dir)?;
    let rows: Vec<KeyRow> = ckpt
        .metadata
        .entries
        .iter()
        .map(|(k, e)| match e {
            Entry::Tensor {
                dtype,
                global_shape,
                chunks,
            } => KeyRow {
                key: k.clone(),
                kind: "tensor",
                dtype: Some(dtype.torch_name()),
                global_shape: Some(global_shape.clone()),
                chunks: chunks.len(),
                bytes: chunks.iter().map(|c| c.storage.length).sum(),
            },
            Entry::Bytes { storage } => KeyRow {
                key: k.clone(),
                kind: "object",
                dtype: None,
                global_shape: None,
                chunks: 1,
                bytes: storage.length,
            },
        })
        .collect();
    let tensors = rows.iter().filter(|r| r.kind == "tensor").count();
    let total: u64 = rows.iter().map(|r| r.bytes).sum();
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            dir: String,
            metadata_class: &'a str,
            tensors: usize,
            objects: usize,
            bytes: u64,
            keys: &'a [KeyRow],
        }
        print_json(&Out {
            dir: dir.to_string(),
            metadata_class: &ckpt.metadata.class,
            tensors,
            objects: rows.len() - tensors,
            bytes: total,
            keys: &rows,
        })?;
        return Ok(0);
    }
    let width = rows
        .iter()
        .map(|r| shown(&r.key).len())
        .max()
        .unwrap_or(3)
        .max(3);
    out!(
        "{:<width$}  {:<6}  {:<13}  {:<20}  {:>6}  {:>11}",
        "key",
        "kind",
        "dtype",
        "global shape",
        "chunks",
        "size"
    );
    for r in &rows {
        let shape = r
            .global_shape
            .as_ref()
            .map(|s| format!("{s:?}"))
            .unwrap_or_default();
        out!(
            "{:<width$}  {:<6}  {:<13}  {:<20}  {:>6}  {:>11}",
            shown(&r.key),
            r.kind,
            r.dtype.unwrap_or("-"),
            shape,
            r.chunks,
            size(r.bytes)
        );
    }
    out!(
        "{}, {}, {} in items ({} metadata)",
        count(tensors, "tensor"),
        count(rows.len() - tensors, "object"),
        size(total),
        format_name(&ckpt.metadata.class)
    );
    Ok(0)
}

fn verify(
    dir: &Location,
    json: bool,
    quick: bool,
    torch: Option<shardwise::torch_compat::Torch>,
) -> Outcome {
    if quick {
        let mut report = shardwise::verify::verify_quick(dir)?;
        torch_compat(dir, torch, &mut report, json)?;
        return verify_output(dir, &report, json);
    }
    let bar = progress(
        indicatif::ProgressBar::new(0),
        "verify {bar:40} {pos}/{len} items {elapsed}",
        json,
    );
    // The item count is known once .metadata is decoded; verify() reports progress per item.
    let mut report = shardwise::verify::verify(dir, &|n| bar.set_length(n), &|n| bar.inc(n))?;
    bar.finish_and_clear();
    torch_compat(dir, torch, &mut report, json)?;
    verify_output(dir, &report, json)
}

/// `verify --torch-compat`: each reason `torch` cannot read the checkpoint is a problem on
/// `.metadata`; when it can, the text output says so.
fn torch_compat(
    dir: &Location,
    torch: Option<shardwise::torch_compat::Torch>,
    report: &mut shardwise::verify::Report,
    json: bool,
) -> std::result::Result<(), Stop> {
    let Some(torch) = torch else { return Ok(()) };
    let meta = dir
        .read(METADATA_FILE)?
        .ok_or_else(|| shardwise::hints::no_metadata(dir))?;
    let compat = shardwise::torch_compat::check(&meta, torch)?;
    for b in &compat.blockers {
        let fix = if b.rewritable {
            format!("`shardwise rewrite-metadata {dir} --torch-compat {torch}` fixes this")
        } else {
            "no rewrite of .metadata fixes this".to_string()
        };
        report.problems.push(shardwise::verify::Problem {
            key: METADATA_FILE.into(),
            file: Some(METADATA_FILE.into()),
            offset: None,
            message: format!("torch {torch} cannot read it: {} ({fix})", b.reason),
        });
    }
    if compat.readable && !json {
        out!("torch {torch} reads {dir}/.metadata");
    }
    Ok(())
}

fn rewrite_metadata(dir: &Location, torch: shardwise::torch_compat::Torch, json: bool) -> Outcome {
    let r = shardwise::torch_compat::rewrite(dir, torch)?;
    if json {
        print_json(&r)?;
    } else if r.unchanged {
        out!("torch {torch} already reads {dir}/.metadata: nothing rewritten");
    } else {
        out!(
            "rewrote {dir}/.metadata for torch {torch} ({} -> {}): {}",
            size(r.metadata_bytes_before),
            size(r.metadata_bytes),
            r.removed.join("; ")
        );
        for rel in &r.records_updated {
            out!("updated {rel} to the new .metadata");
        }
    }
    Ok(0)
}

fn verify_output(dir: &Location, report: &shardwise::verify::Report, json: bool) -> Outcome {
    if json {
        print_json(report)?;
    } else {
        for line in problem_lines(&report.problems) {
            out!("{line}");
        }
        out!(
            "{}: {}, {}, {}: {}",
            dir,
            count(report.keys, "key"),
            count(report.items, "item"),
            if report.quick {
                "structures and pickles only (--quick: no payload read)".to_string()
            } else {
                format!(
                    "{} checked against save-time CRC-32s",
                    report.sidecar_checked
                )
            },
            if report.problems.is_empty() {
                "OK".to_string()
            } else {
                count(report.problems.len(), "problem").to_uppercase()
            }
        );
    }
    Ok(if report.problems.is_empty() {
        0
    } else {
        EXIT_FAILED
    })
}

/// `verify`'s problems for people, grouped per file: layout problems (no file) first, then each
/// file's problems, where one message shared by many items (a missing or unreadable data file) is
/// one line naming how many items and keys it hit.
fn problem_lines(problems: &[shardwise::verify::Problem]) -> Vec<String> {
    // file -> message -> (key, offset) of every item with that message, in report order.
    let mut by_file: BTreeMap<&str, Vec<(&str, Vec<(&str, Option<u64>)>)>> = BTreeMap::new();
    let mut lines = Vec::new();
    for p in problems {
        let Some(file) = p.file.as_deref() else {
            lines.push(format!("PROBLEM {}: {}", shown(&p.key), p.message));
            continue;
        };
        let messages = by_file.entry(file).or_default();
        match messages.iter_mut().find(|(m, _)| *m == p.message) {
            Some((_, items)) => items.push((&p.key, p.offset)),
            None => messages.push((&p.message, vec![(&p.key, p.offset)])),
        }
    }
    for (file, messages) in by_file {
        for (message, items) in messages {
            match items.as_slice() {
                [(key, Some(o))] => {
                    lines.push(format!("PROBLEM {} [{file} @ {o}]: {message}", shown(key)))
                }
                [(key, None)] => lines.push(format!("PROBLEM {} [{file}]: {message}", shown(key))),
                many => {
                    let mut keys: Vec<Cow<str>> = many.iter().map(|(k, _)| shown(k)).collect();
                    keys.dedup();
                    let shown = keys.len().min(3);
                    let more = match keys.len() - shown {
                        0 => String::new(),
                        n => format!(" and {n} more"),
                    };
                    lines.push(format!(
                        "PROBLEM {file}: {message} ({} of {}: {}{more})",
                        count(many.len(), "item"),
                        count(keys.len(), "key"),
                        keys[..shown].join(", ")
                    ));
                }
            }
        }
    }
    lines
}

/// `status`: repairs first when asked, then prints the report (text or JSON) and exits by the
/// checkpoint's state ([`status_exit_code`]).
fn status(dir: &Location, keys: bool, json: bool, repair: bool) -> Outcome {
    if repair {
        repair_checkpoint(dir, Duration::ZERO, false, json)?;
    }
    let (checkpoint, report) = status_report(dir, keys)?;
    if json {
        print_json(&report)?;
    } else {
        print_status(dir, &checkpoint, report, keys)?;
    }
    Ok(status_exit_code(&checkpoint))
}

/// `status`'s exit code: 0 only for a committed checkpoint (its files as the commit recorded; the
/// data's bytes are `verify`'s to check); damaged or not committed
/// is [`EXIT_FAILED`], as `verify` exits on problems, so that `shardwise status DIR && resume`
/// never resumes from a checkpoint a load would refuse or read wrong.
fn status_exit_code(checkpoint: &CheckpointState) -> i32 {
    match checkpoint {
        CheckpointState::Committed { .. } => 0,
        CheckpointState::NotCommitted { .. } | CheckpointState::Damaged { .. } => EXIT_FAILED,
    }
}

/// `status`'s text: the checkpoint's state, its orphaned data files, then each save with its ranks
/// (and keys with `keys`).
fn print_status(
    dir: &Location,
    checkpoint: &CheckpointState,
    report: StatusReport,
    keys: bool,
) -> std::result::Result<(), Stop> {
    let StatusReport {
        orphaned_data_files: orphans,
        saves,
        ..
    } = report;
    match checkpoint {
        CheckpointState::Committed { record } => out!(
            "{dir}: committed{}",
            record
                .as_ref()
                .map_or(String::new(), |r| format!(" (save {})", r.save_id))
        ),
        CheckpointState::NotCommitted { reason } => out!("{dir}: not committed ({reason})"),
        CheckpointState::Damaged { reason, repairable } => out!(
            "{dir}: DAMAGED: {reason}{}",
            repairable.as_ref().map_or(String::new(), |id| format!(
                "; `shardwise merge --repair {dir}` rebuilds it from save {id}'s parts"
            ))
        ),
    }
    if !orphans.is_empty() {
        out!(
            "{} that no part names (ranks that died before publishing): {}",
            count(orphans.len(), "data file"),
            orphans.join(", ")
        );
    }
    if saves.is_empty() {
        out!(
            "no shardwise saves (no {} directory){}",
            STATE_DIR,
            shardwise::hints::elsewhere(dir).map_or(String::new(), |h| format!("; {h}"))
        );
    }
    for s in &saves {
        out!(
            "save {}: {}; {} of {} rank parts",
            s.save_id,
            s.detail,
            s.present,
            s.world_size
        );
        if !s.missing.is_empty() {
            out!("  missing ranks: [{}]", fmt_ranks(&s.missing));
        }
        for r in &s.ranks {
            let files = if r.files.is_empty() {
                "no data file".to_string()
            } else {
                format!("{} in {}", size(r.bytes), r.files.join(", "))
            };
            match &r.error {
                Some(e) => out!(
                    "  rank {}: unreadable part ({:.0}s old): {e}",
                    r.rank,
                    r.age_s
                ),
                None => out!(
                    "  rank {}: {}, {}, {}{}; part {:.0}s old",
                    r.rank,
                    count(r.tensor_chunks, "tensor chunk"),
                    count(r.byte_objects, "byte object"),
                    files,
                    if r.common { " + common.pt" } else { "" },
                    r.age_s
                ),
            }
        }
        out!("  {}", count(s.key_count, "tensor key"));
        if keys {
            for k in &s.keys {
                out!(
                    "  {}  {} {:?}: {} from {} [{}]",
                    shown(&k.key),
                    k.dtype,
                    k.global_shape,
                    count(k.chunks, "chunk"),
                    if k.ranks.len() == 1 { "rank" } else { "ranks" },
                    fmt_ranks(&k.ranks)
                );
            }
        }
    }
    Ok(())
}

/// `merge --repair` / `status --repair`: rebuilds a damaged checkpoint from its save's parts and
/// prints what it did (as a JSON summary with `json`, nothing when `quiet`).
fn repair_checkpoint(dir: &Location, timeout: Duration, json: bool, quiet: bool) -> Outcome {
    let (save_id, summary) = shardwise::commit::repair(dir, timeout)?;
    if quiet {
        return Ok(0);
    }
    if json {
        print_json(&summary)?;
        return Ok(0);
    }
    out!(
        "repaired {dir} from save {save_id}: {}, {}, .metadata {}",
        count(summary.keys, "key"),
        count(summary.tensor_chunks, "tensor chunk"),
        size(summary.metadata_bytes)
    );
    Ok(0)
}

/// The world_size the parts of `save_id` record.
///
/// Errors: [`Error::InvalidArgument`] naming the saves in `dir` when `save_id` is not one of them
/// (or has no readable part), and what `--world-size` is for.
fn recorded_world_size(dir: &Location, save_id: &str) -> Result<u32> {
    if let Some(w) = read_parts(dir, save_id)
        .into_iter()
        .find_map(|(_, p, _)| p.ok().map(|p| p.world_size))
    {
        return Ok(w);
    }
    let ids = save_ids(dir)?;
    let why = if ids.iter().any(|id| id == save_id) {
        format!("save {save_id} has no readable part (`shardwise status {dir}` says why)")
    } else if ids.is_empty() {
        format!("no save {save_id} in {dir}, which holds no shardwise save")
    } else {
        format!("no save {save_id} in {dir} (its saves: {})", ids.join(", "))
    };
    Err(Error::InvalidArgument(format!(
        "{why}; the number of ranks comes from the parts: to merge a save whose ranks have not \
         published their parts yet, pass --world-size N (and --timeout S to wait for them)"
    )))
}

fn merge(
    dir: &Location,
    save_id: Option<String>,
    world_size: Option<u32>,
    timeout: f64,
    json: bool,
    repair: bool,
) -> Outcome {
    if repair {
        return repair_checkpoint(dir, timeout_from_secs("--timeout", timeout)?, json, false);
    }
    if save_id.is_none() && save_ids(dir)?.is_empty() && shardwise::dcp_local::has_rank_local(dir)?
    {
        return merge_rank_local(
            dir,
            world_size,
            timeout_from_secs("--timeout", timeout)?,
            json,
        );
    }
    let save_id = match save_id {
        Some(s) => s,
        None => {
            let ids: Vec<String> = save_ids(dir)?
                .into_iter()
                .filter(|id| !dir.exists(&Marker::Committed.rel(id)))
                .collect();
            match ids.as_slice() {
                [one] => one.clone(),
                [] => {
                    let all = save_ids(dir)?;
                    match all.as_slice() {
                        [one] => one.clone(), // committed already: merging again is a no-op
                        _ => {
                            return Err(Error::InvalidArgument(format!(
                                "no uncommitted save in {}",
                                dir
                            ))
                            .into())
                        }
                    }
                }
                many => {
                    return Err(Error::InvalidArgument(format!(
                        "several uncommitted saves in {}: {}; pick one with --save-id",
                        dir,
                        many.join(", ")
                    ))
                    .into())
                }
            }
        }
    };
    let world_size = match world_size {
        Some(w) => w,
        None => recorded_world_size(dir, &save_id)?,
    };
    let timeout = timeout_from_secs("--timeout", timeout)?;
    let bar = spinner(
        "merge {spinner} save {msg}: waiting for, validating and committing parts {elapsed}",
        json,
    );
    bar.set_message(save_id.clone());
    let summary =
        shardwise::commit::merge(dir, &save_id, world_size, timeout, &Freshness::any_part());
    bar.finish_and_clear();
    let summary = summary?;
    // A save committed earlier whose checkpoint was damaged since: "nothing to do" would be false.
    if summary.already_committed {
        if let CheckpointState::Damaged { reason, repairable } = checkpoint_state(dir)? {
            let fix = repairable.map_or(String::new(), |_| {
                format!("; `shardwise merge --repair {dir}` rebuilds it")
            });
            return Err(Error::InvalidArgument(format!(
                "save {save_id} committed {dir}, which is damaged since: {reason}{fix}"
            ))
            .into());
        }
    }
    if json {
        print_json(&summary)?;
    } else if summary.already_committed {
        out!(
            "save {save_id} is committed (nothing to do): {}, {}, {}, {} of data",
            count(summary.keys, "key"),
            count(summary.tensor_chunks, "tensor chunk"),
            count(summary.byte_objects, "byte object"),
            size(summary.data_bytes)
        );
    } else {
        out!(
            "committed save {save_id}: {}, {}, {}, {} of data, .metadata {}",
            count(summary.keys, "key"),
            count(summary.tensor_chunks, "tensor chunk"),
            count(summary.byte_objects, "byte object"),
            size(summary.data_bytes),
            size(summary.metadata_bytes)
        );
    }
    Ok(0)
}

/// `merge` of a torch DCP `use_collectives=False` checkpoint ([`shardwise::dcp_local`]).
fn merge_rank_local(
    dir: &Location,
    world_size: Option<u32>,
    timeout: Duration,
    json: bool,
) -> Outcome {
    let s = shardwise::dcp_local::merge(dir, world_size, timeout)?;
    if json {
        print_json(&s)?;
        return Ok(0);
    }
    let what = format!(
        "{}, {}, {} ({} kept once)",
        count(s.keys, "key"),
        count(s.tensor_chunks, "tensor chunk"),
        count(s.byte_objects, "byte object"),
        count(s.replicas_dropped, "replicated item")
    );
    if s.replaced_stale {
        out!("{dir}: replaced the .metadata of an earlier save (older than every rank-local file)");
    }
    if s.already_merged {
        out!("{dir}: .metadata is already the merge of the rank-local metadata of {} (nothing to do): {what}", count(s.ranks as usize, "rank"));
    } else {
        out!(
            "merged the rank-local metadata of {} (torch DCP use_collectives=False): {what}; .metadata {}",
            count(s.ranks as usize, "rank"),
            size(s.metadata_bytes)
        );
    }
    Ok(0)
}

fn from_hf(hf: &Path, out: &Path, opts: &FromHfOptions, json: bool) -> Outcome {
    let bar = spinner(
        "from-hf {spinner} {binary_bytes} converted {binary_bytes_per_sec} {elapsed}",
        json,
    );
    let summary = shardwise_hf::from_hf(hf, out, opts, &|n| bar.inc(n));
    bar.finish_and_clear();
    let summary = summary?;
    let mut err = std::io::stderr();
    if !summary.skipped.is_empty() {
        let _ = writeln!(
            err,
            "shardwise: note: {} HF tensors no rule reads were skipped: {}",
            summary.skipped.len(),
            summary.skipped.join(", ")
        );
    }
    for w in &summary.warnings {
        let _ = writeln!(err, "shardwise: warning: {}", shown(w));
    }
    warn_nonfinite(&summary.nonfinite);
    if let (n @ 1.., Some(prefix)) = (summary.vision_tensors, &summary.vision_prefix) {
        let _ = writeln!(
            err,
            "shardwise: note: the vision tower ({n} tensors, {prefix}*) is left out: a Megatron text model has none; to-hf --base-hf {} copies it back",
            shown(&hf.display().to_string())
        );
    }
    if !summary.committed {
        let _ = writeln!(
            err,
            "shardwise: note: part {} published; the last part to finish commits",
            summary.part.as_deref().unwrap_or("?")
        );
    }
    if json {
        print_json(&summary)?;
    } else {
        out!(
            "wrote {} of {}, {} in {} to {} in {:.2}s ({:.2} GB/s){}{}{}{}",
            count(summary.chunks, "tensor chunk"),
            count(summary.keys, "key"),
            size(summary.bytes),
            count(summary.files, "file"),
            out.display(),
            summary.seconds,
            summary.gb_per_s,
            if summary.dequantized > 0 {
                format!("; {} dequantized", count(summary.dequantized, "tensor"))
            } else {
                String::new()
            },
            match summary.mtp_layers {
                0 => String::new(),
                n => format!("; {} converted", count(n as usize, "MTP layer")),
            },
            if summary.committed { "; committed" } else { "" },
            match &summary.tracker {
                Some(t) => format!("; tracker {}", t.display()),
                None => String::new(),
            }
        );
    }
    Ok(0)
}

/// A conversion's tensors holding NaN or infinities (its summary's `nonfinite`), on stderr: one
/// line naming each with its count.
fn warn_nonfinite(nonfinite: &std::collections::BTreeMap<String, u64>) {
    if nonfinite.is_empty() {
        return;
    }
    let listed: Vec<String> = nonfinite
        .iter()
        .map(|(name, n)| format!("{} ({n})", shown(name)))
        .collect();
    let _ = writeln!(
        std::io::stderr(),
        "shardwise: warning: {} hold NaN or infinite values, written as they are: {}",
        count(nonfinite.len(), "tensor"),
        listed.join(", ")
    );
}

fn to_hf(dir: &Location, out: &Path, opts: &HfOptions, json: bool) -> Outcome {
    let bar = spinner(
        "to-hf {spinner} {binary_bytes} written {binary_bytes_per_sec} {elapsed}",
        json,
    );
    let summary = shardwise_hf::to_hf(dir, out, opts, &|n| bar.inc(n));
    bar.finish_and_clear();
    let summary = summary?;
    // What was not checked or not written goes to stderr in both modes (stdout may be JSON).
    let mut err = std::io::stderr();
    if summary.args_check != "passed" {
        let _ = writeln!(
            err,
            "shardwise: note: config check against the checkpoint's args {}; tensor shapes were checked against the config",
            summary.args_check
        );
    }
    if !summary.args_unchecked.is_empty() {
        let _ = writeln!(
            err,
            "shardwise: note: not in the stored args, so not checked: {}",
            summary.args_unchecked.join(", ")
        );
    }
    if opts.config.is_none() && summary.config_written {
        let _ = writeln!(
            err,
            "shardwise: note: config.json built from the checkpoint's stored args (no --hf-config): fields the args do not hold (token ids, RoPE scaling) are transformers' defaults"
        );
    }
    for w in &summary.warnings {
        let _ = writeln!(err, "shardwise: warning: {w}");
    }
    warn_nonfinite(&summary.nonfinite);
    if json {
        print_json(&summary)?;
    } else {
        out!(
            "wrote {}, {} in {} to {} in {:.2}s ({:.2} GB/s); {} skipped (optimizer, extra state, objects){}{}",
            count(summary.tensors, "tensor"),
            size(summary.bytes),
            count(summary.files, "file"),
            out.display(),
            summary.seconds,
            summary.gb_per_s,
            count(summary.skipped_keys, "checkpoint key"),
            if summary.padding_rows_dropped > 0 {
                format!(
                    "; {} vocabulary padding rows left out",
                    summary.padding_rows_dropped
                )
            } else {
                String::new()
            },
            match (&summary.part, summary.committed) {
                (Some(p), true) => format!("; part {p}: every part done, index committed"),
                (Some(p), false) => format!("; part {p}: waiting for the other parts to commit"),
                (None, _) => String::new(),
            }
        );
    }
    Ok(0)
}

// --- diff -----------------------------------------------------------------------------------

const DIFF_EXIT_CODES: &str = "Exit codes:\n  0  same keys, dtypes and global shapes; every tensor within --atol/--rtol, every object equal\n  1  a difference (missing or extra key, dtype, shape, values, object bytes)\n  2  bad command line, or a checkpoint or key that cannot be read\n  141  stdout was closed early";

#[derive(clap::Args, Debug)]
struct DiffArgs {
    /// First checkpoint: directory, URL (s3://, gs://, az://), or HF safetensors folder.
    a: PathBuf,
    /// Second checkpoint (at most one of the two an HF folder).
    b: PathBuf,
    /// Compare only keys matching this glob (`*`, `?`); repeatable. HF tensor names when one side
    /// is an HF folder.
    #[arg(long, value_name = "PATTERN")]
    keys: Vec<String>,
    /// Leave out keys matching this glob; repeatable.
    #[arg(long, value_name = "PATTERN")]
    exclude: Vec<String>,
    /// Absolute tolerance: |a - b| <= atol + rtol * max(|a|, |b|).
    #[arg(long, default_value_t = shardwise_hf::diff::DiffRequest::default().atol, allow_negative_numbers = true)]
    atol: f64,
    /// Relative tolerance.
    #[arg(long, default_value_t = shardwise_hf::diff::DiffRequest::default().rtol, allow_negative_numbers = true)]
    rtol: f64,
    /// HF config.json of the to-hf mapping (default: the HF folder's own config.json).
    #[arg(long)]
    hf_config: Option<PathBuf>,
    /// Architecture of the to-hf mapping (default: the config's model_type).
    #[arg(long)]
    arch: Option<String>,
    /// Skip checkpoint keys the to-hf mapping does not map instead of failing.
    #[arg(long)]
    allow_unmapped: bool,
    /// Worker threads (default: the number of CPUs, at most 8); memory is about
    /// threads x 2 x 32 MiB.
    #[arg(long, allow_negative_numbers = true)]
    threads: Option<usize>,
    /// List every compared key, not only those that differ.
    #[arg(long)]
    all: bool,
    #[arg(long, help = JSON_HELP)]
    json: bool,
}

fn diff(args: DiffArgs) -> Outcome {
    let report = (|| {
        let request = shardwise_hf::diff::DiffRequest {
            atol: args.atol,
            rtol: args.rtol,
            keys: args.keys.clone(),
            exclude: args.exclude.clone(),
            hf_config: args.hf_config.clone(),
            arch: args.arch.clone(),
            allow_unmapped: args.allow_unmapped,
            threads: args.threads,
        };
        let opts = shardwise_hf::diff::DiffOptions::from_user(
            request,
            shardwise_hf::diff::Spelling::Flags,
        )?;
        shardwise_hf::diff::diff(&location(&args.a)?, &location(&args.b)?, &opts)
    })();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "shardwise: error: {}",
                shown(&e.to_string())
            );
            return Ok(2);
        }
    };
    if args.json {
        print_json(&report)?;
        return Ok(report.exit_code);
    }
    use shardwise_hf::diff::Status;
    for k in &report.keys {
        let label = match k.status {
            Status::Equal if !args.all => continue,
            Status::Equal => "EQUAL",
            Status::Close => "CLOSE",
            Status::Different => "DIFFERENT",
            Status::OnlyInA => "ONLY IN A",
            Status::OnlyInB => "ONLY IN B",
            Status::Unreadable => "UNREADABLE",
        };
        let mut line = format!("{label} {}", shown(&k.key));
        if let Some(m) = &k.message {
            line += &format!(": {m}");
        }
        if let (Some(a), Some(r)) = (k.max_abs, k.max_rel) {
            if k.status != Status::Equal {
                line += &format!(" (max abs {a:.3e}, max rel {r:.3e})");
            }
        }
        out!("{line}");
    }
    out!(
        "{} vs {}: {} equal, {} close, {} different, {} only in A, {} only in B, {} unreadable{}",
        report.a,
        report.b,
        report.equal,
        report.close,
        report.different,
        report.only_in_a,
        report.only_in_b,
        report.unreadable,
        if report.mode == "hf" {
            format!(
                " (through the to-hf mapping; {} skipped)",
                count(report.skipped_keys, "checkpoint key")
            )
        } else {
            String::new()
        }
    );
    Ok(report.exit_code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwise::format::dtype::DType;
    use shardwise_hf::{Impl, Quantize, QuantizeFormat};

    fn command(args: &[&str]) -> Command {
        parse(std::iter::once("shardwise").chain(args.iter().copied()))
            .unwrap_or_else(|code| panic!("{args:?}: exit code {code}"))
            .command
    }

    #[test]
    fn a_bad_command_line_and_help_are_exit_codes() {
        assert_eq!(parse(["shardwise", "bogus"]).err(), Some(2));
        assert_eq!(parse(["shardwise", "status"]).err(), Some(2));
        assert_eq!(parse(["shardwise", "--version"]).err(), Some(0));
        assert!(matches!(command(&["status", "d"]), Command::Status { .. }));
    }

    /// Only a committed, whole checkpoint passes `shardwise status DIR && resume`; a damaged one
    /// and a directory with nothing committed fail as a checkpoint `verify` finds problems in.
    #[test]
    fn status_exits_0_only_for_a_committed_checkpoint() {
        let reason = || "why".to_string();
        assert_eq!(
            status_exit_code(&CheckpointState::Committed { record: None }),
            0
        );
        for state in [
            CheckpointState::NotCommitted { reason: reason() },
            CheckpointState::Damaged {
                reason: reason(),
                repairable: None,
            },
            CheckpointState::Damaged {
                reason: reason(),
                repairable: Some("s".into()),
            },
        ] {
            assert_eq!(status_exit_code(&state), EXIT_FAILED, "{state:?}");
        }
        assert_eq!(EXIT_FAILED, 1, "verify's code for problems found");
    }

    /// The message of a bad command line, as `parse` prints it.
    fn message(args: &[&str]) -> String {
        let e = Cli::try_parse_from(std::iter::once("shardwise").chain(args.iter().copied()))
            .unwrap_err();
        one_line(&e.render().to_string())
    }

    /// A missing argument is named (clap puts it on a line of its own); usage and tips are not
    /// shown.
    #[test]
    fn a_bad_command_line_is_one_line_naming_what_is_wrong() {
        for m in [
            message(&["inspect"]),
            message(&["status"]),
            message(&["inspect", "--json"]),
        ] {
            assert_eq!(
                m,
                "the following required arguments were not provided: <DIR>"
            );
        }
        assert_eq!(
            message(&["diff", "a"]),
            "the following required arguments were not provided: <B>"
        );
        let m = message(&["inspect", "d", "--bogus"]);
        assert_eq!(m, "unexpected argument '--bogus' found");
        assert_eq!(message(&["bogus"]), "unrecognized subcommand 'bogus'");
        assert_eq!(
            message(&["verify", "d", "--quick=1"]),
            "unexpected value '1' for '--quick' found; no more were expected"
        );
    }

    /// The flags left out are the library's defaults; the names are parsed by the library.
    #[test]
    fn from_hf_flags_become_the_library_options() {
        let Command::FromHf(f) = command(&["from-hf", "hf", "ck"]) else {
            panic!("from-hf")
        };
        let o = f.options().unwrap();
        let d = FromHfOptions::from_user(FromHfRequest::default()).unwrap();
        assert_eq!((o.dtype, d.dtype), (DType::BF16, DType::BF16));
        assert_eq!(o.transformer_impl, Impl::TransformerEngine);
        assert_eq!(
            (o.make_vocab_size_divisible_by, o.tensor_model_parallel_size),
            (d.make_vocab_size_divisible_by, d.tensor_model_parallel_size)
        );
        assert_eq!(
            (o.iteration, o.max_file_bytes, o.threads),
            (0, 0, d.threads)
        );
        let Command::FromHf(f) = command(&[
            "from-hf",
            "hf",
            "ck",
            "--dtype",
            "fp32",
            "--transformer-impl",
            "local",
            "--part",
            "1/2",
            "--max-file-size",
            "1KB",
        ]) else {
            panic!("from-hf")
        };
        let o = f.options().unwrap();
        assert_eq!((o.dtype, o.transformer_impl), (DType::F32, Impl::Local));
        assert_eq!(o.part.map(|p| (p.index, p.count)), Some((1, 2)));
        assert_eq!(o.max_file_bytes, 1000);
        let Command::FromHf(f) = command(&["from-hf", "hf", "ck", "--dtype", "fp64"]) else {
            panic!("from-hf")
        };
        let e = f.options().unwrap_err().to_string();
        assert!(e.contains("dtype \"fp64\": use bf16, fp16 or fp32"), "{e}");
    }

    #[test]
    fn to_hf_flags_become_the_library_options() {
        let Command::ToHf(f) = command(&["to-hf", "ck", "out"]) else {
            panic!("to-hf")
        };
        let o = f.options().unwrap();
        let d = HfOptions::from_user(ToHfRequest::default()).unwrap();
        assert_eq!((o.dtype, o.max_shard_bytes), (None, d.max_shard_bytes));
        assert_eq!((o.quantize, o.quantize_format), (None, None));
        let Command::ToHf(f) = command(&[
            "to-hf",
            "ck",
            "out",
            "--dtype",
            "bf16",
            "--quantize",
            "nvfp4",
            "--quantize-format",
            "modelopt",
        ]) else {
            panic!("to-hf")
        };
        let o = f.options().unwrap();
        assert_eq!(o.dtype, Some(DType::BF16));
        assert_eq!(
            (o.quantize, o.quantize_format),
            (Some(Quantize::Nvfp4), Some(QuantizeFormat::ModelOpt))
        );
        let Command::ToHf(f) = command(&["to-hf", "ck", "out", "--quantize", "int4"]) else {
            panic!("to-hf")
        };
        let e = f.options().unwrap_err().to_string();
        assert!(e.contains("--quantize \"int4\": use fp8-block"), "{e}");
    }
}
