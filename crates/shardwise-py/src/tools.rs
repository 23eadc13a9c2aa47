//! Whole-checkpoint operations from Python: merge, to-hf, diff, the committed checks, the CLI.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::args::{opt_positive, opt_seconds, positive, seconds, str_list, whole};
use super::report::to_dict;
use super::{location, to_py};
use shardwise::commit::wait::Freshness;

/// Converts checkpoint `checkpoint_dir` to HF safetensors in `out_dir`; see `shardwise to-hf`.
/// `dtype` is bf16, fp16, fp32 or None (as stored); `max_shard_size` like "5GB"; `workers`
/// threads; `part` like "0/2" for one part of a split conversion; `overwrite` replaces an earlier
/// conversion in a non-empty `out_dir`; `base_hf` (a multimodal config's original release: its
/// vision tower is copied), `text_only` (a multimodal config's text model alone), `drop_mtp`
/// (without the MTP layers), `tokenizer` (the tokenizer folder to copy; default the
/// checkpoint's `tokenizer/`), `quantize` (`"fp8-block"`, `"mxfp4"`, `"nvfp4"` or `"mxfp8"`: see
/// `shardwise to-hf --quantize`), `quantize_format` (`"compressed-tensors"` or `"modelopt"`, for
/// `"nvfp4"`), `allow_config_mismatch` (a list of config field names, each a `str`: see
/// `shardwise to-hf --allow-config-mismatch`), `allow_nonfinite` (quantize a weight holding NaN or
/// infinities anyway, a warning each; without it such a weight raises `ValidationError` naming
/// it, before anything is committed). Returns the summary as a dict with the fields of
/// `shardwise to-hf --json` (`tensors`, `bytes`, `files`, `seconds`, `gb_per_s`, `skipped_keys`,
/// `args_check`, `args_unchecked`, `warnings`, `padding_rows_dropped`, `config_written`,
/// `mtp_layers`, `vision_tensors`, `quantized`, `tokenizer_files`, `nonfinite`, `part`,
/// `committed`).
/// Raises `InvalidArgumentError` (also for `workers` that is not a whole number >= 1, and an
/// `allow_config_mismatch` that is not a list of str), `ValidationError`, `StorageError`,
/// `CorruptFileError`.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, out_dir, *, hf_config=None, arch=None, dtype=None, max_shard_size="5GB", workers=None, allow_unmapped=false, overwrite=false, part=None, base_hf=None, text_only=false, drop_mtp=false, tokenizer=None, quantize=None, quantize_format=None, allow_config_mismatch=None, allow_nonfinite=false))]
#[allow(clippy::too_many_arguments)]
pub(super) fn to_hf(
    py: Python<'_>,
    checkpoint_dir: PathBuf,
    out_dir: PathBuf,
    hf_config: Option<PathBuf>,
    arch: Option<String>,
    dtype: Option<String>,
    max_shard_size: &str,
    workers: Option<&Bound<'_, PyAny>>,
    allow_unmapped: bool,
    overwrite: bool,
    part: Option<String>,
    base_hf: Option<PathBuf>,
    text_only: bool,
    drop_mtp: bool,
    tokenizer: Option<PathBuf>,
    quantize: Option<String>,
    quantize_format: Option<String>,
    allow_config_mismatch: Option<&Bound<'_, PyAny>>,
    allow_nonfinite: bool,
) -> PyResult<Py<PyAny>> {
    let allow_config_mismatch = str_list("allow_config_mismatch", allow_config_mismatch)?;
    let opts = shardwise_hf::HfOptions::from_user(shardwise_hf::ToHfRequest {
        hf_config,
        arch,
        dtype,
        max_shard_size: max_shard_size.into(),
        workers: opt_positive("workers", workers)?,
        allow_unmapped,
        overwrite,
        part,
        base_hf,
        text_only,
        drop_mtp,
        tokenizer,
        quantize,
        quantize_format,
        allow_config_mismatch,
        allow_nonfinite,
    })
    .map_err(to_py)?;
    let s = py
        .detach(|| {
            let loc = location(&checkpoint_dir)?;
            shardwise_hf::to_hf(&loc, &out_dir, &opts, &|_| {})
        })
        .map_err(to_py)?;
    Ok(to_dict(py, &s)?.unbind())
}

/// Converts the Hugging Face folder `hf_dir` into a torch_dist checkpoint in `ckpt_dir`; see
/// `shardwise from-hf`. `dtype` bf16, fp16 or fp32; `transformer_impl` transformer_engine or
/// local; `workers` threads; `max_file_size` like "1GB" or "auto" (the largest tensor); `part`
/// like "0/2"; `drop_mtp`: convert without the folder's MTP layers. Returns the summary as a dict
/// (chunks, keys, bytes, files, seconds, gb_per_s, hf_tensors, dequantized, skipped,
/// stacked_layers, padded_vocab_size, iteration, part, committed, tracker, mtp_layers,
/// dropped_mtp, vision_tensors, vision_prefix, warnings, nonfinite).
/// Raises `InvalidArgumentTypeError` for a count that is not an `int` (a `bool` among them),
/// `InvalidArgumentError` for one out of range or another bad value, `ValidationError`,
/// `UnsupportedDtypeError`, `StorageError`.
#[pyfunction]
#[pyo3(signature = (hf_dir, ckpt_dir, *, arch=None, dtype="bf16", transformer_impl="transformer_engine", moe_grouped_gemm=false, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, iteration=0, tracker=false, workers=None, max_file_size="auto", part=None, overwrite=false, allow_unmapped=false, drop_mtp=false))]
#[allow(clippy::too_many_arguments)]
pub(super) fn from_hf(
    py: Python<'_>,
    hf_dir: PathBuf,
    ckpt_dir: PathBuf,
    arch: Option<String>,
    dtype: &str,
    transformer_impl: &str,
    moe_grouped_gemm: bool,
    #[pyo3(from_py_with = vocab_divisor)] make_vocab_size_divisible_by: u64,
    #[pyo3(from_py_with = tensor_parallel)] tensor_model_parallel_size: u64,
    #[pyo3(from_py_with = iteration_arg)] iteration: u64,
    tracker: bool,
    workers: Option<&Bound<'_, PyAny>>,
    max_file_size: &str,
    part: Option<String>,
    overwrite: bool,
    allow_unmapped: bool,
    drop_mtp: bool,
) -> PyResult<Py<PyAny>> {
    let opts = shardwise_hf::FromHfOptions::from_user(shardwise_hf::FromHfRequest {
        arch,
        dtype: dtype.into(),
        transformer_impl: transformer_impl.into(),
        moe_grouped_gemm,
        make_vocab_size_divisible_by,
        tensor_model_parallel_size,
        iteration,
        tracker,
        workers: opt_positive("workers", workers)?,
        max_file_size: max_file_size.into(),
        part,
        overwrite,
        allow_unmapped,
        drop_mtp,
    })
    .map_err(to_py)?;
    let s = py
        .detach(|| shardwise_hf::from_hf(&hf_dir, &ckpt_dir, &opts, &|_| {}))
        .map_err(to_py)?;
    let json = serde_json::to_string(&s).expect("serializable");
    Ok(py.import("json")?.call_method1("loads", (json,))?.unbind())
}

/// `from_hf`'s whole-number arguments, by the rule of every other ([`whole`]; their ranges are
/// `from-hf`'s own checks), each naming its argument.
fn vocab_divisor(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    whole("make_vocab_size_divisible_by", v)
}
fn tensor_parallel(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    whole("tensor_model_parallel_size", v)
}
fn iteration_arg(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    whole("iteration", v)
}

/// Compares checkpoints `a` and `b` (directories, URLs, or one HF safetensors folder); see
/// `shardwise diff`. Returns the report as a dict with the fields of `shardwise diff --json`
/// (`shardwise.diff` documents them). Raises `InvalidArgumentError` for a tolerance that is not a
/// number >= 0 or `workers` that is not a whole number >= 1.
#[pyfunction]
#[pyo3(signature = (a, b, *, atol=0.0, rtol=0.0, keys=Vec::new(), exclude=Vec::new(), hf_config=None, arch=None, allow_unmapped=false, workers=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn diff<'py>(
    py: Python<'py>,
    a: PathBuf,
    b: PathBuf,
    atol: f64,
    rtol: f64,
    keys: Vec<String>,
    exclude: Vec<String>,
    hf_config: Option<PathBuf>,
    arch: Option<String>,
    allow_unmapped: bool,
    workers: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let request = shardwise_hf::diff::DiffRequest {
        atol,
        rtol,
        keys,
        exclude,
        hf_config,
        arch,
        allow_unmapped,
        threads: opt_positive("workers", workers)?,
    };
    let opts =
        shardwise_hf::diff::DiffOptions::from_user(request, shardwise_hf::diff::Spelling::Keywords)
            .map_err(to_py)?;
    let report = py
        .detach(|| shardwise_hf::diff::diff(&location(&a)?, &location(&b)?, &opts))
        .map_err(to_py)?;
    to_dict(py, &report)
}

/// Whether a CUDA driver can be loaded here (the GPU path is used only then). Never raises.
#[pyfunction]
pub(super) fn cuda_available(py: Python<'_>) -> bool {
    py.detach(shardwise::gpu::available)
}

/// Merges the parts of save `save_id` of `world_size` ranks and commits `.metadata`, waiting up to
/// `timeout_s` seconds for missing parts; see `shardwise merge`. Returns a dict with the fields of
/// `shardwise merge --json`: `already_committed` (a racing merger or an earlier merge committed;
/// the counts are then that commit's), `keys`, `tensor_chunks`, `byte_objects`, `data_bytes` and
/// `metadata_bytes` (bytes), `took_over_dead_merger`.
///
/// Raises `MissingRanksError` (parts still missing at `timeout_s`), `ValidationError` (nothing
/// committed), `InvalidArgumentError` (also for a `world_size` that is not a whole number >= 1, a
/// timeout that is not a finite number of seconds in `0..=MAX_TIMEOUT_S`), `StorageError`, and
/// `KeyboardInterrupt` when Ctrl-C interrupts the wait (nothing committed).
#[pyfunction]
pub(super) fn merge<'py>(
    py: Python<'py>,
    checkpoint_dir: PathBuf,
    save_id: String,
    world_size: &Bound<'py, PyAny>,
    timeout_s: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let world_size: u32 = positive("world_size", world_size)?;
    let timeout = seconds("timeout_s", timeout_s)?;
    let s = py
        .detach(|| {
            let loc = location(&checkpoint_dir)?.with_timeout(Some(timeout))?;
            shardwise::commit::merge(&loc, &save_id, world_size, timeout, &Freshness::any_part())
        })
        .map_err(to_py)?;
    to_dict(py, &s)
}

/// The whole file `rel` of the checkpoint `checkpoint_dir` (a directory or URL), or None when it
/// does not exist; object-store requests bounded by `timeout_s` seconds when given.
///
/// Raises `InvalidArgumentError` (a timeout that is not a finite number of seconds in
/// `0..=MAX_TIMEOUT_S`) or `StorageError`.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, rel, timeout_s=None))]
pub(super) fn read_file<'py>(
    py: Python<'py>,
    checkpoint_dir: PathBuf,
    rel: String,
    timeout_s: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let timeout = opt_seconds("timeout_s", timeout_s)?;
    let got = py
        .detach(|| location(&checkpoint_dir)?.with_timeout(timeout)?.read(&rel))
        .map_err(to_py)?;
    Ok(got.map(|b| PyBytes::new(py, &b)))
}

/// Merges the rank-local `__{rank}.metadata` files of a torch DCP `use_collectives=False` save
/// into its global `.metadata` (`shardwise.dcp.finish`; see `shardwise::dcp_local`). `world_size`,
/// when given, is waited for up to `timeout_s` seconds. Returns the summary as a dict (the fields
/// of `shardwise::dcp_local::Summary`: `ranks`, `keys`, `tensor_chunks`, `byte_objects`,
/// `replicas_dropped`, `metadata_bytes` in bytes, `already_merged`, `replaced_stale`).
///
/// Raises `InvalidArgumentError` (a `world_size` that is not a whole number >= 1, a timeout that
/// is not a finite number of seconds in `0..=MAX_TIMEOUT_S`), `ValidationError`, `StorageError`.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, world_size=None, timeout_s=None))]
pub(super) fn merge_rank_local<'py>(
    py: Python<'py>,
    checkpoint_dir: PathBuf,
    world_size: Option<&Bound<'py, PyAny>>,
    timeout_s: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let world_size: Option<u32> = opt_positive("world_size", world_size)?;
    let timeout = opt_seconds("timeout_s", timeout_s)?.unwrap_or(Duration::ZERO);
    let s = py
        .detach(|| {
            let loc = location(&checkpoint_dir)?.with_timeout(Some(timeout))?;
            shardwise::dcp_local::merge(&loc, world_size, timeout)
        })
        .map_err(to_py)?;
    to_dict(py, &s)
}

/// Wall-clock start of this process, ns since the Unix epoch: files written before it belong to an
/// earlier launch (the save's `Freshness` rule, `shardwise::commit::wait`; also the strict-load key
/// exchange, `shardwise.requested_keys`).
#[pyfunction]
pub(super) fn process_start_ns() -> u64 {
    shardwise::commit::liveness::process_start_ns()
}

/// Whether `checkpoint_dir` holds a committed, whole checkpoint: the one definition shared with
/// the save and `shardwise status` (`shardwise::commit::state`). Never raises for a missing or
/// unreadable directory (False).
#[pyfunction]
pub(super) fn is_committed(py: Python<'_>, checkpoint_dir: PathBuf) -> bool {
    py.detach(|| {
        location(&checkpoint_dir).is_ok_and(|l| shardwise::commit::state::is_committed(&l))
    })
}

/// Whether two checkpoints hold the same tensors by their save-time CRC-32s (sidecars only, no
/// data read); None when either was not saved by shardwise. See `shardwise::commit::same_tensor_crcs`.
#[pyfunction]
pub(super) fn same_tensor_crcs(py: Python<'_>, a: PathBuf, b: PathBuf) -> PyResult<Option<bool>> {
    py.detach(|| shardwise::commit::same_tensor_crcs(&location(&a)?, &location(&b)?))
        .map_err(to_py)
}

/// The state of checkpoint `checkpoint_dir` and of each save in it, as `shardwise status --json`
/// prints it: `dir`, `checkpoint` (`committed`, `not_committed` or `damaged`), `reason`,
/// `orphaned_data_files`, `saves` (docs/cli.md, "JSON output", lists every field); each save's `keys`
/// only with `keys=True` (as `--keys`: on a committed save that reads every part). Reads only;
/// raises `StorageError` when the directory cannot be read.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, keys=false))]
pub(super) fn status(
    py: Python<'_>,
    checkpoint_dir: PathBuf,
    keys: bool,
) -> PyResult<Bound<'_, PyAny>> {
    let (_, report) = py
        .detach(|| shardwise::status::status_report(&location(&checkpoint_dir)?, keys))
        .map_err(to_py)?;
    to_dict(py, &report)
}
