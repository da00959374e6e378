//! Q4 and Q8 weight rows widened to f32 (embedding rows looked up in a Q8 matrix, references in
//! tests): the same values, bit for bit, on every path (`value = min + q * scale` for Q4, `q *
//! scale` for Q8, each a product rounded and then a sum rounded, never fused).

use crate::bits16::f16_value;

/// Values per group (one scale, and for Q4 one minimum, each).
const GROUP: usize = 32;

/// `dst` = a Q4 row: group g's value i is `mins[g] + q * scales[g]`, q the i-th 4-bit value (the
/// low nibbles of the group's 16 bytes are its first 16 values, the high ones its last 16).
pub(crate) fn widen_q4_row(packed: &[u8], scales: &[u16], mins: &[u16], dst: &mut [f32]) {
    assert!(dst.len() == scales.len() * GROUP && scales.len() == mins.len() && packed.len() * 2 == dst.len());
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: AVX2 and F16C (checked); lengths asserted above.
        unsafe { widen_q4_row_avx2(packed, scales, mins, dst) };
        return;
    }
    for (g, d) in dst.chunks_exact_mut(GROUP).enumerate() {
        let (s, m) = (f16_value(scales[g]), f16_value(mins[g]));
        let (lo, hi) = d.split_at_mut(GROUP / 2);
        for ((l, h), b) in lo.iter_mut().zip(hi).zip(&packed[g * GROUP / 2..(g + 1) * GROUP / 2]) {
            *l = m + (b & 15) as f32 * s;
            *h = m + (b >> 4) as f32 * s;
        }
    }
}

/// `dst` = a Q8 row: group g's value i is `q * scales[g]`.
pub(crate) fn widen_q8_row(values: &[i8], scales: &[u16], dst: &mut [f32]) {
    assert!(dst.len() == scales.len() * GROUP && values.len() == dst.len());
    #[cfg(target_arch = "x86_64")]
    if super::avx2() {
        // SAFETY: AVX2 and F16C (checked); lengths asserted above.
        unsafe { widen_q8_row_avx2(values, scales, dst) };
        return;
    }
    for ((d, q), &s) in dst.chunks_exact_mut(GROUP).zip(values.chunks_exact(GROUP)).zip(scales) {
        let s = f16_value(s);
        for (d, &q) in d.iter_mut().zip(q) {
            *d = q as f32 * s;
        }
    }
}

/// # Safety
/// AVX2 and F16C; lengths as [`widen_q4_row`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_q4_row_avx2(packed: &[u8], scales: &[u16], mins: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let low = _mm_set1_epi8(15);
    let (pq, pd) = (packed.as_ptr(), dst.as_mut_ptr());
    for g in 0..scales.len() {
        let s = _mm256_cvtph_ps(_mm_set1_epi16(scales[g] as i16));
        let m = _mm256_cvtph_ps(_mm_set1_epi16(mins[g] as i16));
        let bytes = _mm_loadu_si128(pq.add(g * 16).cast());
        let lo = _mm_and_si128(bytes, low);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low);
        // Values 0-7, 8-15 from the low nibbles, 16-23, 24-31 from the high ones.
        let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
        for (j, q) in parts.into_iter().enumerate() {
            let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
            _mm256_storeu_ps(pd.add(g * GROUP + j * 8), _mm256_add_ps(m, _mm256_mul_ps(q, s)));
        }
    }
}

/// # Safety
/// AVX2 and F16C; lengths as [`widen_q8_row`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_q8_row_avx2(values: &[i8], scales: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let (pv, pd) = (values.as_ptr(), dst.as_mut_ptr());
    for (g, &scale) in scales.iter().enumerate() {
        let s = _mm256_cvtph_ps(_mm_set1_epi16(scale as i16));
        for j in 0..GROUP / 8 {
            let q = _mm_loadl_epi64(pv.add(g * GROUP + j * 8).cast());
            let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_storeu_ps(pd.add(g * GROUP + j * 8), _mm256_mul_ps(q, s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bits16::f16_bits;

    /// Every nibble and int8 value, scales and minimums of both signs: the AVX2 rows equal the
    /// portable loop's bit for bit.
    #[test]
    fn widened_rows_are_the_portable_values_bit_for_bit() {
        let groups = 9;
        let packed: Vec<u8> = (0..groups * 16).map(|i| (i * 37 % 256) as u8).collect();
        let values: Vec<i8> = (0..groups * GROUP).map(|i| (i * 53 % 256) as u8 as i8).collect();
        let scales: Vec<u16> = (0..groups).map(|g| f16_bits((g as f32 - 4.3) * 0.013)).collect();
        let mins: Vec<u16> = (0..groups).map(|g| f16_bits((g as f32 - 3.7) * 0.021)).collect();
        let mut got = vec![0f32; groups * GROUP];
        widen_q4_row(&packed, &scales, &mins, &mut got);
        for (i, &v) in got.iter().enumerate() {
            let (g, j) = (i / GROUP, i % GROUP);
            let b = packed[g * 16 + j % 16];
            let q = if j < 16 { b & 15 } else { b >> 4 };
            let want = f16_value(mins[g]) + q as f32 * f16_value(scales[g]);
            assert_eq!(v.to_bits(), want.to_bits(), "q4 value {i}");
        }
        widen_q8_row(&values, &scales, &mut got);
        for (i, &v) in got.iter().enumerate() {
            let want = values[i] as f32 * f16_value(scales[i / GROUP]);
            assert_eq!(v.to_bits(), want.to_bits(), "q8 value {i}");
        }
    }
}
