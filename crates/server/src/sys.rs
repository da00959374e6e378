//! Signal handling, returning freed heap memory and pinning to CPU cores: the crate's only unsafe code.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

static TERMINATE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_terminate(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    TERMINATE.store(true, Ordering::SeqCst);
}

/// Routes SIGTERM and SIGINT to a flag read by [`terminate_requested`].
pub(crate) fn install_termination_handler() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `on_terminate` is an `extern "C"` function that only stores to an atomic, which is
        // async-signal-safe; installing a handler has no other preconditions.
        unsafe {
            libc::signal(sig, on_terminate as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
}

/// Asks for the same graceful stop as SIGTERM.
pub(crate) fn request_termination() {
    TERMINATE.store(true, Ordering::SeqCst);
}

pub(crate) fn terminate_requested() -> bool {
    TERMINATE.load(Ordering::SeqCst)
}

/// Hands the heap's free pages back to the kernel: after the model is loaded, the f32 copies the
/// backend converted and freed would otherwise stay resident (glibc keeps freed heap memory).
pub(crate) fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Pins the calling thread, and so every thread it starts later, to `cores` (Linux CPU numbers).
pub(crate) fn pin_to_cores(cores: &[usize]) -> std::io::Result<()> {
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    if cores.is_empty() {
        return Err(invalid("no cores".into()));
    }
    // SAFETY: cpu_set_t is plain data, all zeros a valid empty set; CPU_SET writes within it for a
    // core below CPU_SETSIZE (checked); sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            if c >= libc::CPU_SETSIZE as usize {
                return Err(invalid(format!("core {c} is past the largest CPU number")));
            }
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
