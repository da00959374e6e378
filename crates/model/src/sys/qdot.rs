//! Quantized dot products: an f32 vector against a row of Q8 (int8, f16 scale per 32) or Q4 (4-bit,
//! f16 scale and minimum per 32) weights, or of f16 weights: AVX-512, AVX2 (+FMA, F16C), and the
//! portable loops, chosen by `cpu_kernels()`.

use super::CpuKernels;
use crate::bits16::{bf16_bits, bf16_value, f16_value};

/// `sum_i x[i] * q[i] * scales[i / 32]`: a dot product against one Q8 row (`scales` as f16 bits),
/// with an AVX-512 kernel where the CPU has one.
pub(crate) fn dot_q8(x: &[f32], q: &[i8], scales: &[u16]) -> f32 {
    dot_q8_with(super::cpu_kernels(), x, q, scales)
}

/// [`dot_q8`] with the kernels `k` (at most what the CPU has: `cpu_kernels()` or `available()`): the
/// one-row tile of [`dot_q8_rows`](super::dot_q8_rows), so one row and several rows give the same values.
pub(crate) fn dot_q8_with(k: CpuKernels, x: &[f32], q: &[i8], scales: &[u16]) -> f32 {
    let mut out = [0f32];
    super::dot_q8_rows_with(k, &[x], q, scales, &mut out);
    out[0]
}

/// The sum of the eight lanes of `v`.
///
/// # Safety
/// AVX (part of AVX2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

pub(super) fn dot_q8_portable(x: &[f32], q: &[i8], scales: &[u16]) -> f32 {
    let mut sum = 0f32;
    for ((xg, qg), &s) in x.chunks_exact(32).zip(q.chunks_exact(32)).zip(scales) {
        let mut acc = [0f32; 8];
        for (xs, qs) in xg.chunks_exact(8).zip(qg.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += xs[l] * qs[l] as f32;
            }
        }
        sum += acc.iter().sum::<f32>() * f16_value(s);
    }
    sum
}

/// f16 bits `h` as f32, broadcast to 16 lanes.
///
/// # Safety
/// AVX-512F (the 512-bit `vcvtph2ps` is part of it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn f16_splat(h: u16) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_cvtph_ps(_mm256_set1_epi16(h as i16))
}

/// f16 bits `h` as f32, broadcast to 8 lanes, with F16C: `f16_value`'s value, without the software
/// conversion `half` runs there (once per group and weight row, it was a fifth of the AVX2 Q4
/// kernel's time).
///
/// # Safety
/// AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16_splat256(h: u16) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    _mm256_cvtph_ps(_mm_set1_epi16(h as i16))
}

/// f16 bits `h` as f32 with F16C (see [`f16_splat256`]).
///
/// # Safety
/// F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16_f16c(h: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(h as i16)))
}

/// `sum_g scales[g] * (q_g . x_g) + mins[g] * xsum[g]` for one Q4 row (see `quant::Q4Matrix`; scales
/// and minimums as f16 bits), with an AVX-512 kernel where the CPU has one.
pub(crate) fn dot_q4(x: &[f32], packed: &[u8], scales: &[u16], mins: &[u16], xsum: &[f32]) -> f32 {
    dot_q4_with(super::cpu_kernels(), x, packed, scales, mins, xsum)
}

/// [`dot_q4`] with the kernels `k` (at most what the CPU has): the one-row tile of
/// [`dot_q4_rows`](super::dot_q4_rows), so one row and several rows give the same values.
pub(crate) fn dot_q4_with(
    k: CpuKernels,
    x: &[f32],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    xsum: &[f32],
) -> f32 {
    let mut out = [0f32];
    super::dot_q4_rows_with(k, &[x], packed, scales, mins, &[xsum], &mut out);
    out[0]
}

pub(super) fn dot_q4_portable(x: &[f32], packed: &[u8], scales: &[u16], mins: &[u16], xsum: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (g, (xg, pg)) in x.chunks_exact(32).zip(packed.chunks_exact(16)).enumerate() {
        let mut acc = 0f32;
        for (j, b) in pg.iter().enumerate() {
            acc += xg[j] * (b & 15) as f32 + xg[j + 16] * (b >> 4) as f32;
        }
        sum += acc * f16_value(scales[g]) + f16_value(mins[g]) * xsum[g];
    }
    sum
}

/// `x . w` for `w` in f16 bits (an f16 checkpoint's row), widened as it is read: the AVX2 kernel on
/// AVX-512 CPUs too, whose arithmetic `rows_f32`'s tiles give long steps (decode reads the weights
/// from memory at the same pace either way).
pub(crate) fn dot_f16(x: &[f32], w: &[u16]) -> f32 {
    dot_f16_with(super::cpu_kernels(), x, w)
}

/// [`dot_f16`] with the kernels `k` (at most what the CPU has).
pub(crate) fn dot_f16_with(k: CpuKernels, x: &[f32], w: &[u16]) -> f32 {
    assert_eq!(x.len(), w.len());
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX2, FMA and F16C (`k` is at most what it has, asserted above, and
        // both families include them); lengths match.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 | CpuKernels::Avx2 => unsafe { dot_f16_avx2(x, w) },
        _ => x.iter().zip(w).map(|(a, &b)| a * f16_value(b)).sum(),
    }
}

/// # Safety
/// AVX2, FMA and F16C; `x.len() == w.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_avx2(x: &[f32], w: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY (of the loads): i + 16 <= n for both slices.
        let w0 = _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(i).cast()));
        let w1 = _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(i + 8).cast()));
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x.as_ptr().add(i)), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.as_ptr().add(i + 8)), a1);
        i += 16;
    }
    // (What `rows_f32`'s tiles compute for every output: the same chains, the same reduction.)
    let sum = hsum256(_mm256_add_ps(a0, a1));
    if i == n {
        return sum;
    }
    sum + x[i..].iter().zip(&w[i..]).map(|(a, &b)| a * f16_value(b)).sum::<f32>()
}

/// `x . w` for `w` in bf16 bits (a bf16 checkpoint's row on a CPU without AVX-512 BF16), widened as
/// it is read (exactly: a bf16 value is the top half of its f32): the AVX2 kernel on AVX-512 CPUs
/// too, the arithmetic of `rows_f32`'s tiles, which long steps take (and of `dot` on f32 weights
/// with the AVX2 kernels, so a bf16 checkpoint gives there the bits its f32 copy gives).
pub(crate) fn dot_bf16(x: &[f32], w: &[u16]) -> f32 {
    dot_bf16_with(super::cpu_kernels(), x, w)
}

/// [`dot_bf16`] with the kernels `k` (at most what the CPU has).
pub(crate) fn dot_bf16_with(k: CpuKernels, x: &[f32], w: &[u16]) -> f32 {
    assert_eq!(x.len(), w.len());
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX2 and FMA (`k` is at most what it has, asserted above, and both
        // families include them); lengths match.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 | CpuKernels::Avx2 => unsafe { dot_bf16_avx2(x, w) },
        _ => dot_bf16_portable(x, w),
    }
}

/// The portable `dot`'s arithmetic (eight lane sums, then the tail) on the widened values.
fn dot_bf16_portable(x: &[f32], w: &[u16]) -> f32 {
    let mut acc = [0f32; 8];
    let (cx, cw) = (x.chunks_exact(8), w.chunks_exact(8));
    let tail: f32 = cx.remainder().iter().zip(cw.remainder()).map(|(a, &b)| a * bf16_value(b)).sum();
    for (a, b) in cx.zip(cw) {
        for l in 0..8 {
            acc[l] += a[l] * bf16_value(b[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Eight bf16 values from `p` as f32 (each shifted into the top half of its lane).
///
/// # Safety
/// AVX2; `p..p + 8` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn load_bf16x8(p: *const u16) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract (8 values, 16 bytes).
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
}

/// # Safety
/// AVX2 and FMA; `x.len() == w.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16_avx2(x: &[f32], w: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY (of the loads): i + 16 <= n for both slices.
        a0 = _mm256_fmadd_ps(load_bf16x8(w.as_ptr().add(i)), _mm256_loadu_ps(x.as_ptr().add(i)), a0);
        a1 = _mm256_fmadd_ps(load_bf16x8(w.as_ptr().add(i + 8)), _mm256_loadu_ps(x.as_ptr().add(i + 8)), a1);
        i += 16;
    }
    // (What `rows_f32`'s tiles compute for every output: the same chains, the same reduction.)
    let sum = hsum256(_mm256_add_ps(a0, a1));
    if i == n {
        return sum;
    }
    sum + x[i..].iter().zip(&w[i..]).map(|(a, &b)| a * bf16_value(b)).sum::<f32>()
}

/// Rows `r0..r0 + rows` of a Q8 matrix `cols` wide (see `quant::Q8Matrix`), every column, written
/// as bf16 into `dst` row-major (`rows` x `cols`). AVX-512 BF16 where the CPU has it.
pub(crate) fn q8_bf16_rows(q: &[i8], scales: &[u16], cols: usize, r0: usize, rows: usize, dst: &mut [u16]) {
    let (g0, groups) = (r0 * cols / 32, rows * cols / 32);
    assert!(cols.is_multiple_of(32) && q.len() >= (r0 + rows) * cols && scales.len() * 32 == q.len());
    assert!(dst.len() >= rows * cols);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::sys::has_bf16_gemm() {
            // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked); the lengths were asserted.
            unsafe { q8_bf16_rows_avx512(q, scales, g0, groups, dst) };
            return;
        }
    }
    for (i, d) in dst[..rows * cols].iter_mut().enumerate() {
        let g = g0 + i / 32;
        *d = bf16_bits(q[g * 32 + i % 32] as f32 * f16_value(scales[g]));
    }
}

/// [`q8_bf16_rows`] for a Q4 matrix (see `quant::Q4Matrix`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn q4_bf16_rows(
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    cols: usize,
    r0: usize,
    rows: usize,
    dst: &mut [u16],
) {
    let (g0, groups) = (r0 * cols / 32, rows * cols / 32);
    assert!(cols.is_multiple_of(32) && packed.len() * 2 >= (r0 + rows) * cols);
    assert!(scales.len() * 16 == packed.len() && mins.len() == scales.len() && dst.len() >= rows * cols);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::sys::has_bf16_gemm() {
            // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked); the lengths were asserted.
            unsafe { q4_bf16_rows_avx512(packed, scales, mins, g0, groups, dst) };
            return;
        }
    }
    for (gi, d) in dst[..rows * cols].chunks_exact_mut(32).enumerate() {
        let g = g0 + gi;
        let (s, m) = (f16_value(scales[g]), f16_value(mins[g]));
        for (i, &b) in packed[g * 16..][..16].iter().enumerate() {
            d[i] = bf16_bits(m + (b & 15) as f32 * s);
            d[i + 16] = bf16_bits(m + (b >> 4) as f32 * s);
        }
    }
}

/// # Safety
/// AVX-512F and AVX-512 BF16; groups `g0..g0 + groups` exist; `dst` holds `32 * groups` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn q8_bf16_rows_avx512(q: &[i8], scales: &[u16], g0: usize, groups: usize, dst: &mut [u16]) {
    use std::arch::x86_64::*;
    for gi in 0..groups {
        let g = g0 + gi;
        let s = f16_splat(*scales.get_unchecked(g));
        let pq = q.as_ptr().add(g * 32);
        let widen = |p: *const i8| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())));
        let (lo, hi) = (_mm512_mul_ps(widen(pq), s), _mm512_mul_ps(widen(pq.add(16)), s));
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(dst.as_mut_ptr().add(gi * 32).cast(), v);
    }
}

/// # Safety
/// AVX-512F and AVX-512 BF16; groups `g0..g0 + groups` exist; `dst` holds `32 * groups` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn q4_bf16_rows_avx512(
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    g0: usize,
    groups: usize,
    dst: &mut [u16],
) {
    use std::arch::x86_64::*;
    let low = _mm_set1_epi8(15);
    for gi in 0..groups {
        let g = g0 + gi;
        let (s, m) = (f16_splat(*scales.get_unchecked(g)), f16_splat(*mins.get_unchecked(g)));
        let bytes = _mm_loadu_si128(packed.as_ptr().add(g * 16).cast());
        let value =
            |n: __m128i| _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n)), s), m);
        let lo = value(_mm_and_si128(bytes, low));
        let hi = value(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(dst.as_mut_ptr().add(gi * 32).cast(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::CpuKernels;
    use crate::bits16::{bf16_bits, bf16_value, f16_bits, f16_value};

    #[test]
    fn q8_dot_kernels_agree() {
        let n = 32 * 37; // two blocks of 16 groups and a partial one
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let q: Vec<i8> = (0..n).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let s: Vec<u16> = (0..37).map(|g| f16_bits(0.01 + g as f32 * 0.003)).collect();
        let sf = |g: usize| f64::from(f16_value(s[g]));
        let exact: f64 = (0..n).map(|i| f64::from(x[i]) * f64::from(q[i]) * sf(i / 32)).sum();
        for k in CpuKernels::available() {
            let got = f64::from(super::dot_q8_with(k, &x, &q, &s));
            assert!((got - exact).abs() < 1e-3, "{k:?}: {got} against {exact}");
        }
    }

    #[test]
    fn q4_dot_kernels_agree() {
        let groups = 37;
        let x: Vec<f32> = (0..groups * 32).map(|i| (i as f32 * 0.37).sin()).collect();
        let packed: Vec<u8> = (0..groups * 16).map(|i| (i * 73 % 256) as u8).collect();
        let s: Vec<u16> = (0..groups).map(|g| f16_bits(0.01 + g as f32 * 0.003)).collect();
        let m: Vec<u16> = (0..groups).map(|g| f16_bits(-0.1 + g as f32 * 0.02)).collect();
        let (sf, mf) = (|g: usize| f64::from(f16_value(s[g])), |g: usize| f64::from(f16_value(m[g])));
        let xsum: Vec<f32> = x.chunks(32).map(|c| c.iter().sum()).collect();
        let mut exact = 0f64;
        for g in 0..groups {
            for j in 0..16 {
                let b = packed[g * 16 + j];
                let (lo, hi) = (f64::from(b & 15), f64::from(b >> 4));
                exact += f64::from(x[g * 32 + j]) * (mf(g) + lo * sf(g));
                exact += f64::from(x[g * 32 + j + 16]) * (mf(g) + hi * sf(g));
            }
        }
        for k in CpuKernels::available() {
            let got = f64::from(super::dot_q4_with(k, &x, &packed, &s, &m, &xsum));
            assert!((got - exact).abs() < 1e-3, "{k:?}: {got} against {exact}");
        }
    }

    #[test]
    fn f16_dot_kernels_agree() {
        for n in [0, 7, 16, 32 * 37 + 5] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<u16> = (0..n).map(|i| f16_bits((i as f32 * 0.11).cos())).collect();
            let exact: f64 = x.iter().zip(&w).map(|(&a, &b)| f64::from(a) * f64::from(f16_value(b))).sum();
            for k in CpuKernels::available() {
                let got = f64::from(super::dot_f16_with(k, &x, &w));
                assert!((got - exact).abs() < 1e-3, "{k:?} at {n}: {got} against {exact}");
            }
        }
    }

    /// Each family's bf16 dot gives the bits its f32 `dot` gives on the widened row (AVX2's on both
    /// x86 families, the portable loop's elsewhere).
    #[test]
    fn bf16_dots_are_the_f32_dots_of_the_widened_rows() {
        for n in [0, 7, 16, 32 * 37 + 5] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<u16> = (0..n).map(|i| bf16_bits((i as f32 * 0.11).cos())).collect();
            let wide: Vec<f32> = w.iter().map(|&b| bf16_value(b)).collect();
            for k in CpuKernels::available() {
                let want = match k {
                    CpuKernels::Portable => crate::sys::elementwise::dot_portable(&x, &wide),
                    // `dot` runs the AVX2 kernel wherever the kernels in use have it.
                    _ if crate::sys::avx2() => crate::sys::dot(&x, &wide),
                    _ => continue,
                };
                let got = super::dot_bf16_with(k, &x, &w);
                assert_eq!(got.to_bits(), want.to_bits(), "{k:?} at {n}: {got} against {want}");
            }
        }
    }
}
