//! The crate's unsafe code: mapping the shared KV files of same-host transfers, asking who we are,
//! and (feature `ucx`) UCX's UCP API.
#![allow(unsafe_code)]

#[cfg(feature = "ucx")]
pub(crate) mod ucx;

use std::fs::File;
use std::io;

pub(crate) use libc::O_NOFOLLOW;
pub(crate) use memmap2::{Mmap, MmapMut};

/// This process's effective user id (who owns the files it creates).
pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// Gives `file` (just created, `bytes` long) its storage now: on tmpfs every page is allocated, so a
/// full `/dev/shm` is an error here (ENOSPC) rather than a SIGBUS at the first write or read of a
/// page it could not back.
pub(crate) fn allocate(file: &File, bytes: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    if bytes == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the descriptor is open for writing for the whole call (`file` is borrowed); the call
    // touches no memory of ours.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Takes a shared advisory lock (`flock`) on `file`, held until the file is closed: by the region's
/// owner, for as long as it lives (the kernel drops it when the process dies, however it dies).
pub(crate) fn lock_shared(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the whole call; the call touches no memory of ours.
    match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Whether nobody holds a lock on `file`: an exclusive lock taken without waiting (and kept until
/// `file` is closed). `false` while any owner lives.
pub(crate) fn unlocked(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: as in `lock_shared`.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Maps a file this process just created (and alone writes) read-write and shared.
pub(crate) fn map_created(file: &File) -> io::Result<MmapMut> {
    // SAFETY: the caller created the file (`create_new`) and sized it; other processes map it
    // read-only and never truncate it. The mapping lives as long as the returned value.
    unsafe { MmapMut::map_mut(file) }
}

/// Maps another process's shared KV file read-only, every page mapped at once (`MAP_POPULATE`): the
/// view lives as long as its sender, and a transfer should not pay a page fault per 4 KiB it reads.
pub(crate) fn map_read_only(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only. Its owner writes blocks while we may read them: a torn read
    // is possible by design and harmless, because the protocol trusts a copied block only after the
    // owner confirms its lease held (nobody wrote the block) until after the copy. The owner never
    // truncates the file while it lives; a file truncated underneath us would fault, the documented
    // hazard of memory mapping.
    unsafe { memmap2::MmapOptions::new().populate().map(file) }
}

/// CRC-32C of `data` from the SSE4.2 instruction where the CPU has it (8 bytes per instruction);
/// `None` where it does not.
pub(crate) fn crc32c_hw(data: &[u8]) -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU has SSE4.2 (checked just above).
            return Some(unsafe { crc32c_sse42(data) });
        }
    }
    let _ = data;
    None
}

/// The CRC-32C of each of `data`'s four stripes (see `checksum::striped`) from the SSE4.2
/// instruction, the four chains interleaved (one instruction's latency is three of its issue
/// slots, so four independent chains run about three times one's rate); `None` without SSE4.2.
pub(crate) fn crc32c_stripes_hw(data: &[u8]) -> Option<[u32; 4]> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU has SSE4.2 (checked just above).
            return Some(unsafe { crc32c_stripes_sse42(data) });
        }
    }
    let _ = data;
    None
}

/// # Safety
/// The CPU has SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_stripes_sse42(data: &[u8]) -> [u32; 4] {
    use std::arch::x86_64::_mm_crc32_u64;
    let q = crate::checksum::stripe_len(data.len());
    let p = data.as_ptr();
    let mut c = [u64::from(u32::MAX); 4];
    let mut at = 0;
    while at < q {
        // SAFETY (of the reads): at + 8 <= q, and 3q + q <= data.len() (`stripe_len`).
        let w = |s: usize| u64::from_le(std::ptr::read_unaligned(p.add(s * q + at).cast::<u64>()));
        c[0] = _mm_crc32_u64(c[0], w(0));
        c[1] = _mm_crc32_u64(c[1], w(1));
        c[2] = _mm_crc32_u64(c[2], w(2));
        c[3] = _mm_crc32_u64(c[3], w(3));
        at += 8;
    }
    // The last stripe's tail (what does not fill four whole stripes of 8-byte words).
    let tail = crc32c_continue(c[3] as u32, &data[4 * q..]);
    [!(c[0] as u32), !(c[1] as u32), !(c[2] as u32), !tail]
}

/// `dst` = `src` (plain stores: 8-byte streaming stores across four stripes were 12x slower), and
/// the stripes' CRC-32Cs of `src` as [`crc32c_stripes_hw`] computes them, from the one pass that
/// copies: the words are checksummed from the registers they are stored from, so checking a block
/// costs little beside copying it. `None` (nothing copied) without SSE4.2.
pub(crate) fn copy_stripes_hw(dst: &mut [u8], src: &[u8]) -> Option<[u32; 4]> {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU has SSE4.2 (checked just above); lengths are equal (asserted).
            return Some(unsafe { copy_stripes_sse42(dst, src) });
        }
    }
    None
}

/// # Safety
/// The CPU has SSE4.2 (and SSE2, part of x86_64); `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn copy_stripes_sse42(dst: &mut [u8], src: &[u8]) -> [u32; 4] {
    use std::arch::x86_64::_mm_crc32_u64;
    let q = crate::checksum::stripe_len(src.len());
    let (p, d) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = [u64::from(u32::MAX); 4];
    let mut at = 0;
    while at < q {
        for (s, c) in c.iter_mut().enumerate() {
            // SAFETY (of the read and the store): at + 8 <= q and 4q <= len for both slices.
            let w = std::ptr::read_unaligned(p.add(s * q + at).cast::<u64>());
            *c = _mm_crc32_u64(*c, u64::from_le(w));
            std::ptr::write_unaligned(d.add(s * q + at).cast::<u64>(), w);
        }
        at += 8;
    }
    dst[4 * q..].copy_from_slice(&src[4 * q..]);
    let tail = crc32c_continue(c[3] as u32, &src[4 * q..]);
    [!(c[0] as u32), !(c[1] as u32), !(c[2] as u32), !tail]
}

/// A CRC-32C register `c` (not yet inverted) continued over `data`.
///
/// # Safety
/// The CPU has SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_continue(c: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut words = data.chunks_exact(8);
    let mut c = u64::from(c);
    for w in &mut words {
        c = _mm_crc32_u64(c, u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]));
    }
    let mut c = c as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    c
}

/// # Safety
/// The CPU has SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut words = data.chunks_exact(8);
    let mut c = u64::from(u32::MAX);
    for w in &mut words {
        c = _mm_crc32_u64(c, u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]));
    }
    let mut c = c as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    !c
}
