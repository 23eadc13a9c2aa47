//! One rank's save from Python: the chunk and object descriptions, `save_rank` and the handle of
//! an asynchronous save.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::report::report_dict;
use super::{location, to_py, InvalidArgumentError, NotCommittedError, ShardwiseError};
use crate::commit::part::ObjectShard;
use crate::commit::wait::{timeout_from_secs, Freshness};
use crate::format::dtype::DType;
use crate::save::{save_rank as rust_save_rank, ObjectItem, SaveOptions, SaveReport};
use crate::staging::{self, DEFAULT_BUFFER_BYTES};
use crate::writer::{ByteObject, Payload, Staging, TensorChunk};

pub(super) type PyObject_ = (String, Vec<u8>, Option<(String, Vec<u64>, Vec<u64>)>);

/// A tensor chunk as the Python side describes it: `(fqn, dtype, global_shape, offsets, sizes,
/// data_ptr, nbytes[, device])`, `device` being the CUDA ordinal or -1 (absent) for host memory.
pub(super) struct RawChunk {
    fqn: String,
    dtype: DType,
    global_shape: Vec<u64>,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    ptr: usize,
    nbytes: usize,
    device: Option<u32>,
}

pub(super) fn raw_chunks(tensors: &Bound<'_, PyList>) -> PyResult<Vec<RawChunk>> {
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
pub(super) unsafe fn chunks_of(raw: &[RawChunk]) -> Vec<TensorChunk<'static>> {
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

pub(super) fn object_items(objects: &[PyObject_]) -> Vec<ObjectItem<'_>> {
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

/// An asynchronous save in flight: its data is staged in host memory; persistence and the
/// rendezvous go on in a Rust thread without the GIL.
#[pyclass(frozen, name = "SaveHandle")]
pub(super) struct SaveHandle {
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
pub(super) fn save_rank<'py>(
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
        location: location(&checkpoint_dir)
            .and_then(|l| l.with_timeout(Some(timeout)))
            .map_err(to_py)?,
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
