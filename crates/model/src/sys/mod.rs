//! The crate's unsafe code, each use with its reasoning: mapping files into memory, viewing KV memory
//! as f32 or 16-bit values, and the CPU kernels (AMX tiles / AVX-512 / AVX-512 BF16 / AVX2, chosen at run time), one module
//! per kind, each with the portable loop it falls back to and is tested against.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;

pub(crate) use memmap2::Mmap;

/// Maps `file` read-only.
pub(crate) fn map_file(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only and private to this process. Model files are written once (by
    // import, to a temporary name renamed into place) and never modified while a process maps them;
    // a file truncated underneath us would fault, which is the documented hazard of memory mapping and
    // is outside what safe code can rule out.
    unsafe { Mmap::map(file) }
}

/// Lets the kernel take back this process's pages of `map` within `range` (the whole pages inside it):
/// a tensor read once and converted need not stay resident, so loading a model holds its file's pages
/// one tensor at a time, not the whole file. Best effort: an error leaves the pages where they are.
pub(crate) fn release_pages(map: &Mmap, range: std::ops::Range<usize>) {
    const PAGE: usize = 4096;
    let (start, end) = (range.start.next_multiple_of(PAGE), range.end.min(map.len()) / PAGE * PAGE);
    if end > start {
        // SAFETY: the mapping is read-only and private, of a file nobody modifies while it is mapped
        // (see `map_file`), and nothing borrows these bytes now: a later read of them faults the same
        // bytes back in from the file, so no value anyone observes changes.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
    }
}

/// For row tiles of up to six rows over `t` rows, with `$i` bound to each tile's first row, runs
/// `$tile::<R>(args)` for the tile's row count R (a const generic, so each tile size gets its own fully
/// unrolled register tile).
macro_rules! row_tiles {
    ($t:expr, |$i:ident| $tile:ident($($arg:expr),* $(,)?)) => {{
        let mut $i = 0;
        while $i < $t {
            let r = ($t - $i).min(6);
            match r {
                6 => $tile::<6>($($arg),*),
                5 => $tile::<5>($($arg),*),
                4 => $tile::<4>($($arg),*),
                3 => $tile::<3>($($arg),*),
                2 => $tile::<2>($($arg),*),
                _ => $tile::<1>($($arg),*),
            }
            $i += r;
        }
    }};
}

mod amx;
mod attention;
mod convert;
mod decode_avx2;
mod decode_avx512;
mod elementwise;
mod fp4;
mod fp8;
mod gemm;
mod isa;
pub mod peak;
mod qdot;
mod qint8;
mod qrows;
mod qwiden;
mod rows_bf16;
mod rows_f32;

pub(crate) use isa::{amx, avx2, avx512};
pub use isa::{cpu_kernels, set_cpu_kernels, CpuKernels};

pub(crate) use attention::*;
pub(crate) use convert::*;
pub(crate) use elementwise::*;
pub(crate) use fp4::{dot_fp4, e2m1_value, widen_fp4_row, E2M1};
pub(crate) use fp8::{dot_fp8, e4m3_value, widen_fp8_row};
pub(crate) use gemm::*;
pub(crate) use qdot::*;
pub(crate) use qint8::*;
pub(crate) use qrows::*;
pub(crate) use qwiden::*;
pub(crate) use rows_bf16::{gemm_rows_bf16, has_rows_bf16, Q4Rows, Q8Rows};
pub(crate) use rows_f32::{
    gemm_rows_f32, Bf16RowMajor, F16Weights, F32Weights, Fp4Weights, Fp8Weights, WIDE_ROWS,
};

/// The bytes of f32 values (native, little-endian on every supported target).
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte of it is initialized; u8 has alignment 1; the length
    // covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Mutable form of [`f32_bytes`].
pub(crate) fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`, and every byte pattern written through it is a valid f32; the
    // borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Views bytes as f32 values. Panics unless the bytes are 4-aligned and a whole number of values
/// (a page-aligned mapping always is).
pub(crate) fn as_f32(bytes: &[u8]) -> &[f32] {
    // SAFETY: every bit pattern is a valid f32; `align_to` never returns misaligned middles, and the
    // assertion makes sure no byte is left out.
    let (head, mid, tail) = unsafe { bytes.align_to::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "KV memory is not f32-aligned");
    mid
}

/// Mutable form of [`as_f32`].
pub(crate) fn as_f32_mut(bytes: &mut [u8]) -> &mut [f32] {
    // SAFETY: as in `as_f32`; the borrow is unique.
    let (head, mid, tail) = unsafe { bytes.align_to_mut::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "KV memory is not f32-aligned");
    mid
}

/// Views bytes as 16-bit values (f16 or bf16 bits). Panics unless the bytes are 2-aligned and a whole
/// number of values.
pub(crate) fn as_u16(bytes: &[u8]) -> &[u16] {
    // SAFETY: every bit pattern is a valid u16; `align_to` never returns misaligned middles, and the
    // assertion makes sure no byte is left out.
    let (head, mid, tail) = unsafe { bytes.align_to::<u16>() };
    assert!(head.is_empty() && tail.is_empty(), "KV memory is not 16-bit aligned");
    mid
}

/// Mutable form of [`as_u16`].
pub(crate) fn as_u16_mut(bytes: &mut [u8]) -> &mut [u16] {
    // SAFETY: as in `as_u16`; the borrow is unique.
    let (head, mid, tail) = unsafe { bytes.align_to_mut::<u16>() };
    assert!(head.is_empty() && tail.is_empty(), "KV memory is not 16-bit aligned");
    mid
}
