//! The dicts returned to Python.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::save::SaveReport;

pub(super) fn report_dict<'py>(
    py: Python<'py>,
    report: &SaveReport,
) -> PyResult<Bound<'py, PyDict>> {
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
