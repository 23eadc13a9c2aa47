use std::sync::atomic::{AtomicBool, Ordering};

static SIGINT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    SIGINT.store(true, Ordering::SeqCst);
}

fn main() {
    // Ctrl-C ends a bounded wait at its next poll (exit 130) instead of killing the process in the
    // middle of a commit; outside waits the command finishes its step first.
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
    shardwise::interrupt::set_interrupt_check(|| SIGINT.load(Ordering::SeqCst));
    std::process::exit(shardwise_cli::run(std::env::args_os()));
}
