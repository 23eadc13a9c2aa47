//! The `COMMITTING` lock of a local save: exclusive create plus an advisory `flock` held for as long
//! as the merger lives, so a later merger can tell a dead holder from a slow one without any clock
//! or heartbeat. Object stores have no lock (see the module docs of [`super`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::liveness::hostname;
use super::part::Marker;
use crate::error::{Error, Result};
use crate::storage::Location;

/// The `COMMITTING` lock of one save, held through an advisory `flock` for as long as its holder
/// lives: the kernel drops the `flock` when the holder dies (even by SIGKILL), so a later merger can
/// tell a dead holder from a slow one without any clock or heartbeat.
pub(super) struct CommitLock {
    path: PathBuf,
    file: std::fs::File,
}

/// What a merger finds at the lock.
pub(super) enum Lock {
    /// We hold it; `took_over` when a dead merger's lock was taken over.
    Held(CommitLock, bool),
    /// A live merger holds it (or liveness cannot be told on this filesystem).
    Busy,
}

/// `flock(LOCK_EX | LOCK_NB)`: `Some(true)` acquired, `Some(false)` held by a live process,
/// `None` when the filesystem has no `flock` (Lustre without `-o flock`): liveness is then unknown.
fn try_flock(file: &std::fs::File) -> Option<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: plain syscall on an open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Some(true);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EWOULDBLOCK) => Some(false),
        _ => None,
    }
}

fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

impl CommitLock {
    fn record_holder(&mut self) {
        use std::io::{Seek, Write};
        let _ = self.file.set_len(0);
        let _ = self.file.seek(std::io::SeekFrom::Start(0));
        let _ = write!(self.file, "pid {} host {}", std::process::id(), hostname());
        let _ = self.file.sync_all();
    }

    /// Takes the lock at `path`, or takes over the lock of a dead merger.
    pub(super) fn acquire(path: &Path) -> Result<Lock> {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(file) => {
                // Blocking: a contender may hold the flock of this still-empty file for a moment
                // (it then backs off). The holder records itself only once it holds the flock.
                use std::os::unix::io::AsRawFd;
                // SAFETY: plain syscall on an open descriptor. Without flock support the lock is
                // still exclusive by its creation; only dead-holder detection is lost.
                unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
                let mut lock = CommitLock {
                    path: path.to_path_buf(),
                    file,
                };
                lock.record_holder();
                Ok(Lock::Held(lock, false))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let Ok(file) = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                else {
                    return Ok(Lock::Busy); // released meanwhile; the caller looks again
                };
                if try_flock(&file) != Some(true) {
                    return Ok(Lock::Busy);
                }
                // We hold the flock of the file we opened; it is a dead holder's lock only if it
                // is still the lock file (not one its holder removed after finishing) and the
                // holder had recorded itself (an empty file may be a holder about to lock it).
                let current = std::fs::metadata(path).ok();
                let ours = file.metadata().ok();
                let still_lock = matches!((&current, &ours), (Some(a), Some(b)) if same_file(a, b));
                let age = ours
                    .as_ref()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.elapsed().ok())
                    .unwrap_or_default();
                let recorded = ours.is_some_and(|m| m.len() > 0);
                if !still_lock || (!recorded && age < Duration::from_secs(10)) {
                    return Ok(Lock::Busy);
                }
                let mut lock = CommitLock {
                    path: path.to_path_buf(),
                    file,
                };
                lock.record_holder();
                Ok(Lock::Held(lock, true))
            }
            Err(e) => Err(Error::Io {
                op: "create",
                path: path.to_path_buf(),
                source: e,
            }),
        }
    }
}

impl Drop for CommitLock {
    fn drop(&mut self) {
        // Remove the name before the flock goes with the descriptor, so no contender can take
        // over a lock whose holder has finished.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether the `COMMITTING` lock of `save_id` is held by a merger that died (its `flock` is free and
/// it had recorded itself). `None` when there is no lock, liveness cannot be told, or `loc` is an
/// object store (which has no lock).
pub fn dead_merger(loc: &Location, save_id: &str) -> Option<String> {
    let path = loc.as_local()?.join(Marker::Committing.rel(save_id));
    let file = std::fs::File::open(&path).ok()?;
    if try_flock(&file)? {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        (!holder.is_empty()).then_some(holder)
    } else {
        None
    }
}
