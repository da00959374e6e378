//! The machine's peaks, as `cargo xtask bench peak` measures them (`benches/peak.rs` drives these on 1
//! and on all threads): f32 FMA throughput, bf16 dot throughput (AVX-512 BF16 `vdpbf16ps`; AMX's
//! `tdpbf16ps` tiles) and the
//! rate at which one thread streams a buffer through wide loads. The CPU kernels' speed is judged
//! against these figures, so each kernel here is the plainest loop that reaches its unit's limit:
//! [`CHAINS`] independent accumulators in registers, no memory traffic but the buffer read.
//!
//! Every function checks the CPU for the instructions it uses each time it is called (never trusting
//! the process's kernel choice, which may be lower) and answers `None` where the CPU lacks them.

use super::CpuKernels;

/// Independent accumulator chains per kernel: more than an FMA's latency (4 cycles) times the FMA
/// units (2), so no chain waits on another, and few enough (of 16 or 32 vector registers) never to
/// spill.
pub const CHAINS: usize = 12;

/// Runs `iters` rounds of [`CHAINS`] f32 vector FMAs with the `kernels` family's widest vectors (16
/// lanes for AVX-512, 8 for AVX2); the floating-point operations done (2 per lane per FMA), or `None`
/// if this CPU lacks the family or it has no FMA (`Portable`).
pub fn fma_f32(kernels: CpuKernels, iters: u64) -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    match kernels {
        CpuKernels::Amx | CpuKernels::Avx512 if std::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU has AVX-512F (checked just above).
            std::hint::black_box(unsafe { fma_avx512(iters) });
            return Some(iters * (CHAINS * 16 * 2) as u64);
        }
        CpuKernels::Avx2 if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") => {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            std::hint::black_box(unsafe { fma_avx2(iters) });
            return Some(iters * (CHAINS * 8 * 2) as u64);
        }
        _ => {}
    }
    let _ = (kernels, iters);
    None
}

/// Runs `iters` rounds of [`CHAINS`] AVX-512 BF16 dot products (`vdpbf16ps`: 32 bf16 pairs multiplied
/// and summed into 16 f32 lanes); the floating-point operations done (2 per pair), or `None` if this
/// CPU has no AVX-512 BF16.
pub fn dot_bf16(iters: u64) -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") {
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked just above).
        std::hint::black_box(unsafe { dot_bf16_avx512(iters) });
        return Some(iters * (CHAINS * 32 * 2) as u64);
    }
    let _ = iters;
    None
}

/// Runs `iters` rounds of four AMX `tdpbf16ps` (each 16 x 32 bf16 by 32 x 16 into 16 x 16 f32: 16,384
/// operations) on tiles in registers; the operations done, or `None` where the CPU has no AMX or the
/// system grants no tile state.
pub fn tile_bf16(iters: u64) -> Option<u64> {
    super::amx::tile_peak(iters)
}

/// Reads every byte of `buf` once, with the `kernels` family's widest loads (64 bytes for AVX-512,
/// 32 for AVX2, 8 for `Portable`), folding them into a value the caller keeps (so the reads cannot
/// be left out); `None` if this CPU lacks the family.
pub fn read(kernels: CpuKernels, buf: &[u8]) -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    match kernels {
        CpuKernels::Amx | CpuKernels::Avx512 if std::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return Some(unsafe { read_avx512(buf) });
        }
        CpuKernels::Avx2 if std::is_x86_feature_detected!("avx2") => {
            // SAFETY: the CPU has AVX2 (checked just above).
            return Some(unsafe { read_avx2(buf) });
        }
        CpuKernels::Amx | CpuKernels::Avx512 | CpuKernels::Avx2 => return None,
        CpuKernels::Portable => {}
    }
    Some(read_portable(buf))
}

/// The bytes of `buf` outside its middle of 8-byte-aligned words, folded; and that middle.
fn read_portable(buf: &[u8]) -> u64 {
    // SAFETY: every bit pattern is a valid u64; `align_to` hands out only aligned, in-bounds middles.
    let (head, mid, tail) = unsafe { buf.align_to::<u64>() };
    let mut acc = [0u64; 4];
    let mut chunks = mid.chunks_exact(4);
    for c in &mut chunks {
        for (a, &w) in acc.iter_mut().zip(c) {
            *a ^= w;
        }
    }
    let words = chunks.remainder().iter().fold(acc[0] ^ acc[1] ^ acc[2] ^ acc[3], |a, &w| a ^ w);
    head.iter().chain(tail).fold(words, |a, &b| a.rotate_left(8) ^ u64::from(b))
}

/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    // Multiplier just under 1 and a tiny addend: the values stay finite and normal for any count.
    let (a, b) =
        (_mm512_set1_ps(std::hint::black_box(0.999_999)), _mm512_set1_ps(std::hint::black_box(1e-7)));
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm512_fmadd_ps(*c, a, b);
        }
    }
    acc.iter().map(|&c| _mm512_reduce_add_ps(c)).sum()
}

/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) =
        (_mm256_set1_ps(std::hint::black_box(0.999_999)), _mm256_set1_ps(std::hint::black_box(1e-7)));
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm256_fmadd_ps(*c, a, b);
        }
    }
    let mut lanes = [0f32; 8];
    let sum = acc.iter().fold(_mm256_setzero_ps(), |s, &c| _mm256_add_ps(s, c));
    // SAFETY: `lanes` holds exactly 8 f32 values, the 32 bytes the store writes.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
    lanes.iter().sum()
}

/// # Safety
/// AVX-512F and AVX-512 BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_bf16_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    // Pairs of small bf16 values (from f32 0.001 and 0.002): each round adds about 6e-5 per lane, so
    // the sums stay finite for any count a benchmark runs.
    let x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.001), _mm512_set1_ps(std::hint::black_box(0.001)));
    let y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.002), _mm512_set1_ps(std::hint::black_box(0.002)));
    let mut acc = [_mm512_setzero_ps(); CHAINS];
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm512_dpbf16_ps(*c, x, y);
        }
    }
    acc.iter().map(|&c| _mm512_reduce_add_ps(c)).sum()
}

/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_avx512(buf: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    // SAFETY: every bit pattern is a valid __m512i; `align_to` hands out only aligned, in-bounds
    // middles, so each element is read with an aligned load.
    let (head, mid, tail) = unsafe { buf.align_to::<__m512i>() };
    let mut acc = [_mm512_setzero_si512(); 4];
    let mut chunks = mid.chunks_exact(4);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = _mm512_xor_si512(*a, v);
        }
    }
    for &v in chunks.remainder() {
        acc[0] = _mm512_xor_si512(acc[0], v);
    }
    let all = _mm512_xor_si512(_mm512_xor_si512(acc[0], acc[1]), _mm512_xor_si512(acc[2], acc[3]));
    // A sum, not an OR, so that one changed lane always changes the result.
    let words = _mm512_reduce_add_epi64(all) as u64;
    head.iter().chain(tail).fold(words, |a, &b| a.rotate_left(8) ^ u64::from(b))
}

/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_avx2(buf: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    // SAFETY: as in `read_avx512`, for 32-byte vectors.
    let (head, mid, tail) = unsafe { buf.align_to::<__m256i>() };
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut chunks = mid.chunks_exact(4);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = _mm256_xor_si256(*a, v);
        }
    }
    for &v in chunks.remainder() {
        acc[0] = _mm256_xor_si256(acc[0], v);
    }
    let all = _mm256_xor_si256(_mm256_xor_si256(acc[0], acc[1]), _mm256_xor_si256(acc[2], acc[3]));
    let words = (_mm256_extract_epi64::<0>(all)
        ^ _mm256_extract_epi64::<1>(all)
        ^ _mm256_extract_epi64::<2>(all)
        ^ _mm256_extract_epi64::<3>(all)) as u64;
    head.iter().chain(tail).fold(words, |a, &b| a.rotate_left(8) ^ u64::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_read_kernel_sees_every_byte() {
        // One changed byte anywhere (in the unaligned head, the vector middle or the tail) changes
        // the fold.
        let buf: Vec<u8> = (0..4096 + 77).map(|i| (i * 31 % 251) as u8).collect();
        for k in [CpuKernels::Portable, CpuKernels::Avx2, CpuKernels::Avx512] {
            let Some(base) = read(k, &buf[3..]) else { continue };
            for at in [3, 100, 2048, buf.len() - 1] {
                let mut other = buf.clone();
                other[at] ^= 0x5a;
                assert_ne!(read(k, &other[3..]), Some(base), "{k:?} missed byte {at}");
            }
        }
    }

    #[test]
    fn compute_kernels_count_their_operations() {
        assert_eq!(fma_f32(CpuKernels::Portable, 10), None);
        if let Some(flops) = fma_f32(CpuKernels::Avx2, 10) {
            assert_eq!(flops, 10 * CHAINS as u64 * 16);
        }
        if let Some(flops) = fma_f32(CpuKernels::Avx512, 10) {
            assert_eq!(flops, 10 * CHAINS as u64 * 32);
        }
        if let Some(flops) = dot_bf16(10) {
            assert_eq!(flops, 10 * CHAINS as u64 * 64);
        }
        if let Some(flops) = tile_bf16(10) {
            assert_eq!(flops, 10 * 4 * 16_384);
        }
    }
}
