//! SIGTERM and SIGINT for the `pdserve-router` binary: the only unsafe code of the crate (the library
//! forbids it).
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

static TERMINATE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_terminate(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    TERMINATE.store(true, Ordering::SeqCst);
}

/// Routes SIGTERM and SIGINT to a flag read by [`terminate_requested`].
pub fn install_termination_handler() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `on_terminate` is an `extern "C"` function that only stores to an atomic, which is
        // async-signal-safe; installing a handler has no other preconditions.
        unsafe {
            libc::signal(sig, on_terminate as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
}

pub fn terminate_requested() -> bool {
    TERMINATE.load(Ordering::SeqCst)
}
