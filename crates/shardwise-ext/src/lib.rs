//! The extension module `shardwise._native` that maturin builds (pyproject.toml): the Python
//! binding ([`shardwise_py::register`]) plus the entry point of the `shardwise` command, which pip
//! installs as a console script (`shardwise.cli:main`). Kept apart so that the binding does not
//! depend on the CLI, nor the CLI on Python.

use pyo3::prelude::*;

/// Runs the `shardwise` command line with `argv` (program name first; `str`, where the bytes of a
/// non-UTF-8 path are surrogate escapes, as in `sys.argv` and `os.fsdecode`); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> i32 {
    py.detach(|| shardwise_cli::run(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    shardwise_py::register(m)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    Ok(())
}
