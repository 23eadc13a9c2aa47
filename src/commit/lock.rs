//! The `COMMITTING` lock of a local save: exclusive create plus an advisory `flock` held for as long
//! as the merger lives, so a later merger can tell a dead holder from a slow one without any clock
//! or heartbeat. Object stores have no lock (see the module docs of [`super`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::liveness::hostname;
use super::part::Marker;
use crate::error::{Error, Result};
use crate::failpoint::{hit, Op};
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
        hit(Op::Write, &self.path);
        let _ = self.file.set_len(0);
        let _ = self.file.seek(std::io::SeekFrom::Start(0));
        let _ = write!(self.file, "pid {} host {}", std::process::id(), hostname());
        hit(Op::Fsync, &self.path);
        let _ = self.file.sync_all();
    }

    /// Takes the lock at `path` (creating its directory), or takes over the lock of a dead merger.
    pub(super) fn acquire(path: &Path) -> Result<Lock> {
        if let Some(dir) = path.parent() {
            crate::storage::create_dir_all(dir)?;
        }
        hit(Op::Create, path);
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
        hit(Op::Unlink, &self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The path of the `COMMITTING` lock of `save_id`; `None` on object stores, which have no lock
/// (no `flock`; their commit relies on create-if-absent instead).
pub(super) fn lock_path(loc: &Location, save_id: &str) -> Option<PathBuf> {
    Some(loc.as_local()?.join(Marker::Committing.rel(save_id)))
}

/// Whether the `COMMITTING` lock of `save_id` is held by a merger that died (its `flock` is free and
/// it had recorded itself). `None` when there is no lock, liveness cannot be told, or `loc` is an
/// object store (which has no lock).
pub fn dead_merger(loc: &Location, save_id: &str) -> Option<String> {
    let path = lock_path(loc, save_id)?;
    let file = std::fs::File::open(&path).ok()?;
    if try_flock(&file)? {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        (!holder.is_empty()).then_some(holder)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_busy_for_others_and_gone_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s/COMMITTING");
        let Lock::Held(lock, false) = CommitLock::acquire(&path).unwrap() else {
            panic!("a free lock is taken")
        };
        // flock belongs to the open file: a second open in this process contends like another
        // process would.
        assert!(matches!(CommitLock::acquire(&path).unwrap(), Lock::Busy));
        let holder = std::fs::read_to_string(&path).unwrap();
        assert!(
            holder.starts_with(&format!("pid {} host ", std::process::id())),
            "{holder}"
        );
        drop(lock);
        assert!(!path.exists());
        assert!(matches!(
            CommitLock::acquire(&path).unwrap(),
            Lock::Held(_, false)
        ));
    }

    /// A lock file whose holder recorded itself but holds no flock is a dead merger's: reported as
    /// such, and taken over.
    #[test]
    fn a_dead_mergers_lock_is_reported_and_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        let path = lock_path(&loc, "s").unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "pid 1 host gone").unwrap();
        assert_eq!(dead_merger(&loc, "s").as_deref(), Some("pid 1 host gone"));
        assert!(matches!(
            CommitLock::acquire(&path).unwrap(),
            Lock::Held(_, true)
        ));
        assert_eq!(dead_merger(&loc, "other"), None);
    }

    #[test]
    fn object_stores_have_no_lock() {
        let loc = Location::parse("memory://lock-tests/x").unwrap();
        assert_eq!(lock_path(&loc, "s"), None);
        assert_eq!(dead_merger(&loc, "s"), None);
    }
}
