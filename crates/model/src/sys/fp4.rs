//! FP4 e2m1 weight rows (see `fp4::Fp4Matrix`): two codes a byte (the even column in the low
//! nibble), widened by table and dotted with an f32 vector. A weight is `e2m1(code) * scale` in one
//! f32 rounding, the value the loader computes; the dot product is the AVX2 `dot`'s arithmetic over
//! those values (two 8-lane FMA chains over each 16 columns, then their sum), which is also what
//! `rows_f32`'s tiles compute over rows [`widen_fp4_row`] writes: one step or many, a row gets the
//! same bits, and the bits of the f32 copy's product.

#![allow(unsafe_code)]

/// The e2m1 magnitudes by code (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
pub(crate) const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Code `c`'s value (`c` in 0..16).
pub(crate) fn e2m1_value(c: u8) -> f32 {
    let m = E2M1[usize::from(c & 7)];
    if c & 8 != 0 {
        -m
    } else {
        m
    }
}

/// `dst[c] = e2m1(code c) * scales[c / group]`, the codes packed two a byte.
pub(crate) fn widen_fp4_row(packed: &[u8], scales: &[f32], group: usize, dst: &mut [f32]) {
    assert!(
        group.is_multiple_of(16)
            && packed.len() * 2 == dst.len()
            && scales.len() == dst.len().div_ceil(group)
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: AVX2 (checked); lengths asserted above (16 values for every 8 bytes).
        unsafe { widen_fp4_avx2(packed, scales, group, dst) };
        return;
    }
    for (c, d) in dst.iter_mut().enumerate() {
        let b = packed[c / 2];
        *d = e2m1_value(if c % 2 == 0 { b & 15 } else { b >> 4 }) * scales[c / group];
    }
}

/// [`widen_fp4_row`] 16 values at a time (the same table, the same one rounding).
///
/// # Safety
/// AVX2; lengths as [`widen_fp4_row`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_fp4_avx2(packed: &[u8], scales: &[f32], group: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    for s in 0..dst.len() / 16 {
        // SAFETY (of the loads and stores): 8 bytes and 16 values at step s, as asserted.
        let [v0, v1] = e2m1x16(packed.as_ptr().add(s * 8));
        let scale = _mm256_set1_ps(*scales.get_unchecked(s * 16 / group));
        _mm256_storeu_ps(dst.as_mut_ptr().add(s * 16), _mm256_mul_ps(v0, scale));
        _mm256_storeu_ps(dst.as_mut_ptr().add(s * 16 + 8), _mm256_mul_ps(v1, scale));
    }
}

/// `sum_c x[c] * w[c]`, each weight widened as [`widen_fp4_row`] widens it; `x.len()` a multiple of
/// 16.
pub(crate) fn dot_fp4(x: &[f32], packed: &[u8], scales: &[f32], group: usize) -> f32 {
    assert!(
        group.is_multiple_of(16)
            && x.len().is_multiple_of(16)
            && packed.len() * 2 == x.len()
            && scales.len() == x.len().div_ceil(group)
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: AVX2 and FMA (checked); lengths asserted above.
        return unsafe { dot_fp4_avx2(x, packed, scales, group) };
    }
    // The portable `dot`'s arithmetic: eight lane sums, then their sum.
    let mut acc = [0f32; 8];
    let mut w = [0f32; 16];
    for (s, (xs, ps)) in x.chunks_exact(16).zip(packed.chunks_exact(8)).enumerate() {
        widen_fp4_row(ps, &[scales[s * 16 / group]], 16, &mut w);
        for h in 0..2 {
            for l in 0..8 {
                acc[l] += xs[h * 8 + l] * w[h * 8 + l];
            }
        }
    }
    acc.iter().sum()
}

/// Codes `p[0..8]` (16 columns) as two vectors of 8 e2m1 values, unscaled.
///
/// # Safety
/// AVX2; 8 bytes readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn e2m1x16(p: *const u8) -> [std::arch::x86_64::__m256; 2] {
    use std::arch::x86_64::*;
    let bytes = _mm_loadl_epi64(p.cast());
    let low = _mm_and_si128(bytes, _mm_set1_epi8(15));
    let high = _mm_and_si128(_mm_srli_epi16::<4>(bytes), _mm_set1_epi8(15));
    // Column order: byte j's low nibble, then its high one.
    let codes = _mm_unpacklo_epi8(low, high);
    let table = _mm256_loadu_ps(E2M1.as_ptr());
    let value = |c: __m128i| {
        let c = _mm256_cvtepu8_epi32(c);
        let mag = _mm256_permutevar8x32_ps(table, c);
        let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(c, _mm256_set1_epi32(8)));
        _mm256_xor_ps(mag, _mm256_castsi256_ps(sign))
    };
    [value(codes), value(_mm_srli_si128::<8>(codes))]
}

/// Codes `p[0..8]` (16 columns) as two vectors of 8 values of twice their e2m1 value (the integers
/// 0, 1, 2, 3, 4, 6, 8, 12 and their negatives, looked up 16 at a time; the sign of a zero is lost,
/// which no product can see).
///
/// # Safety
/// AVX2; 8 bytes readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn twice_e2m1x16(p: *const u8) -> [std::arch::x86_64::__m256; 2] {
    use std::arch::x86_64::*;
    let bytes = _mm_loadl_epi64(p.cast());
    let low = _mm_and_si128(bytes, _mm_set1_epi8(15));
    let high = _mm_and_si128(_mm_srli_epi16::<4>(bytes), _mm_set1_epi8(15));
    let codes = _mm_unpacklo_epi8(low, high);
    let table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    let q = _mm_shuffle_epi8(table, codes);
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q))),
    ]
}

/// # Safety
/// AVX2 and FMA; lengths as [`dot_fp4`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_fp4_avx2(x: &[f32], packed: &[u8], scales: &[f32], group: usize) -> f32 {
    use std::arch::x86_64::*;
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for s in 0..x.len() / 16 {
        // SAFETY (of the loads): 16 values of `x` and 8 bytes of `packed` at step s, as asserted.
        let [v0, v1] = twice_e2m1x16(packed.as_ptr().add(s * 8));
        // Twice the value times half the scale: the same real product, so the same rounding (halving
        // is exact for every normal scale).
        let scale = _mm256_set1_ps(*scales.get_unchecked(s * 16 / group) * 0.5);
        let (w0, w1) = (_mm256_mul_ps(v0, scale), _mm256_mul_ps(v1, scale));
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x.as_ptr().add(s * 16)), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.as_ptr().add(s * 16 + 8)), a1);
    }
    super::hsum256(_mm256_add_ps(a0, a1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's products are the f32 `dot` of the widened row, bit for bit (every code, both
    /// group widths, scales that round).
    #[test]
    fn fp4_dots_are_the_dots_of_the_widened_rows() {
        for group in [16, 32] {
            let cols = 256;
            let packed: Vec<u8> = (0..cols / 2).map(|i| (i * 37 % 256) as u8).collect();
            let scales: Vec<f32> = (0..cols / group).map(|g| 0.0137 * (1.0 + g as f32 * 0.731)).collect();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut w = vec![0.0; cols];
            widen_fp4_row(&packed, &scales, group, &mut w);
            assert_eq!(w[1], e2m1_value(packed[0] >> 4) * scales[0]);
            assert!((0..16u8).all(|c| e2m1_value(c).abs() == E2M1[usize::from(c & 7)]));
            assert_eq!(dot_fp4(&x, &packed, &scales, group).to_bits(), super::super::dot(&x, &w).to_bits());
        }
    }
}
