//! The crate's unsafe code: mapping a GGUF file read-only.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;

pub(crate) use memmap2::Mmap;

/// Maps `file` read-only.
pub(crate) fn map_file(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only and private to this process. A GGUF file is not modified
    // while it is imported; a file truncated underneath us would fault, which is the documented
    // hazard of memory mapping and is outside what safe code can rule out.
    unsafe { Mmap::map(file) }
}
