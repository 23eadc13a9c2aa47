//! An open checkpoint from Python: keys, metadata, reads of one region, loads of many.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::args::{opt_positive, opt_seconds, opt_whole, whole, wholes};
use super::report::to_dict;
use super::{invalid_argument, location, to_py};
use shardwise::error::Error;
use shardwise::format::metadata::Entry;
use shardwise::reader::Checkpoint;

/// A region of a tensor and the memory it is read into.
///
/// `Region(*, key, offsets, sizes, data_ptr, nbytes, device=None)`: `sizes` elements at `offsets`
/// (one per dimension) of tensor `key`, into `nbytes` bytes of C-contiguous memory at address
/// `data_ptr` in the checkpoint's dtype: host memory, or memory of CUDA device `device` (its
/// ordinal). Checked against the checkpoint by `load_into`/`read_into`, before any read.
///
/// Raises `InvalidArgumentError`: a number that is not a whole number >= 0, `offsets` and `sizes`
/// of different lengths, a null `data_ptr` for `nbytes` > 0.
#[pyclass(frozen, module = "shardwise._native")]
pub(super) struct Region {
    inner: shardwise::load::Request,
}

#[pymethods]
impl Region {
    #[new]
    #[pyo3(signature = (*, key, offsets, sizes, data_ptr, nbytes, device=None))]
    fn new(
        key: String,
        offsets: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
        data_ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let inner = shardwise::load::Request {
            offsets: wholes("offsets", offsets)?,
            sizes: wholes("sizes", sizes)?,
            ptr: whole("data_ptr", data_ptr)?,
            nbytes: whole("nbytes", nbytes)?,
            device: opt_whole("device", device)?,
            key,
        };
        if inner.offsets.len() != inner.sizes.len() {
            return Err(invalid_argument(format!(
                "{}: offsets {:?} and sizes {:?} differ in dimensions",
                inner.key, inner.offsets, inner.sizes
            )));
        }
        if inner.ptr == 0 && inner.nbytes > 0 {
            return Err(invalid_argument(format!(
                "{}: data_ptr is null for {} bytes",
                inner.key, inner.nbytes
            )));
        }
        Ok(Region { inner })
    }

    #[getter]
    fn key(&self) -> &str {
        &self.inner.key
    }

    #[getter]
    fn offsets(&self) -> Vec<u64> {
        self.inner.offsets.clone()
    }

    #[getter]
    fn sizes(&self) -> Vec<u64> {
        self.inner.sizes.clone()
    }

    #[getter]
    fn data_ptr(&self) -> u64 {
        self.inner.ptr
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.nbytes
    }

    #[getter]
    fn device(&self) -> Option<u32> {
        self.inner.device
    }

    fn __repr__(&self) -> String {
        let r = &self.inner;
        format!(
            "Region(key={:?}, offsets={:?}, sizes={:?}, data_ptr={:#x}, nbytes={}, device={})",
            r.key,
            r.offsets,
            r.sizes,
            r.ptr,
            r.nbytes,
            r.device.map_or("None".to_owned(), |d| d.to_string())
        )
    }
}

/// An open checkpoint (any DCP / torch_dist checkpoint), parsed as data.
#[pyclass(frozen, name = "Checkpoint", module = "shardwise._native")]
pub(super) struct PyCheckpoint {
    inner: Checkpoint,
}

fn storage_dict<'py>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
    s: &shardwise::format::metadata::StorageInfo,
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
        shardwise::status::format_name(&self.inner.metadata.class)
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

    /// Reads `region` (a host `Region`: `sizes` elements at `offsets` of tensor `key`) into its
    /// memory, which the caller owns and keeps alive until this returns. Only the saved chunks that
    /// overlap the region are read, each checked against its save-time CRC-32 where one was recorded.
    ///
    /// Raises `InvalidArgumentError` (a CUDA region: use `load_into`; a region outside the global
    /// shape; `nbytes` other than the region's size), `MissingKeyError`, `ValidationError` (part of
    /// the region not covered by saved chunks), `CorruptFileError`, `StorageError`.
    fn read_into(&self, py: Python<'_>, region: &Bound<'_, Region>) -> PyResult<()> {
        let r = &region.get().inner;
        if let Some(d) = r.device {
            return Err(invalid_argument(format!(
                "{}: read_into reads into host memory, the region is on CUDA device {d} (use load_into)",
                r.key
            )));
        }
        py.detach(|| {
            let out: &mut [u8] = if r.nbytes == 0 {
                &mut []
            } else {
                // SAFETY: a Region's data_ptr is non-null when nbytes > 0 (checked by Region::new);
                // the caller owns that memory and keeps it alive, untouched, until this returns.
                unsafe { std::slice::from_raw_parts_mut(r.ptr as *mut u8, r.nbytes as usize) }
            };
            shardwise::load::read_region(&self.inner, &r.key, &r.offsets, &r.sizes, out)
        })
        .map_err(to_py)
    }

    /// Checks, before the caller allocates its destination, that the region `offsets`/`sizes`
    /// (elements) of tensor `key` lies inside its shape and is covered by saved chunks. Raises
    /// `MissingKeyError`, `InvalidArgumentError` (outside the shape, a byte object),
    /// `ValidationError` (not covered).
    fn check_region(&self, key: &str, offsets: Vec<u64>, sizes: Vec<u64>) -> PyResult<()> {
        shardwise::load::check_region(&self.inner, key, &offsets, &sizes).map_err(to_py)
    }

    /// Loads many regions at once, straight into the caller's memory (`shardwise::load`).
    ///
    /// `regions`: a list of `Region`, each in the checkpoint's dtype; CUDA regions are filled
    /// through a pinned staging pool of at most `staging_budget_bytes` bytes (None: the engine's
    /// default), with `cuda_stream` (a `CUstream` as an int) ordered after the copies. Every region
    /// is validated before any read. The caller keeps every destination alive and untouched until
    /// this returns. `timeout_s` bounds each object-store request, in seconds (None: the store's
    /// own retry timeout).
    ///
    /// Returns the load's statistics as a dict: `bytes_read` (bytes, item probes included),
    /// `read_ops`, `requests`, `seconds` and `plan_seconds` (wall time), `items_checked`,
    /// `items_unchecked`. Raises `MissingKeyError`, `InvalidArgumentError` (also for a timeout or a
    /// budget out of range), `ValidationError` (region not covered), `CorruptFileError` (missing
    /// or truncated data file, CRC-32 mismatch; names key, file and offset), `StorageError`,
    /// `GpuError`.
    #[pyo3(signature = (regions, *, staging_budget_bytes=None, cuda_stream=0, check_crc=true, timeout_s=None))]
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        regions: Vec<Bound<'py, Region>>,
        staging_budget_bytes: Option<&Bound<'py, PyAny>>,
        cuda_stream: u64,
        check_crc: bool,
        timeout_s: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let opts = shardwise::load::LoadOptions {
            staging_budget: opt_positive("staging_budget_bytes", staging_budget_bytes)?,
            cuda_stream,
            check_crc,
            timeout: opt_seconds("timeout_s", timeout_s)?,
            threads: None,
        };
        let reqs: Vec<shardwise::load::Request> =
            regions.iter().map(|r| r.get().inner.clone()).collect();
        // SAFETY: every Region describes live contiguous memory that the Python caller keeps
        // alive, and does not touch, until this call returns (the contract of load_into).
        let stats = py
            .detach(|| unsafe { shardwise::load::load(&self.inner, &reqs, &opts) })
            .map_err(to_py)?;
        to_dict(py, &stats)
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
    timeout_s: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyCheckpoint> {
    let timeout = opt_seconds("timeout_s", timeout_s)?;
    py.detach(|| Checkpoint::open(&location(&path)?.with_timeout(timeout)?))
        .map(|inner| PyCheckpoint { inner })
        .map_err(to_py)
}
