//! Ctrl-C for long native calls: every bounded wait (commit, parts) and every load polls
//! [`interrupted`] and stops with [`crate::Error::Interrupted`] when it is true.
//!
//! The host installs the check once: the Python binding one that runs Python's signal handlers
//! (Ctrl-C raises `KeyboardInterrupt` there), the `shardwise` binary one that reads its SIGINT flag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

static INTERRUPT_CHECK: OnceLock<fn() -> bool> = OnceLock::new();

/// Installs the function every wait and load calls at each poll; when it returns true the call
/// ends with [`crate::Error::Interrupted`]. Only the first call takes effect.
pub fn set_interrupt_check(check: fn() -> bool) {
    let _ = INTERRUPT_CHECK.set(check);
}

/// Whether the process was asked to stop (Ctrl-C seen by the check [`set_interrupt_check`] set).
pub fn interrupted() -> bool {
    INTERRUPT_CHECK.get().is_some_and(|f| f())
}

/// How often [`watching`]'s caller polls for Ctrl-C.
const POLL: Duration = Duration::from_millis(20);

/// Runs `work` on a scoped thread while the calling thread polls [`interrupted`] every 20 ms, and
/// returns its result with whether Ctrl-C was seen. On Ctrl-C the flag `work` is given turns true;
/// `work` is expected to stop at its next check of it. The flag starts true when Ctrl-C was already
/// seen (a call stops before its first step).
///
/// Why a second thread: the Python binding's check runs signal handlers only on Python's main
/// thread (the caller here), never on a pool's workers. A panic in `work` is resumed here.
pub fn watching<T: Send>(work: impl FnOnce(&AtomicBool) -> T + Send) -> (T, bool) {
    let stop = AtomicBool::new(interrupted());
    let caller = std::thread::current();
    let out = std::thread::scope(|scope| {
        let job = scope.spawn(|| {
            let r = work(&stop);
            caller.unpark();
            r
        });
        while !job.is_finished() {
            if interrupted() {
                stop.store(true, Ordering::Relaxed);
            }
            std::thread::park_timeout(POLL);
        }
        job.join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    });
    (out, stop.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_that_ends_returns_its_result() {
        let (r, stopped) = watching(|stop| {
            std::thread::sleep(Duration::from_millis(30));
            (7, stop.load(Ordering::Relaxed))
        });
        assert_eq!(r, (7, false));
        assert!(!stopped);
    }
}
