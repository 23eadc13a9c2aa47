//! Python numbers to Rust values, by one rule for every argument of the Python API (the Python
//! side checks its own through [`check_whole`] and [`check_seconds`]). A value of the wrong type
//! (a `bool` where a count is meant, a `float`, a `str`) is an `InvalidArgumentTypeError` (a
//! `TypeError`), one out of range an `InvalidArgumentError` (a `ValueError`), each naming the
//! argument: never an `OverflowError` or a `TypeError` from the conversion that does not say which
//! argument, nor a Rust panic (`Duration::from_secs_f64` panics on NaN, infinite, negative and
//! huge values).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};

use super::{invalid_argument, invalid_argument_type, to_py};
use shardwise::commit::wait::timeout_from_secs;

fn shown(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map_or_else(|_| "an unprintable value".to_owned(), |r| r.to_string())
}

/// `value` is of the wrong type for argument `name`.
fn wrong_type(name: &str, want: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let ty = value
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    invalid_argument_type(format!(
        "{name} must be {want}, got {} of type {ty}",
        shown(value)
    ))
}

/// `value` is out of range for argument `name`.
fn out_of_range(name: &str, want: &str, value: &Bound<'_, PyAny>) -> PyErr {
    invalid_argument(format!("{name} must be {want}, got {}", shown(value)))
}

/// A whole number in `min..=max`: a Python `int` or a type with `__index__` (numpy's integers).
/// `bool` is refused: `True` is an `int` to Python, but never a meant count.
///
/// Raises `InvalidArgumentTypeError` for another type, `InvalidArgumentError` out of the range.
fn whole_in(name: &str, value: &Bound<'_, PyAny>, min: u64, max: u64) -> PyResult<u64> {
    let want = || match max {
        u64::MAX => format!("a whole number >= {min}"),
        _ => format!("a whole number in {min}..={max}"),
    };
    if value.is_instance_of::<PyBool>() {
        return Err(wrong_type(
            name,
            &format!("{} (an int, not a bool)", want()),
            value,
        ));
    }
    // `__index__`: ints and numpy's integers, not floats or strings.
    let Ok(index) = value.call_method0("__index__") else {
        return Err(wrong_type(name, &format!("{} (an int)", want()), value));
    };
    let Ok(index) = index.cast_into::<PyInt>() else {
        return Err(wrong_type(name, &format!("{} (an int)", want()), value));
    };
    match index.extract::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(out_of_range(name, &want(), value)),
    }
}

/// A whole number >= 0 that fits `T` (see [`whole_in`]).
pub(super) fn whole<T: TryFrom<u64> + TryInto<u64> + Bounded>(
    name: &str,
    value: &Bound<'_, PyAny>,
) -> PyResult<T> {
    let n = whole_in(name, value, 0, T::MAX.try_into().unwrap_or(u64::MAX))?;
    T::try_from(n).map_err(|_| out_of_range(name, "a whole number that fits", value))
}

/// [`whole`] of an optional argument (None stays None).
pub(super) fn opt_whole<T: TryFrom<u64> + TryInto<u64> + Bounded>(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<T>> {
    value.map(|v| whole(name, v)).transpose()
}

/// A whole number >= 1 that fits `T` (a byte budget, a world size).
pub(super) fn positive<T: TryFrom<u64> + TryInto<u64> + Bounded>(
    name: &str,
    value: &Bound<'_, PyAny>,
) -> PyResult<T> {
    let n = whole_in(name, value, 1, T::MAX.try_into().unwrap_or(u64::MAX))?;
    T::try_from(n).map_err(|_| out_of_range(name, "a whole number that fits", value))
}

/// [`positive`] of an optional argument (None stays None).
pub(super) fn opt_positive<T: TryFrom<u64> + TryInto<u64> + Bounded>(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<T>> {
    value.map(|v| positive(name, v)).transpose()
}

/// The largest value of an unsigned integer type, for [`whole`]'s range.
pub(super) trait Bounded: Sized {
    const MAX: Self;
}
impl Bounded for u32 {
    const MAX: u32 = u32::MAX;
}
impl Bounded for u64 {
    const MAX: u64 = u64::MAX;
}
impl Bounded for usize {
    const MAX: usize = usize::MAX;
}

/// A list of whole numbers >= 0 (offsets, sizes, shapes, in elements). A `str` is refused, not
/// taken as a sequence of characters.
pub(super) fn wholes(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let want = "a list of whole numbers >= 0";
    if value.is_instance_of::<PyString>() {
        return Err(wrong_type(name, want, value));
    }
    let items = value
        .try_iter()
        .map_err(|_| wrong_type(name, want, value))?;
    let mut out = Vec::new();
    for item in items {
        // An element's error names the list, with the element's class (type or range).
        match whole_in(name, &item?, 0, u64::MAX) {
            Ok(n) => out.push(n),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(value.py()) => {
                return Err(wrong_type(name, want, value))
            }
            Err(_) => return Err(out_of_range(name, want, value)),
        }
    }
    Ok(out)
}

/// A list of `str` (a list or tuple; a lone `str` is refused, not read as its characters); None is
/// an empty list. Another type is an `InvalidArgumentTypeError`.
pub(super) fn str_list(name: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let want = "a list of str";
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(Vec::new());
    };
    let listlike = value.is_instance_of::<pyo3::types::PyList>()
        || value.is_instance_of::<pyo3::types::PyTuple>();
    if !listlike {
        return Err(wrong_type(name, want, value));
    }
    let mut out = Vec::new();
    for item in value.try_iter()? {
        let item = item?;
        if !item.is_instance_of::<pyo3::types::PyString>() {
            return Err(wrong_type(name, want, value));
        }
        out.push(item.extract::<String>()?);
    }
    Ok(out)
}

/// A bound in seconds: an `int` or a `float` (not a `bool`), finite, >= 0 and at most
/// [`shardwise::commit::wait::MAX_TIMEOUT_S`] (the rule of [`timeout_from_secs`], shared with the CLI).
pub(super) fn seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let want = "a number of seconds (an int or a float)";
    if value.is_instance_of::<PyBool>()
        || !(value.is_instance_of::<PyInt>() || value.is_instance_of::<PyFloat>())
    {
        return Err(wrong_type(name, want, value));
    }
    let secs: f64 = value
        .extract()
        .map_err(|_| out_of_range(name, want, value))?;
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
/// Raises `InvalidArgumentTypeError` naming `name` for a value that is not an `int` or a `float`,
/// `InvalidArgumentError` for one that is not a finite number of seconds in `0..=MAX_TIMEOUT_S`.
#[pyfunction]
pub(super) fn check_seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    seconds(name, value).map(|d| d.as_secs_f64())
}

/// Checks a whole-number argument of the Python side (a rank, an iteration, a count) by the rule
/// of every other one ([`whole_in`]); returns it as an `int`. `max` None: no upper bound but the
/// 64-bit one.
///
/// Raises `InvalidArgumentTypeError` naming `name` for a value that is not an `int` (a `bool`, a
/// `float`, a `str`), `InvalidArgumentError` for one outside `min..=max`.
#[pyfunction]
#[pyo3(signature = (name, value, min=0, max=None))]
pub(super) fn check_whole(
    name: &str,
    value: &Bound<'_, PyAny>,
    min: u64,
    max: Option<u64>,
) -> PyResult<u64> {
    whole_in(name, value, min, max.unwrap_or(u64::MAX))
}
