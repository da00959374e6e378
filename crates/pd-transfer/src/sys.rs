//! The crate's unsafe code: mapping the shared KV files of same-host transfers.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;

pub(crate) use memmap2::{Mmap, MmapMut};

/// Maps a file this process just created (and alone writes) read-write and shared.
pub(crate) fn map_created(file: &File) -> io::Result<MmapMut> {
    // SAFETY: the caller created the file (`create_new`) and sized it; other processes map it
    // read-only and never truncate it. The mapping lives as long as the returned value.
    unsafe { MmapMut::map_mut(file) }
}

/// Maps another process's shared KV file read-only.
pub(crate) fn map_read_only(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only. Its owner writes blocks while we may read them: a torn read
    // is possible by design and harmless, because the protocol trusts a copied block only after the
    // owner confirms its lease held (nobody wrote the block) until after the copy. The owner never
    // truncates the file while it lives; a file truncated underneath us would fault, the documented
    // hazard of memory mapping.
    unsafe { Mmap::map(file) }
}
