//! Quantized dot products: an f32 vector against a row of Q8 (int8, f16 scale per 32) or Q4 (4-bit,
//! f16 scale and minimum per 32) weights, or of f16 weights: AVX-512, AVX2 (+FMA, F16C), and the
//! portable loops, chosen by `cpu_kernels()`.

use super::CpuKernels;
use crate::bits16::{bf16_bits, f16_value};

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

/// `x . w` for `w` in f16 bits (an f16 checkpoint's row), widened as it is read: AVX-512 where the
/// CPU has it.
pub(crate) fn dot_f16(x: &[f32], w: &[u16]) -> f32 {
    dot_f16_with(super::cpu_kernels(), x, w)
}

/// [`dot_f16`] with the kernels `k` (at most what the CPU has).
pub(crate) fn dot_f16_with(k: CpuKernels, x: &[f32], w: &[u16]) -> f32 {
    assert_eq!(x.len(), w.len());
    assert!(k <= CpuKernels::detected());
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has, asserted above); lengths match.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => unsafe { dot_f16_avx512(x, w) },
        // SAFETY: the CPU has AVX2, FMA and F16C (as above); lengths match.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => unsafe { dot_f16_avx2(x, w) },
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
    let tail: f32 = x[i..].iter().zip(&w[i..]).map(|(a, &b)| a * f16_value(b)).sum();
    hsum256(_mm256_add_ps(a0, a1)) + tail
}

/// # Safety
/// AVX-512F; `x.len() == w.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_f16_avx512(x: &[f32], w: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY (of the loads): i + 32 <= n for both slices.
        let w0 = _mm512_cvtph_ps(_mm256_loadu_si256(w.as_ptr().add(i).cast()));
        let w1 = _mm512_cvtph_ps(_mm256_loadu_si256(w.as_ptr().add(i + 16).cast()));
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x.as_ptr().add(i)), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.as_ptr().add(i + 16)), a1);
        i += 32;
    }
    let tail: f32 = x[i..].iter().zip(&w[i..]).map(|(a, &b)| a * f16_value(b)).sum();
    _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail
}

/// Where the bf16 GEMM's panel order puts pair `j` of row `c` (in units of two values): see
/// `sys::pack_bf16_panels`.
const fn panel_pair(j: usize, c: usize) -> usize {
    j * 32 + c
}

/// Rows `r0..r0 + 32` of a Q8 matrix `cols` wide (see `quant::Q8Matrix`), columns `k0..k0 + kc`
/// (multiples of 32), written as bf16 into `dst` in the bf16 GEMM's panel order: columns `k0 + 2j` and
/// `k0 + 2j + 1` of row `r0 + c` at `dst[2 * (j * 32 + c)..][..2]`. AVX-512 BF16 where the CPU has it.
pub(crate) fn q8_bf16_panel(
    q: &[i8],
    scales: &[u16],
    cols: usize,
    r0: usize,
    k: (usize, usize),
    dst: &mut [u16],
) {
    let (k0, kc) = k;
    assert!(k0.is_multiple_of(32) && kc.is_multiple_of(32) && k0 + kc <= cols);
    assert!(q.len() >= (r0 + 32) * cols && scales.len() * 32 == q.len() && dst.len() >= 32 * kc);
    #[cfg(target_arch = "x86_64")]
    {
        if crate::sys::has_bf16_gemm() {
            // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked); the lengths were asserted.
            unsafe { q8_bf16_panel_avx512(q, scales, cols, r0, k, dst) };
            return;
        }
    }
    for c in 0..32 {
        for gi in 0..kc / 32 {
            let g = ((r0 + c) * cols + k0) / 32 + gi;
            let s = f16_value(scales[g]);
            for (i, &v) in q[g * 32..][..32].iter().enumerate() {
                dst[2 * panel_pair(gi * 16 + i / 2, c) + i % 2] = bf16_bits(v as f32 * s);
            }
        }
    }
}

/// [`q8_bf16_panel`] for a Q4 matrix (see `quant::Q4Matrix`): value = min + q * scale, rounded to bf16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn q4_bf16_panel(
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    cols: usize,
    r0: usize,
    k: (usize, usize),
    dst: &mut [u16],
) {
    let (k0, kc) = k;
    assert!(k0.is_multiple_of(32) && kc.is_multiple_of(32) && k0 + kc <= cols);
    assert!(packed.len() * 2 >= (r0 + 32) * cols && dst.len() >= 32 * kc);
    assert!(scales.len() * 16 == packed.len() && mins.len() == scales.len());
    #[cfg(target_arch = "x86_64")]
    {
        if crate::sys::has_bf16_gemm() {
            // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked); the lengths were asserted.
            unsafe { q4_bf16_panel_avx512(packed, scales, mins, cols, r0, k, dst) };
            return;
        }
    }
    for c in 0..32 {
        for gi in 0..kc / 32 {
            let g = ((r0 + c) * cols + k0) / 32 + gi;
            let (s, m) = (f16_value(scales[g]), f16_value(mins[g]));
            for (i, &b) in packed[g * 16..][..16].iter().enumerate() {
                // Byte i holds value i (low nibble) and value i + 16 (high nibble).
                for (at, nibble) in [(i, b & 15), (i + 16, b >> 4)] {
                    dst[2 * panel_pair(gi * 16 + at / 2, c) + at % 2] = bf16_bits(m + nibble as f32 * s);
                }
            }
        }
    }
}

/// Stores one group of sixteen rows at their panel places: `v[c]` holds the group's 32 bf16 values
/// of row c in column order (lane i: pair i), and pair i of the sixteen rows goes side by side to
/// `base + panel_pair(i, 0)` (in units of two values). A 16 x 16 transpose of the pairs in registers
/// (unpacks within 128-bit lanes, then two rounds of lane shuffles), each store 64 bytes. Pair by
/// pair (a vector stored and read back in 4-byte pieces) the panels took 4.7% of a served native
/// 1,000-token prefill's samples.
///
/// # Safety
/// AVX-512F; `base` points at `panel_pair(15, 0) + 16` writable pairs (u32, alignment 2 suffices).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_group_pairs16(v: &[std::arch::x86_64::__m512i; 16], base: *mut u16) {
    use std::arch::x86_64::*;
    // a[2k], a[2k + 1]: rows 2k and 2k + 1 interleaved, pairs 4L, 4L + 1 (resp. 4L + 2, 4L + 3) of
    // each 128-bit lane L.
    let a: [__m512i; 16] = std::array::from_fn(|i| {
        let (x, y) = (v[i & !1], v[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    // b[4k + m], lane L: pair 4L + m of rows 4k..4k + 4.
    let b: [__m512i; 16] = std::array::from_fn(|i| {
        let (k, m) = (i / 4, i % 4);
        let (x, y) = (a[4 * k + m / 2], a[4 * k + 2 + m / 2]);
        if m % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    let base = base.cast::<u32>();
    for m in 0..4 {
        // Lanes 0, 1 (imm 0x44) or 2, 3 (0xee) of rows 0..8 (c0, c1) and of rows 8..16 (c2, c3).
        let c0 = _mm512_shuffle_i32x4::<0x44>(b[m], b[4 + m]);
        let c1 = _mm512_shuffle_i32x4::<0xee>(b[m], b[4 + m]);
        let c2 = _mm512_shuffle_i32x4::<0x44>(b[8 + m], b[12 + m]);
        let c3 = _mm512_shuffle_i32x4::<0xee>(b[8 + m], b[12 + m]);
        // Pair 4L + m of all sixteen rows: lane L of each b (imm 0x88 even lanes, 0xdd odd ones).
        let out = [
            _mm512_shuffle_i32x4::<0x88>(c0, c2),
            _mm512_shuffle_i32x4::<0xdd>(c0, c2),
            _mm512_shuffle_i32x4::<0x88>(c1, c3),
            _mm512_shuffle_i32x4::<0xdd>(c1, c3),
        ];
        for (l, o) in out.iter().enumerate() {
            _mm512_storeu_si512(base.add(panel_pair(4 * l + m, 0)).cast(), *o);
        }
    }
}

/// # Safety
/// AVX-512F and AVX-512 BF16; lengths as [`q8_bf16_panel`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn q8_bf16_panel_avx512(
    q: &[i8],
    scales: &[u16],
    cols: usize,
    r0: usize,
    k: (usize, usize),
    dst: &mut [u16],
) {
    use std::arch::x86_64::*;
    fill_panel(cols, r0, k, dst, |g| {
        let s = f16_splat(*scales.get_unchecked(g));
        let pq = q.as_ptr().add(g * 32);
        let widen = |p: *const i8| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())));
        let (lo, hi) = (_mm512_mul_ps(widen(pq), s), _mm512_mul_ps(widen(pq.add(16)), s));
        std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo))
    });
}

/// # Safety
/// AVX-512F and AVX-512 BF16; lengths as [`q4_bf16_panel`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn q4_bf16_panel_avx512(
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    cols: usize,
    r0: usize,
    k: (usize, usize),
    dst: &mut [u16],
) {
    use std::arch::x86_64::*;
    let low = _mm_set1_epi8(15);
    fill_panel(cols, r0, k, dst, |g| {
        let (s, m) = (f16_splat(*scales.get_unchecked(g)), f16_splat(*mins.get_unchecked(g)));
        let bytes = _mm_loadu_si128(packed.as_ptr().add(g * 16).cast());
        // min + q * scale, multiplied and added apart (no fused rounding) like the scalar form.
        let value =
            |n: __m128i| _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n)), s), m);
        let lo = value(_mm_and_si128(bytes, low));
        let hi = value(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo))
    });
}

/// Rows `r0..r0 + 32` of a matrix `cols` wide, columns `k0..k0 + kc`, into `dst` in the panel order:
/// `group(g)` gives the matrix's group g (32 consecutive values of a row, `g = (row * cols + column)
/// / 32`) as 32 bf16 values in column order, and each group of sixteen rows is stored by
/// [`store_group_pairs16`].
///
/// # Safety
/// AVX-512F; `dst` holds `32 * kc` values, and `group` is safe to call for every group of the block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fill_panel(
    cols: usize,
    r0: usize,
    (k0, kc): (usize, usize),
    dst: &mut [u16],
    group: impl Fn(usize) -> std::arch::x86_64::__m512i,
) {
    for c0 in [0, 16] {
        for gi in 0..kc / 32 {
            let v = std::array::from_fn(|c| group(((r0 + c0 + c) * cols + k0) / 32 + gi));
            store_group_pairs16(&v, dst.as_mut_ptr().add(2 * panel_pair(gi * 16, c0)));
        }
    }
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
    use crate::bits16::{f16_bits, f16_value};

    /// The bf16 GEMM's panels of Q4 and Q8 rows, filled by the kernels running, hold each value
    /// (`min + q * scale` for Q4, `q * scale` for Q8, rounded to bf16) at its panel place, for every
    /// block of columns a product asks for.
    #[test]
    fn bf16_panels_hold_each_value_at_its_place() {
        use crate::bits16::bf16_bits;
        let (rows, cols) = (64, 32 * 19);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 73 % 256) as u8).collect();
        let q: Vec<i8> = (0..rows * cols).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let s: Vec<u16> = (0..rows * cols / 32).map(|g| f16_bits(0.01 + (g % 29) as f32 * 0.003)).collect();
        let m: Vec<u16> = (0..rows * cols / 32).map(|g| f16_bits(-0.1 + (g % 31) as f32 * 0.02)).collect();
        for r0 in [0, 32] {
            for (k0, kc) in [(0, 256), (256, 256), (512, 96), (32, 64)] {
                let (mut q4, mut q8) = (vec![0xffffu16; 32 * kc], vec![0xffffu16; 32 * kc]);
                super::q4_bf16_panel(&packed, &s, &m, cols, r0, (k0, kc), &mut q4);
                super::q8_bf16_panel(&q, &s, cols, r0, (k0, kc), &mut q8);
                for c in 0..32 {
                    for j in 0..kc {
                        let at = (r0 + c) * cols + k0 + j;
                        let (g, i) = (at / 32, at % 32);
                        // Byte i of a Q4 group: value i in its low nibble, value i + 16 in its high one.
                        let byte = packed[g * 16 + i % 16];
                        let nibble = if i < 16 { byte & 15 } else { byte >> 4 };
                        let (sf, mf) = (f16_value(s[g]), f16_value(m[g]));
                        let place = 2 * super::panel_pair(j / 2, c) + j % 2;
                        assert_eq!(
                            q4[place],
                            bf16_bits(mf + nibble as f32 * sf),
                            "q4 row {} column {}",
                            r0 + c,
                            k0 + j
                        );
                        assert_eq!(
                            q8[place],
                            bf16_bits(q[at] as f32 * sf),
                            "q8 row {} column {}",
                            r0 + c,
                            k0 + j
                        );
                    }
                }
            }
        }
    }

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
}
