//! Q4 and Q8 dot products of several input rows against a block of weight rows at once: each weight
//! row is read from memory once, its values unpacked once per tile of input rows (four on AVX-512,
//! six on AVX2: a decode batch, or a decode with its draft tokens), and on AVX-512 each input row's
//! values, loaded once per group, weigh four weight rows.
//! Every (input row, weight row) pair's arithmetic is the same operations in the same order whatever
//! tile computes it (the one-row product *is* the smallest tile), so a row's value does not depend
//! on the rows beside it, and a decode with drafts gives what decoding token by token gives.

use super::CpuKernels;

/// `out[w * t + r] = sum_g scales[w, g] * (q[w]_g . xs[r]_g) + mins[w, g] * xsums[r][g]` for the
/// `out.len() / t` consecutive Q4 weight rows `w` whose bytes, scales and minimums (f16 bits) are
/// `packed`, `scales` and `mins` (see `quant::Q4Matrix`), `t = xs.len()` input rows.
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
    if t == 0 {
        assert!(out.is_empty() && xsums.is_empty());
        return;
    }
    let n = out.len() / t;
    let groups = xs[0].len() / 32;
    assert!(xsums.len() == t && out.len() == n * t);
    assert!(scales.len() == n * groups && mins.len() == n * groups && packed.len() == n * groups * 16);
    for (x, xsum) in xs.iter().zip(xsums) {
        assert!(x.len() == groups * 32 && xsum.len() == groups);
    }
    assert!(k <= CpuKernels::detected());
    // Weight row `w`'s bytes, scales and minimums.
    let row = |w: usize| {
        let g = w * groups..(w + 1) * groups;
        (&packed[w * groups * 16..(w + 1) * groups * 16], &scales[g.clone()], &mins[g])
    };
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has, asserted above); every length
        // matches (asserted above), and each tile reads weight rows `w..w + W` of `n` and input rows
        // `i..i + R` of `t`.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => unsafe {
            block_tiles!(n, t, |w, i| q4_tile_avx512(w, i, groups, xs, packed, scales, mins, xsums, out))
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => {
            for (w, o) in out.chunks_exact_mut(t).enumerate() {
                let (pw, sw, mw) = row(w);
                // SAFETY: the CPU has AVX2, FMA and F16C (as above); lengths as above, per weight row.
                unsafe { row_tiles!(t, |i| q4_tile_avx2(i, xs, pw, sw, mw, o)) }
            }
        }
        _ => {
            for (w, o) in out.chunks_exact_mut(t).enumerate() {
                let (pw, sw, mw) = row(w);
                for ((x, xsum), o) in xs.iter().zip(xsums).zip(o) {
                    *o = super::dot_q4_portable(x, pw, sw, mw, xsum);
                }
            }
        }
    }
}

/// Tiles of up to `W_MAX` weight rows by up to four input rows over `n` weight rows and `t` input
/// rows: `$tile::<W, R>(w, i, ...)` for weight rows `w..w + W` and input rows `i..i + R`.
macro_rules! block_tiles {
    ($n:expr, $t:expr, |$w:ident, $i:ident| $tile:ident($($arg:expr),* $(,)?)) => {{
        let mut $w = 0;
        while $w < $n {
            let full = $n - $w >= W_MAX;
            let mut $i = 0;
            while $i < $t {
                let r = ($t - $i).min(4);
                match (full, r) {
                    (true, 4) => $tile::<W_MAX, 4>($($arg),*),
                    (true, 3) => $tile::<W_MAX, 3>($($arg),*),
                    (true, 2) => $tile::<W_MAX, 2>($($arg),*),
                    (true, _) => $tile::<W_MAX, 1>($($arg),*),
                    (false, 4) => $tile::<1, 4>($($arg),*),
                    (false, 3) => $tile::<1, 3>($($arg),*),
                    (false, 2) => $tile::<1, 2>($($arg),*),
                    (false, _) => $tile::<1, 1>($($arg),*),
                }
                $i += r;
            }
            $w += if full { W_MAX } else { 1 };
        }
    }};
}
use block_tiles;

/// Input rows per tile of the Q4/Q8 products with the kernels this process runs: a step of one
/// row more than a multiple of it unpacks every weight row once more.
pub(crate) fn dot_tile_rows() -> usize {
    match super::cpu_kernels() {
        CpuKernels::Amx | CpuKernels::Avx512 => 4,
        CpuKernels::Avx2 => 6,
        CpuKernels::Portable => 1,
    }
}

/// Weight rows per AVX-512 tile: each input row's values, loaded once per group, weigh four.
const W_MAX: usize = 4;

/// How many weight tiles (of `W_MAX` rows) ahead the AVX-512 tiles prefetch their weight bytes
/// (within a block they run past its end, into another block's rows or past the matrix: harmless
/// hints, never dereferenced).
const PREFETCH_TILES: usize = 4;

/// The sums of the sixteen lanes of each of `a[0..4]`, as the four lanes of the result. Each sum's
/// additions are the same whatever the other three vectors hold (halves, then quarters, then pairs).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn reduce4_avx512(a: [std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let quarter = |v: __m512| {
        let half = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
        );
        _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1))
    };
    let (u0, u1, u2, u3) = (quarter(a[0]), quarter(a[1]), quarter(a[2]), quarter(a[3]));
    _mm_hadd_ps(_mm_hadd_ps(u0, u1), _mm_hadd_ps(u2, u3))
}

/// Writes the tile's sums: `out[(w0 + w) * t + i + r]` for its `W` weight rows and `R` input rows.
///
/// # Safety
/// AVX-512F; `(w0 + W) * t <= out.len()` and `i + R <= t`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_tile_avx512<const W: usize, const R: usize>(
    acc: &[[std::arch::x86_64::__m512; R]; W],
    w0: usize,
    i: usize,
    t: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    for r in 0..R {
        let four: [__m512; 4] = std::array::from_fn(|w| if w < W { acc[w][r] } else { _mm512_setzero_ps() });
        let mut sums = [0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), reduce4_avx512(four));
        for (w, &v) in sums.iter().take(W).enumerate() {
            out[(w0 + w) * t + i + r] = v;
        }
    }
}

/// Weight rows `w0..w0 + W` of [`dot_q4_rows`] against input rows `i..i + R`, `groups` groups of 32
/// per row.
///
/// # Safety
/// AVX-512F; lengths as `dot_q4_rows_with` asserts; `w0 + W <= n` and `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_tile_avx512<const W: usize, const R: usize>(
    w0: usize,
    i: usize,
    groups: usize,
    xs: &[&[f32]],
    packed: &[u8],
    scales: &[u16],
    mins: &[u16],
    xsums: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    // The sixteen values a nibble can hold, as f32: times a group's scale, a table the nibbles index.
    let nibbles =
        _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
    let mut acc = [[_mm512_setzero_ps(); R]; W];
    // A tile's weight rows are a few cache lines each: too short a run for the hardware prefetcher,
    // so each group's step asks for one line of the bytes PREFETCH_TILES tiles ahead (a tile of
    // four rows is one line per group).
    let ahead = packed.as_ptr().wrapping_add((w0 + W * PREFETCH_TILES) * groups * 16);
    for g in 0..groups {
        let o = g * 32;
        if W == W_MAX {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(g * 64) as *const i8);
        }
        // SAFETY (of the loads): o + 32 <= every x's length; each weight row's group g is at
        // (row * groups + g) * 16 < packed.len(), its scale and minimum at row * groups + g.
        let x0: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(px[r].add(o)));
        let x1: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(px[r].add(o + 16)));
        for (w, a) in acc.iter_mut().enumerate() {
            let at = (w0 + w) * groups + g;
            // Byte j of the group in lane j: value j in its low nibble, value j + 16 in its high one.
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(packed.as_ptr().add(at * 16) as *const __m128i));
            // The group's weights times its scale, once for every input row: exact in f32 (a 4-bit
            // integer times an f16 value needs 15 bits), so an input row costs two FMAs per group.
            // Looked up in the scaled table (`vpermps` reads an index's low four bits: the low
            // nibble, then the high one shifted down), the very products a conversion and a
            // multiply per value gave, with one multiply per group.
            let table = _mm512_mul_ps(nibbles, super::f16_splat(*scales.get_unchecked(at)));
            let wl = _mm512_permutexvar_ps(bytes, table);
            let wh = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table);
            for r in 0..R {
                a[r] = _mm512_fmadd_ps(wh, x1[r], _mm512_fmadd_ps(wl, x0[r], a[r]));
            }
        }
    }
    // The minimums' share, sixteen groups at a time (the last chunk zero-padded), into the same sums.
    let mut h = 0;
    while h < groups {
        let n = (groups - h).min(16);
        let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
        // SAFETY (of the loads): the masked lanes h..h + n are within every xsum (groups long).
        let xsv: [__m512; R] =
            std::array::from_fn(|r| _mm512_maskz_loadu_ps(mask, xsums[i + r].as_ptr().add(h)));
        for (w, a) in acc.iter_mut().enumerate() {
            let row = &mins[(w0 + w) * groups + h..][..n];
            let m = if n == 16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(row.as_ptr() as *const __m256i))
            } else {
                let mut pad = [0u16; 16];
                pad[..n].copy_from_slice(row);
                _mm512_cvtph_ps(_mm256_loadu_si256(pad.as_ptr() as *const __m256i))
            };
            for r in 0..R {
                a[r] = _mm512_fmadd_ps(m, xsv[r], a[r]);
            }
        }
        h += 16;
    }
    store_tile_avx512(&acc, w0, i, xs.len(), out);
}

/// Input rows `i..i + R` against one weight row of [`dot_q4_rows`] (`packed`, `scales` and `mins`
/// that row's; `out` its `t` values).
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
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let pq = packed.as_ptr();
    let low = _mm_set1_epi8(15);
    // Two accumulators per row: independent FMA chains.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (g, (&s, &m)) in scales.iter().zip(mins).enumerate() {
        let (o, b) = (g * 32, g * 16);
        // SAFETY (of the loads): b + 16 <= packed.len() and o + 32 <= every x's length.
        let bytes = _mm_loadu_si128(pq.add(b).cast());
        // Low nibbles weigh x[o..o + 16], high ones x[o + 16..o + 32], eight at a time.
        let lo = _mm_and_si128(bytes, low);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        // The weights, `min + q * scale` in one rounding (what `rows_f32` widens them to), once for
        // every row.
        let (sv, mv) = (super::f16_splat256(s), super::f16_splat256(m));
        for (nib, at) in [(lo, 0usize), (hi, 16)] {
            let w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib)), sv, mv);
            let w1 =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8))), sv, mv);
            for r in 0..R {
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(px[r].add(o + at)), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(px[r].add(o + at + 8)), acc[r][1]);
            }
        }
    }
    for r in 0..R {
        out[i + r] = super::hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}

/// `out[w * t + r] = sum_i xs[r][i] * q[w][i] * scales[w, i / 32]` for the `out.len() / t`
/// consecutive Q8 weight rows `w` whose values and scales (f16 bits) are `q` and `scales`.
pub(crate) fn dot_q8_rows(xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    dot_q8_rows_with(super::cpu_kernels(), xs, q, scales, out)
}

/// [`dot_q8_rows`] with the kernels `k` (at most what the CPU has).
pub(crate) fn dot_q8_rows_with(k: CpuKernels, xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    let t = xs.len();
    if t == 0 {
        assert!(out.is_empty());
        return;
    }
    let n = out.len() / t;
    let groups = xs[0].len() / 32;
    assert!(out.len() == n * t && q.len() == n * groups * 32 && scales.len() == n * groups);
    assert!(xs.iter().all(|x| x.len() == groups * 32));
    assert!(k <= CpuKernels::detected());
    // Weight row `w`'s values and scales.
    let row = |w: usize| (&q[w * groups * 32..(w + 1) * groups * 32], &scales[w * groups..(w + 1) * groups]);
    match k {
        // SAFETY: the CPU has AVX-512F (`k` is at most what it has, asserted above); every length
        // matches (asserted above), and each tile reads weight rows `w..w + W` of `n` and input rows
        // `i..i + R` of `t`.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Amx | CpuKernels::Avx512 => unsafe {
            block_tiles!(n, t, |w, i| q8_tile_avx512(w, i, groups, xs, q, scales, out))
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => {
            for (w, o) in out.chunks_exact_mut(t).enumerate() {
                let (qw, sw) = row(w);
                // SAFETY: the CPU has AVX2, FMA and F16C (as above); lengths as above, per weight row.
                unsafe { row_tiles!(t, |i| q8_tile_avx2(i, xs, qw, sw, o)) }
            }
        }
        _ => {
            for (w, o) in out.chunks_exact_mut(t).enumerate() {
                let (qw, sw) = row(w);
                for (x, o) in xs.iter().zip(o) {
                    *o = super::dot_q8_portable(x, qw, sw);
                }
            }
        }
    }
}

/// Weight rows `w0..w0 + W` of [`dot_q8_rows`] against input rows `i..i + R`.
///
/// # Safety
/// AVX-512F; lengths as `dot_q8_rows_with` asserts; `w0 + W <= n` and `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q8_tile_avx512<const W: usize, const R: usize>(
    w0: usize,
    i: usize,
    groups: usize,
    xs: &[&[f32]],
    q: &[i8],
    scales: &[u16],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); R]; W];
    // As for Q4: a tile of four rows is two lines per group.
    let ahead = q.as_ptr().wrapping_add((w0 + W * PREFETCH_TILES) * groups * 32);
    for g in 0..groups {
        let o = g * 32;
        if W == W_MAX {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(g * 128));
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(g * 128 + 64));
        }
        // SAFETY (of the loads): o + 32 <= every x's length; each weight row's group g is at
        // (row * groups + g) * 32 < q.len(), its scale at row * groups + g.
        let x0: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(px[r].add(o)));
        let x1: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(px[r].add(o + 16)));
        for (w, a) in acc.iter_mut().enumerate() {
            let at = (w0 + w) * groups + g;
            let pq = q.as_ptr().add(at * 32);
            // The group's weights times its scale, once for every input row: exact in f32 (an 8-bit
            // integer times an f16 value needs 19 bits), so an input row costs two FMAs per group.
            let s = super::f16_splat(*scales.get_unchecked(at));
            let wl = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq as *const __m128i)));
            let wh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pq.add(16) as *const __m128i)));
            let (wl, wh) = (_mm512_mul_ps(wl, s), _mm512_mul_ps(wh, s));
            for r in 0..R {
                a[r] = _mm512_fmadd_ps(wh, x1[r], _mm512_fmadd_ps(wl, x0[r], a[r]));
            }
        }
    }
    store_tile_avx512(&acc, w0, i, xs.len(), out);
}

/// Input rows `i..i + R` against one weight row of [`dot_q8_rows`] (`q` and `scales` that row's;
/// `out` its `t` values).
///
/// # Safety
/// AVX2, FMA and F16C; lengths as `dot_q8_rows_with` asserts; `i + R <= xs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_tile_avx2<const R: usize>(i: usize, xs: &[&[f32]], q: &[i8], scales: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let px: [*const f32; R] = std::array::from_fn(|r| xs[i + r].as_ptr());
    let pq = q.as_ptr();
    // Two accumulators per row: independent FMA chains.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (g, &s) in scales.iter().enumerate() {
        let o = g * 32;
        // The weights times the group's scale, once for every row (exact in f32, as above).
        let sv = super::f16_splat256(s);
        for j in [0usize, 16] {
            // SAFETY (of the loads): o + j + 16 <= q.len() == every x's length.
            let w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(pq.add(o + j).cast())));
            let w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(pq.add(o + j + 8).cast())));
            let (w0, w1) = (_mm256_mul_ps(w0, sv), _mm256_mul_ps(w1, sv));
            for r in 0..R {
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(px[r].add(o + j)), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(px[r].add(o + j + 8)), acc[r][1]);
            }
        }
    }
    for r in 0..R {
        out[i + r] = super::hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
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

    /// A block of weight rows gives, bit for bit, what each weight row alone gives (the AVX-512 tiles
    /// of four weight rows and the single-row ones for the rest), with one input row and several.
    #[test]
    fn weight_rows_at_once_equal_one_weight_row_at_a_time_exactly() {
        // Minimums in one partial chunk, in whole chunks, and in whole chunks and a partial one.
        for groups in [7, 32, 37] {
            weight_rows_at_once(groups);
        }
    }

    fn weight_rows_at_once(groups: usize) {
        let n = 11;
        let packed: Vec<u8> = (0..n * groups * 16).map(|i| (i * 73 % 256) as u8).collect();
        let q: Vec<i8> = (0..n * groups * 32).map(|i| ((i * 53 % 255) as i32 - 127) as i8).collect();
        let s: Vec<u16> = (0..n * groups).map(|g| f16_bits(0.01 + (g % 29) as f32 * 0.003)).collect();
        let m: Vec<u16> = (0..n * groups).map(|g| f16_bits(-0.1 + (g % 31) as f32 * 0.02)).collect();
        let rows: Vec<Vec<f32>> =
            (0..9).map(|r| (0..groups * 32).map(|i| ((i * (r + 3)) as f32 * 0.37).sin()).collect()).collect();
        let sums: Vec<Vec<f32>> =
            rows.iter().map(|x| x.chunks(32).map(|c| c.iter().sum()).collect()).collect();
        for k in CpuKernels::available() {
            for t in 1..=9 {
                let xs: Vec<&[f32]> = rows[..t].iter().map(Vec::as_slice).collect();
                let xsums: Vec<&[f32]> = sums[..t].iter().map(Vec::as_slice).collect();
                let (mut q4, mut q8) = (vec![0f32; n * t], vec![0f32; n * t]);
                super::dot_q4_rows_with(k, &xs, &packed, &s, &m, &xsums, &mut q4);
                super::dot_q8_rows_with(k, &xs, &q, &s, &mut q8);
                for w in 0..n {
                    let g = w * groups..(w + 1) * groups;
                    let mut one = vec![0f32; t];
                    let pw = &packed[w * groups * 16..(w + 1) * groups * 16];
                    super::dot_q4_rows_with(k, &xs, pw, &s[g.clone()], &m[g.clone()], &xsums, &mut one);
                    for r in 0..t {
                        assert_eq!(
                            q4[w * t + r].to_bits(),
                            one[r].to_bits(),
                            "q4 {k:?}, weight row {w}, row {r} of {t}"
                        );
                    }
                    super::dot_q8_rows_with(
                        k,
                        &xs,
                        &q[w * groups * 32..(w + 1) * groups * 32],
                        &s[g],
                        &mut one,
                    );
                    for r in 0..t {
                        assert_eq!(
                            q8[w * t + r].to_bits(),
                            one[r].to_bits(),
                            "q8 {k:?}, weight row {w}, row {r} of {t}"
                        );
                    }
                }
            }
        }
    }
}
