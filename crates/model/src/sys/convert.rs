//! 16-bit KV values to and from f32, a slice at a time: f16 with AVX-512F or F16C (vcvtph2ps /
//! vcvtps2ph, round to nearest even), bf16 with AVX-512F (a widening shift); the portable loops use
//! the `half` crate's conversions, which the tests hold the kernels to.

use crate::bits16::{bf16_bits, bf16_value, f16_bits, f16_value};

/// Asks the CPU to bring `v`'s cache lines into its L2 cache (a hint: nothing is read now, and
/// nothing happens where there is no prefetch instruction). For memory a loop reads soon that the
/// hardware prefetchers do not guess: decode attention's values, read a pass after their keys.
pub(crate) fn prefetch<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (p, bytes) = (v.as_ptr().cast::<i8>(), std::mem::size_of_val(v));
        // From the line holding the first byte to the one holding the last.
        let first = (p as usize % 64) as isize;
        for at in (-first..bytes as isize).step_by(64) {
            // SAFETY: a prefetch reads nothing and cannot fault, whatever the address (here within
            // a cache line of `v`'s bytes); SSE, which every x86-64 CPU has.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_offset(at)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// `dst` = `src`, for a copy too big to stay in the cache (a transferred KV block): the stores go
/// straight to memory instead of first reading each destination line into the cache (AVX2 streaming
/// stores; 1.1-1.25x a `memcpy` of 368,640-byte blocks on this machine's Zen 4). A plain copy on
/// other CPUs or under the portable kernels.
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // An ordinary copy up to the destination's first 32-byte boundary and after its last whole
        // 128-byte stretch; streaming stores in between.
        let head = ((32 - dst.as_ptr() as usize % 32) % 32).min(dst.len());
        let body = (dst.len() - head) / 128 * 128;
        let (d_head, rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = rest.split_at_mut(body);
        d_head.copy_from_slice(&src[..head]);
        if body > 0 {
            // SAFETY: AVX2 (checked); `d_body` starts on a 32-byte boundary (a head cut short by
            // the length leaves no body), is a whole number of 128-byte stretches and as long as
            // the source slice.
            unsafe { copy_streaming_avx2(d_body, &src[head..head + body]) };
        }
        d_tail.copy_from_slice(&src[head + body..]);
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_streaming_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    assert!(
        dst.len() == src.len() && dst.len().is_multiple_of(128) && (dst.as_ptr() as usize).is_multiple_of(32)
    );
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    for at in (0..dst.len()).step_by(128) {
        let v = [0, 32, 64, 96].map(|o| _mm256_loadu_si256(s.add(at + o).cast::<__m256i>()));
        for (k, v) in v.into_iter().enumerate() {
            _mm256_stream_si256(d.add(at + 32 * k).cast::<__m256i>(), v);
        }
    }
    // Streaming stores are weakly ordered: they are all visible before anything after this copy.
    _mm_sfence();
}

/// `dst[i]` = the f16 value whose bits are `src[i]`.
pub(crate) fn widen_f16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: AVX-512F (checked); equal lengths (asserted).
            unsafe { widen_f16_avx512(src, dst) };
            return;
        }
        if super::avx2() {
            // SAFETY: F16C and AVX (checked); equal lengths (asserted).
            unsafe { widen_f16_f16c(src, dst) };
            return;
        }
    }
    widen_tail(src, dst, 0, f16_value);
}

/// `dst[i]` = the bf16 value whose bits are `src[i]`.
pub(crate) fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: AVX-512F (checked); equal lengths (asserted).
            unsafe { widen_bf16_avx512(src, dst) };
            return;
        }
    }
    widen_tail(src, dst, 0, bf16_value);
}

/// `dst[i]` = `src[i]` as f16 bits, rounded to nearest even (past f16's range: infinity).
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: AVX-512F (checked); equal lengths (asserted).
            unsafe { narrow_f16_avx512(src, dst) };
            return;
        }
        if super::avx2() {
            // SAFETY: F16C and AVX (checked); equal lengths (asserted).
            unsafe { narrow_f16_f16c(src, dst) };
            return;
        }
    }
    narrow_tail(src, dst, 0, f16_bits);
}

/// `dst[i]` = `src[i]` as bf16 bits, rounded to nearest even. Only the new tokens' K and V are
/// narrowed each step, so the portable loop is fast enough.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    narrow_tail(src, dst, 0, bf16_bits);
}

#[inline(always)]
fn widen_tail(src: &[u16], dst: &mut [f32], from: usize, f: fn(u16) -> f32) {
    for (d, &s) in dst[from..].iter_mut().zip(&src[from..]) {
        *d = f(s);
    }
}

#[inline(always)]
fn narrow_tail(src: &[f32], dst: &mut [u16], from: usize, f: fn(f32) -> u16) {
    for (d, &s) in dst[from..].iter_mut().zip(&src[from..]) {
        *d = f(s);
    }
}

/// # Safety
/// AVX-512F; equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_f16_avx512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 16 <= src.len() {
        // SAFETY (of the load and the store): i + 16 <= len of both.
        let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        i += 16;
    }
    widen_tail(src, dst, i, crate::bits16::f16_value);
}

/// # Safety
/// AVX-512F; equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_bf16_avx512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 16 <= src.len() {
        // SAFETY (of the load and the store): i + 16 <= len of both. A bf16 is the top half of an f32.
        let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
        let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(w));
        i += 16;
    }
    widen_tail(src, dst, i, crate::bits16::bf16_value);
}

/// # Safety
/// AVX-512F; equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn narrow_f16_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 16 <= src.len() {
        // SAFETY (of the load and the store): i + 16 <= len of both.
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_loadu_ps(
            src.as_ptr().add(i),
        ));
        _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        i += 16;
    }
    narrow_tail(src, dst, i, crate::bits16::f16_bits);
}

/// # Safety
/// F16C and AVX; equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 8 <= src.len() {
        // SAFETY (of the load and the store): i + 8 <= len of both.
        let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    widen_tail(src, dst, i, crate::bits16::f16_value);
}

/// # Safety
/// F16C and AVX; equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn narrow_f16_f16c(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 8 <= src.len() {
        // SAFETY (of the load and the store): i + 8 <= len of both.
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
        _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
        i += 8;
    }
    narrow_tail(src, dst, i, crate::bits16::f16_bits);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 bit pattern (and every 7th bf16 one), at a length with a tail the vector loops leave.
    #[test]
    fn widening_matches_the_portable_conversion_for_every_value() {
        let all: Vec<u16> = (0..=u16::MAX).chain(0..5).collect();
        let mut got = vec![0f32; all.len()];
        widen_f16(&all, &mut got);
        for (&h, &g) in all.iter().zip(&got) {
            let want = f16_value(h);
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "{h:#06x}: {g} vs {want}"
            );
        }
        let some: Vec<u16> = (0..=u16::MAX).step_by(7).collect();
        let mut got = vec![0f32; some.len()];
        widen_bf16(&some, &mut got);
        for (&h, &g) in some.iter().zip(&got) {
            assert_eq!(g.to_bits(), (h as u32) << 16, "{h:#06x}");
        }
    }

    #[test]
    fn narrowing_rounds_like_the_portable_conversion() {
        // Ties, subnormals, overflow, signs, and ordinary values across f16's range.
        let mut vals =
            vec![0.0, -0.0, 1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 65519.0, 65520.0, 1e6, -1e6];
        vals.extend([2f32.powi(-24), 2f32.powi(-25), 3.0 * 2f32.powi(-26), f32::INFINITY, f32::NEG_INFINITY]);
        vals.extend((0..5000).map(|i| ((i as f32) * 0.7311).sin() * 10f32.powi(i % 11 - 5)));
        let mut got = vec![0u16; vals.len()];
        narrow_f16(&vals, &mut got);
        for (&v, &g) in vals.iter().zip(&got) {
            assert_eq!(g, f16_bits(v), "{v}");
        }
        narrow_bf16(&vals, &mut got);
        for (&v, &g) in vals.iter().zip(&got) {
            assert_eq!(g, bf16_bits(v), "{v}");
        }
        let mut nan = [0u16; 17];
        narrow_f16(&[f32::NAN; 17], &mut nan);
        assert!(nan.iter().all(|&h| f16_value(h).is_nan()));
    }

    /// Every offset of the destination against a cache line and lengths around the 128-byte
    /// stretches: the bytes land exactly, and nothing outside the destination is touched.
    #[test]
    fn a_streaming_copy_copies_exactly_the_bytes_asked_for() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        for offset in 0..40 {
            for len in [0, 1, 31, 127, 128, 129, 300, 4000, 4960] {
                let mut dst = vec![0xaau8; 5000 + 80];
                copy_streaming(&mut dst[offset..offset + len], &src[..len]);
                assert_eq!(&dst[offset..offset + len], &src[..len], "offset {offset}, len {len}");
                assert!(dst[..offset].iter().chain(&dst[offset + len..]).all(|&b| b == 0xaa));
            }
        }
    }
}
