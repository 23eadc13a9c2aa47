//! Every report reaches Python the same way: its serde form as plain Python values (a struct is a
//! `dict`, an `Option` `None` or the value, a `Vec` a `list`), so that a report's dict has exactly
//! the fields of the CLI's `--json` output for the same operation (docs/cli.md, "JSON output").

use pyo3::prelude::*;
use serde::Serialize;

/// `report` as Python values (`pythonize`: the same fields and nesting as `serde_json`; floats stay
/// floats, where JSON would print NaN as null).
pub(super) fn to_dict<'py, T: Serialize>(
    py: Python<'py>,
    report: &T,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(pythonize::pythonize(py, report)?)
}
