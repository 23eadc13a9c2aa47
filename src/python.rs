//! The `shardwise._native` extension module: thin wrappers that release the GIL and map
//! [`crate::Error`] variants to `shardwise.ShardwiseError` subclasses.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::Error;
use crate::format::dtype::DType;
use crate::format::metadata::Entry;
use crate::reader::Checkpoint;
use crate::rendezvous::{self, ObjectShard};
use crate::save::{save_rank as rust_save_rank, ObjectItem, SaveOptions};
use crate::writer::{ByteObject, TensorChunk};

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
    ValidationError,
    ShardwiseError,
    "The merged save is not a valid checkpoint; nothing was committed."
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
    CorruptFileError,
    ShardwiseError,
    "A shardwise or checkpoint file is malformed."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::UnsupportedDtype(_) => UnsupportedDtypeError::new_err(msg),
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        Error::Validation(_) => ValidationError::new_err(msg),
        Error::MissingRanks { .. } => MissingRanksError::new_err(msg),
        Error::NotCommitted { .. } => NotCommittedError::new_err(msg),
        Error::CheckpointExists(_) => CheckpointExistsError::new_err(msg),
        Error::Io { .. } => StorageError::new_err(msg),
        Error::Corrupt { .. } => CorruptFileError::new_err(msg),
    }
}

type PyTensor = (String, String, Vec<u64>, Vec<u64>, Vec<u64>, usize, usize);
type PyObject_ = (String, Vec<u8>, Option<(String, Vec<u64>, Vec<u64>)>);

/// Saves one rank. `tensors` are `(fqn, dtype, global_shape, offsets, sizes, data_ptr, nbytes)`
/// for contiguous CPU memory that the caller keeps alive for the duration of the call; `objects`
/// are `(fqn, torch_save_bytes, (key, global_shape, global_offset) | None)`. Returns the report as
/// a dict. Raises a `ShardwiseError` subclass.
#[pyfunction]
#[pyo3(signature = (checkpoint_dir, rank, world_size, save_id, tensors, objects, common, megatron, merge_rank, timeout_s, wait_for_commit, overwrite))]
#[allow(clippy::too_many_arguments)]
fn save_rank<'py>(
    py: Python<'py>,
    checkpoint_dir: PathBuf,
    rank: u32,
    world_size: u32,
    save_id: String,
    tensors: Vec<PyTensor>,
    objects: Vec<PyObject_>,
    common: Option<Vec<u8>>,
    megatron: bool,
    merge_rank: Option<u32>,
    timeout_s: f64,
    wait_for_commit: bool,
    overwrite: bool,
) -> PyResult<Bound<'py, PyDict>> {
    if !(timeout_s.is_finite() && timeout_s >= 0.0) {
        return Err(InvalidArgumentError::new_err(format!(
            "timeout_s must be a finite number >= 0, got {timeout_s}"
        )));
    }
    let opts = SaveOptions {
        dir: checkpoint_dir,
        rank,
        world_size,
        save_id,
        megatron,
        merge_rank,
        timeout: Duration::from_secs_f64(timeout_s),
        wait_for_commit,
        overwrite,
    };
    let report = py
        .detach(|| {
            let mut chunks = Vec::with_capacity(tensors.len());
            for (fqn, dtype, global_shape, offsets, sizes, ptr, nbytes) in tensors {
                let dtype = DType::from_torch_name(&dtype)?;
                let data: &[u8] = if nbytes == 0 {
                    &[]
                } else {
                    // SAFETY: the Python caller passes data_ptr()/nbytes of contiguous CPU tensors and
                    // holds references to them until this call returns.
                    unsafe { std::slice::from_raw_parts(ptr as *const u8, nbytes) }
                };
                chunks.push(TensorChunk {
                    fqn,
                    dtype,
                    global_shape,
                    offsets,
                    sizes,
                    data,
                });
            }
            let items: Vec<ObjectItem> = objects
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
                .collect();
            rust_save_rank(&opts, &chunks, &items, common.as_deref())
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("rank", report.rank)?;
    d.set_item("save_id", report.save_id)?;
    d.set_item("data_file", report.data_file)?;
    d.set_item("data_bytes", report.data_bytes)?;
    d.set_item("write_s", report.write_s)?;
    d.set_item("rendezvous_s", report.rendezvous_s)?;
    d.set_item("committed", report.committed)?;
    if let Some(c) = report.commit {
        d.set_item("keys", c.keys)?;
        d.set_item("tensor_chunks", c.tensor_chunks)?;
        d.set_item("byte_objects", c.byte_objects)?;
        d.set_item("metadata_bytes", c.metadata_bytes)?;
    }
    Ok(d)
}

/// Merges the parts of `save_id` and commits `.metadata`; see `shardwise merge`.
#[pyfunction]
fn merge(
    py: Python<'_>,
    checkpoint_dir: PathBuf,
    save_id: String,
    world_size: u32,
    timeout_s: f64,
) -> PyResult<usize> {
    let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
    py.detach(|| rendezvous::merge(&checkpoint_dir, &save_id, world_size, timeout))
        .map(|s| s.keys)
        .map_err(to_py)
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
    /// Sorted keys (tensor fqns and byte-object keys).
    fn keys(&self) -> Vec<String> {
        self.inner.metadata.entries.keys().cloned().collect()
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
            self.inner.read_region(key, &offsets, &sizes, out)
        })
        .map_err(to_py)
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
    py.detach(|| Checkpoint::open(&path))
        .map(|inner| PyCheckpoint { inner })
        .map_err(to_py)
}

/// Runs the `shardwise` command line with `argv` (program name first); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| crate::cli::run(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
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
    m.add("ValidationError", py.get_type::<ValidationError>())?;
    m.add("MissingRanksError", py.get_type::<MissingRanksError>())?;
    m.add("NotCommittedError", py.get_type::<NotCommittedError>())?;
    m.add(
        "CheckpointExistsError",
        py.get_type::<CheckpointExistsError>(),
    )?;
    m.add("StorageError", py.get_type::<StorageError>())?;
    m.add("CorruptFileError", py.get_type::<CorruptFileError>())?;
    Ok(())
}
