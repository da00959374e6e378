//! FP8 e4m3 weight rows (see `fp8::Fp8Matrix`): widened and dotted with an f32 vector. A code's
//! value over 256 is an f16 (the same sign, exponent and mantissa bits, moved: e4m3's bias 7 against
//! f16's 15, its subnormals f16 subnormals), so a weight is `f16(code) * (scale * 256)`: F16C widens
//! 8 codes at a time, and the one rounding of that product is the rounding of `e4m3(code) * scale`,
//! the value the f32 loader computes. The dot product is `dot_f16`'s arithmetic over those values
//! (two 8-lane FMA chains over each 16 columns, then their sum), which is also what `rows_f32`'s
//! tiles compute over rows [`widen_fp8_row`] writes: one step or many, a row gets the same bits.

#![allow(unsafe_code)]

use crate::bits16::f16_value;

/// Every FP8 e4m3 (`float8_e4m3fn`) value by its bits: sign, 4 exponent bits (bias 7), 3 mantissa
/// bits, subnormals below exponent 1, no infinities, NaN at `S.1111.111`.
pub(crate) fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xF, b & 7);
    let v = match (e, m) {
        (15, 7) => f32::NAN,
        (0, m) => m as f32 / 8.0 * 2f32.powi(-6),
        (e, m) => (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7),
    };
    sign * v
}

/// The f16 bits of e4m3 code `b`'s value over 256.
fn f16_of(b: u8) -> u16 {
    (u16::from(b & 0x7F) << 7) | (u16::from(b & 0x80) << 8)
}

/// `dst[c] = e4m3(codes[c]) * scales[c / group]`.
pub(crate) fn widen_fp8_row(codes: &[u8], scales: &[f32], group: usize, dst: &mut [f32]) {
    assert!(
        group.is_multiple_of(16) && codes.len() == dst.len() && scales.len() == codes.len().div_ceil(group)
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: AVX2 and F16C (checked); lengths asserted above.
        unsafe { widen_fp8_avx2(codes, scales, group, dst) };
        return;
    }
    for (c, (d, &b)) in dst.iter_mut().zip(codes).enumerate() {
        *d = f16_value(f16_of(b)) * (scales[c / group] * 256.0);
    }
}

/// `sum_c x[c] * e4m3(codes[c]) * scales[c / group]`, each weight widened as [`widen_fp8_row`]
/// widens it.
pub(crate) fn dot_fp8(x: &[f32], codes: &[u8], scales: &[f32], group: usize) -> f32 {
    assert!(
        group.is_multiple_of(16) && codes.len() == x.len() && scales.len() == codes.len().div_ceil(group)
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: AVX2, FMA and F16C (checked); lengths asserted above.
        return unsafe { dot_fp8_avx2(x, codes, scales, group) };
    }
    x.iter()
        .zip(codes)
        .enumerate()
        .map(|(c, (a, &b))| a * (f16_value(f16_of(b)) * (scales[c / group] * 256.0)))
        .sum()
}

/// Codes `p[0..16]` as two vectors of 8 f16-widened values (still to be scaled).
///
/// # Safety
/// AVX2 and F16C; 16 bytes readable at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen16(p: *const u8) -> [std::arch::x86_64::__m256; 2] {
    use std::arch::x86_64::*;
    let bytes = _mm_loadu_si128(p.cast());
    let f16 = |w: __m128i| {
        let mag = _mm_slli_epi16::<7>(_mm_and_si128(w, _mm_set1_epi16(0x7F)));
        let sign = _mm_slli_epi16::<8>(_mm_and_si128(w, _mm_set1_epi16(0x80)));
        _mm256_cvtph_ps(_mm_or_si128(mag, sign))
    };
    [f16(_mm_cvtepu8_epi16(bytes)), f16(_mm_cvtepu8_epi16(_mm_srli_si128::<8>(bytes)))]
}

/// # Safety
/// AVX2 and F16C; lengths as [`widen_fp8_row`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_fp8_avx2(codes: &[u8], scales: &[f32], group: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = codes.len();
    let mut i = 0;
    while i + 16 <= n {
        let s = _mm256_set1_ps(scales[i / group] * 256.0);
        // SAFETY (of the loads and stores): i + 16 <= n for both slices.
        let [w0, w1] = widen16(codes.as_ptr().add(i));
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_mul_ps(w0, s));
        _mm256_storeu_ps(dst.as_mut_ptr().add(i + 8), _mm256_mul_ps(w1, s));
        i += 16;
    }
    for c in i..n {
        dst[c] = f16_value(f16_of(codes[c])) * (scales[c / group] * 256.0);
    }
}

/// # Safety
/// AVX2, FMA and F16C; lengths as [`dot_fp8`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_fp8_avx2(x: &[f32], codes: &[u8], scales: &[f32], group: usize) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        let s = _mm256_set1_ps(scales[i / group] * 256.0);
        // SAFETY (of the loads): i + 16 <= n for both slices.
        let [w0, w1] = widen16(codes.as_ptr().add(i));
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(w0, s), _mm256_loadu_ps(x.as_ptr().add(i)), a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(w1, s), _mm256_loadu_ps(x.as_ptr().add(i + 8)), a1);
        i += 16;
    }
    let sum = super::qdot::hsum256(_mm256_add_ps(a0, a1));
    if i == n {
        return sum;
    }
    sum + (i..n).map(|c| x[c] * (f16_value(f16_of(codes[c])) * (scales[c / group] * 256.0))).sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code, scales of several sizes, a ragged tail: the widened values are `e4m3 * scale` (the
    /// loader's) bit for bit, on the vector path and the portable one alike, and the dot product is
    /// theirs.
    #[test]
    fn widened_codes_are_the_loaders_values() {
        let (n, group) = (256 + 40, 32);
        let codes: Vec<u8> =
            (0..n).map(|i| (i % 256) as u8).filter(|b| b & 0x7F != 0x7F).chain([0x7E; 2]).collect();
        let n = codes.len();
        let scales: Vec<f32> = (0..n.div_ceil(group)).map(|g| 1e-3 * (1.0 + g as f32 * 0.731)).collect();
        let mut got = vec![0f32; n];
        widen_fp8_row(&codes, &scales, group, &mut got);
        for (c, &v) in got.iter().enumerate() {
            let want = e4m3_value(codes[c]) * scales[c / group];
            assert_eq!(v.to_bits(), want.to_bits(), "code {:#04x}", codes[c]);
            assert_eq!((f16_value(f16_of(codes[c])) * (scales[c / group] * 256.0)).to_bits(), want.to_bits());
        }
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let want: f64 = x.iter().zip(&got).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
        assert!((f64::from(dot_fp8(&x, &codes, &scales, group)) - want).abs() < 1e-3);
    }
}
