//! One rank's save from Python: the typed descriptions (`Chunk`, `ObjectItem`, `SaveOptions`),
//! `save_rank` and the handle of an asynchronous save.
//!
//! Each description checks itself when it is made, so `save_rank` receives checked values and raises
//! argument errors before any side effect (for an async save too, whose thread could only report
//! them at `wait()`). The shape follows safetensors' `TensorSpec` (`bindings/python/src/lib.rs`):
//! frozen classes, keyword-only constructors that validate, a `__repr__`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::args::{opt_positive, opt_seconds, opt_whole, positive, seconds, whole, wholes};
use super::report::to_dict;
use super::{
    invalid_argument, invalid_argument_type, location, to_py, NotCommittedError, ShardwiseError,
};
use shardwise::commit::part::ObjectShard;
use shardwise::format::dtype::DType;
use shardwise::save::{save_rank as rust_save_rank, SaveReport};
use shardwise::staging::{self, DEFAULT_BUFFER_BYTES};
use shardwise::writer::{ByteObject, Payload, Staging, TensorChunk};

/// One chunk of a tensor that this rank writes, described by where its memory is.
///
/// `Chunk(*, fqn, dtype, global_shape, offsets, sizes, data_ptr, nbytes, device=None)`:
/// `fqn` the DCP key (Megatron's `ShardedTensor.key`); `dtype` a torch dtype name (`"torch.bfloat16"`
/// or `"bfloat16"`); `global_shape`, `offsets` (the chunk's global offset) and `sizes` in elements,
/// one per dimension, prepended axes included; `nbytes` bytes of C-contiguous memory at address
/// `data_ptr`: host memory, or memory of CUDA device `device` (its ordinal). The memory must stay
/// valid and unchanged until `save_rank` returns (an async save: until it returns its handle).
///
/// Raises `InvalidArgumentError` (a number that is not a whole number >= 0, dimensions that differ,
/// `nbytes` other than `prod(sizes)` × the dtype's item size, a null `data_ptr`) or
/// `UnsupportedDtypeError`.
#[pyclass(frozen, module = "shardwise._native")]
#[derive(Clone)]
pub(super) struct Chunk {
    #[pyo3(get)]
    fqn: String,
    dtype: DType,
    #[pyo3(get)]
    global_shape: Vec<u64>,
    #[pyo3(get)]
    offsets: Vec<u64>,
    #[pyo3(get)]
    sizes: Vec<u64>,
    #[pyo3(get)]
    data_ptr: u64,
    #[pyo3(get)]
    nbytes: u64,
    #[pyo3(get)]
    device: Option<u32>,
}

#[pymethods]
impl Chunk {
    #[new]
    #[pyo3(signature = (*, fqn, dtype, global_shape, offsets, sizes, data_ptr, nbytes, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        fqn: String,
        dtype: &str,
        global_shape: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
        data_ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let chunk = Chunk {
            dtype: DType::from_torch_name(dtype).map_err(to_py)?,
            global_shape: wholes("global_shape", global_shape)?,
            offsets: wholes("offsets", offsets)?,
            sizes: wholes("sizes", sizes)?,
            data_ptr: whole("data_ptr", data_ptr)?,
            nbytes: whole("nbytes", nbytes)?,
            device: opt_whole("device", device)?,
            fqn,
        };
        if chunk.data_ptr == 0 && chunk.nbytes > 0 {
            return Err(invalid_argument(format!(
                "{}: data_ptr is null for {} bytes",
                chunk.fqn, chunk.nbytes
            )));
        }
        shardwise::writer::check_chunk(&chunk.layout()).map_err(to_py)?;
        Ok(chunk)
    }

    /// The torch dtype name, e.g. `"torch.bfloat16"`.
    #[getter]
    fn dtype(&self) -> String {
        format!("torch.{}", self.dtype.torch_name())
    }

    fn __repr__(&self) -> String {
        format!(
            "Chunk(fqn={:?}, dtype='torch.{}', global_shape={:?}, offsets={:?}, sizes={:?}, data_ptr={:#x}, nbytes={}, device={})",
            self.fqn,
            self.dtype.torch_name(),
            self.global_shape,
            self.offsets,
            self.sizes,
            self.data_ptr,
            self.nbytes,
            self.device.map_or("None".to_owned(), |d| d.to_string())
        )
    }
}

impl Chunk {
    /// The chunk with its payload given by its size alone, for [`shardwise::writer::check_chunk`]: a
    /// `Device` payload is a description the check never dereferences, so no memory is touched.
    fn layout(&self) -> TensorChunk<'static> {
        TensorChunk {
            fqn: self.fqn.clone(),
            dtype: self.dtype,
            global_shape: self.global_shape.clone(),
            offsets: self.offsets.clone(),
            sizes: self.sizes.clone(),
            data: Payload::Device {
                ptr: self.data_ptr,
                len: self.nbytes,
                device: self.device.unwrap_or(0),
            },
        }
    }

    /// The chunk as the writer reads it.
    ///
    /// # Safety
    /// A host chunk's `data_ptr..data_ptr + nbytes` must stay valid and unmodified for as long as the
    /// result is read (until staging completes, or until the save returns without staging).
    unsafe fn tensor_chunk(&self) -> TensorChunk<'static> {
        let data = match self.device {
            Some(device) => Payload::Device {
                ptr: self.data_ptr,
                len: self.nbytes,
                device,
            },
            None if self.nbytes == 0 => Payload::Host(&[]),
            // SAFETY: non-null (checked by `new`), and valid by this function's contract.
            None => Payload::Host(unsafe {
                std::slice::from_raw_parts(self.data_ptr as *const u8, self.nbytes as usize)
            }),
        };
        TensorChunk {
            data,
            ..self.layout()
        }
    }
}

/// One byte object: `data` (the `torch.save` bytes) under DCP key `fqn`, with a Megatron
/// `ShardedObject`'s position when it is one.
///
/// `ObjectItem(*, fqn, data, key=None, global_shape=None, global_offset=None)`: `key`,
/// `global_shape` and `global_offset` (whole numbers, one per dimension) are all given or all None.
///
/// Raises `InvalidArgumentError` when `data` is not `bytes` or the position is partial.
#[pyclass(frozen, module = "shardwise._native")]
#[derive(Clone)]
pub(super) struct ObjectItem {
    #[pyo3(get)]
    fqn: String,
    data: Vec<u8>,
    shard: Option<ObjectShard>,
}

#[pymethods]
impl ObjectItem {
    #[new]
    #[pyo3(signature = (*, fqn, data, key=None, global_shape=None, global_offset=None))]
    fn new(
        fqn: String,
        data: &Bound<'_, PyAny>,
        key: Option<String>,
        global_shape: Option<&Bound<'_, PyAny>>,
        global_offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let data = data
            .cast::<PyBytes>()
            .map_err(|_| invalid_argument_type(format!("{fqn}: data must be bytes")))?
            .as_bytes()
            .to_vec();
        let shard = match (key, global_shape, global_offset) {
            (None, None, None) => None,
            (Some(key), Some(shape), Some(offset)) => {
                let shard = ObjectShard {
                    key,
                    global_shape: wholes("global_shape", shape)?,
                    global_offset: wholes("global_offset", offset)?,
                };
                if shard.global_shape.len() != shard.global_offset.len() {
                    return Err(invalid_argument(format!(
                        "{fqn}: global_shape {:?} and global_offset {:?} differ in dimensions",
                        shard.global_shape, shard.global_offset
                    )));
                }
                Some(shard)
            }
            _ => {
                return Err(invalid_argument(format!(
                    "{fqn}: key, global_shape and global_offset are all given or all None"
                )))
            }
        };
        Ok(ObjectItem { fqn, data, shard })
    }

    /// The ShardedObject's base key, or None.
    #[getter]
    fn key(&self) -> Option<&str> {
        self.shard.as_ref().map(|s| s.key.as_str())
    }

    /// Size of `data` in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.data.len()
    }

    fn __repr__(&self) -> String {
        match &self.shard {
            None => format!("ObjectItem(fqn={:?}, data=<{} bytes>)", self.fqn, self.data.len()),
            Some(s) => format!(
                "ObjectItem(fqn={:?}, data=<{} bytes>, key={:?}, global_shape={:?}, global_offset={:?})",
                self.fqn,
                self.data.len(),
                s.key,
                s.global_shape,
                s.global_offset
            ),
        }
    }
}

impl ObjectItem {
    fn item(&self) -> shardwise::save::ObjectItem<'_> {
        shardwise::save::ObjectItem {
            object: ByteObject {
                fqn: self.fqn.clone(),
                bytes: &self.data,
            },
            shard: self.shard.clone(),
        }
    }
}

/// How this rank saves.
///
/// `SaveOptions(*, checkpoint_dir, rank, world_size, save_id, timeout_s, merge_rank,
/// wait_for_commit=True, overwrite=False, async_save=False, staging_budget_bytes=None,
/// integrity=False, derived_save_id=False, megatron=True)`:
/// `checkpoint_dir` a directory or object-store URL; `rank` in `0..world_size`; `save_id` equal on
/// every rank; `timeout_s` the bound in seconds of every wait; `merge_rank` the rank that commits
/// (None: nobody, `shardwise merge` does); `staging_budget_bytes` host staging memory in bytes
/// (None: sized to this rank's bytes); `integrity` writes megatron-core 0.19's `integrity.json`;
/// `derived_save_id` says the id was derived alike by every launch (`default_save_id`): the save
/// joins an attempt of it numbered from what the directory holds, and parts written before this
/// process started are an earlier launch's; `megatron` writes Megatron's
/// `metadata.json`. See `shardwise.megatron.save`.
///
/// Raises `InvalidArgumentError`: rank, world_size, merge_rank or save_id out of range, a
/// timeout that is not a finite number of seconds in `0..=MAX_TIMEOUT_S`, a staging budget that is
/// not a whole number >= 1.
#[pyclass(frozen, module = "shardwise._native")]
pub(super) struct SaveOptions {
    inner: shardwise::save::SaveOptions,
    #[pyo3(get)]
    async_save: bool,
    #[pyo3(get)]
    staging_budget_bytes: Option<usize>,
}

#[pymethods]
impl SaveOptions {
    #[new]
    #[pyo3(signature = (*, checkpoint_dir, rank, world_size, save_id, timeout_s, merge_rank, wait_for_commit=true, overwrite=false, async_save=false, staging_budget_bytes=None, integrity=false, derived_save_id=false, megatron=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        checkpoint_dir: PathBuf,
        rank: &Bound<'_, PyAny>,
        world_size: &Bound<'_, PyAny>,
        save_id: String,
        timeout_s: &Bound<'_, PyAny>,
        merge_rank: Option<&Bound<'_, PyAny>>,
        wait_for_commit: bool,
        overwrite: bool,
        async_save: bool,
        staging_budget_bytes: Option<&Bound<'_, PyAny>>,
        integrity: bool,
        derived_save_id: bool,
        megatron: bool,
    ) -> PyResult<Self> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let inner = shardwise::save::SaveOptions {
            // Every object-store request of the save is bounded by the save's timeout too.
            location: location(&checkpoint_dir)
                .and_then(|l| l.with_timeout(Some(timeout)))
                .map_err(to_py)?,
            rank: whole("rank", rank)?,
            world_size: positive("world_size", world_size)?,
            save_id,
            megatron,
            merge_rank: opt_whole("merge_rank", merge_rank)?,
            timeout,
            wait_for_commit,
            overwrite,
            integrity,
            derived_save_id,
        };
        shardwise::save::check_options(&inner).map_err(to_py)?;
        let staging_budget_bytes = opt_positive("staging_budget_bytes", staging_budget_bytes)?;
        Ok(SaveOptions {
            inner,
            async_save,
            staging_budget_bytes,
        })
    }

    /// The checkpoint directory or URL.
    #[getter]
    fn checkpoint_dir(&self) -> String {
        self.inner.location.to_string()
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    #[getter]
    fn save_id(&self) -> &str {
        &self.inner.save_id
    }

    #[getter]
    fn merge_rank(&self) -> Option<u32> {
        self.inner.merge_rank
    }

    /// The bound of every wait, in seconds.
    #[getter]
    fn timeout_s(&self) -> f64 {
        self.inner.timeout.as_secs_f64()
    }

    fn __repr__(&self) -> String {
        let o = &self.inner;
        format!(
            "SaveOptions(checkpoint_dir={:?}, rank={}, world_size={}, save_id={:?}, timeout_s={}, merge_rank={}, wait_for_commit={}, overwrite={}, async_save={}, staging_budget_bytes={}, integrity={}, megatron={})",
            o.location.to_string(),
            o.rank,
            o.world_size,
            o.save_id,
            o.timeout.as_secs_f64(),
            o.merge_rank.map_or("None".to_owned(), |m| m.to_string()),
            py_bool(o.wait_for_commit),
            py_bool(o.overwrite),
            py_bool(self.async_save),
            self.staging_budget_bytes.map_or("None".to_owned(), |b| b.to_string()),
            py_bool(o.integrity),
            py_bool(o.megatron),
        )
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// An asynchronous save in flight: its data is staged in host memory; persistence and the
/// rendezvous go on in a Rust thread without the GIL.
#[pyclass(frozen, name = "SaveHandle", module = "shardwise._native")]
pub(super) struct SaveHandle {
    thread: Mutex<Option<std::thread::JoinHandle<shardwise::Result<SaveReport>>>>,
    outcome: Mutex<Option<PyResult<Py<PyAny>>>>,
    /// Seconds the caller was blocked: from the call until every byte was staged.
    #[pyo3(get)]
    stall_s: f64,
    /// Payload bytes staged (tensor bytes of this rank's main replicas).
    #[pyo3(get)]
    staged_bytes: u64,
    /// Whether a `wait` has returned the save's outcome (its report, or raised its error) to the
    /// caller; the exit hook of `shardwise.save` waits only for saves whose outcome nobody saw.
    delivered: AtomicBool,
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

    /// Waits up to `timeout_s` seconds (None: until the save ends, which its own `timeout_s` bounds
    /// except for the writes) and returns the save's report dict (as `save_rank`'s).
    ///
    /// Raises the save's own `ShardwiseError` if it failed, `NotCommittedError` when it is still in
    /// flight at `timeout_s`, `InvalidArgumentError` for a timeout that is not a finite number of
    /// seconds in `0..=MAX_TIMEOUT_S`, and what a signal handler raises (`KeyboardInterrupt` on
    /// Ctrl-C) within 5 ms of the signal; the save itself goes on, and a later `wait` returns its
    /// outcome.
    #[pyo3(signature = (timeout_s=None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        timeout_s: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = opt_seconds("timeout_s", timeout_s)?;
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(done) = self.outcome.lock().unwrap().as_ref() {
                self.delivered.store(true, Ordering::Relaxed);
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
                    Some(Ok(Ok(report))) => to_dict(py, &report).map(|d| d.unbind()),
                    Some(Ok(Err(e))) => Err(to_py(e)),
                    Some(Err(_)) => Err(ShardwiseError::new_err("the save thread panicked")),
                    None => Err(ShardwiseError::new_err("the save thread is gone")),
                };
                *self.outcome.lock().unwrap() = Some(result);
                continue;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(NotCommittedError::new_err(format!(
                    "save still in flight after {:.1}s",
                    timeout.unwrap_or_default().as_secs_f64()
                )));
            }
            // Ctrl-C answers within a poll, as every other wait does; the save goes on in its
            // thread, and a later wait() still gets its outcome.
            py.check_signals()?;
            py.detach(|| std::thread::sleep(Duration::from_millis(5)));
        }
    }

    /// Whether a `wait` has returned this save's outcome (its report, or raised its error).
    #[getter]
    fn outcome_delivered(&self) -> bool {
        self.delivered.load(Ordering::Relaxed)
    }

    fn __repr__(&self) -> String {
        format!(
            "<shardwise SaveHandle {}, {} bytes staged in {:.3} s>",
            if self.done() { "done" } else { "in flight" },
            self.staged_bytes,
            self.stall_s
        )
    }
}

/// Saves this rank's `chunks` (a list of `Chunk`), `objects` (a list of `ObjectItem`) and, on the
/// rank that writes it, `common` (the `torch.save` bytes of `common.pt`, else None), as `options`
/// say. `caller_streams` maps each CUDA device of the chunks to the caller's current stream
/// (`torch.cuda.current_stream(d).cuda_stream`): the copies start after the work queued there.
///
/// CUDA chunks, and every chunk when `options.async_save`, go through the process's staging pool of
/// `options.staging_budget_bytes` bytes (pinned when CUDA is there). Returns the report dict (the
/// fields of `shardwise::save::SaveReport`: `rank`, `save_id`, `data_file`, `data_bytes` (this rank's
/// bytes), `write_s` and `rendezvous_s` (seconds), `committed`, and `commit`: on the merging rank
/// the merge's report, the fields of `shardwise merge --json`, else None), or with `async_save` a
/// `SaveHandle` as soon as every byte is staged. Raises a `ShardwiseError` subclass.
#[pyfunction]
#[pyo3(signature = (options, chunks, objects, common, *, caller_streams=None))]
pub(super) fn save_rank<'py>(
    py: Python<'py>,
    options: &Bound<'py, SaveOptions>,
    chunks: Vec<Bound<'py, Chunk>>,
    objects: Vec<Bound<'py, ObjectItem>>,
    common: Option<Vec<u8>>,
    caller_streams: Option<HashMap<u32, u64>>,
) -> PyResult<Py<PyAny>> {
    let options = options.get();
    let opts = options.inner.clone();
    let chunks: Vec<Chunk> = chunks.iter().map(|c| c.get().clone()).collect();
    let objects: Vec<ObjectItem> = objects.iter().map(|o| o.get().clone()).collect();
    let staged_bytes: u64 = chunks.iter().map(|c| c.nbytes).sum();
    let first_device = chunks.iter().find_map(|c| c.device);
    let streams = caller_streams.unwrap_or_default();
    let budget = options
        .staging_budget_bytes
        .unwrap_or_else(|| staging::default_budget(staged_bytes));
    let t0 = Instant::now();
    if !options.async_save {
        let report = py
            .detach(|| {
                let pool = match first_device {
                    Some(d) => Some(staging::pool(budget, DEFAULT_BUFFER_BYTES, Some(d))?),
                    None => None,
                };
                // SAFETY: the caller keeps every chunk's memory alive and unmodified until we return.
                let tensors: Vec<_> = chunks.iter().map(|c| unsafe { c.tensor_chunk() }).collect();
                let items: Vec<_> = objects.iter().map(ObjectItem::item).collect();
                let st = pool.as_deref().map(|pool| Staging {
                    pool,
                    caller_streams: &streams,
                    on_staged: None,
                });
                rust_save_rank(&opts, &tensors, &items, common.as_deref(), st)
            })
            .map_err(to_py)?;
        return Ok(to_dict(py, &report)?.unbind());
    }
    let (staged_tx, staged_rx) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let pool = staging::pool(budget, DEFAULT_BUFFER_BYTES, first_device)?;
        // SAFETY: the Python caller blocks, holding every chunk's memory, until `on_staged` has run
        // (or this thread ended); after that the writer reads only the staging buffers.
        let tensors: Vec<_> = chunks.iter().map(|c| unsafe { c.tensor_chunk() }).collect();
        let items: Vec<_> = objects.iter().map(ObjectItem::item).collect();
        let on_staged: Box<dyn FnOnce() + Send> = Box::new(move || {
            let _ = staged_tx.send(());
        });
        let st = Staging {
            pool: &pool,
            caller_streams: &streams,
            on_staged: Some(on_staged),
        };
        rust_save_rank(&opts, &tensors, &items, common.as_deref(), Some(st))
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
        delivered: AtomicBool::new(false),
    };
    Ok(Py::new(py, handle)?.into_any())
}

/// Starts pinning the process's staging pool in a background thread, for a rank of `rank_bytes`
/// bytes (the pool a save of that many bytes uses by default: `rank_bytes` plus one 64 MiB
/// buffer, within the host bound) or of `staging_budget_bytes` when given, on CUDA device
/// `device`. Returns at once with a dict: `pinned` (False without a CUDA device or driver: plain
/// memory costs nothing to reserve, and nothing is done), `rank_bytes`, `budget_bytes`, `buffer_bytes`,
/// `buffers` (the pool's capacity in buffers). Raises
/// `InvalidArgumentError` for a bad number, `GpuError` when pinning fails at once.
#[pyfunction]
#[pyo3(signature = (*, rank_bytes, device=None, staging_budget_bytes=None))]
pub(super) fn reserve_staging<'py>(
    py: Python<'py>,
    rank_bytes: &Bound<'py, PyAny>,
    device: Option<&Bound<'py, PyAny>>,
    staging_budget_bytes: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let rank_bytes: u64 = whole("rank_bytes", rank_bytes)?;
    let device: Option<u32> = opt_whole("device", device)?;
    let budget = opt_positive("staging_budget_bytes", staging_budget_bytes)?
        .unwrap_or_else(|| staging::default_budget(rank_bytes));
    let reserved = match device {
        Some(d) if shardwise::gpu::available() => {
            let (buffer_bytes, buffers) =
                py.detach(|| staging::reserve(budget, d)).map_err(to_py)?;
            Some((buffer_bytes, buffers))
        }
        _ => None,
    };
    let dict = pyo3::types::PyDict::new(py);
    dict.set_item("pinned", reserved.is_some())?;
    dict.set_item("rank_bytes", rank_bytes)?;
    dict.set_item("budget_bytes", budget)?;
    dict.set_item("buffer_bytes", reserved.map_or(0, |r| r.0))?;
    dict.set_item("buffers", reserved.map_or(0, |r| r.1))?;
    Ok(dict.into_any())
}
