//! An open checkpoint from Python: keys, metadata, reads of one region, loads of many.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::{location, to_py, InvalidArgumentError};
use crate::commit::wait::timeout_from_secs;
use crate::error::Error;
use crate::format::metadata::Entry;
use crate::reader::Checkpoint;

/// A `load_into` request: `(key, offsets, sizes, data_ptr, nbytes, device)`.
pub(super) type LoadRequest = (String, Vec<u64>, Vec<u64>, u64, u64, i64);

/// An open checkpoint (any DCP / torch_dist checkpoint), parsed as data.
#[pyclass(frozen, name = "Checkpoint")]
pub(super) struct PyCheckpoint {
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
    /// Number of keys.
    fn __len__(&self) -> usize {
        self.inner.metadata.entries.len()
    }

    /// Whether `key` is a key of the checkpoint.
    fn __contains__(&self, key: &str) -> bool {
        self.inner.metadata.entries.contains_key(key)
    }

    /// The checkpoint format in words (`PyTorch DCP` or `Megatron-Core torch_dist`).
    fn format_name(&self) -> &'static str {
        crate::cli::format_name(&self.inner.metadata.class)
    }

    /// Sorted keys (tensor fqns and byte-object keys).
    fn keys(&self) -> Vec<String> {
        self.inner.metadata.entries.keys().cloned().collect()
    }

    /// `("tensor", dtype, global_shape)` or `("object", None, None)` for `key`: what a loader needs
    /// per key, without building a dict per chunk as [`metadata`](Self::metadata) does (at 1M chunks
    /// that costs seconds). Raises `MissingKeyError` for a key the checkpoint does not hold.
    fn describe(
        &self,
        key: &str,
    ) -> PyResult<(&'static str, Option<&'static str>, Option<Vec<u64>>)> {
        match self.inner.metadata.entries.get(key) {
            Some(Entry::Tensor {
                dtype,
                global_shape,
                ..
            }) => Ok((
                "tensor",
                Some(dtype.torch_name()),
                Some(global_shape.clone()),
            )),
            Some(Entry::Bytes { .. }) => Ok(("object", None, None)),
            None => Err(to_py(Error::MissingKey {
                key: key.to_owned(),
                dir: self.inner.dir().to_path_buf(),
            })),
        }
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
            crate::load::read_region(&self.inner, key, &offsets, &sizes, out)
        })
        .map_err(to_py)
    }

    /// Loads many regions at once, straight into the caller's memory (`crate::load`).
    ///
    /// `requests`: `(key, offsets, sizes, data_ptr, nbytes, device)` tuples: the region
    /// `offsets`/`sizes` (elements) of tensor `key` into `nbytes` bytes of C-contiguous memory at
    /// `data_ptr` in the checkpoint's dtype; `device` -1 for host memory, else the CUDA ordinal
    /// (filled through a pinned staging pool of at most `staging_budget_bytes`, with
    /// `cuda_stream` ordered after the copies). Every request is validated before any read. The
    /// caller keeps every destination alive and untouched until this returns. Returns
    /// `{"bytes_read", "read_ops", "requests", "seconds", "plan_seconds", "items_checked",
    /// "items_unchecked"}`. Raises `MissingKeyError`, `InvalidArgumentError`, `ValidationError`
    /// (region not covered), `CorruptFileError` (missing or truncated data file, CRC-32
    /// mismatch; names key, file and offset), `StorageError`, `GpuError`.
    #[pyo3(signature = (requests, *, staging_budget_bytes=None, cuda_stream=0, check_crc=true, timeout_s=None))]
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<LoadRequest>,
        staging_budget_bytes: Option<usize>,
        cuda_stream: u64,
        check_crc: bool,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = timeout_s
            .map(|t| timeout_from_secs("timeout_s", t))
            .transpose()
            .map_err(to_py)?;
        let mut reqs = Vec::with_capacity(requests.len());
        for (key, offsets, sizes, ptr, nbytes, device) in requests {
            let device = match device {
                -1 => None,
                d => Some(u32::try_from(d).map_err(|_| {
                    InvalidArgumentError::new_err(format!(
                        "{key}: device {d} is neither -1 (host) nor a CUDA ordinal"
                    ))
                })?),
            };
            reqs.push(crate::load::Request {
                key,
                offsets,
                sizes,
                ptr,
                nbytes,
                device,
            });
        }
        let opts = crate::load::LoadOptions {
            staging_budget: staging_budget_bytes,
            cuda_stream,
            check_crc,
            timeout,
            threads: None,
        };
        // SAFETY: the Python caller passes the data_ptr()/nbytes of live contiguous tensors it
        // keeps alive, and does not touch, until this call returns (the contract of load_into).
        let s = py
            .detach(|| unsafe { crate::load::load(&self.inner, &reqs, &opts) })
            .map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("read_ops", s.read_ops)?;
        d.set_item("requests", s.requests)?;
        d.set_item("seconds", s.seconds)?;
        d.set_item("plan_seconds", s.plan_seconds)?;
        d.set_item("items_checked", s.items_checked)?;
        d.set_item("items_unchecked", s.items_unchecked)?;
        Ok(d)
    }

    /// The common state as `(source, bytes)`: `common.pt`, or the `common_state` object of
    /// megatron-core 0.19 (`source` is then its key); None when there is neither. Raw torch.save
    /// bytes (never unpickled here) whose zip records passed their CRC-32s.
    fn read_common<'py>(&self, py: Python<'py>) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        let common = py.detach(|| self.inner.read_common()).map_err(to_py)?;
        Ok(common.map(|c| (c.source, PyBytes::new(py, &c.bytes))))
    }

    /// The raw bytes of byte object `key`: a torch.save archive (never unpickled here).
    fn read_bytes<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py
            .detach(|| self.inner.read_bytes(key, 1 << 34))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &bytes))
    }
}

/// Opens a checkpoint directory or URL, every object-store request bounded by `timeout_s` seconds
/// when given; raises a `ShardwiseError` subclass when `.metadata` is missing or not DCP metadata.
#[pyfunction]
#[pyo3(signature = (path, timeout_s=None))]
pub(super) fn open_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    timeout_s: Option<f64>,
) -> PyResult<PyCheckpoint> {
    let timeout = timeout_s
        .map(|t| crate::commit::wait::timeout_from_secs("timeout_s", t))
        .transpose()
        .map_err(to_py)?;
    py.detach(|| Checkpoint::open(&location(&path)?.with_timeout(timeout)?))
        .map(|inner| PyCheckpoint { inner })
        .map_err(to_py)
}
