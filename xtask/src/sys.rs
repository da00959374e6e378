//! Signal handling for `cargo xtask serve`: the crate's only unsafe code.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Routes SIGTERM and SIGINT to a flag read by [`stop_requested`].
pub(crate) fn install_stop_handler() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `on_stop` is an `extern "C"` function that only stores to an atomic, which is
        // async-signal-safe; installing a handler has no other preconditions.
        unsafe {
            libc::signal(sig, on_stop as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
}

pub(crate) fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Whether this process runs as root (may install system packages).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
