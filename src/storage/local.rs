//! Local filesystem primitives: atomic publish (tmp + fsync + rename + directory fsync),
//! preallocation and positioned writes.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::writeback::Writeback;

use crate::failpoint::{hit, Op};

use crate::error::{Error, Result};

/// Infix of every temporary file [`atomic_write`] creates: `.<name>.tmp.<pid>.<n>`.
const TMP_INFIX: &str = ".tmp.";

/// Per-process counter, so two threads publishing the same path never share a temporary file.
static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Fsyncs a directory so that a rename inside it is durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    hit(Op::FsyncDir, dir);
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(Error::io("fsync directory", dir))
}

/// Writes `bytes` to `path` atomically: a unique temporary name in the same directory, fsync,
/// rename over `path`, fsync of the directory. Readers see the old file or the whole new one.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    write_temp(path, bytes, true).map(|_| ())
}

/// Like [`atomic_write`] but only if `path` does not exist yet: the temporary file is hard-linked
/// to `path` (`link` fails with `EEXIST` instead of replacing, unlike `rename`). `Ok(true)` when
/// this call created `path`, `Ok(false)` when it was already there (nothing changed).
pub fn atomic_create(path: &Path, bytes: &[u8]) -> Result<bool> {
    write_temp(path, bytes, false)
}

/// `bytes` written to a temporary file and fsynced, then [`publish_temp`].
fn write_temp(path: &Path, bytes: &[u8], replace: bool) -> Result<bool> {
    let tmp = temp_name(path);
    let written = (|| {
        hit(Op::Create, &tmp);
        let mut f = File::create(&tmp).map_err(Error::io("create", &tmp))?;
        hit(Op::Write, &tmp);
        f.write_all(bytes).map_err(Error::io("write", &tmp))?;
        hit(Op::Fsync, &tmp);
        f.sync_all().map_err(Error::io("fsync", &tmp))
    })();
    if let Err(e) = written {
        hit(Op::Unlink, &tmp);
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    publish_temp(&tmp, path, replace)
}

/// Publishes the written and fsynced temporary file `tmp` as `path`: renamed over it (`replace`),
/// or hard-linked only if `path` does not exist (`Ok(false)` when it did: nothing changed); then
/// the directory is fsynced. `tmp` is gone afterwards, whatever the outcome.
pub(super) fn publish_temp(tmp: &Path, path: &Path, replace: bool) -> Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let result = if replace {
        hit(Op::Rename { from: tmp }, path);
        std::fs::rename(tmp, path).map_err(Error::io("rename", path))
    } else {
        hit(Op::Link { from: tmp }, path);
        match std::fs::hard_link(tmp, path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                hit(Op::Unlink, tmp);
                let _ = std::fs::remove_file(tmp);
                return Ok(false);
            }
            Err(e) => Err(Error::io("link", path)(e)),
        }
    };
    if !replace || result.is_err() {
        hit(Op::Unlink, tmp);
    }
    let _ = std::fs::remove_file(tmp);
    result?;
    fsync_dir(dir)?;
    Ok(true)
}

/// `.<name>.tmp.<pid>.<n>` beside `path`.
pub(super) fn temp_name(path: &Path) -> PathBuf {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let seq = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(".{name}{TMP_INFIX}{}.{seq}", std::process::id()))
}

/// Removes the temporary files that [`atomic_write`] calls killed mid-write left directly in `dir`
/// (a killed process cannot clean up after itself). Only call it when no writer can still be
/// publishing into `dir`, e.g. after a commit. Best effort; returns how many were removed.
pub fn sweep_temp_files(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with('.')
                && name.contains(TMP_INFIX)
                && e.file_type().is_ok_and(|t| t.is_file())
        })
        .filter(|e| {
            hit(Op::Unlink, &e.path());
            std::fs::remove_file(e.path()).is_ok()
        })
        .count()
}

/// Opens `path` for reading, only if it is a regular file (after symlinks). A FIFO, device,
/// socket or directory given as `.metadata`, `config.json`, an index, a tokenizer file or data
/// is refused at once: opening a FIFO for reading waits for a writer forever, and a device never
/// ends. `O_NONBLOCK` makes the open itself return at once; it changes nothing for a regular
/// file's reads.
///
/// Errors: the open's `io::Error` (kind `NotFound` for a missing file); kind `InvalidInput`,
/// "not a regular file (...)", for anything else.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("not a regular file (a {})", file_kind(&kind)),
    ))
}

/// What a non-regular file is, for messages.
fn file_kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() || t.is_char_device() {
        "device"
    } else {
        "special file"
    }
}

/// The whole regular file `path` ([`open_regular`]), its buffer reserved fallibly: a file larger
/// than the memory that can be had (a sparse file of terabytes) is an error, not an abort.
///
/// Errors: [`open_regular`]'s; kind `OutOfMemory` when the buffer cannot be had; read errors.
pub fn read_regular(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = open_regular(path)?;
    let len = file.metadata()?.len();
    let mut out = Vec::new();
    usize::try_from(len)
        .ok()
        .and_then(|n| out.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("{len} bytes do not fit in memory"),
            )
        })?;
    file.read_to_end(&mut out)?;
    Ok(out)
}

/// Creates the directory and its parents, durably: the parent of each directory it creates is
/// fsynced, outermost first. Without that a power loss may take a new directory away with
/// everything in it, however durable its files (the checkpoint directory of a commit that
/// returned, or the state directory whose `COMMITTED` record makes it one: found by
/// `tests/crashpoints.rs`).
pub fn create_dir_all(dir: &Path) -> Result<()> {
    hit(Op::CreateDir, dir);
    let mut created = Vec::new();
    let mut at = Some(dir);
    while let Some(d) = at.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        created.push(d);
        at = d.parent();
    }
    std::fs::create_dir_all(dir).map_err(Error::io("create directory", dir))?;
    for d in created.iter().rev() {
        match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => fsync_dir(p)?,
            _ => fsync_dir(Path::new("."))?,
        }
    }
    Ok(())
}

/// A data file opened for parallel positioned writes; its writeback starts while it is written
/// ([`Writeback`]).
pub struct DataFile {
    pub(crate) path: PathBuf,
    file: Arc<File>,
    writeback: Writeback,
}

impl DataFile {
    /// Creates `path` anew ([`DataFile::create_empty`]) and reserves `len` bytes
    /// ([`DataFile::reserve`]).
    pub fn create(path: &Path, len: u64) -> Result<DataFile> {
        let file = DataFile::create_empty(path)?;
        file.reserve(len)?;
        Ok(file)
    }

    /// Creates `path` as a new, empty file: one left there (a failed attempt's) is unlinked first,
    /// not truncated. A process of that attempt may still be writing it (a straggler the retry did
    /// not wait for): its late writes then land in the unlinked file, never in this one, so they
    /// can neither corrupt this attempt's data nor its commit. A hard link to the old file keeps
    /// its bytes too.
    pub fn create_empty(path: &Path) -> Result<DataFile> {
        // Best effort: if the unlink fails (no such file, a directory in the way), the open below
        // reports what matters.
        hit(Op::Unlink, path);
        let _ = std::fs::remove_file(path);
        hit(Op::Create, path);
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)
            .map_err(Error::io("create", path))?;
        Ok(DataFile {
            path: path.to_path_buf(),
            file: Arc::new(file),
            writeback: Writeback::default(),
        })
    }

    /// Reserves the first `len` bytes, so a full disk fails here, before any data is written,
    /// where the filesystem supports `posix_fallocate` (elsewhere the file is only extended).
    pub fn reserve(&self, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let path = &self.path;
        hit(Op::Write, path);
        // SAFETY: plain syscall on an open descriptor.
        let rc = unsafe { libc::posix_fallocate(self.file.as_raw_fd(), 0, len as libc::off_t) };
        match rc {
            0 => Ok(()),
            libc::EOPNOTSUPP | libc::EINVAL => {
                self.file.set_len(len).map_err(Error::io("resize", path))
            }
            errno => Err(Error::Io {
                op: "allocate",
                path: path.to_path_buf(),
                source: std::io::Error::from_raw_os_error(errno),
            }),
        }
    }

    /// `pwrite` of all of `buf` at byte `offset`; safe to call from many threads at once. The
    /// bytes' writeback may start before [`DataFile::sync`] ([`Writeback`]).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        hit(Op::Write, &self.path);
        self.file
            .write_all_at(buf, offset)
            .map_err(Error::io("write", &self.path))?;
        self.writeback.wrote(&self.file, buf.len() as u64);
        Ok(())
    }

    /// Flushes data to stable storage (`fdatasync`), then the file's name (an fsync of its
    /// directory): the file's bytes, and the file under its name, are durable when it returns,
    /// whether or not their writeback started early. The name matters as much: the part published
    /// next vouches for the file, and a power loss that kept the part but lost the name left an
    /// `overwrite` that nothing could commit (found by `tests/crashpoints.rs`).
    pub fn sync(&self) -> Result<()> {
        hit(Op::Fsync, &self.path);
        self.file
            .sync_data()
            .map_err(Error::io("fsync", &self.path))?;
        match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => fsync_dir(dir),
            _ => fsync_dir(Path::new(".")),
        }
    }
}
