//! The `shardwise._native` extension module: thin wrappers that release the GIL and map
//! [`crate::Error`] variants to `shardwise.ShardwiseError` subclasses.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::commit::part::ObjectShard;
use crate::commit::wait::{timeout_from_secs, Freshness};
use crate::error::Error;
use crate::format::dtype::DType;
use crate::format::metadata::Entry;
use crate::reader::Checkpoint;
use crate::save::{save_rank as rust_save_rank, ObjectItem, SaveOptions, SaveReport};
use crate::staging::{self, DEFAULT_BUFFER_BYTES};
use crate::storage::Location;
use crate::writer::{ByteObject, Payload, Staging, TensorChunk};

create_exception!(
    shardwise,
    ShardwiseError,
    PyException,
    "Base class of every shardwise error."
);
create_exception!(
    shardwise,
    UnsupportedDtypeError,
    ShardwiseError,
    "A tensor dtype the DCP writer does not support."
);
create_exception!(
    shardwise,
    InvalidArgumentError,
    ShardwiseError,
    "Arguments that contradict themselves."
);
create_exception!(
    shardwise,
    MissingKeyError,
    ShardwiseError,
    "A requested key is not in the checkpoint."
);
create_exception!(
    shardwise,
    ValidationError,
    ShardwiseError,
    "Inputs that do not fit together: a save's parts (nothing was committed), a region the chunks do not cover, a to-hf config."
);
create_exception!(
    shardwise,
    MissingRanksError,
    ShardwiseError,
    "Ranks did not publish their parts within the timeout."
);
create_exception!(
    shardwise,
    NotCommittedError,
    ShardwiseError,
    "The save was not committed (merger failed or timed out)."
);
create_exception!(
    shardwise,
    CheckpointExistsError,
    ShardwiseError,
    "The directory already holds a committed checkpoint."
);
create_exception!(
    shardwise,
    StorageError,
    ShardwiseError,
    "An I/O operation failed."
);
create_exception!(
    shardwise,
    GpuError,
    ShardwiseError,
    "The CUDA driver is missing or a CUDA call failed."
);
create_exception!(
    shardwise,
    CorruptFileError,
    ShardwiseError,
    "A shardwise or checkpoint file is malformed."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::UnsupportedDtype(_) => UnsupportedDtypeError::new_err(msg),
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        Error::MissingKey { .. } => MissingKeyError::new_err(msg),
        Error::Validation(_) => ValidationError::new_err(msg),
        Error::MissingRanks { .. } => MissingRanksError::new_err(msg),
        Error::NotCommitted { .. } => NotCommittedError::new_err(msg),
        Error::CheckpointExists(_) => CheckpointExistsError::new_err(msg),
        Error::Io { .. } | Error::Remote { .. } | Error::RankStorage { .. } => {
            StorageError::new_err(msg)
        }
        Error::Corrupt { .. } => CorruptFileError::new_err(msg),
        Error::Interrupted(_) => pyo3::exceptions::PyKeyboardInterrupt::new_err(msg),
        Error::Gpu(_) => GpuError::new_err(msg),
    }
}

/// A `load_into` request: `(key, offsets, sizes, data_ptr, nbytes, device)`.
type LoadRequest = (String, Vec<u64>, Vec<u64>, u64, u64, i64);

type PyObject_ = (String, Vec<u8>, Option<(String, Vec<u64>, Vec<u64>)>);

/// A tensor chunk as the Python side describes it: `(fqn, dtype, global_shape, offsets, sizes,
/// data_ptr, nbytes[, device])`, `device` being the CUDA ordinal or -1 (absent) for host memory.
struct RawChunk {
    fqn: String,
    dtype: DType,
    global_shape: Vec<u64>,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    ptr: usize,
    nbytes: usize,
    device: Option<u32>,
}

fn raw_chunks(tensors: &Bound<'_, PyList>) -> PyResult<Vec<RawChunk>> {
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors.iter() {
        let t = t.cast_into::<PyTuple>()?;
        if !(7..=8).contains(&t.len()) {
            return Err(InvalidArgumentError::new_err(
                "a tensor entry is a 7- or 8-tuple",
            ));
        }
        let dtype: String = t.get_item(1)?.extract()?;
        let device: i64 = if t.len() == 8 {
            t.get_item(7)?.extract()?
        } else {
            -1
        };
        out.push(RawChunk {
            fqn: t.get_item(0)?.extract()?,
            dtype: DType::from_torch_name(&dtype).map_err(to_py)?,
            global_shape: t.get_item(2)?.extract()?,
            offsets: t.get_item(3)?.extract()?,
            sizes: t.get_item(4)?.extract()?,
            ptr: t.get_item(5)?.extract()?,
            nbytes: t.get_item(6)?.extract()?,
            device: u32::try_from(device).ok(),
        });
    }
    Ok(out)
}

/// Borrows the described memory.
///
/// # Safety
/// Every host chunk's `ptr..ptr+nbytes` must stay valid and unmodified for as long as the returned
/// chunks are read (until staging completes, or until the save returns without staging).
unsafe fn chunks_of(raw: &[RawChunk]) -> Vec<TensorChunk<'static>> {
    raw.iter()
        .map(|r| TensorChunk {
            fqn: r.fqn.clone(),
            dtype: r.dtype,
            global_shape: r.global_shape.clone(),
            offsets: r.offsets.clone(),
            sizes: r.sizes.clone(),
            data: match r.device {
                Some(device) => Payload::Device {
                    ptr: r.ptr as u64,
                    len: r.nbytes as u64,
                    device,
                },
                None if r.nbytes == 0 => Payload::Host(&[]),
                None => Payload::Host(std::slice::from_raw_parts(r.ptr as *const u8, r.nbytes)),
            },
        })
        .collect()
}

fn object_items(objects: &[PyObject_]) -> Vec<ObjectItem<'_>> {
    objects
        .iter()
        .map(|(fqn, bytes, shard)| ObjectItem {
            object: ByteObject {
                fqn: fqn.clone(),
                bytes,
            },
            shard: shard
                .clone()
                .map(|(key, global_shape, global_offset)| ObjectShard {
                    key,
                    global_shape,
                    global_offset,
                }),
        })
        .collect()
}

fn report_dict<'py>(py: Python<'py>, report: &SaveReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rank", report.rank)?;
    d.set_item("save_id", &report.save_id)?;
    d.set_item("data_file", &report.data_file)?;
    d.set_item("data_bytes", report.data_bytes)?;
    d.set_item("write_s", report.write_s)?;
    d.set_item("rendezvous_s", report.rendezvous_s)?;
    d.set_item("committed", report.committed)?;
    if let Some(c) = &report.commit {
        d.set_item("keys", c.keys)?;
        d.set_item("tensor_chunks", c.tensor_chunks)?;
        d.set_item("byte_objects", c.byte_objects)?;
        d.set_item("metadata_bytes", c.metadata_bytes)?;
    }
    Ok(d)
}

/// An asynchronous save in flight: its data is staged in host memory; persistence and the
/// rendezvous go on in a Rust thread without the GIL.
#[pyclass(frozen, name = "SaveHandle")]
struct SaveHandle {
    thread: Mutex<Option<std::thread::JoinHandle<crate::Result<SaveReport>>>>,
    outcome: Mutex<Option<PyResult<Py<PyDict>>>>,
    /// Seconds the caller was blocked: from the call until every byte was staged.
    #[pyo3(get)]
    stall_s: f64,
    /// Payload bytes staged (tensor bytes of this rank's main replicas).
    #[pyo3(get)]
    staged_bytes: u64,
}

#[pymethods]
impl SaveHandle {
    /// Whether the save has finished (committed or failed).
    fn done(&self) -> bool {
        self.outcome.lock().unwrap().is_some()
            || self
                .thread
                .lock()
                .unwrap()
                .as_ref()
                .is_none_or(|t| t.is_finished())
    }

    /// Waits up to `timeout_s` seconds (forever when None) and returns the save's report dict.
    /// Raises the save's own `ShardwiseError` if it failed, `NotCommittedError` on timeout.
    #[pyo3(signature = (timeout_s=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout_s: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let deadline =
            timeout_s.map(|t| std::time::Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            if let Some(done) = self.outcome.lock().unwrap().as_ref() {
                return match done {
                    Ok(d) => Ok(d.bind(py).clone()),
                    Err(e) => Err(e.clone_ref(py)),
                };
            }
            let finished = self
                .thread
                .lock()
                .unwrap()
                .as_ref()
                .is_none_or(|t| t.is_finished());
            if finished {
                let thread = self.thread.lock().unwrap().take();
                let result = match thread.map(|t| t.join()) {
                    Some(Ok(Ok(report))) => report_dict(py, &report).map(|d| d.unbind()),
                    Some(Ok(Err(e))) => Err(to_py(e)),
                    Some(Err(_)) => Err(ShardwiseError::new_err("the save thread panicked")),
                    None => Err(ShardwiseError::new_err("the save thread is gone")),
                };
                *self.outcome.lock().unwrap() = Some(result);
                continue;
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(NotCommittedError::new_err(format!(
                    "save still in flight after {:.1}s",
                    timeout_s.unwrap_or(0.0)
                )));
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(5)));
        }
    }
}

/// Saves one rank. `tensors` are `(fqn, dtype, global_shape, offsets, sizes, data_ptr, nbytes[,
/// device])`: contiguous memory (host, or CUDA device `device`) that the caller keeps alive and
/// unmodified until this call returns; `objects` are `(fqn, torch_save_bytes, (key, global_shape,
/// global_offset) | None)`. `caller_streams` maps each CUDA device to the caller's current stream
/// (`torch.cuda.current_stream(d).cuda_stream`): copies start after the work queued there.
///
/// Device tensors, and every tensor when `async_save`, go through the process's staging pool of
/// `staging_budget` bytes (pinned when CUDA is there). Returns the report dict, or with
/// `async_save` a `SaveHandle` as soon as every byte is staged. With `integrity`, the commit writes
/// megatron-core 0.19's `integrity.json` (SHA-256 of every file, computed while writing). Raises a
/// `ShardwiseError` subclass.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, rank, world_size, save_id, tensors, objects, common, megatron, merge_rank, timeout_s, wait_for_commit, overwrite, async_save=false, staging_budget=None, caller_streams=None, integrity=false, derived_save_id=false))]
#[allow(clippy::too_many_arguments)]
fn save_rank<'py>(
    py: Python<'py>,
    checkpoint_dir: PathBuf,
    rank: u32,
    world_size: u32,
    save_id: String,
    tensors: Bound<'py, PyList>,
    objects: Vec<PyObject_>,
    common: Option<Vec<u8>>,
    megatron: bool,
    merge_rank: Option<u32>,
    timeout_s: f64,
    wait_for_commit: bool,
    overwrite: bool,
    async_save: bool,
    staging_budget: Option<usize>,
    caller_streams: Option<HashMap<u32, u64>>,
    integrity: bool,
    derived_save_id: bool,
) -> PyResult<Py<PyAny>> {
    let timeout = timeout_from_secs("timeout_s", timeout_s).map_err(to_py)?;
    if staging_budget == Some(0) {
        return Err(InvalidArgumentError::new_err(
            "staging_budget_bytes must be > 0 bytes (None: sized to this rank's bytes)",
        ));
    }
    let raw = raw_chunks(&tensors)?;
    let opts = SaveOptions {
        location: location(&checkpoint_dir).map_err(to_py)?,
        rank,
        world_size,
        save_id,
        megatron,
        merge_rank,
        timeout,
        wait_for_commit,
        overwrite,
        integrity,
        freshness: if derived_save_id {
            Freshness::this_launch()
        } else {
            Freshness::any_part()
        },
    };
    // Argument errors are raised here, before any side effect, for async saves too (the thread
    // would only report them at wait()).
    crate::save::check_options(&opts).map_err(to_py)?;
    // SAFETY: only the descriptions are read here, while the caller holds every tensor.
    for c in unsafe { chunks_of(&raw) } {
        crate::writer::check_chunk(&c).map_err(to_py)?;
    }
    let staged_bytes: u64 = raw.iter().map(|r| r.nbytes as u64).sum();
    let first_device = raw.iter().find_map(|r| r.device);
    let streams = caller_streams.unwrap_or_default();
    let budget = staging_budget.unwrap_or_else(|| staging::default_budget(staged_bytes));
    let t0 = std::time::Instant::now();
    if !async_save {
        let report = py
            .detach(|| {
                let pool = match first_device {
                    Some(d) => Some(staging::pool(budget, DEFAULT_BUFFER_BYTES, Some(d))?),
                    None => None,
                };
                // SAFETY: the caller keeps every tensor alive and unmodified until we return.
                let chunks = unsafe { chunks_of(&raw) };
                let st = pool.as_deref().map(|pool| Staging {
                    pool,
                    caller_streams: &streams,
                    on_staged: None,
                });
                rust_save_rank(
                    &opts,
                    &chunks,
                    &object_items(&objects),
                    common.as_deref(),
                    st,
                )
            })
            .map_err(to_py)?;
        return Ok(report_dict(py, &report)?.into_any().unbind());
    }
    let (staged_tx, staged_rx) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let pool = staging::pool(budget, DEFAULT_BUFFER_BYTES, first_device)?;
        // SAFETY: the Python caller blocks, holding every tensor, until `on_staged` has run (or this
        // thread ended); after that the writer reads only the staging buffers.
        let chunks = unsafe { chunks_of(&raw) };
        let on_staged: Box<dyn FnOnce() + Send> = Box::new(move || {
            let _ = staged_tx.send(());
        });
        let st = Staging {
            pool: &pool,
            caller_streams: &streams,
            on_staged: Some(on_staged),
        };
        rust_save_rank(
            &opts,
            &chunks,
            &object_items(&objects),
            common.as_deref(),
            Some(st),
        )
    });
    // Returns when staged, or when the thread ended first (an error before staging completed).
    py.detach(move || {
        let _ = staged_rx.recv();
    });
    let handle = SaveHandle {
        thread: Mutex::new(Some(thread)),
        outcome: Mutex::new(None),
        stall_s: t0.elapsed().as_secs_f64(),
        staged_bytes,
    };
    Ok(Py::new(py, handle)?.into_any())
}

/// Converts checkpoint `checkpoint_dir` to HF safetensors in `out_dir`; see `shardwise to-hf`.
/// `dtype` is bf16, fp16, fp32 or None (as stored); `max_shard_size` like "5GB"; `workers`
/// threads; `part` like "0/2" for one part of a split conversion; `overwrite` replaces an earlier
/// conversion in a non-empty `out_dir`. Returns the summary as a dict (tensors, bytes, files,
/// seconds, gb_per_s, skipped_keys, args_check, args_unchecked, padding_rows_dropped,
/// config_written, part, committed).
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, out_dir, hf_config=None, arch=None, dtype=None, max_shard_size="5GB", threads=None, allow_unmapped=false, overwrite=false, part=None))]
#[allow(clippy::too_many_arguments)]
fn to_hf(
    py: Python<'_>,
    checkpoint_dir: PathBuf,
    out_dir: PathBuf,
    hf_config: Option<PathBuf>,
    arch: Option<String>,
    dtype: Option<String>,
    max_shard_size: &str,
    threads: Option<usize>,
    allow_unmapped: bool,
    overwrite: bool,
    part: Option<String>,
) -> PyResult<Py<PyAny>> {
    let mut opts = crate::hf::HfOptions::from_user(
        hf_config,
        arch,
        dtype.as_deref(),
        max_shard_size,
        threads,
        allow_unmapped,
    )
    .map_err(to_py)?;
    opts.overwrite = overwrite;
    opts.part = part
        .as_deref()
        .map(crate::hf::Part::parse)
        .transpose()
        .map_err(to_py)?;
    let s = py
        .detach(|| {
            let loc = location(&checkpoint_dir)?;
            crate::hf::to_hf(&loc, &out_dir, &opts, &|_| {})
        })
        .map_err(to_py)?;
    let json = serde_json::to_string(&s).expect("serializable");
    Ok(py.import("json")?.call_method1("loads", (json,))?.unbind())
}

/// Compares checkpoints `a` and `b` (directories, URLs, or one HF safetensors folder); see
/// `shardwise diff`. Returns the report as JSON text (the Python wrapper decodes it).
#[pyfunction]
#[pyo3(signature = (a, b, atol=0.0, rtol=0.0, keys=Vec::new(), exclude=Vec::new(), hf_config=None, arch=None, allow_unmapped=false, threads=None))]
#[allow(clippy::too_many_arguments)]
fn diff_json(
    py: Python<'_>,
    a: PathBuf,
    b: PathBuf,
    atol: f64,
    rtol: f64,
    keys: Vec<String>,
    exclude: Vec<String>,
    hf_config: Option<PathBuf>,
    arch: Option<String>,
    allow_unmapped: bool,
    threads: Option<usize>,
) -> PyResult<String> {
    if !(atol >= 0.0 && rtol >= 0.0) {
        return Err(InvalidArgumentError::new_err(
            "atol and rtol must be numbers >= 0",
        ));
    }
    let threads = threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get().min(8)));
    let opts = crate::diff::DiffOptions {
        atol,
        rtol,
        keys,
        exclude,
        hf: crate::hf::HfOptions::from_user(
            hf_config,
            arch,
            None,
            "5GB",
            Some(threads),
            allow_unmapped,
        )
        .map_err(to_py)?,
        slab_bytes: 32 << 20,
        threads,
    };
    let report = py
        .detach(|| crate::diff::diff(&location(&a)?, &location(&b)?, &opts))
        .map_err(to_py)?;
    Ok(serde_json::to_string(&report).expect("serializable"))
}

/// A checkpoint path or URL as Python passed it (`str` or `os.PathLike`; a local path need not be
/// UTF-8: its undecodable bytes arrive as Python's surrogate escapes and are restored here).
fn location(p: &std::path::Path) -> crate::error::Result<Location> {
    Location::from_os(p.as_os_str())
}

/// Whether a CUDA driver can be loaded here (the GPU path is used only then). Never raises.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(crate::gpu::available)
}

/// Merges the parts of `save_id` and commits `.metadata`; see `shardwise merge`. Returns a dict:
/// `keys`, `tensor_chunks`, `data_bytes` (bytes) and `already_committed` (a racing merger or an
/// earlier merge committed; the counts are then that commit's). Raises `KeyboardInterrupt` when
/// Ctrl-C interrupts the wait (nothing committed).
#[pyfunction]
fn merge(
    py: Python<'_>,
    checkpoint_dir: PathBuf,
    save_id: String,
    world_size: u32,
    timeout_s: f64,
) -> PyResult<Bound<'_, PyDict>> {
    let timeout = timeout_from_secs("timeout_s", timeout_s).map_err(to_py)?;
    let s = py
        .detach(|| {
            let loc = location(&checkpoint_dir)?;
            crate::commit::merge(&loc, &save_id, world_size, timeout, &Freshness::any_part())
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("keys", s.keys)?;
    d.set_item("already_committed", s.already_committed)?;
    d.set_item("tensor_chunks", s.tensor_chunks)?;
    d.set_item("data_bytes", s.data_bytes)?;
    Ok(d)
}

/// An open checkpoint (any DCP / torch_dist checkpoint), parsed as data.
#[pyclass(frozen, name = "Checkpoint")]
struct PyCheckpoint {
    inner: Checkpoint,
}

fn storage_dict<'py>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
    s: &crate::format::metadata::StorageInfo,
) -> PyResult<()> {
    let _ = py;
    d.set_item("relative_path", &s.relative_path)?;
    d.set_item("offset", s.offset)?;
    d.set_item("length", s.length)?;
    Ok(())
}

#[pymethods]
impl PyCheckpoint {
    /// Number of keys.
    fn __len__(&self) -> usize {
        self.inner.metadata.entries.len()
    }

    /// Whether `key` is a key of the checkpoint.
    fn __contains__(&self, key: &str) -> bool {
        self.inner.metadata.entries.contains_key(key)
    }

    /// The checkpoint format in words (`PyTorch DCP` or `Megatron-Core torch_dist`).
    fn format_name(&self) -> &'static str {
        crate::cli::format_name(&self.inner.metadata.class)
    }

    /// Sorted keys (tensor fqns and byte-object keys).
    fn keys(&self) -> Vec<String> {
        self.inner.metadata.entries.keys().cloned().collect()
    }

    /// `("tensor", dtype, global_shape)` or `("object", None, None)` for `key`: what a loader needs
    /// per key, without building a dict per chunk as [`metadata`](Self::metadata) does (at 1M chunks
    /// that costs seconds). Raises `MissingKeyError` for a key the checkpoint does not hold.
    fn describe(
        &self,
        key: &str,
    ) -> PyResult<(&'static str, Option<&'static str>, Option<Vec<u64>>)> {
        match self.inner.metadata.entries.get(key) {
            Some(Entry::Tensor {
                dtype,
                global_shape,
                ..
            }) => Ok((
                "tensor",
                Some(dtype.torch_name()),
                Some(global_shape.clone()),
            )),
            Some(Entry::Bytes { .. }) => Ok(("object", None, None)),
            None => Err(to_py(Error::MissingKey {
                key: key.to_owned(),
                dir: self.inner.dir().to_path_buf(),
            })),
        }
    }

    /// `{"kind": "tensor", "dtype", "global_shape", "chunks": [{"offsets", "sizes", "relative_path",
    /// "offset", "length"}]}` or `{"kind": "object", "relative_path", "offset", "length"}`.
    fn metadata<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match self.inner.entry(key).map_err(to_py)? {
            Entry::Tensor {
                dtype,
                global_shape,
                chunks,
            } => {
                d.set_item("kind", "tensor")?;
                d.set_item("dtype", dtype.torch_name())?;
                d.set_item("global_shape", global_shape.clone())?;
                let list = PyList::empty(py);
                for c in chunks {
                    let cd = PyDict::new(py);
                    cd.set_item("offsets", c.offsets.clone())?;
                    cd.set_item("sizes", c.sizes.clone())?;
                    storage_dict(py, &cd, &c.storage)?;
                    list.append(cd)?;
                }
                d.set_item("chunks", list)?;
            }
            Entry::Bytes { storage } => {
                d.set_item("kind", "object")?;
                storage_dict(py, &d, storage)?;
            }
        }
        Ok(d)
    }

    /// Reads the region `offsets`/`sizes` (elements) of tensor `key` into `nbytes` bytes of
    /// contiguous memory at `data_ptr` (C order), which the caller owns and keeps alive.
    fn read_into(
        &self,
        py: Python<'_>,
        key: &str,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
        data_ptr: usize,
        nbytes: usize,
    ) -> PyResult<()> {
        py.detach(|| {
            let out: &mut [u8] = if nbytes == 0 {
                &mut []
            } else {
                // SAFETY: the Python wrapper passes a freshly allocated contiguous tensor's data_ptr()
                // and nbytes, and keeps the tensor alive until this call returns.
                unsafe { std::slice::from_raw_parts_mut(data_ptr as *mut u8, nbytes) }
            };
            crate::load::read_region(&self.inner, key, &offsets, &sizes, out)
        })
        .map_err(to_py)
    }

    /// Loads many regions at once, straight into the caller's memory (`crate::load`).
    ///
    /// `requests`: `(key, offsets, sizes, data_ptr, nbytes, device)` tuples: the region
    /// `offsets`/`sizes` (elements) of tensor `key` into `nbytes` bytes of C-contiguous memory at
    /// `data_ptr` in the checkpoint's dtype; `device` -1 for host memory, else the CUDA ordinal
    /// (filled through a pinned staging pool of at most `staging_budget_bytes`, with
    /// `cuda_stream` ordered after the copies). Every request is validated before any read. The
    /// caller keeps every destination alive and untouched until this returns. Returns
    /// `{"bytes_read", "read_ops", "requests", "seconds", "plan_seconds", "items_checked",
    /// "items_unchecked"}`. Raises `MissingKeyError`, `InvalidArgumentError`, `ValidationError`
    /// (region not covered), `CorruptFileError` (missing or truncated data file, CRC-32
    /// mismatch; names key, file and offset), `StorageError`, `GpuError`.
    #[pyo3(signature = (requests, *, staging_budget_bytes=None, cuda_stream=0, check_crc=true, timeout_s=None))]
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<LoadRequest>,
        staging_budget_bytes: Option<usize>,
        cuda_stream: u64,
        check_crc: bool,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = timeout_s
            .map(|t| timeout_from_secs("timeout_s", t))
            .transpose()
            .map_err(to_py)?;
        let mut reqs = Vec::with_capacity(requests.len());
        for (key, offsets, sizes, ptr, nbytes, device) in requests {
            let device = match device {
                -1 => None,
                d => Some(u32::try_from(d).map_err(|_| {
                    InvalidArgumentError::new_err(format!(
                        "{key}: device {d} is neither -1 (host) nor a CUDA ordinal"
                    ))
                })?),
            };
            reqs.push(crate::load::Request {
                key,
                offsets,
                sizes,
                ptr,
                nbytes,
                device,
            });
        }
        let opts = crate::load::LoadOptions {
            staging_budget: staging_budget_bytes,
            cuda_stream,
            check_crc,
            timeout,
            threads: None,
        };
        // SAFETY: the Python caller passes the data_ptr()/nbytes of live contiguous tensors it
        // keeps alive, and does not touch, until this call returns (the contract of load_into).
        let s = py
            .detach(|| unsafe { crate::load::load(&self.inner, &reqs, &opts) })
            .map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("read_ops", s.read_ops)?;
        d.set_item("requests", s.requests)?;
        d.set_item("seconds", s.seconds)?;
        d.set_item("plan_seconds", s.plan_seconds)?;
        d.set_item("items_checked", s.items_checked)?;
        d.set_item("items_unchecked", s.items_unchecked)?;
        Ok(d)
    }

    /// The common state as `(source, bytes)`: `common.pt`, or the `common_state` object of
    /// megatron-core 0.19 (`source` is then its key); None when there is neither. Raw torch.save
    /// bytes (never unpickled here) whose zip records passed their CRC-32s.
    fn read_common<'py>(&self, py: Python<'py>) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        let common = py.detach(|| self.inner.read_common()).map_err(to_py)?;
        Ok(common.map(|c| (c.source, PyBytes::new(py, &c.bytes))))
    }

    /// The raw bytes of byte object `key`: a torch.save archive (never unpickled here).
    fn read_bytes<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py
            .detach(|| self.inner.read_bytes(key, 1 << 34))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &bytes))
    }
}

/// Opens a checkpoint directory; raises a `ShardwiseError` subclass when `.metadata` is missing or
/// not DCP metadata.
#[pyfunction]
fn open_checkpoint(py: Python<'_>, path: PathBuf) -> PyResult<PyCheckpoint> {
    py.detach(|| Checkpoint::open(&location(&path)?))
        .map(|inner| PyCheckpoint { inner })
        .map_err(to_py)
}

/// Runs the `shardwise` command line with `argv` (program name first; `str`, where the bytes of a
/// non-UTF-8 path are surrogate escapes, as in `sys.argv` and `os.fsdecode`); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> i32 {
    py.detach(|| crate::cli::run(argv))
}

/// Whether `checkpoint_dir` holds a committed, whole checkpoint: the one definition shared with
/// the save and `shardwise status` (`crate::commit::state`). Never raises for a missing or
/// unreadable directory (False).
#[pyfunction]
fn is_committed(py: Python<'_>, checkpoint_dir: PathBuf) -> bool {
    py.detach(|| location(&checkpoint_dir).is_ok_and(|l| crate::commit::state::is_committed(&l)))
}

/// The thread that imported the module: Python's main thread, the only one that runs signal
/// handlers.
static MAIN_THREAD: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();

/// Whether two checkpoints hold the same tensors by their save-time CRC-32s (sidecars only, no
/// data read); None when either was not saved by shardwise. See `crate::commit::same_tensor_crcs`.
#[pyfunction]
fn same_tensor_crcs(py: Python<'_>, a: PathBuf, b: PathBuf) -> PyResult<Option<bool>> {
    py.detach(|| crate::commit::same_tensor_crcs(&location(&a)?, &location(&b)?))
        .map_err(to_py)
}

/// The interrupt check of every bounded wait: in Python's main thread, runs Python's signal handlers
/// and reports whether one raised (`KeyboardInterrupt` on Ctrl-C). Other threads (an async save's)
/// never run handlers, so they do not take the GIL for it.
fn python_interrupted() -> bool {
    MAIN_THREAD.get() == Some(&std::thread::current().id())
        && Python::attach(|py| py.check_signals().is_err())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let _ = MAIN_THREAD.set(std::thread::current().id());
    crate::interrupt::set_interrupt_check(python_interrupted);
    m.add_function(wrap_pyfunction!(is_committed, m)?)?;
    m.add_function(wrap_pyfunction!(same_tensor_crcs, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(save_rank, m)?)?;
    m.add_function(wrap_pyfunction!(merge, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(open_checkpoint, m)?)?;
    m.add_class::<PyCheckpoint>()?;
    m.add("ShardwiseError", py.get_type::<ShardwiseError>())?;
    m.add(
        "UnsupportedDtypeError",
        py.get_type::<UnsupportedDtypeError>(),
    )?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("MissingKeyError", py.get_type::<MissingKeyError>())?;
    m.add("ValidationError", py.get_type::<ValidationError>())?;
    m.add("MissingRanksError", py.get_type::<MissingRanksError>())?;
    m.add("NotCommittedError", py.get_type::<NotCommittedError>())?;
    m.add(
        "CheckpointExistsError",
        py.get_type::<CheckpointExistsError>(),
    )?;
    m.add("StorageError", py.get_type::<StorageError>())?;
    m.add("CorruptFileError", py.get_type::<CorruptFileError>())?;
    m.add("GpuError", py.get_type::<GpuError>())?;
    m.add_class::<SaveHandle>()?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(to_hf, m)?)?;
    m.add_function(wrap_pyfunction!(diff_json, m)?)?;
    Ok(())
}
