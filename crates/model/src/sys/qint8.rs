//! Products of int8-quantized activations with Q4 and Q8 weight rows (`--activations q8`, as
//! llama.cpp multiplies its quantized weights): each input row is rounded once to int8 in groups of
//! 32 with an f32 scale, so a group's product is an exact integer sum (AVX2 `vpmaddubsw`) times the
//! two scales. One weight row against several input rows at once, each row's arithmetic that of the
//! one-row product, as in `qrows`.

use super::CpuKernels;
use crate::bits16::f16_value;

/// Input rows per tile of the int8 products with the kernels this process runs (see
/// `dot_tile_rows`).
pub(crate) fn int8_tile_rows() -> usize {
    match super::cpu_kernels() {
        CpuKernels::Amx | CpuKernels::Avx2 | CpuKernels::Avx512 => 6,
        CpuKernels::Portable => 1,
    }
}

/// Input rows rounded to int8: row `r` is `q[r * k..][..k]`, group `g`'s scale `d[r * k / 32 + g]`;
/// `sum` holds each group's exact f32 sum (what Q4's minimums weigh).
#[derive(Debug, Default)]
pub(crate) struct Int8Rows {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub sum: Vec<f32>,
}

/// One row of [`Int8Rows`] (values in -127..=127, as `Int8Rows::quantize` makes them: the Q8
/// kernels' sign trick needs no -128).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Int8Row<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub sum: &'a [f32],
}

impl Int8Rows {
    /// `x` (`t` rows of `k`, `k` a multiple of 32) rounded to int8: per group of 32, scale
    /// `max |x| / 127` and values `round(x / scale)` (ties to even), all 0 for an all-zero group.
    pub(crate) fn quantize(x: &[f32], k: usize) -> Int8Rows {
        assert!(k.is_multiple_of(32) && x.len().is_multiple_of(k));
        let mut rows = Int8Rows {
            q: vec![0; x.len()],
            d: Vec::with_capacity(x.len() / 32),
            sum: Vec::with_capacity(x.len() / 32),
        };
        for (g, q) in x.chunks_exact(32).zip(rows.q.chunks_exact_mut(32)) {
            rows.d.push(round_to_int8(g, q));
            rows.sum.push(g.iter().sum());
        }
        rows
    }

    /// Row `r` of rows `k` wide.
    pub(crate) fn row(&self, r: usize, k: usize) -> Int8Row<'_> {
        let g = k / 32;
        Int8Row { q: &self.q[r * k..][..k], d: &self.d[r * g..][..g], sum: &self.sum[r * g..][..g] }
    }
}

/// `v` rounded to the nearest integer, ties to even, for |v| < 2^22: adding and taking away 1.5 * 2^23
/// rounds in plain f32 arithmetic that vectorizes (`f32::round_ties_even` calls libm's `rintf` on
/// baseline x86-64).
pub(super) fn round_ties_even(v: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    (v + ROUND) - ROUND
}

/// `x` rounded to int8 into `q` (as long): scale `max |x| / 127` and values `round(x / scale)` (ties
/// to even), all 0 where `x` is all zero or too small for `127 / max` to be finite; the scale, NaN
/// where `x` holds a NaN (so products carry it as f32 ones would).
fn round_to_int8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let inv = if inv.is_finite() { inv } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_ties_even(v * inv).clamp(-127.0, 127.0) as i8;
    }
    if x.iter().any(|v| v.is_nan()) {
        f32::NAN
    } else {
        amax / 127.0
    }
}

/// `out[r] = sum_g scales[g] * d_r[g] * (q_g . x_r,g) + mins[g] * sum_r[g]` for one Q4 row (see
/// `quant::Q4Matrix`) against int8 rows `xs`.
pub(crate) fn dot_q4_int8_rows(
    xs: &[Int8Row<'_>],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    out: &mut [f32],
) {
    dot_q4_int8_rows_with(super::cpu_kernels(), xs, packed, scales, mins, out)
}

/// [`dot_q4_int8_rows`] with the kernels `k` (at most what the CPU has); the AVX-512 family runs the
/// AVX2 kernel (an AVX-512 VNNI one, two groups per `vpdpbusd`, measured no faster on the Zen 4 this
/// was written on, whose 512-bit operations take two 256-bit passes).
pub(crate) fn dot_q4_int8_rows_with(
    k: CpuKernels,
    xs: &[Int8Row<'_>],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    out: &mut [f32],
) {
    let t = xs.len();
    assert!(out.len() == t && scales.len() == mins.len() && packed.len() * 2 == scales.len() * 32);
    assert!(xs.iter().all(|x| x.q.len() == scales.len() * 32 && x.d.len() == scales.len()));
    assert!(xs.iter().all(|x| x.sum.len() == scales.len()));
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX2, FMA and F16C (`k` is at most what it has, and the AVX-512
        // family is only detected with them); every length matches (asserted above), and each tile
        // reads rows `i..i + R` of `t`.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx2 | CpuKernels::Avx512 => unsafe {
            let w = packed.as_ptr();
            row_tiles!(t, |i| q4_int8_tile_avx2(i, xs, w, scales, out))
        },
        _ => {
            for (x, o) in xs.iter().zip(out) {
                *o = q4_int8_portable(x, packed, scales, mins);
            }
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    for (x, o) in xs.iter().zip(out) {
        // SAFETY: the CPU has AVX2, FMA and F16C (an x86-64 family above the portable one runs);
        // `x.sum.len() == mins.len()` (asserted above).
        *o += unsafe { mins_share_avx2(mins, x.sum) };
    }
}

fn q4_int8_portable(x: &Int8Row<'_>, packed: &[u8], scales: &[u16], mins: &[u16]) -> f32 {
    let mut sum = 0f32;
    for (g, (xq, pg)) in x.q.chunks_exact(32).zip(packed.chunks_exact(16)).enumerate() {
        let mut isum = 0i32;
        for (j, b) in pg.iter().enumerate() {
            isum += i32::from(b & 15) * i32::from(xq[j]) + i32::from(b >> 4) * i32::from(xq[j + 16]);
        }
        sum += isum as f32 * (f16_value(scales[g]) * x.d[g]) + f16_value(mins[g]) * x.sum[g];
    }
    sum
}

/// `sum_g mins[g] * sum[g]`: Q4's minimums' share of a product (eight groups at a time).
///
/// # Safety
/// AVX2, FMA and F16C; `sum.len() == mins.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mins_share_avx2(mins: &[u16], sum: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let groups = mins.len();
    let mut macc = _mm256_setzero_ps();
    let mut h = 0;
    while h + 8 <= groups {
        // SAFETY (of the loads): h + 8 <= groups == mins.len() == sum.len().
        let m = _mm256_cvtph_ps(_mm_loadu_si128(mins.as_ptr().add(h).cast()));
        macc = _mm256_fmadd_ps(m, _mm256_loadu_ps(sum.as_ptr().add(h)), macc);
        h += 8;
    }
    super::hsum256(macc) + mins[h..].iter().zip(&sum[h..]).map(|(&m, s)| super::f16_f16c(m) * s).sum::<f32>()
}

/// The integer part of rows `i..i + R` of [`dot_q4_int8_rows`] (the minimums' share is added after).
///
/// # Safety
/// As [`int8_tile_avx2`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_int8_tile_avx2<const R: usize>(
    i: usize,
    xs: &[Int8Row<'_>],
    w: *const u8,
    scales: &[u16],
    out: &mut [f32],
) {
    int8_tile_avx2::<R, true>(i, xs, w, scales, out)
}

/// `out[i + r] = sum_g scales[g] * d_r[g] * (w_g . x_r,g)` for rows `i..i + R` of `xs`, `w` one
/// weight row: Q4 nibbles (16 bytes a group, see `quant::Q4Matrix`) where `Q4`, else Q8's int8
/// values (32 bytes a group).
///
/// # Safety
/// AVX2, FMA and F16C; `w` holds `scales.len()` groups; every row of `xs` holds as many groups;
/// `i + R <= xs.len()` and `i + R <= out.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn int8_tile_avx2<const R: usize, const Q4: bool>(
    i: usize,
    xs: &[Int8Row<'_>],
    w: *const u8,
    scales: &[u16],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (low, ones) = (_mm256_set1_epi8(15), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); R];
    // Each row's group scales (the weights' times the row's), for eight groups at a time.
    let mut sd = [_mm256_setzero_ps(); R];
    macro_rules! group {
        ($g:expr, $lane:expr, $acc:ident) => {{
            let g = $g;
            // SAFETY (of the loads): g < groups, so the group's bytes lie within `w` and its 32
            // values within every row.
            let (wu, wv) = if Q4 {
                // Byte j holds value j (low nibble) and value j + 16 (high): the 32 values in order.
                let bytes = _mm_loadu_si128(w.add(g * 16).cast());
                (_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low), low)
            } else {
                // |w| times x with w's sign: `vpmaddubsw` takes one unsigned operand (|-128| is 128
                // unsigned, still exact); x is never -128 (`Int8Rows` clamps to +-127), so no
                // product pair exceeds 2 * 128 * 127 and none saturates.
                let v = _mm256_loadu_si256(w.add(g * 32).cast());
                (_mm256_sign_epi8(v, v), v)
            };
            let lane = _mm256_set1_epi32($lane as i32);
            for r in 0..R {
                let mut xq = _mm256_loadu_si256(xs.get_unchecked(i + r).q.as_ptr().add(g * 32).cast());
                if !Q4 {
                    xq = _mm256_sign_epi8(xq, wv);
                }
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wu, xq), ones));
                $acc[r] = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(sd[r], lane), $acc[r]);
            }
        }};
    }
    let groups = scales.len();
    let mut g0 = 0;
    while g0 < groups {
        let n = (groups - g0).min(8);
        // SAFETY (of the loads): groups g0..g0 + 8 exist in `scales` and every row when n == 8.
        if n == 8 {
            let sw = _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(g0).cast()));
            for (r, sd) in sd.iter_mut().enumerate() {
                *sd = _mm256_mul_ps(sw, _mm256_loadu_ps(xs.get_unchecked(i + r).d.as_ptr().add(g0)));
            }
        } else {
            // The last few groups, through full vectors.
            let (mut s8, mut d8) = ([0u16; 8], [0f32; 8]);
            for (j, s) in s8.iter_mut().take(n).enumerate() {
                *s = scales[g0 + j];
            }
            let sw = _mm256_cvtph_ps(_mm_loadu_si128(s8.as_ptr().cast()));
            for (r, sd) in sd.iter_mut().enumerate() {
                for (j, d) in d8.iter_mut().take(n).enumerate() {
                    *d = xs[i + r].d[g0 + j];
                }
                *sd = _mm256_mul_ps(sw, _mm256_loadu_ps(d8.as_ptr()));
            }
        }
        // One accumulator per row: the rows of a tile are independent FMA chains, and a lone row's
        // arithmetic is the same as in a tile.
        for j in 0..n {
            group!(g0 + j, j, acc);
        }
        g0 += n;
    }
    for r in 0..R {
        out[i + r] = super::hsum256(acc[r]);
    }
}

/// `out[r] = sum_g scales[g] * d_r[g] * (q_g . x_r,g)` for one Q8 row (see `quant::Q8Matrix`)
/// against int8 rows `xs`.
pub(crate) fn dot_q8_int8_rows(xs: &[Int8Row<'_>], q: &[i8], scales: &[u16], out: &mut [f32]) {
    dot_q8_int8_rows_with(super::cpu_kernels(), xs, q, scales, out)
}

/// [`dot_q8_int8_rows`] with the kernels `k` (at most what the CPU has); the AVX-512 family runs the
/// AVX2 kernel.
pub(crate) fn dot_q8_int8_rows_with(
    k: CpuKernels,
    xs: &[Int8Row<'_>],
    q: &[i8],
    scales: &[u16],
    out: &mut [f32],
) {
    let t = xs.len();
    assert!(out.len() == t && q.len() == scales.len() * 32);
    assert!(xs.iter().all(|x| x.q.len() == q.len() && x.d.len() == scales.len()));
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: as in `dot_q4_int8_rows_with`.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx2 | CpuKernels::Avx512 => unsafe {
            row_tiles!(t, |i| q8_int8_tile(i, xs, q.as_ptr().cast(), scales, out))
        },
        _ => {
            for (x, o) in xs.iter().zip(out) {
                let mut sum = 0f32;
                for (g, (xq, wq)) in x.q.chunks_exact(32).zip(q.chunks_exact(32)).enumerate() {
                    let isum: i32 = xq.iter().zip(wq).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum();
                    sum += isum as f32 * (f16_value(scales[g]) * x.d[g]);
                }
                *o = sum;
            }
        }
    }
}

/// Rows `i..i + R` of [`dot_q8_int8_rows`].
///
/// # Safety
/// As [`int8_tile_avx2`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_int8_tile<const R: usize>(
    i: usize,
    xs: &[Int8Row<'_>],
    w: *const u8,
    scales: &[u16],
    out: &mut [f32],
) {
    int8_tile_avx2::<R, false>(i, xs, w, scales, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bits16::f16_bits;

    fn input(rows: usize, k: usize) -> Vec<f32> {
        (0..rows * k).map(|i| ((i * 7 % 1000) as f32 * 0.37).sin() * (1.0 + (i % 5) as f32)).collect()
    }

    #[test]
    fn quantized_rows_are_within_half_a_step_of_the_input() {
        let (k, x) = (96, input(3, 96));
        let rows = Int8Rows::quantize(&x, k);
        for (g, (xg, qg)) in x.chunks_exact(32).zip(rows.q.chunks_exact(32)).enumerate() {
            let d = rows.d[g];
            assert!(qg.iter().any(|&q| q.abs() == 127), "the largest value uses the whole range");
            for (&v, &q) in xg.iter().zip(qg) {
                assert!((v - q as f32 * d).abs() <= d * 0.5 + 1e-6, "group {g}: {v} as {q} * {d}");
            }
            assert!((rows.sum[g] - xg.iter().sum::<f32>()).abs() < 1e-5);
        }
        let zero = Int8Rows::quantize(&[0.0; 32], 32);
        assert_eq!((zero.d[0], zero.q.iter().all(|&q| q == 0)), (0.0, true));
    }

    /// Every kernel family gives the int8 product (an exact integer sum per group times the scales),
    /// and several rows at once give, bit for bit, what each row alone gives.
    #[test]
    fn int8_products_agree_across_kernels_and_row_counts() {
        for groups in [18usize, 37] {
            let k = groups * 32;
            let packed: Vec<u8> = (0..groups * 16).map(|i| (i * 73 % 256) as u8).collect();
            let q: Vec<i8> = (0..k).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
            let s: Vec<u16> = (0..groups).map(|g| f16_bits(0.01 + g as f32 * 0.003)).collect();
            let m: Vec<u16> = (0..groups).map(|g| f16_bits(-0.1 + g as f32 * 0.02)).collect();
            let x = Int8Rows::quantize(&input(13, k), k);
            let rows: Vec<Int8Row<'_>> = (0..13).map(|r| x.row(r, k)).collect();
            // The exact value of each product (f64 over the same integers and scales).
            let exact = |r: usize, q4: bool| -> f64 {
                let x = rows[r];
                (0..groups)
                    .map(|g| {
                        let isum: i64 = (0..32)
                            .map(|j| {
                                let w = if q4 {
                                    let b = packed[g * 16 + j % 16];
                                    i64::from(if j < 16 { b & 15 } else { b >> 4 })
                                } else {
                                    i64::from(q[g * 32 + j])
                                };
                                w * i64::from(x.q[g * 32 + j])
                            })
                            .sum();
                        let scaled = isum as f64 * f64::from(f16_value(s[g])) * f64::from(x.d[g]);
                        scaled + if q4 { f64::from(f16_value(m[g])) * f64::from(x.sum[g]) } else { 0.0 }
                    })
                    .sum()
            };
            for kern in CpuKernels::available() {
                for t in 1..=rows.len() {
                    let (mut o4, mut o8) = (vec![0f32; t], vec![0f32; t]);
                    dot_q4_int8_rows_with(kern, &rows[..t], &packed, &s, &m, &mut o4);
                    dot_q8_int8_rows_with(kern, &rows[..t], &q, &s, &mut o8);
                    for r in 0..t {
                        let (mut one4, mut one8) = ([0f32], [0f32]);
                        dot_q4_int8_rows_with(kern, &rows[r..=r], &packed, &s, &m, &mut one4);
                        dot_q8_int8_rows_with(kern, &rows[r..=r], &q, &s, &mut one8);
                        assert_eq!(o4[r].to_bits(), one4[0].to_bits(), "{kern:?} q4 row {r} of {t}");
                        assert_eq!(o8[r].to_bits(), one8[0].to_bits(), "{kern:?} q8 row {r} of {t}");
                        for (got, want) in [(o4[r], exact(r, true)), (o8[r], exact(r, false))] {
                            let tol = 1e-4 * want.abs().max(1.0);
                            assert!((f64::from(got) - want).abs() < tol, "{kern:?}: {got} against {want}");
                        }
                    }
                }
            }
        }
    }
}
