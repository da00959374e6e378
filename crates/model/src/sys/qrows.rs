//! Q4 and Q8 dot products of several input rows against one weight row at once: the weight row's
//! values are unpacked once and weigh every input row (a decode batch, or a decode with its draft tokens).
//! Each input row's arithmetic is exactly that of the one-row product (the same operations in the
//! same order: the one-row product *is* the one-row tile), so a row's value does not depend on the
//! rows beside it.

use super::CpuKernels;
use crate::bits16::f16_value;

/// `out[r] = sum_g scales[g] * (q_g . xs[r]_g) + mins[g] * xsums[r][g]` for one Q4 row (see
/// `quant::Q4Matrix`; scales and minimums as f16 bits).
pub(crate) fn dot_q4_rows(
    xs: &[&[f32]],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    xsums: &[&[f32]],
    out: &mut [f32],
) {
    dot_q4_rows_with(super::cpu_kernels(), xs, packed, scales, mins, xsums, out)
}

/// [`dot_q4_rows`] with the kernels `k` (at most what the CPU has).
pub(crate) fn dot_q4_rows_with(
    k: CpuKernels,
    xs: &[&[f32]],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    xsums: &[&[f32]],
    out: &mut [f32],
) {
    let t = xs.len();
    assert!(xsums.len() == t && out.len() == t);
    assert!(scales.len() == mins.len() && packed.len() * 2 == scales.len() * 32);
    for (x, xsum) in xs.iter().zip(xsums) {
        assert!(x.len() == scales.len() * 32 && xsum.len() == mins.len());
    }
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has, asserted above); every length
        // matches (asserted above), and each tile reads rows `i..i + R` of `t`.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => unsafe {
            row_tiles!(t, |i| q4_tile_avx512(i, xs, packed, scales, mins, xsums, out))
        },
        // SAFETY: the CPU has AVX2, FMA and F16C (as above); lengths as above.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => unsafe {
            row_tiles!(t, |i| q4_tile_avx2(i, xs, packed, scales, mins, xsums, out))
        },
        _ => {
            for ((x, xsum), o) in xs.iter().zip(xsums).zip(out) {
                *o = super::dot_q4_portable(x, packed, scales, mins, xsum);
            }
        }
    }
}

/// Rows `i..i + R` of [`dot_q4_rows`].
///
/// # Safety
/// AVX-512F; lengths as `dot_q4_rows_with` asserts; `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q4_tile_avx512<const R: usize>(
    i: usize,
    xs: &[&[f32]],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    xsums: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let pq = packed.as_ptr();
    let low = _mm_set1_epi8(15);
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    let groups = scales.len();
    let mut g = 0;
    // Two groups per iteration into two accumulators per row: independent FMA chains.
    while g + 2 <= groups {
        for j in 0..2 {
            let (o, b) = ((g + j) * 32, (g + j) * 16);
            // SAFETY (of the loads): b + 16 <= packed.len() and o + 32 <= every x's length.
            let bytes = _mm_loadu_si128(pq.add(b) as *const __m128i);
            let lo = _mm_and_si128(bytes, low);
            let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
            let w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
            let w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
            let s = super::f16_splat(*scales.get_unchecked(g + j));
            for r in 0..R {
                let p = _mm512_fmadd_ps(
                    w1,
                    _mm512_loadu_ps(px[r].add(o + 16)),
                    _mm512_mul_ps(w0, _mm512_loadu_ps(px[r].add(o))),
                );
                let acc = if j == 0 { &mut acc0[r] } else { &mut acc1[r] };
                *acc = _mm512_fmadd_ps(p, s, *acc);
            }
        }
        g += 2;
    }
    for r in 0..R {
        let (x, xsum) = (xs[i + r], xsums[i + r]);
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
        if g < groups {
            sum += super::dot_q4_portable(&x[g * 32..], &packed[g * 16..], &scales[g..], &[0], &[0.0]);
        }
        // The minimums' share: sixteen groups at a time.
        let mut macc = _mm512_setzero_ps();
        let mut h = 0;
        while h + 16 <= groups {
            // SAFETY (of the loads): h + 16 <= groups == mins.len() == xsum.len().
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(mins.as_ptr().add(h) as *const __m256i));
            macc = _mm512_fmadd_ps(m, _mm512_loadu_ps(xsum.as_ptr().add(h)), macc);
            h += 16;
        }
        out[i + r] = sum
            + _mm512_reduce_add_ps(macc)
            + mins[h..].iter().zip(&xsum[h..]).map(|(&m, s)| f16_value(m) * s).sum::<f32>();
    }
}

/// Rows `i..i + R` of [`dot_q4_rows`].
///
/// # Safety
/// AVX2, FMA and F16C; lengths as `dot_q4_rows_with` asserts; `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_tile_avx2<const R: usize>(
    i: usize,
    xs: &[&[f32]],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    xsums: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let pq = packed.as_ptr();
    let low = _mm_set1_epi8(15);
    let mut acc = [_mm256_setzero_ps(); R];
    for (g, &s) in scales.iter().enumerate() {
        let (o, b) = (g * 32, g * 16);
        // SAFETY (of the loads): b + 16 <= packed.len() and o + 32 <= every x's length.
        let bytes = _mm_loadu_si128(pq.add(b).cast());
        // Low nibbles weigh x[o..o + 16], high ones x[o + 16..o + 32], eight at a time.
        let lo = _mm_and_si128(bytes, low);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        let mut a = [_mm256_setzero_ps(); R];
        let mut c = [_mm256_setzero_ps(); R];
        for (nib, at) in [(lo, 0usize), (hi, 16)] {
            let w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
            let w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8)));
            for r in 0..R {
                a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(px[r].add(o + at)), a[r]);
                c[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(px[r].add(o + at + 8)), c[r]);
            }
        }
        let sv = _mm256_set1_ps(f16_value(s));
        for r in 0..R {
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(a[r], c[r]), sv, acc[r]);
        }
    }
    let groups = mins.len();
    for r in 0..R {
        let xsum = xsums[i + r];
        // The minimums' share: eight groups at a time.
        let mut macc = _mm256_setzero_ps();
        let mut h = 0;
        while h + 8 <= groups {
            // SAFETY (of the loads): h + 8 <= groups == mins.len() == xsum.len().
            let m = _mm256_cvtph_ps(_mm_loadu_si128(mins.as_ptr().add(h).cast()));
            macc = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum.as_ptr().add(h)), macc);
            h += 8;
        }
        out[i + r] = super::hsum256(acc[r])
            + super::hsum256(macc)
            + mins[h..].iter().zip(&xsum[h..]).map(|(&m, s)| f16_value(m) * s).sum::<f32>();
    }
}

/// `out[r] = sum_i xs[r][i] * q[i] * scales[i / 32]` for one Q8 row (`scales` as f16 bits).
pub(crate) fn dot_q8_rows(xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    dot_q8_rows_with(super::cpu_kernels(), xs, q, scales, out)
}

/// [`dot_q8_rows`] with the kernels `k` (at most what the CPU has).
pub(crate) fn dot_q8_rows_with(k: CpuKernels, xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    let t = xs.len();
    assert!(out.len() == t && q.len() == scales.len() * 32);
    assert!(xs.iter().all(|x| x.len() == q.len()));
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has, asserted above); every length
        // matches (asserted above), and each tile reads rows `i..i + R` of `t`.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => unsafe { row_tiles!(t, |i| q8_tile_avx512(i, xs, q, scales, out)) },
        // SAFETY: the CPU has AVX2, FMA and F16C (as above); lengths as above.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => unsafe { row_tiles!(t, |i| q8_tile_avx2(i, xs, q, scales, out)) },
        _ => {
            for (x, o) in xs.iter().zip(out) {
                *o = super::dot_q8_portable(x, q, scales);
            }
        }
    }
}

/// Rows `i..i + R` of [`dot_q8_rows`].
///
/// # Safety
/// AVX-512F; lengths as `dot_q8_rows_with` asserts; `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q8_tile_avx512<const R: usize>(i: usize, xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let pq = q.as_ptr();
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    let groups = scales.len();
    let mut g = 0;
    // Two groups per iteration into two accumulators per row: independent FMA chains.
    while g + 2 <= groups {
        for j in 0..2 {
            let o = (g + j) * 32;
            // SAFETY (of the loads): o + 32 <= q.len() == every x's length.
            let w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.add(o) as *const __m128i)));
            let w1 =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.add(o + 16) as *const __m128i)));
            let s = super::f16_splat(*scales.get_unchecked(g + j));
            for r in 0..R {
                let p = _mm512_fmadd_ps(
                    w1,
                    _mm512_loadu_ps(px[r].add(o + 16)),
                    _mm512_mul_ps(w0, _mm512_loadu_ps(px[r].add(o))),
                );
                let acc = if j == 0 { &mut acc0[r] } else { &mut acc1[r] };
                *acc = _mm512_fmadd_ps(p, s, *acc);
            }
        }
        g += 2;
    }
    for r in 0..R {
        let x = xs[i + r];
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
        for h in g..groups {
            let o = h * 32;
            sum += super::dot_q8_portable(&x[o..o + 32], &q[o..o + 32], &scales[h..h + 1]);
        }
        out[i + r] = sum;
    }
}

/// Rows `i..i + R` of [`dot_q8_rows`].
///
/// # Safety
/// AVX2, FMA and F16C; lengths as `dot_q8_rows_with` asserts; `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_tile_avx2<const R: usize>(i: usize, xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let pq = q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for (g, &s) in scales.iter().enumerate() {
        let o = g * 32;
        // Four rows of eight: two independent FMA chains per row, then the group's scale.
        let mut a = [_mm256_setzero_ps(); R];
        let mut b = [_mm256_setzero_ps(); R];
        for j in [0usize, 16] {
            // SAFETY (of the loads): o + j + 16 <= q.len() == every x's length.
            let w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(pq.add(o + j).cast())));
            let w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(pq.add(o + j + 8).cast())));
            for r in 0..R {
                a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(px[r].add(o + j)), a[r]);
                b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(px[r].add(o + j + 8)), b[r]);
            }
        }
        let sv = _mm256_set1_ps(f16_value(s));
        for r in 0..R {
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(a[r], b[r]), sv, acc[r]);
        }
    }
    for r in 0..R {
        out[i + r] = super::hsum256(acc[r]);
    }
}

#[cfg(test)]
mod tests {
    use super::CpuKernels;
    use crate::bits16::f16_bits;

    #[test]
    fn q8_rows_at_once_equal_one_row_at_a_time_exactly() {
        for groups in [18usize, 37] {
            let q: Vec<i8> = (0..groups * 32).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
            let s: Vec<u16> = (0..groups).map(|g| f16_bits(0.01 + g as f32 * 0.003)).collect();
            let rows: Vec<Vec<f32>> = (0..13)
                .map(|r| (0..groups * 32).map(|i| ((i * (r + 3)) as f32 * 0.37).sin()).collect())
                .collect();
            for k in CpuKernels::available() {
                for t in 1..=rows.len() {
                    let xs: Vec<&[f32]> = rows[..t].iter().map(Vec::as_slice).collect();
                    let mut out = vec![0f32; t];
                    super::dot_q8_rows_with(k, &xs, &q, &s, &mut out);
                    for r in 0..t {
                        let one = super::super::dot_q8_with(k, xs[r], &q, &s);
                        assert_eq!(out[r].to_bits(), one.to_bits(), "{k:?}, {groups} groups, row {r} of {t}");
                    }
                }
            }
        }
    }

    /// Several rows at once give, bit for bit, what each row alone gives, on every kernel family and
    /// for every tile size (up to two full tiles and a partial one).
    #[test]
    fn rows_at_once_equal_one_row_at_a_time_exactly() {
        for groups in [18, 37] {
            let packed: Vec<u8> = (0..groups * 16).map(|i| (i * 73 % 256) as u8).collect();
            let s: Vec<u16> = (0..groups).map(|g| f16_bits(0.01 + g as f32 * 0.003)).collect();
            let m: Vec<u16> = (0..groups).map(|g| f16_bits(-0.1 + g as f32 * 0.02)).collect();
            let rows: Vec<Vec<f32>> = (0..13)
                .map(|r| (0..groups * 32).map(|i| ((i * (r + 3)) as f32 * 0.37).sin()).collect())
                .collect();
            let sums: Vec<Vec<f32>> =
                rows.iter().map(|x| x.chunks(32).map(|c| c.iter().sum()).collect()).collect();
            for k in CpuKernels::available() {
                for t in 1..=rows.len() {
                    let xs: Vec<&[f32]> = rows[..t].iter().map(Vec::as_slice).collect();
                    let xsums: Vec<&[f32]> = sums[..t].iter().map(Vec::as_slice).collect();
                    let mut out = vec![0f32; t];
                    super::dot_q4_rows_with(k, &xs, &packed, &s, &m, &xsums, &mut out);
                    for r in 0..t {
                        let one = super::super::dot_q4_with(k, xs[r], &packed, &s, &m, xsums[r]);
                        assert_eq!(out[r].to_bits(), one.to_bits(), "{k:?}, {groups} groups, row {r} of {t}");
                    }
                }
            }
        }
    }
}
