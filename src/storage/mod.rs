//! Where checkpoints live. [`Location`] is a checkpoint directory: a local path (our own parallel
//! positioned writes, atomic renames, `flock`) or a prefix in an object store (`object_store`
//! crate, conditional creates). Everything above this module names files by their `/`-separated
//! path inside the checkpoint (`.metadata`, `.shardwise/<save_id>/3.part`).

mod data;
mod local;
pub mod remote;
mod stream;
mod writeback;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use data::{DataSink, DataSource, Held};
pub use local::{
    atomic_create, atomic_write, create_dir_all, fsync_dir, open_regular, read_regular,
    sweep_temp_files, DataFile,
};
pub use stream::{Mode, Staged, StreamSink};

use crate::error::{Error, Result};
use crate::failpoint::{hit, Op};

/// A file directly under a listed directory.
#[derive(Clone, Debug)]
pub struct Listed {
    /// The file's name.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Seconds since its last modification.
    pub age_s: f64,
}

/// A checkpoint directory, local or in an object store.
#[derive(Clone, Debug)]
pub enum Location {
    /// A local directory.
    Local(PathBuf),
    /// An object-store prefix.
    Remote(Arc<remote::Remote>),
}

impl Location {
    /// Parses a path or URL: plain paths and `file://` are local; `s3://`, `gs://`, `az://`
    /// (also `abfs://`, `abfss://`, `azure://`) and `memory://` are object stores.
    ///
    /// Errors: [`Error::InvalidArgument`] for other schemes, malformed URLs, and an empty path
    /// (which the OS would take as the current directory: a checkpoint written there by a caller
    /// whose directory variable was empty).
    pub fn parse(s: &str) -> Result<Location> {
        match s.split_once("://") {
            None => Location::local_path(PathBuf::from(s)),
            Some(("file", rest)) => Location::local_path(PathBuf::from(rest)),
            Some(_) => Ok(Location::Remote(Arc::new(remote::Remote::open(s)?))),
        }
    }

    /// [`Location::parse`] for a path as the OS gives it (a command-line argument, a Python
    /// `str` or `bytes` path): a local path need not be UTF-8; a URL must be.
    ///
    /// Errors: as [`Location::parse`].
    pub fn from_os(s: &std::ffi::OsStr) -> Result<Location> {
        match s.to_str() {
            Some(s) => Location::parse(s),
            None => Location::local_path(PathBuf::from(s)),
        }
    }

    /// A local path given by a user; refuses an empty one.
    fn local_path(p: PathBuf) -> Result<Location> {
        if p.as_os_str().is_empty() {
            return Err(Error::InvalidArgument(
                "empty checkpoint path: give a directory (\".\" for the current one)".into(),
            ));
        }
        Ok(Location::Local(p))
    }

    /// This location with every object-store request bounded by a caller's `timeout`
    /// ([`remote::Bound::within`]); a local path gives the location as it is. No timeout, or a
    /// zero one (a caller that does not wait, e.g. `merge --timeout 0`), keeps the default bound.
    ///
    /// Errors: as [`Location::parse`].
    pub fn with_timeout(&self, timeout: Option<std::time::Duration>) -> Result<Location> {
        match (self, timeout) {
            (Location::Remote(r), Some(t)) if !t.is_zero() => {
                Ok(Location::Remote(Arc::new(r.with_timeout(t)?)))
            }
            _ => Ok(self.clone()),
        }
    }

    /// The local directory `dir`.
    pub fn local(dir: &Path) -> Location {
        Location::Local(dir.to_path_buf())
    }

    /// The local directory, if local.
    pub fn as_local(&self) -> Option<&Path> {
        match self {
            Location::Local(p) => Some(p),
            Location::Remote(_) => None,
        }
    }

    /// Whether a file here can be replaced or renamed atomically, so that a checkpoint can be
    /// switched to another in one step (its `.metadata` renamed over) and a file staged elsewhere
    /// moved into place: local filesystems. Object stores have neither rename nor a way to switch
    /// a prefix from one set of objects to another.
    pub fn can_replace_atomically(&self) -> bool {
        matches!(self, Location::Local(_))
    }

    /// Where a file that is moved into place at commit waits until then: `staged` where files can
    /// be renamed atomically (local), `final_rel` itself on object stores, which cannot rename
    /// (the object is written where it belongs; a reader only trusts it once the commit record
    /// names its size and CRC).
    pub fn stage_rel(&self, staged: String, final_rel: &str) -> String {
        if self.can_replace_atomically() {
            staged
        } else {
            final_rel.to_string()
        }
    }

    /// Refuses to replace a committed checkpoint here where that cannot be done in one step: on
    /// object stores, whose prefix cannot be switched from one set of objects to another (a reader
    /// could see files of both).
    ///
    /// Errors: [`Error::InvalidArgument`] on an object store.
    pub fn check_replaceable(&self) -> Result<()> {
        if self.can_replace_atomically() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "overwrite=True is refused on object stores ({self}): they cannot switch a checkpoint atomically; save into a new prefix, or delete the old one first"
        )))
    }

    /// Removes `rel` when it may be a file of a checkpoint that a commit here replaces; nothing on
    /// object stores, where a committed checkpoint is never replaced ([`Location::check_replaceable`]),
    /// so an object there belongs to this save.
    ///
    /// Errors: [`Error::Io`].
    pub fn remove_replaced(&self, rel: &str) -> Result<()> {
        match self {
            Location::Local(_) => self.remove(rel),
            Location::Remote(_) => Ok(()),
        }
    }

    /// `dir` as a local directory to write into, for a command that only writes locally (`what`
    /// names it).
    ///
    /// Errors: [`Error::InvalidArgument`] for an object-store URL.
    pub fn local_output<'p>(dir: &'p Path, what: &str) -> Result<&'p Path> {
        if dir.to_string_lossy().contains("://") {
            return Err(Error::InvalidArgument(format!(
                "{what} writes to a local directory, not to {}",
                dir.display()
            )));
        }
        Ok(dir)
    }

    /// The location with a local path made canonical (absolute, symlinks resolved), so that files
    /// found under it can be checked to lie inside it; an object-store location as it is.
    ///
    /// Errors: [`Error::Io`] when the directory cannot be resolved (missing) or is not a
    /// directory (a file given as the checkpoint directory).
    pub fn canonical(&self) -> Result<Location> {
        match self {
            Location::Local(dir) => {
                let real = dir
                    .canonicalize()
                    .map_err(Error::io("open checkpoint directory", dir))?;
                if !real.is_dir() {
                    return Err(not_a_directory("open checkpoint directory", dir));
                }
                Ok(Location::Local(real))
            }
            remote => Ok(remote.clone()),
        }
    }

    /// Makes the renames and creations done in the directory durable (local: fsync of the
    /// directory; an object-store write is durable when it returns).
    ///
    /// Errors: [`Error::Io`].
    pub fn sync_dir(&self) -> Result<()> {
        match self {
            Location::Local(dir) => fsync_dir(dir),
            Location::Remote(_) => Ok(()),
        }
    }

    /// Removes the temporary files of local writers killed mid-write ([`sweep_temp_files`]);
    /// object stores have none (a PUT is whole or absent). Only call it when no writer can still
    /// be publishing here. Best effort.
    pub fn sweep_temp_files(&self) {
        if let Location::Local(dir) = self {
            sweep_temp_files(dir);
        }
    }

    /// The location as a path for messages and errors (a URL is kept as written).
    pub fn display_path(&self) -> PathBuf {
        match self {
            Location::Local(p) => p.clone(),
            Location::Remote(r) => PathBuf::from(&r.url),
        }
    }

    /// `rel` as a path for messages.
    pub fn path_of(&self, rel: &str) -> PathBuf {
        self.display_path().join(rel)
    }

    /// Creates the directory (local) — object stores have no directories.
    ///
    /// Errors: [`Error::Io`], also for a path that exists and is not a directory.
    pub fn create_dir(&self) -> Result<()> {
        match self {
            Location::Local(p) if p.exists() && !p.is_dir() => {
                Err(not_a_directory("create checkpoint directory", p))
            }
            Location::Local(p) => create_dir_all(p),
            Location::Remote(_) => Ok(()),
        }
    }

    /// The whole file `rel`, or `None` when it does not exist.
    pub fn read(&self, rel: &str) -> Result<Option<Vec<u8>>> {
        match self {
            Location::Local(p) => {
                let path = p.join(rel);
                match read_regular(&path) {
                    Ok(b) => Ok(Some(b)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::Io {
                        op: "read",
                        path,
                        source: e,
                    }),
                }
            }
            Location::Remote(r) => r.get(rel),
        }
    }

    /// Size in bytes of `rel`, or `None` when it does not exist.
    pub fn size(&self, rel: &str) -> Result<Option<u64>> {
        match self {
            Location::Local(p) => match std::fs::metadata(p.join(rel)) {
                Ok(m) if m.is_file() => Ok(Some(m.len())),
                Ok(_) => Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::Io {
                    op: "stat",
                    path: p.join(rel),
                    source: e,
                }),
            },
            Location::Remote(r) => r.size(rel),
        }
    }

    /// Whether `rel` exists (errors count as absent: callers poll).
    pub fn exists(&self, rel: &str) -> bool {
        matches!(self.size(rel), Ok(Some(_)))
    }

    /// Publishes `bytes` as `rel` atomically, replacing it: readers see the old file or the whole
    /// new one (local: tmp + fsync + rename + directory fsync; object stores: one PUT).
    pub fn write(&self, rel: &str, bytes: Vec<u8>) -> Result<()> {
        match self {
            Location::Local(p) => {
                let path = p.join(rel);
                if let Some(parent) = path.parent() {
                    create_dir_all(parent)?;
                }
                atomic_write(&path, &bytes)
            }
            Location::Remote(r) => r.put(rel, bytes),
        }
    }

    /// Publishes `bytes` as `rel` only if `rel` does not exist yet (local: [`atomic_create`];
    /// object stores: a conditional create). `Ok(false)` when it already existed.
    pub fn write_new(&self, rel: &str, bytes: Vec<u8>) -> Result<bool> {
        match self {
            Location::Local(p) => {
                let path = p.join(rel);
                if let Some(parent) = path.parent() {
                    create_dir_all(parent)?;
                }
                atomic_create(&path, &bytes)
            }
            Location::Remote(r) => r.put_new(rel, bytes),
        }
    }

    /// The identity of the file `rel` as storage sees it now, `None` when absent: locally its size
    /// and modification time in ns (a rewrite or a replacement changes them; a copy that keeps
    /// timestamps, `cp -a` or `rsync -a`, keeps them); on object stores the ETag (or version, or
    /// size and modification time when the store gives neither). A part records the stamps of its
    /// data files, so a merger can tell that a data file was replaced after its part was published.
    pub fn stamp(&self, rel: &str) -> Result<Option<String>> {
        match self {
            Location::Local(p) => {
                use std::os::unix::fs::MetadataExt;
                match std::fs::metadata(p.join(rel)) {
                    Ok(m) if m.is_file() => Ok(Some(format!(
                        "{}:{}.{:09}",
                        m.len(),
                        m.mtime(),
                        m.mtime_nsec()
                    ))),
                    Ok(_) => Ok(None),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::io("stat", p.join(rel))(e)),
                }
            }
            Location::Remote(r) => r.stamp(rel),
        }
    }

    /// Renames `from` to `to` inside the checkpoint, replacing `to` (local only: object stores
    /// have no rename, and shardwise never calls this on them).
    ///
    /// Errors: [`Error::Io`]; [`Error::InvalidArgument`] on an object store.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        match self {
            Location::Local(p) => {
                hit(
                    Op::Rename {
                        from: &p.join(from),
                    },
                    &p.join(to),
                );
                std::fs::rename(p.join(from), p.join(to)).map_err(Error::io("rename", p.join(to)))
            }
            Location::Remote(r) => Err(Error::InvalidArgument(format!(
                "cannot rename {from} in {}: object stores have no rename",
                r.url
            ))),
        }
    }

    /// Removes `rel`; absent is fine.
    pub fn remove(&self, rel: &str) -> Result<()> {
        match self {
            Location::Local(p) => {
                hit(Op::Unlink, &p.join(rel));
                match std::fs::remove_file(p.join(rel)) {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                    Err(e) => Err(Error::io("remove", p.join(rel))(e)),
                }
            }
            Location::Remote(r) => r.delete(rel),
        }
    }

    /// Removes the directory `rel_dir` and everything under it (best effort for local).
    pub fn remove_dir(&self, rel_dir: &str) -> Result<()> {
        match self {
            Location::Local(p) => {
                hit(Op::RemoveTree, &p.join(rel_dir));
                let _ = std::fs::remove_dir_all(p.join(rel_dir));
                Ok(())
            }
            Location::Remote(r) => r.delete_all(rel_dir),
        }
    }

    /// Files directly under `rel_dir` and the names of its subdirectories; a missing directory
    /// lists as empty.
    ///
    /// Errors: [`Error::Io`] when `rel_dir` exists but cannot be listed (permissions, not a
    /// directory): that must not read as "no such directory".
    pub fn list(&self, rel_dir: &str) -> Result<(Vec<Listed>, Vec<String>)> {
        match self {
            Location::Local(p) => {
                let (mut files, mut dirs) = (Vec::new(), Vec::new());
                let path = p.join(rel_dir);
                let rd = match std::fs::read_dir(&path) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((files, dirs)),
                    Err(e) => return Err(Error::io("list", path)(e)),
                };
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let Ok(m) = e.metadata() else { continue };
                    if m.is_dir() {
                        dirs.push(name);
                    } else if m.is_file() {
                        let age_s = m
                            .modified()
                            .ok()
                            .and_then(|t| t.elapsed().ok())
                            .map_or(0.0, |d| d.as_secs_f64());
                        files.push(Listed {
                            name,
                            size: m.len(),
                            age_s,
                        });
                    }
                }
                Ok((files, dirs))
            }
            Location::Remote(r) => r.list(rel_dir),
        }
    }
}

/// A checkpoint directory given as a path that is a file (or anything but a directory): a
/// [`Error::Io`] (Python's `StorageError`, as for a missing directory and as `shardwise.load`'s
/// own check says it), naming the path and what to pass instead.
fn not_a_directory(op: &'static str, path: &Path) -> Error {
    Error::Io {
        op,
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotADirectory,
            "not a directory: a checkpoint is a directory (pass the directory that holds \
             .metadata, not a file in it)",
        ),
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.display_path().display())
    }
}
