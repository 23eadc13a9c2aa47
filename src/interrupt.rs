//! Ctrl-C for long native calls: every bounded wait (commit, parts) and every load polls
//! [`interrupted`] and stops with [`crate::Error::Interrupted`] when it is true.
//!
//! The host installs the check once: the Python binding one that runs Python's signal handlers
//! (Ctrl-C raises `KeyboardInterrupt` there), the `shardwise` binary one that reads its SIGINT flag.

use std::sync::OnceLock;

static INTERRUPT_CHECK: OnceLock<fn() -> bool> = OnceLock::new();

/// Installs the function every wait and load calls at each poll; when it returns true the call
/// ends with [`crate::Error::Interrupted`]. Only the first call takes effect.
pub fn set_interrupt_check(check: fn() -> bool) {
    let _ = INTERRUPT_CHECK.set(check);
}

/// Whether the process was asked to stop (Ctrl-C seen by the check [`set_interrupt_check`] set).
pub(crate) fn interrupted() -> bool {
    INTERRUPT_CHECK.get().is_some_and(|f| f())
}
