//! The `shardwise._native` extension module: thin wrappers that release the GIL and map
//! [`crate::Error`] variants to `shardwise.ShardwiseError` subclasses.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::Error;
use crate::format::dtype::DType;
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
