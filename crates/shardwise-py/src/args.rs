//! Python numbers to Rust values. Every value of the wrong type or out of range is an
//! `InvalidArgumentError` naming the argument: never an `OverflowError` or a `TypeError` from the
//! conversion, nor a Rust panic (`Duration::from_secs_f64` panics on NaN, infinite, negative and
//! huge values).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBool;

use super::{to_py, InvalidArgumentError};
use shardwise::commit::wait::timeout_from_secs;

fn refuse(name: &str, want: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let shown = value
        .repr()
        .map_or_else(|_| "an unprintable value".to_owned(), |r| r.to_string());
    InvalidArgumentError::new_err(format!("{name} must be {want}, got {shown}"))
}

/// A whole number >= 0 that fits `T`: a Python `int` or a type with `__index__` (numpy's
/// integers). `bool` is refused: `True` is an `int` to Python, but never a meant count.
pub(super) fn whole<T: TryFrom<u64>>(name: &str, value: &Bound<'_, PyAny>) -> PyResult<T> {
    let want = "a whole number >= 0 (an int, not a bool or a float) that fits the type";
    if value.is_instance_of::<PyBool>() {
        return Err(refuse(name, want, value));
    }
    let n: u64 = value.extract().map_err(|_| refuse(name, want, value))?;
    T::try_from(n).map_err(|_| refuse(name, want, value))
}

/// [`whole`] of an optional argument (None stays None).
pub(super) fn opt_whole<T: TryFrom<u64>>(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<T>> {
    value.map(|v| whole(name, v)).transpose()
}

/// A whole number >= 1 that fits `T` (a byte budget, a world size).
pub(super) fn positive<T: TryFrom<u64>>(name: &str, value: &Bound<'_, PyAny>) -> PyResult<T> {
    let n: u64 = whole(name, value)?;
    if n == 0 {
        return Err(refuse(name, "a whole number >= 1", value));
    }
    T::try_from(n).map_err(|_| refuse(name, "a whole number >= 1 that fits the type", value))
}

/// [`positive`] of an optional argument (None stays None).
pub(super) fn opt_positive<T: TryFrom<u64>>(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<T>> {
    value.map(|v| positive(name, v)).transpose()
}

/// A list of whole numbers >= 0 (offsets, sizes, shapes, in elements).
pub(super) fn wholes(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let want = "a list of whole numbers >= 0";
    if value.is_instance_of::<pyo3::types::PyString>() {
        return Err(refuse(name, want, value));
    }
    let mut out = Vec::new();
    for item in value.try_iter().map_err(|_| refuse(name, want, value))? {
        let item = item?;
        out.push(whole(name, &item).map_err(|_| refuse(name, want, value))?);
    }
    Ok(out)
}

/// A list of `str` (a list or tuple; a lone `str` is refused, not read as its characters); None is
/// an empty list.
pub(super) fn str_list(name: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let want = "a list of str";
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(Vec::new());
    };
    let listlike = value.is_instance_of::<pyo3::types::PyList>()
        || value.is_instance_of::<pyo3::types::PyTuple>();
    if !listlike {
        return Err(refuse(name, want, value));
    }
    let mut out = Vec::new();
    for item in value.try_iter()? {
        let item = item?;
        if !item.is_instance_of::<pyo3::types::PyString>() {
            return Err(refuse(name, want, value));
        }
        out.push(item.extract::<String>()?);
    }
    Ok(out)
}

/// A bound in seconds: an `int` or a `float` (not a `bool`), finite, >= 0 and at most
/// [`shardwise::commit::wait::MAX_TIMEOUT_S`] (the rule of [`timeout_from_secs`], shared with the CLI).
pub(super) fn seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    if value.is_instance_of::<PyBool>() {
        return Err(refuse(name, "a number of seconds", value));
    }
    let secs: f64 = value
        .extract()
        .map_err(|_| refuse(name, "a number of seconds", value))?;
    timeout_from_secs(name, secs).map_err(to_py)
}

/// [`seconds`] of an optional argument (None stays None: no bound).
pub(super) fn opt_seconds(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Duration>> {
    value.map(|v| seconds(name, v)).transpose()
}

/// Checks a bound in seconds for the Python side's own waits (`shardwise.barrier`), by the rule
/// every other wait follows; returns it as a float.
///
/// Raises `InvalidArgumentError` naming `name` for anything but a finite number of seconds in
/// `0..=MAX_TIMEOUT_S`.
#[pyfunction]
pub(super) fn check_seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    seconds(name, value).map(|d| d.as_secs_f64())
}
