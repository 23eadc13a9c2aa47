//! The data plane: how data files (`__<rank>_<n>.distcp`) are written and read, whatever the
//! backend. A [`DataSink`] takes a rank's file as positioned writes (local: a preallocated file,
//! written in parallel) or as a stream (object stores: a multipart upload, in file order); a
//! [`DataSource`] gives positioned reads of one file (local: `pread`, and a memory map for the
//! reader; object stores: ranged GETs, like `object_store`'s `get_range`). Writer, reader, load and
//! diff use these and never ask which backend they are on.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::local::{open_regular, DataFile};
use super::remote::{Remote, Upload};
use super::Location;
use crate::error::{Error, Result};

/// Where a rank's data file is written.
pub enum DataSink<'a> {
    /// A local file: any byte may be written at any time, from many threads
    /// ([`DataFile::write_at`]), after [`DataFile::reserve`] preallocated it.
    Positioned(DataFile),
    /// An object-store upload: bytes go in file order, as parts ([`Upload`]).
    Stream(Upload<'a>),
}

/// Where a data file is read from: positioned reads of a file whose length is known.
pub struct DataSource {
    len: u64,
    kind: Kind,
    /// Bound of each object-store request (None: the store's own retry timeout).
    timeout: Option<Duration>,
}

enum Kind {
    Local { file: File, path: PathBuf },
    Remote { remote: Arc<Remote>, rel: String },
}

impl Location {
    /// Creates data file `rel` for writing (replacing one already there): a local file to be
    /// [`DataFile::reserve`]d and written at positions, or an upload that creates the object
    /// when it finishes.
    ///
    /// Errors: [`Error::Io`] when the local file cannot be created; [`Error::InvalidArgument`] for
    /// a key the store refuses.
    pub fn create_data(&self, rel: &str) -> Result<DataSink<'_>> {
        match self {
            Location::Local(dir) => Ok(DataSink::Positioned(DataFile::create_empty(
                &dir.join(rel),
            )?)),
            Location::Remote(r) => Ok(DataSink::Stream(r.upload(rel)?)),
        }
    }

    /// Opens data file `rel` for positioned reads. `rel` must be a `relative_path` that
    /// `.metadata` decoding accepted (no `..`, not absolute); locally the file is also refused when
    /// it resolves outside the directory through a symlink, or is not a regular file (a FIFO would
    /// block the open, a device would never end).
    ///
    /// Errors: [`Error::Io`] (kind `NotFound` for a missing file or object); [`Error::Corrupt`] for
    /// a file outside the directory or not a regular file; [`Error::Remote`].
    pub fn open_data(&self, rel: &str) -> Result<DataSource> {
        let (len, kind) = match self {
            Location::Local(dir) => {
                let path = dir.join(rel);
                let corrupt = |reason: String| Error::Corrupt {
                    path: path.clone(),
                    reason,
                };
                // A symlink inside the directory must not lead out of it either.
                let real = path.canonicalize().map_err(Error::io("open", &path))?;
                let root = dir.canonicalize().map_err(Error::io("open", dir))?;
                if !real.starts_with(&root) {
                    return Err(corrupt(format!(
                        "{rel:?} resolves outside the checkpoint directory"
                    )));
                }
                let file = open_regular(&real).map_err(|e| match e.kind() {
                    std::io::ErrorKind::InvalidInput => corrupt(format!("{rel:?} is {e}")),
                    _ => Error::io("open", &path)(e),
                })?;
                let len = file.metadata().map_err(Error::io("stat", &path))?.len();
                (len, Kind::Local { file, path })
            }
            Location::Remote(r) => {
                let len = r.size(rel)?.ok_or_else(|| Error::Io {
                    op: "open",
                    path: self.path_of(rel),
                    source: std::io::ErrorKind::NotFound.into(),
                })?;
                let kind = Kind::Remote {
                    remote: r.clone(),
                    rel: rel.to_string(),
                };
                (len, kind)
            }
        };
        Ok(DataSource {
            len,
            kind,
            timeout: None,
        })
    }
}

impl DataSource {
    /// Bounds each object-store request of this source by `timeout` (retries included), so a
    /// stalled store fails a read instead of hanging it; None: the store's own retry timeout.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> DataSource {
        self.timeout = timeout;
        self
    }

    /// Size of the file in bytes, when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file was empty when opened.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A local file (positioned reads are cheap system calls), not an object (each read is a
    /// request).
    pub fn is_local(&self) -> bool {
        matches!(self.kind, Kind::Local { .. })
    }

    /// Reads up to `buf.len()` bytes at byte `offset` into `buf`; returns how many were read,
    /// fewer only where the file ends.
    ///
    /// Errors: [`Error::Io`] / [`Error::Remote`]; [`Error::Io`] of kind `TimedOut` past the
    /// source's timeout.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        match &self.kind {
            Kind::Local { file, path } => {
                let mut done = 0;
                while done < buf.len() {
                    let n = file
                        .read_at(&mut buf[done..], offset + done as u64)
                        .map_err(Error::io("read", path))?;
                    if n == 0 {
                        break;
                    }
                    done += n;
                }
                Ok(done)
            }
            Kind::Remote { .. } => {
                let end = (offset + buf.len() as u64).min(self.len);
                if end <= offset {
                    return Ok(0);
                }
                let got = self.read_range(offset..end)?;
                let n = got.len().min(buf.len());
                buf[..n].copy_from_slice(&got[..n]);
                Ok(n)
            }
        }
    }

    /// Bytes `range` of the file as one buffer: one ranged GET, or one positioned read.
    ///
    /// Errors: as [`DataSource::read_at`].
    pub fn read_range(&self, range: std::ops::Range<u64>) -> Result<Bytes> {
        match &self.kind {
            Kind::Local { .. } => {
                let mut buf = vec![0u8; (range.end - range.start) as usize];
                let n = self.read_at(range.start, &mut buf)?;
                buf.truncate(n);
                Ok(Bytes::from(buf))
            }
            Kind::Remote { remote, rel } => remote.get_range_within(rel, range, self.timeout),
        }
    }

    /// A read-only memory map of a local file (None for an empty file, and for an object, which
    /// is read by ranges instead).
    ///
    /// Errors: [`Error::Io`] when the file cannot be mapped.
    pub fn map(&self) -> Result<Option<memmap2::Mmap>> {
        match &self.kind {
            Kind::Local { file, path } if self.len > 0 => {
                // SAFETY: checkpoint files are immutable once written; a concurrent writer would
                // be a misuse that can only produce wrong bytes, which CRC checks report.
                unsafe { memmap2::Mmap::map(file) }
                    .map(Some)
                    .map_err(Error::io("map", path))
            }
            _ => Ok(None),
        }
    }
}

/// A whole file's bytes as [`Location::read_held`] holds them: a read-only memory map of a local
/// file, or the bytes read (an object, or an empty file, which cannot be mapped).
pub enum Held {
    /// A read-only memory map of a local file.
    Map(memmap2::Mmap),
    /// The bytes read.
    Read(Vec<u8>),
}

impl std::ops::Deref for Held {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Held::Map(m) => m,
            Held::Read(v) => v,
        }
    }
}

impl Location {
    /// The whole file `rel` for decoding, or `None` when it does not exist: memory-mapped locally
    /// (no copy into the heap; pages already decoded can be dropped by the kernel), read whole
    /// from an object store. Only for files replaced whole (written to a temporary file, then
    /// renamed), such as `.metadata`, so that a mapped file never changes under its reader.
    ///
    /// Errors: [`Error::Io`] / [`Error::Remote`] when it cannot be read or mapped.
    pub fn read_held(&self, rel: &str) -> Result<Option<Held>> {
        let Location::Local(dir) = self else {
            return Ok(self.read(rel)?.map(Held::Read));
        };
        let path = dir.join(rel);
        let file = match open_regular(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("read", &path)(e)),
        };
        if file.metadata().map_err(Error::io("stat", &path))?.len() == 0 {
            return Ok(Some(Held::Read(Vec::new())));
        }
        // SAFETY: the file is only ever replaced whole (`storage::atomic_write`: a temporary file,
        // then a rename), so the mapped file never changes under the decoder.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(Error::io("map", &path))?;
        Ok(Some(Held::Map(map)))
    }
}
