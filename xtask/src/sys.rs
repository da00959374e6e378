//! Signal handling and the CPU cores this process may use, for `cargo xtask serve`: the crate's only
//! unsafe code.
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

/// The CPU cores this process may run on (its affinity mask), in increasing order; empty where the
/// mask cannot be read.
pub(crate) fn allowed_cores() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data, all zeros valid; sched_getaffinity writes at most
    // `size_of::<cpu_set_t>()` bytes into it; CPU_ISSET reads within it for i < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&i| libc::CPU_ISSET(i, &set)).collect()
    }
}
