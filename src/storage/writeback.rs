//! Early writeback of a data file being written: the disk writes the first bytes while later ones
//! are still being copied into the page cache, so the final `fdatasync` waits only for the tail.
//!
//! Why: Linux starts writing a file's dirty pages on its own only past `vm.dirty_background_ratio`
//! (10 % of RAM by default: 2.3 GiB on a 24 GiB host, 12 GiB on a 125 GiB one) or after
//! `vm.dirty_expire_centisecs` (30 s). A rank's file is usually smaller than the first and written
//! faster than the second, so without a hint the disk idles while the file is copied into the page
//! cache, and the whole file is written only once `fdatasync` asks for it: copy time + disk time.
//! With the hint the two overlap. Measured in BENCHMARKS.md ("CPU save at the disk's speed").
//!
//! How: every [`STEP_BYTES`] written, a helper thread calls
//! `sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)` (Linux `fs/sync.c`, since 2.6.17), which
//! queues the writeback of the file's dirty pages not already being written and returns without
//! waiting for it (`WB_SYNC_NONE`). It is only a hint: durability still comes from the
//! `fdatasync` of [`super::DataFile::sync`], which the commit protocol waits for as before. The
//! call can block when the device's queue is full, which is why it runs on its own thread and
//! never on a writer's (a staged GPU save's writer threads return pinned buffers to the pool as soon
//! as their write is in the page cache). Its errors are ignored (a filesystem without it, tmpfs);
//! `fdatasync` reports real ones.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Bytes written between two writeback requests: large enough that the requests cost nothing
/// (about 20 for a 300 MB file, one syscall each), small enough that the disk starts early.
pub const STEP_BYTES: u64 = 16 << 20;

/// Counts the bytes written to one file and asks a helper thread to start their writeback every
/// [`STEP_BYTES`]. The thread is started on the first request (files under one step never get
/// one) and ends when this is dropped.
#[derive(Default)]
pub struct Writeback {
    written: AtomicU64,
    helper: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
}

impl Writeback {
    /// Records `len` more bytes written to `file`; starts their writeback when a step boundary is
    /// crossed. Never blocks on the disk.
    pub fn wrote(&self, file: &Arc<File>, len: u64) {
        let before = self.written.fetch_add(len, Ordering::Relaxed);
        if before / STEP_BYTES == (before + len) / STEP_BYTES {
            return;
        }
        let mut helper = self.helper.lock().unwrap_or_else(|e| e.into_inner());
        if helper.is_none() {
            let (tx, rx) = channel::<()>();
            let file = Arc::clone(file);
            let spawned = std::thread::Builder::new()
                .name("shardwise-writeback".into())
                .spawn(move || {
                    while rx.recv().is_ok() {
                        // Requests that arrived meanwhile are served by this one call.
                        while rx.try_recv().is_ok() {}
                        // SAFETY: a plain syscall on a descriptor this thread keeps open.
                        unsafe {
                            libc::sync_file_range(
                                file.as_raw_fd(),
                                0,
                                0,
                                libc::SYNC_FILE_RANGE_WRITE,
                            )
                        };
                    }
                });
            // No thread (resource limits): no early writeback, the fdatasync does it all.
            let Ok(handle) = spawned else { return };
            *helper = Some((tx, handle));
        }
        if let Some((tx, _)) = helper.as_ref() {
            let _ = tx.send(());
        }
    }

    /// Whether the helper thread was started, i.e. a writeback was requested.
    #[cfg(test)]
    pub fn started(&self) -> bool {
        self.helper
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

impl Drop for Writeback {
    fn drop(&mut self) {
        let helper = self.helper.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some((tx, handle)) = helper.take() {
            drop(tx); // ends the helper's loop after its current call
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file under one step never starts the helper thread; crossing a step does, and dropping
    /// the tracker ends it (the join in `Drop` returns).
    #[test]
    fn writeback_starts_at_the_first_step_and_ends_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        let small = Writeback::default();
        small.wrote(&file, STEP_BYTES - 1);
        assert!(!small.started());
        let big = Writeback::default();
        big.wrote(&file, STEP_BYTES - 1);
        assert!(!big.started());
        big.wrote(&file, 1);
        assert!(big.started());
        drop(big);
    }
}
