//! The engine's one system call outside the standard library: the crate's only unsafe code.
#![allow(unsafe_code)]

/// Lowers the calling thread's scheduling priority to niceness `nice` (Linux keeps a niceness per
/// thread; elsewhere this does nothing). Best effort: a refusal leaves the thread as it was.
pub(crate) fn lower_this_threads_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    // SAFETY: `gettid` takes no arguments and cannot fail; `setpriority` on this thread's own id
    // reads nothing from memory.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}
