//! The `shardwise._native` extension module: thin wrappers that release the GIL and map
//! [`shardwise::Error`] variants to `shardwise.ShardwiseError` subclasses.
//!
//! One file per job: `save` (one rank's save: `Chunk`, `ObjectItem`, `SaveOptions`, `save_rank`,
//! `SaveHandle`), `checkpoint` (an open checkpoint: `Region`, reads and loads), `tools` (merge,
//! to-hf, diff, the committed checks, the CLI), `report` (every report as a dict, the same way) and
//! `args` (Python numbers to Rust values: every bad one an `InvalidArgumentError`).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use shardwise::error::Error;
use shardwise::storage::Location;

mod args;
mod checkpoint;
mod report;
mod save;
mod tools;

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

/// `InvalidArgumentError`, a `ShardwiseError` and a `ValueError`, and its subclass
/// `InvalidArgumentTypeError`, also a `TypeError`: classes of two bases, which `create_exception!`
/// cannot declare, so Python's `type` makes them, once, with the `__module__` of the others.
static INVALID_ARGUMENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_ARGUMENT_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A class `name` of `bases`, made by Python's `type(name, bases, {"__module__": "shardwise",
/// "__doc__": doc})`.
fn exception_class(
    py: Python<'_>,
    name: &str,
    doc: &str,
    bases: Vec<Bound<'_, PyType>>,
) -> PyResult<Py<PyType>> {
    let dict = PyDict::new(py);
    dict.set_item("__module__", "shardwise")?;
    dict.set_item("__doc__", doc)?;
    let class = py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, dict))?;
    Ok(class.cast_into::<PyType>()?.unbind())
}

/// The class of an argument out of range, or of arguments that contradict themselves:
/// `InvalidArgumentError(ShardwiseError, ValueError)`.
fn invalid_argument_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    INVALID_ARGUMENT
        .get_or_try_init(py, || {
            exception_class(
                py,
                "InvalidArgumentError",
                "Arguments out of range or that contradict themselves (a ValueError); an \
                 argument of the wrong type is an InvalidArgumentTypeError.",
                vec![
                    py.get_type::<ShardwiseError>(),
                    py.get_type::<pyo3::exceptions::PyValueError>(),
                ],
            )
        })
        .map(|c| c.bind(py))
}

/// The class of an argument of the wrong type (a `bool` where a count is meant, a `str` where a
/// list of names is): `InvalidArgumentTypeError(InvalidArgumentError, TypeError)`.
fn invalid_argument_type_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    INVALID_ARGUMENT_TYPE
        .get_or_try_init(py, || {
            exception_class(
                py,
                "InvalidArgumentTypeError",
                "An argument of the wrong type (a TypeError, and an InvalidArgumentError).",
                vec![
                    invalid_argument_class(py)?.clone(),
                    py.get_type::<pyo3::exceptions::PyTypeError>(),
                ],
            )
        })
        .map(|c| c.bind(py))
}

/// An `InvalidArgumentError` (a `ValueError`) with `msg`.
pub(crate) fn invalid_argument(msg: String) -> PyErr {
    Python::attach(|py| match invalid_argument_class(py) {
        Ok(class) => PyErr::from_type(class.clone(), msg),
        Err(e) => e,
    })
}

/// An `InvalidArgumentTypeError` (a `TypeError` and an `InvalidArgumentError`) with `msg`.
pub(crate) fn invalid_argument_type(msg: String) -> PyErr {
    Python::attach(|py| match invalid_argument_type_class(py) {
        Ok(class) => PyErr::from_type(class.clone(), msg),
        Err(e) => e,
    })
}

pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::UnsupportedDtype(_) => UnsupportedDtypeError::new_err(msg),
        Error::InvalidArgument(_) => invalid_argument(msg),
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

/// A checkpoint path or URL as Python passed it (`str` or `os.PathLike`; a local path need not be
/// UTF-8: its undecodable bytes arrive as Python's surrogate escapes and are restored here).
pub(crate) fn location(p: &std::path::Path) -> shardwise::error::Result<Location> {
    Location::from_os(p.as_os_str())
}

/// The thread that imported the module: Python's main thread, the only one that runs signal
/// handlers.
static MAIN_THREAD: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();

/// The interrupt check of every bounded wait: in Python's main thread, runs Python's signal handlers
/// and reports whether one raised (`KeyboardInterrupt` on Ctrl-C). Other threads (an async save's)
/// never run handlers, so they do not take the GIL for it.
fn python_interrupted() -> bool {
    MAIN_THREAD.get() == Some(&std::thread::current().id())
        && Python::attach(|py| py.check_signals().is_err())
}

/// Adds the binding's classes, functions, exceptions and constants to the module `m`
/// (`shardwise._native`, built by crates/shardwise-ext), and makes every bounded wait of the
/// core answer Ctrl-C through Python's signal handlers. Call once, from the module's init, in
/// Python's main thread.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let _ = MAIN_THREAD.set(std::thread::current().id());
    shardwise::interrupt::set_interrupt_check(python_interrupted);
    m.add_function(wrap_pyfunction!(tools::is_committed, m)?)?;
    m.add_function(wrap_pyfunction!(tools::process_start_ns, m)?)?;
    m.add_function(wrap_pyfunction!(tools::same_tensor_crcs, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(save::save_rank, m)?)?;
    m.add_function(wrap_pyfunction!(save::reserve_staging, m)?)?;
    m.add_class::<save::Chunk>()?;
    m.add_class::<save::ObjectItem>()?;
    m.add_class::<save::SaveOptions>()?;
    m.add_class::<checkpoint::Region>()?;
    m.add_function(wrap_pyfunction!(args::check_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(args::check_whole, m)?)?;
    m.add("MAX_TIMEOUT_S", shardwise::commit::wait::MAX_TIMEOUT_S)?;
    m.add_function(wrap_pyfunction!(tools::merge, m)?)?;
    m.add_function(wrap_pyfunction!(tools::merge_rank_local, m)?)?;
    m.add_function(wrap_pyfunction!(tools::read_file, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::open_checkpoint, m)?)?;
    m.add_class::<checkpoint::PyCheckpoint>()?;
    m.add("ShardwiseError", py.get_type::<ShardwiseError>())?;
    m.add(
        "UnsupportedDtypeError",
        py.get_type::<UnsupportedDtypeError>(),
    )?;
    m.add("InvalidArgumentError", invalid_argument_class(py)?)?;
    m.add("InvalidArgumentTypeError", invalid_argument_type_class(py)?)?;
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
    m.add_class::<save::SaveHandle>()?;
    m.add_function(wrap_pyfunction!(tools::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(tools::to_hf, m)?)?;
    m.add_function(wrap_pyfunction!(tools::from_hf, m)?)?;
    m.add_function(wrap_pyfunction!(tools::diff, m)?)?;
    m.add_function(wrap_pyfunction!(tools::status, m)?)?;
    Ok(())
}
